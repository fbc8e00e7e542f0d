"""Triton sampling, residual sampling and acceptance against kernels/reference.py.

Run in the Triton interpreter on CPU (conftest sets TRITON_INTERPRET=1 when there
is no CUDA device; with one, compiled on it), fp32.
Token equality with the reference is exact except at float-rounding ties: a
row may differ only if its target ``u * total`` lies within 1e-5 of a CDF
boundary of the reference (checked, never just tolerated). The chi-square
tests compare many draws from one launch with the exact softmax.
"""

from __future__ import annotations

import functools

import pytest
import torch

from helpers import assert_same_tokens as _assert_same_tokens
from helpers import chi2_pvalue as _chi2_pvalue
from helpers import P_FAIL, assert_log_ratio, on_triton_device, triton_device, truncated_log_probs
from sigmafast import kernels
from sigmafast.kernels import accept, lm_head, sampling
from sigmafast.kernels import reference as ref

# in the interpreter on CPU, compiled on a GPU (the tensors are built on the CPU either way)
acceptance = on_triton_device(accept.acceptance)
acceptance_from_hidden = on_triton_device(accept.acceptance_from_hidden)
residual_sample = on_triton_device(sampling.residual_sample)
sample = on_triton_device(sampling.sample)
sample_from_hidden = on_triton_device(functools.partial(kernels.sample_from_hidden, backend="triton"))


SAMPLE_CASES = [
    # (N, V, temperature, top_k, block_v)
    (256, 50, 1.0, None, None),
    (256, 300, 0.7, None, 64),  # several vocabulary chunks
    (256, 300, 1.3, 5, 64),
    (64, 9, 1.0, 1, None),
    (64, 1, 1.0, None, None),
]


def _sid(c):
    N, V, T, k, bv = c
    return f"N{N}-V{V}-T{T}-k{k}" + (f"-chunk{bv}" if bv else "")


@pytest.mark.parametrize("case", SAMPLE_CASES, ids=_sid)
def test_sample_matches_reference(case, poisoned_empty):
    N, V, T, k, bv = case
    g = torch.Generator().manual_seed(V + N)
    logits = torch.randn(N, V, generator=g) * 3
    u = torch.rand(N, generator=g)
    tokens, logp = sample(logits, u, T, k, block_v=bv)
    want, want_logp = ref.sample(logits, u, T, k)
    _assert_same_tokens(tokens, want, ref.log_probs(logits, T, k).exp(), u)
    full = ref.log_probs(logits, T, k).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(logp, full, rtol=0, atol=1e-5)


@pytest.mark.parametrize("temperature, top_k", [(1.0, None), (0.7, 5), (0.0, None)])
def test_sample_from_hidden_is_the_sample_of_the_head_s_logits(temperature, top_k):
    """``kernels.sample_from_hidden`` on the Triton path (the logits whole, then the sampling kernel) against
    the reference sampling of the same logits; the head's padding rows past V are never drawn."""
    g = torch.Generator().manual_seed(4)
    N, C, V = 40, 16, 300
    hidden = torch.randn(N, C, generator=g)
    weight = torch.randn(V + 20, C, generator=g) / 2
    weight[V:] = 10.0
    u = torch.rand(N, generator=g)
    tokens, logp = sample_from_hidden(hidden, weight, u, temperature, top_k, vocab_size=V)
    logits = (hidden @ weight.T)[:, :V]
    if temperature == 0:
        assert torch.equal(tokens, logits.argmax(-1)) and not bool(logp.any())
        return
    want, _ = ref.sample(logits, u, temperature, top_k)
    _assert_same_tokens(tokens, want, ref.log_probs(logits, temperature, top_k).exp(), u)
    full = ref.log_probs(logits, temperature, top_k).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(logp, full, rtol=0, atol=1e-5)


