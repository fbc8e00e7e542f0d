"""Triton sampling, residual sampling and acceptance against kernels/reference.py.

Run in the Triton interpreter on CPU (conftest sets TRITON_INTERPRET=1 when there
is no CUDA device; with one, compiled on it), fp32.
Token equality with the reference is exact except at float-rounding ties: a
row may differ only if its target ``u * total`` lies within 1e-5 of a CDF
boundary of the reference (checked, never just tolerated). The chi-square
tests compare many draws from one launch with the exact softmax.
"""

from __future__ import annotations

import pytest
import torch

from helpers import on_triton_device
from sigmafast.kernels import accept, sampling
from sigmafast.kernels import reference as ref

# in the interpreter on CPU, compiled on a GPU (the tensors are built on the CPU either way)
acceptance = on_triton_device(accept.acceptance)
acceptance_from_hidden = on_triton_device(accept.acceptance_from_hidden)
residual_sample = on_triton_device(sampling.residual_sample)
sample = on_triton_device(sampling.sample)


def _assert_same_tokens(tokens, want, probs, uniforms):
    """Tokens equal the reference's except at a float-rounding tie of the inverse CDF."""
    differ = (tokens != want).nonzero().flatten()
    cdf = probs.double().cumsum(-1)
    for i in differ.tolist():
        target = uniforms[i].double() * cdf[i, -1]
        edge = cdf[i, min(tokens[i], want[i])]
        assert abs(edge - target) <= 1e-5, f"row {i}: token {tokens[i]} != reference {want[i]} (not a rounding tie)"
    assert differ.numel() <= max(1, tokens.numel() // 100)


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "sampled a token of probability 0"
    stat = ((counts[keep].double() - expected[keep]) ** 2 / expected[keep]).sum()
    df = keep.sum() - 1
    return torch.special.gammaincc(df.double() / 2, stat / 2).item()


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
def test_sample_matches_reference(case):
    N, V, T, k, bv = case
    g = torch.Generator().manual_seed(V + N)
    logits = torch.randn(N, V, generator=g) * 3
    u = torch.rand(N, generator=g)
    tokens, logp = sample(logits, u, T, k, block_v=bv)
    want, want_logp = ref.sample(logits, u, T, k)
    _assert_same_tokens(tokens, want, ref.log_probs(logits, T, k).exp(), u)
    full = ref.log_probs(logits, T, k).gather(-1, tokens[:, None]).squeeze(-1)
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


def test_sample_chi_square():
    """20000 draws from one launch (stride-0 rows) against the exact softmax, with and without top-k."""
    g = torch.Generator().manual_seed(2)
    row = torch.randn(8, generator=g)
    N = 20000
    for top_k in (None, 3):
        u = torch.rand(N, generator=g)
        tokens, _ = sample(row.expand(N, 8), u, 0.8, top_k)
        counts = torch.bincount(tokens, minlength=8)
        assert _chi2_pvalue(counts, ref.log_probs(row, 0.8, top_k).exp()) > 1e-3


RESIDUAL_CASES = [(128, 60, 1.0, None, None), (128, 300, 0.8, None, 64), (128, 300, 1.0, 20, 64)]


@pytest.mark.parametrize("case", RESIDUAL_CASES, ids=_sid)
def test_residual_matches_reference(case):
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
    assert _chi2_pvalue(torch.bincount(tokens, minlength=8), r / r.sum()) > 1e-3


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
def test_acceptance_matches_reference(case, rule):
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
    for name in ("accept", "n_accept", "best", "first_reject"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    if R > 1 and T > 0:
        assert 0 < got.accept.float().mean() < 1  # both outcomes occur


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
    for name in ("accept", "n_accept", "best", "first_reject"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    with pytest.raises(ValueError, match="weight must be"):
        acceptance_from_hidden(hidden, weight[:, :8], drafts, draft_logp, u, lengths, temperature, top_k, rule)
    with pytest.raises(ValueError, match="scoring must be one of"):
        acceptance_from_hidden(hidden, weight, drafts, draft_logp, u, lengths, temperature, top_k, rule,
                               scoring="cublas")


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda x, u: sample(x, u, -1.0), "temperature must be >= 0"),
        (lambda x, u: sample(x, u, 1.0, 0), "top_k must be None or an int >= 1"),
        (lambda x, u: sample(x[0], u), "logits must have 2 dimensions"),
        (lambda x, u: sample(x, u[:2]), r"uniforms must have shape \(4,\)"),
        (lambda x, u: sample(x.long(), u), "logits must be float32"),
        (lambda x, u: residual_sample(x, x[:, :3], u), "p_logits must have q_logits' shape"),
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


# --- split-V edge cases: ragged chunks, one-row and odd batches, mass in one chunk, ties ---------------------

draft_logq = on_triton_device(accept.draft_logq)


@pytest.fixture
def poisoned_empty(monkeypatch):
    """Every ``torch.empty``/``empty_like`` of the launchers (outputs and split-V partials) comes filled
    with NaN (floats) or a huge value (ints), so that an element the kernels forget to write shows up."""
    real_empty, real_like = torch.empty, torch.empty_like

    def poison(t):
        return t.fill_(float("nan") if t.is_floating_point() else -(2**30) if t.dtype != torch.bool else True)

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(real_like(*a, **k)))


def _edge_logits(kind, N, V, g):
    x = torch.randn(N, V, generator=g) * 3
    if kind == "last-chunk":  # all the mass in the last (ragged) chunk: the others are -inf
        x[:, : V - max(1, V % 64 or 64)] = float("-inf")
    elif kind == "middle-chunk":  # nonzero only in the middle: later chunks -inf, earlier ones underflow
        x[:, : V // 3] = -300.0
        x[:, 2 * V // 3:] = float("-inf")
    elif kind == "ties":  # heavy ties, top-k thresholds included
        x = (x * 0.5).round()
    elif kind == "peaked":
        x[:, V // 2] += 40.0
    return x


EDGE_CASES = [
    # (kind, N, V, temperature, top_k, block_v)
    ("randn", 1, 5, 1.0, None, None),  # one row, V smaller than a chunk
    ("randn", 7, 1, 1.0, None, None),  # V = 1
    ("randn", 7, 1, 0.5, 1, None),
    ("randn", 1, 300, 0.3, None, 64),  # V not a multiple of the chunk
    ("randn", 33, 300, 2.5, 7, 64),
    ("randn", 3, 5000, 1.0, None, None),  # default chunk, ragged last chunk
    ("randn", 5, 5000, 0.9, 50, None),
    ("last-chunk", 9, 300, 1.0, None, 64),
    ("last-chunk", 9, 257, 0.7, 3, 64),
    ("middle-chunk", 11, 300, 1.0, None, 32),
    ("ties", 17, 200, 1.0, 10, 32),
    ("ties", 17, 200, 0.6, 1, 16),
    ("peaked", 5, 333, 1.0, None, 8),
]


def _eid(c):
    kind, N, V, T, k, bv = c
    return f"{kind}-N{N}-V{V}-T{T}-k{k}" + (f"-chunk{bv}" if bv else "")


def _edge_uniforms(N, g):
    u = torch.rand(N, generator=g)
    u[0] = 1.0 - 2**-24  # the last-nonzero clamp
    if N > 1:
        u[1] = 0.0
    return u


@pytest.mark.parametrize("case", EDGE_CASES, ids=_eid)
def test_sample_edge_cases(case, poisoned_empty):
    kind, N, V, T, k, bv = case
    g = torch.Generator().manual_seed(N * 1000 + V)
    x = _edge_logits(kind, N, V, g)
    u = _edge_uniforms(N, g)
    tokens, logp = sample(x, u, T, k, block_v=bv)
    want, _ = ref.sample(x, u, T, k)
    probs = ref.log_probs(x, T, k).exp()
    _assert_same_tokens(tokens, want, probs, u)
    assert torch.all(probs.gather(-1, tokens[:, None]) > 0), "sampled a token of probability 0"
    full = ref.log_probs(x, T, k).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(logp, full, rtol=0, atol=1e-5)
    greedy, logp0 = sample(x, u, 0.0, k, block_v=bv)
    assert torch.equal(greedy, x.argmax(-1)) and torch.all(logp0 == 0)


@pytest.mark.parametrize("case", EDGE_CASES, ids=_eid)
def test_residual_edge_cases(case, poisoned_empty):
    kind, N, V, T, k, bv = case
    g = torch.Generator().manual_seed(N * 1000 + V + 1)
    q = _edge_logits(kind, N, V, g)
    p = q + torch.randn(N, V, generator=g)
    p[::3] = q[::3]  # empty residual rows (row 0 among them): fall back to q
    u = _edge_uniforms(N, g)
    tokens = residual_sample(q, p, u, T, k, block_v=bv)
    want = ref.residual_sample(q, p, u, T, k)
    qp, pp = ref.log_probs(q, T, k).exp(), ref.log_probs(p, T, k).exp()
    r = (qp - pp).clamp_min(0)
    probs = torch.where(r.sum(-1, keepdim=True) <= 0, qp, r)
    _assert_same_tokens(tokens, want, probs, u)
    assert torch.all(probs.gather(-1, tokens[:, None]) > 0), "sampled a token of probability 0"


@pytest.mark.parametrize("case", EDGE_CASES, ids=_eid)
def test_draft_logq_edge_cases(case, poisoned_empty):
    kind, N, V, T, k, bv = case
    g = torch.Generator().manual_seed(N * 1000 + V + 2)
    x = _edge_logits(kind, N, V, g)
    drafts = torch.randint(0, V, (N,), generator=g)
    drafts[0] = V - 1
    got = draft_logq(x, drafts, T, k, bv)
    want = ref.log_probs(x, T, k).gather(-1, drafts[:, None]).squeeze(-1)
    assert got.dtype == torch.float32 and torch.equal(got.isfinite(), want.isfinite())
    finite = want.isfinite()
    torch.testing.assert_close(got[finite], want[finite], rtol=0, atol=1e-5)
    assert torch.all(got[~finite] == float("-inf"))
    assert torch.equal(draft_logq(x, drafts, 0.0, None, bv), x.argmax(-1))


def test_greedy_argmax_ties_across_chunks():
    """The first index of the max, also when it is repeated in later chunks (and in the same chunk)."""
    x = torch.randn(6, 100)
    x[0, [70, 10, 99]] = 50.0  # chunk 1 of 8-wide chunks holds the first
    x[1, [99, 98]] = 50.0  # the ragged last chunk
    x[2] = 0.0  # all equal: index 0
    x[3, 5:] = float("-inf")
    x[4, [33, 34]] = 50.0
    for bv in (8, 32, None):
        assert torch.equal(draft_logq(x, torch.zeros(6, dtype=torch.long), 0.0, None, bv), x.argmax(-1))
    assert draft_logq(x, torch.zeros(6, dtype=torch.long), 0.0, None, 8)[:3].tolist() == [10, 98, 0]


def test_multi_chunk_chi_square():
    """Draws across 8-wide chunks (the crossing chunk, then the token inside it) against the exact law."""
    g = torch.Generator().manual_seed(8)
    q, p = torch.randn(2, 37, generator=g)
    N = 20000
    tokens, _ = sample(q.expand(N, 37), torch.rand(N, generator=g), 1.2, 20, block_v=8)
    assert _chi2_pvalue(torch.bincount(tokens, minlength=37), ref.log_probs(q, 1.2, 20).exp()) > 1e-3
    tokens = residual_sample(q.expand(N, 37), p.expand(N, 37), torch.rand(N, generator=g), block_v=8)
    r = (q.softmax(-1) - p.softmax(-1)).clamp_min(0)
    assert _chi2_pvalue(torch.bincount(tokens, minlength=37), r / r.sum()) > 1e-3


def test_uniform_grid_matches_reference_token_for_token():
    """Uniforms on a fine grid over one multi-chunk row: every token equals the reference's, or sits at a
    rounding tie of the CDF; the chunk boundaries are crossed many times."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(1, 200, generator=g)
    N = 4096
    u = (torch.arange(N) + 0.5) / N
    tokens, _ = sample(x.expand(N, 200), u, 1.0, None, block_v=16)
    want, _ = ref.sample(x.expand(N, 200), u, 1.0, None)
    _assert_same_tokens(tokens, want, ref.log_probs(x.expand(N, 200), 1.0, None).exp(), u)
    assert len(set(tokens.tolist())) > 100


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
def test_low_precision_odd_strides(dtype, poisoned_empty):
    """Rows at odd strides and offsets (a 16-byte window per row start: shifts 0..7) in every dtype: the
    kernels read the rounded logits and work in fp32, so they match the fp32 reference on the upcast values."""
    g = torch.Generator().manual_seed(10)
    base = (torch.randn(23, 301, generator=g) * 3).to(dtype)
    for x in (base, base[:, 1:], base[1::2, 3:290]):  # contiguous odd V, offset views, strided rows
        N, V = x.shape
        xf = x.float()
        u = torch.rand(N, generator=g)
        for T, k, bv in ((1.0, None, 32), (0.8, 5, None), (1.3, None, 16)):
            tokens, logp = sample(x, u, T, k, block_v=bv)
            assert logp.dtype == dtype
            _assert_same_tokens(tokens, ref.sample(xf, u, T, k)[0], ref.log_probs(xf, T, k).exp(), u)
            full = ref.log_probs(xf, T, k).gather(-1, tokens[:, None]).squeeze(-1)
            torch.testing.assert_close(logp.float(), full, rtol=1e-2, atol=1e-2)
            drafts = torch.randint(0, V, (N,), generator=g)
            want = ref.log_probs(xf, T, k).gather(-1, drafts[:, None]).squeeze(-1)
            got = draft_logq(x, drafts, T, k, bv)
            assert torch.equal(got.isfinite(), want.isfinite())
            torch.testing.assert_close(got[want.isfinite()], want[want.isfinite()], rtol=0, atol=1e-5)
            p = x.flip(0).contiguous()  # a different row stride from x's: both copied to one layout
            p[::4] = x[::4]
            tok_r = residual_sample(x, p, u, T, k, block_v=bv)
            qp, pp = ref.log_probs(xf, T, k).exp(), ref.log_probs(p.float(), T, k).exp()
            r = (qp - pp).clamp_min(0)
            _assert_same_tokens(tok_r, ref.residual_sample(xf, p.float(), u, T, k),
                                torch.where(r.sum(-1, keepdim=True) <= 0, qp, r), u)
        assert torch.equal(draft_logq(x, drafts, 0.0, None, 16), xf.argmax(-1))