def test_sample_greedy_and_uniform_edges():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(32, 40, generator=g)
    logits[0, 3] = logits[0, 7] = 10.0  # tie: first index wins
    tokens, logp = sample(logits, torch.rand(32, generator=g), 0.0)
    assert torch.equal(tokens, logits.argmax(-1)) and tokens[0] == 3 and torch.all(logp == 0)
    u = torch.tensor([0.0, 1.0 - 2**-24] + [0.5] * 30)
    tokens, _ = sample(logits, u, 1.0, 4)
    want, _ = ref.sample(logits, u, 1.0, 4)
    assert torch.equal(tokens, want)


@pytest.mark.parametrize("op", ["sample", "residual"])
def test_float64_uniforms_are_rounded_to_float32_as_the_reference_rounds_them(op):
    """The engine passes its float64 draws (strided views too); the kernels round them to float32 as the
    reference does. Two equal logits put a CDF boundary at u = 0.5 exactly: 0.5 - 1e-12 is below it in
    float64 and on it (token 1) once rounded. The residual's q = p is empty, so it samples q."""
    logits = torch.zeros(8, 2)
    draws = torch.tensor([0.5 - 1e-12, 0.0, 0.25, 0.5, 0.75, 1 - 1e-12, 0.5 + 1e-12, 0.1], dtype=torch.float64)
    u = torch.stack([draws, torch.full_like(draws, 0.9)], 1)[:, 0]  # (8,) a strided view
    if op == "sample":
        tokens, _ = sample(logits, u, 1.0)
        want, _ = ref.sample(logits, u, 1.0)
    else:
        tokens = residual_sample(logits, logits.clone(), u, 1.0)
        want = ref.residual_sample(logits, logits.clone(), u, 1.0)
    assert torch.equal(tokens, want) and tokens[0] == 1 and tokens[1] == 0


@pytest.mark.parametrize("block_v", [None, 16], ids=["whole-row", "chunk16"])
@pytest.mark.parametrize("op", ["sample", "residual"])
def test_a_draw_at_the_top_of_the_cdf_stays_in_the_vocabulary(op, block_v):
    """u = 1 - 1e-12 rounds to 1.0 in float32: the inverse CDF then lands on the last token of the row, never
    on a column past V = 50 inside the row's last vector-aligned window (50 is not a multiple of 4)."""
    g = torch.Generator().manual_seed(5)
    q, p = (torch.randn(6, 50, generator=g) for _ in range(2))
    u = torch.full((6,), 1 - 1e-12, dtype=torch.float64)
    if op == "sample":
        tokens, _ = sample(q, u, 1.0, block_v=block_v)
        want, _ = ref.sample(q, u, 1.0)
    else:
        tokens = residual_sample(q, p, u, 1.0, block_v=block_v)
        want = ref.residual_sample(q, p, u, 1.0)
    assert torch.equal(tokens.cpu(), want) and bool((want < 50).all())


def test_sample_chi_square():
    """20000 draws from one launch (stride-0 rows) against the exact softmax, with and without top-k."""
    g = torch.Generator().manual_seed(2)
    row = torch.randn(8, generator=g)
    N = 20000
    for top_k in (None, 3):
        u = torch.rand(N, generator=g)
        tokens, _ = sample(row.expand(N, 8), u, 0.8, top_k)
        counts = torch.bincount(tokens, minlength=8)
        assert _chi2_pvalue(counts, truncated_log_probs(row, 0.8, top_k).exp()) > P_FAIL


RESIDUAL_CASES = [(128, 60, 1.0, None, None), (128, 300, 0.8, None, 64), (128, 300, 1.0, 20, 64)]


@pytest.mark.parametrize("case", RESIDUAL_CASES, ids=_sid)
def test_residual_matches_reference(case, poisoned_empty):
    N, V, T, k, bv = case
    g = torch.Generator().manual_seed(V + 3)
    q = torch.randn(N, V, generator=g) * 2
    p = q + torch.randn(N, V, generator=g)
    p[:8] = q[:8]  # empty residual: falls back to q
    u = torch.rand(N, generator=g)
    tokens = residual_sample(q, p, u, T, k, block_v=bv)
    want = ref.residual_sample(q, p, u, T, k)
    qp, pp = ref.log_probs(q, T, k).exp(), ref.log_probs(p, T, k).exp()
    r = (qp - pp).clamp_min(0)
    _assert_same_tokens(tokens, want, torch.where(r.sum(-1, keepdim=True) <= 0, qp, r), u)
    assert torch.equal(residual_sample(q, p, u, 0.0), q.argmax(-1))


def test_residual_chi_square():
    g = torch.Generator().manual_seed(4)
    q, p = torch.randn(2, 8, generator=g)
    N = 20000
    tokens = residual_sample(q.expand(N, 8), p.expand(N, 8), torch.rand(N, generator=g))
    r = (q.softmax(-1) - p.softmax(-1)).clamp_min(0)
    assert _chi2_pvalue(torch.bincount(tokens, minlength=8), r / r.sum()) > P_FAIL


ACCEPT_CASES = [
    # (B, O, R, V, temperature, top_k, block_v)
    (3, 5, 7, 50, 1.0, None, None),
    (2, 3, 9, 300, 0.8, 7, 64),
    (3, 2, 6, 40, 0.0, None, None),
    (1, 1, 1, 20, 1.0, None, None),
]


@pytest.mark.parametrize("rule", ["paper", "lossless"])
@pytest.mark.parametrize(
    "case",
    ACCEPT_CASES,
    ids=lambda c: f"B{c[0]}-O{c[1]}-R{c[2]}-V{c[3]}-T{c[4]}-k{c[5]}" + ("-chunk64" if c[6] else ""),
)
def test_acceptance_matches_reference(case, rule, poisoned_empty):
    B, O, R, V, T, k, bv = case
    g = torch.Generator().manual_seed(B * 100 + R)
    logits = torch.randn(B, O, R, V, generator=g) * 2
    if T == 0:
        drafts = logits.argmax(-1)
        flip = torch.rand(B, O, R, generator=g) < 0.3
        drafts = torch.where(flip, (drafts + 1) % V, drafts)
        draft_logp = torch.zeros(B, O, R)
        logits[0, 0, 0, :2] = logits[0, 0, 0].max() + 1  # argmax tie: the first index counts
    else:
        draft_src = logits + torch.randn(B, O, R, V, generator=g)  # drafts from a nearby p
        lp = ref.log_probs(draft_src, T, k)
        drafts = ref.inverse_cdf(lp.exp().flatten(0, 2), torch.rand(B * O * R, generator=g)).view(B, O, R)
        draft_logp = lp.gather(-1, drafts[..., None]).squeeze(-1)
    u = torch.rand(B, O, R, generator=g)
    lengths = torch.tensor([R, 1, max(1, R - 2)][:B])
    got = acceptance(logits, drafts, draft_logp, u, lengths, T, k, rule, block_v=bv)
    want = ref.acceptance(logits, drafts, draft_logp, u, lengths, T, k, rule)
    if T > 0:
        exact = ref.log_probs(logits, T, k).gather(-1, drafts[..., None]).squeeze(-1)
        torch.testing.assert_close(got.logq, exact, rtol=0, atol=1e-5)
    else:
        assert torch.all(got.logq == 0)
    for name in ("accept", "n_accept", "best", "first_reject", "n_best"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    if R > 1 and T > 0:
        assert 0 < got.accept.float().mean() < 1  # both outcomes occur
        _assert_knife_edge_decisions(lambda u: acceptance(logits, drafts, draft_logp, u, lengths, T, k, rule,
                                                          block_v=bv), got.logq, drafts, draft_logp, lengths, T, rule)


def _assert_knife_edge_decisions(call, logq, drafts, draft_logp, lengths, temperature, rule):
    """``call(u)``, the Triton acceptance with uniforms ``u``, decides as the reference from the same log q
    when each uniform is the step's ratio q/p itself or one float32 step below it (where a ratio off by one
    rounding, either way, flips the decision); ratios >= 1 get 0.5. The ratios and the reference's decisions
    are taken on the kernels' device: torch's exp on a GPU need not round as on the CPU."""
    dev = triton_device()
    logq, drafts, draft_logp, lengths = (t.to(dev) for t in (logq, drafts, draft_logp, lengths))
    ratio = torch.exp(logq - draft_logp.to(logq.dtype))
    below = torch.nextafter(ratio, torch.zeros_like(ratio))
    pick = torch.rand(ratio.shape, generator=torch.Generator().manual_seed(3)).to(dev) < 0.5
    u = torch.where(ratio < 1, torch.where(pick, ratio, below), 0.5).float()
    got = call(u.cpu())
    want = ref.decide(logq, drafts, draft_logp, u, lengths, temperature, rule)
    assert torch.equal(got.logq, logq.cpu())
    for name in ("accept", "n_accept", "best", "first_reject", "n_best"):
        assert torch.equal(getattr(got, name), getattr(want, name).cpu()), name


@pytest.mark.parametrize("scoring,chunk", [("fused", None), ("matmul", None), ("matmul", 1000)],
                         ids=["fused", "matmul", "matmul-chunks-of-3-rows"])
@pytest.mark.parametrize(
    "temperature, top_k, rule",
    [(1.0, None, "paper"), (0.7, None, "lossless"), (0.0, None, "paper"), (1.0, 5, "paper")],
    ids=["T1", "T0.7-lossless", "greedy", "topk"],
)
def test_acceptance_from_hidden(temperature, top_k, rule, scoring, chunk, monkeypatch):
    """Scoring from hidden states: log q and decisions as acceptance() on the materialised logits."""
    if chunk is not None:
        monkeypatch.setattr(accept, "CHUNK_ELEMENTS", chunk)
    g = torch.Generator().manual_seed(7)
    B, O, R, C, V = 2, 3, 7, 40, 300
    hidden = torch.randn(B, O, R, C, generator=g)
    weight = torch.randn(V, C, generator=g) * 0.3
    logits = hidden @ weight.T
    if temperature == 0:
        drafts = logits.argmax(-1)
        drafts[0, 0, 3] = (drafts[0, 0, 3] + 1) % V
        draft_logp = torch.zeros(B, O, R)
    else:
        lp = ref.log_probs(logits + torch.randn(B, O, R, V, generator=g), temperature, top_k)
        drafts = ref.inverse_cdf(lp.exp().flatten(0, 2), torch.rand(B * O * R, generator=g)).view(B, O, R)
        draft_logp = lp.gather(-1, drafts[..., None]).squeeze(-1)
    u = torch.rand(B, O, R, generator=g)
    lengths = torch.tensor([R, 2])
    got = acceptance_from_hidden(hidden, weight, drafts, draft_logp, u, lengths, temperature, top_k, rule,
                                 scoring=scoring)
    want = ref.acceptance(logits, drafts, draft_logp, u, lengths, temperature, top_k, rule)
    if temperature > 0:
        exact = ref.log_probs(logits, temperature, top_k).gather(-1, drafts[..., None]).squeeze(-1)
        torch.testing.assert_close(got.logq, exact, rtol=0, atol=1e-5)
    for name in ("accept", "n_accept", "best", "first_reject", "n_best"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    if temperature > 0:
        _assert_knife_edge_decisions(lambda u: acceptance_from_hidden(
            hidden, weight, drafts, draft_logp, u, lengths, temperature, top_k, rule, scoring=scoring),
            got.logq, drafts, draft_logp, lengths, temperature, rule)
    with pytest.raises(ValueError, match="weight must be"):
        acceptance_from_hidden(hidden, weight[:, :8], drafts, draft_logp, u, lengths, temperature, top_k, rule)
    with pytest.raises(ValueError, match="scoring must be one of"):
        acceptance_from_hidden(hidden, weight, drafts, draft_logp, u, lengths, temperature, top_k, rule,
                               scoring="cublas")


@pytest.mark.parametrize("temperature", [1.0, 0.6, 0.0], ids=["T1", "T0.6", "greedy"])
@pytest.mark.parametrize("C, one_c", [(40, True), (64, True), (200, False), (128, False)],
                         ids=["rows-in-registers-ragged", "rows-in-registers", "C-in-chunks-ragged", "C-in-chunks"])
@pytest.mark.parametrize("splits", ["one-tile-each", "ragged", "one"])
def test_fused_lm_head_tiles(temperature, C, one_c, splits, poisoned_empty, monkeypatch):
    """The fused scoring's (row blocks, vocabulary splits) grid: three row blocks (the last ragged), five
    64-row weight tiles (the last ragged) streamed one per split, 3 + 2 per split, or all by one split; the
    hidden rows kept in registers (one tl.dot per tile, as 16-bit models at most 128 wide) or loaded in
    64-column chunks (as wider ones and float32), each with and without a ragged last chunk; drafts outside
    the vocabulary, and greedy ties across tiles and splits (the first index wins)."""
    monkeypatch.setattr(lm_head, "lm_head_tiles", lambda C, dtype: dict(
        BLOCK_N=64, BLOCK_V=64, BLOCK_C=64, ONE_C=one_c, EVEN_C=C % 64 == 0, num_warps=4, num_stages=2))
    monkeypatch.setattr(lm_head, "resident_programs", lambda *args: 4)  # the interpreter's, on a GPU too
    if splits == "ragged":  # a wave of 8 programs over 3 row blocks: 2 splits of 3 tiles, the last of 2
        monkeypatch.setattr(lm_head, "num_sms", lambda device: 2)
    elif splits == "one":
        monkeypatch.setattr(lm_head, "MAX_SPLITS", 1)
    chosen, split_count = [], lm_head.split_count
    monkeypatch.setattr(lm_head, "split_count", lambda *args: chosen.append(split_count(*args)) or chosen[-1])
    g = torch.Generator().manual_seed(12)
    N, V = 150, 300
    hidden = (torch.randn(N, C, generator=g) * 4).round() / 4  # quarters: exact products with integer weights
    weight = torch.randn(V, C, generator=g) * 0.3
    weight[5] = weight[290] = torch.randint(-1, 2, (C,), generator=g).float()  # tiles 0 and 4: exact ties
    hidden[3] = weight[5] * 10  # ... that are row 3's maximum
    drafts = torch.randint(0, V, (N,), generator=g)
    drafts[:2] = torch.tensor([-1, V])
    drafts[2] = 290
    got = on_triton_device(lm_head.lm_head_logq)(hidden, weight, drafts, temperature)
    assert chosen == [{"one-tile-each": (5, 1), "ragged": (2, 3), "one": (1, 5)}[splits]]  # (splits, tiles each)
    logits = hidden @ weight.T
    if temperature == 0:
        assert torch.equal(got, logits.argmax(-1)) and got[3] == 5
        return
    want = ref.log_probs(logits, temperature, None).gather(-1, drafts.clamp(0, V - 1)[:, None]).squeeze(-1)
    assert torch.all(got[:2] == float("-inf"))
    # fp32 log q of up to 2500 in size: the kernel's dot products and the host BLAS's (whose order varies with
    # the CPU) round the logits differently, a few ulps of log q (1.1e-5 at |log q| = 34 on an Intel Xeon)
    torch.testing.assert_close(got[2:], want[2:], rtol=1e-6, atol=1e-5)
    assert_log_ratio(lambda logp, ratio: on_triton_device(lm_head.lm_head_logq)(hidden, weight, drafts, temperature,
                                                                               logp, ratio), got, 3)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda x, u: sample(x, u, -1.0), r"temperature must be 0 \(greedy\) or a finite number >= 1e-06"),
        (lambda x, u: sample(x, u, 1.0, 0), "top_k must be None or an int >= 1"),
        (lambda x, u: sample(x[0], u), "logits must have 2 dimensions"),
        (lambda x, u: sample(x, u[:2]), r"uniforms must have shape \(4,\)"),
        (lambda x, u: sample(x.long(), u), "logits must be float32"),
        (lambda x, u: residual_sample(x, x[:, :3], u), r"p_logits must have the shape of q_logits \(4, 10\)"),
        (
            lambda x, u: acceptance(x[None, None], x.argmax(-1)[None, None], u[None, None], u[None, None],
                                    torch.tensor([4]), rule="greedy"),
            "acceptance rule must be one of",
        ),
        (
            lambda x, u: acceptance(x[None, None], x.argmax(-1)[None], u[None, None], u[None, None], torch.tensor([4])),
            r"drafts must be a tensor of shape \(1, 1, 4\)",
        ),
    ],
    ids=[
        "neg-temperature", "top-k-0", "rank", "uniforms-shape", "int-logits", "residual-shape", "rule", "drafts-shape",
    ],
)
def test_bad_input(call, match):
    x, u = torch.randn(4, 10), torch.rand(4)
    with pytest.raises(ValueError, match=match):
        call(x, u)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_acceptance_of_16_bit_logits_scores_in_float32(dtype, monkeypatch):
    """16-bit logits: log q in float32 from their float32 values, on both backends, so the Triton decisions
    take the decide kernel (a 16-bit log q would send them to the reference's dozen ops)."""
    from sigmafast.kernels import decide

    g = torch.Generator().manual_seed(9)
    B, O, R, V = 2, 3, 5, 70
    logits = (torch.randn(B, O, R, V, generator=g) * 2).to(dtype)
    drafts = torch.randint(0, V, (B, O, R), generator=g)
    draft_logp = torch.full((B, O, R), -4.0)
    u, lengths = torch.rand(B, O, R, generator=g), torch.tensor([R, 3])
    want = ref.acceptance(logits, drafts, draft_logp, u, lengths, 0.9, None, "lossless")
    monkeypatch.setattr(decide.reference, "decide", None)  # the fallback would fail
    got = acceptance(logits, drafts, draft_logp, u, lengths, 0.9, None, "lossless")
    assert got.logq.dtype == want.logq.dtype == torch.float32
    exact = ref.log_probs(logits.float(), 0.9, None).gather(-1, drafts[..., None]).squeeze(-1)
    torch.testing.assert_close(want.logq, exact, rtol=0, atol=0)
    torch.testing.assert_close(got.logq, exact, rtol=0, atol=1e-5)
    for name in ("accept", "n_accept", "best", "first_reject", "n_best"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gpu_vocab_50257(dtype):
    """GPT-2 vocabulary, B·O·R = 2·5·64 verifier rows. The kernels read the low-precision
    logits and work in fp32, so they match the fp32 reference on the upcast values (log q
    then rounded to the logits' dtype)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    B, O, R, V = 2, 5, 64, 50257
    logits = (torch.randn(B, O, R, V, device="cuda", generator=g) * 3).to(dtype)
    x = logits.float()
    drafts = torch.randint(0, V, (B, O, R), device="cuda", generator=g)
    u = torch.rand(B, O, R, device="cuda", generator=g)
    lengths = torch.tensor([R, 7], device="cuda")
    for top_k in (None, 50):
        got = acceptance(logits, drafts, torch.full((B, O, R), -10.0, device="cuda"), u, lengths, 0.9, top_k)
        exact = ref.log_probs(x, 0.9, top_k).gather(-1, drafts[..., None]).squeeze(-1)
        finite = exact.isfinite()
        assert torch.equal(finite, got.logq.isfinite())
        rtol = 8e-3 if dtype == torch.bfloat16 else 1e-3  # log q is returned in the logits' dtype
        torch.testing.assert_close(got.logq.float()[finite], exact[finite], rtol=rtol, atol=1e-3)
    rows, uu = x.flatten(0, 2), u.flatten()
    tokens, _ = sample(logits.flatten(0, 2), uu, 0.9, 50)
    _assert_same_tokens(tokens, ref.sample(rows, uu, 0.9, 50)[0], ref.log_probs(rows, 0.9, 50).exp(), uu)
