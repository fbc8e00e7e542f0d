"""Split-V vocabulary kernels at their edges: ragged chunks, one-row and odd batches, all the mass in one
chunk, ties, low precision and odd strides, against kernels/reference.py (see test_kernels_sampling.py for
the tie rule)."""

from __future__ import annotations

import pytest
import torch
import triton

from helpers import assert_same_tokens as _assert_same_tokens
from helpers import chi2_pvalue as _chi2_pvalue
from helpers import P_FAIL, assert_log_ratio, on_triton_device, triton_device, truncated_log_probs
from sigmafast.kernels import accept, residual, sampling
from sigmafast.kernels import reference as ref

residual_sample = on_triton_device(sampling.residual_sample)
sample = on_triton_device(sampling.sample)

draft_logq = on_triton_device(accept.draft_logq)


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
    assert_log_ratio(lambda logp, ratio: draft_logq(x, drafts, T, k, bv, logp, ratio), got, N + V)
    assert torch.equal(draft_logq(x, drafts, 0.0, None, bv), x.argmax(-1))


@pytest.mark.parametrize("V, k", [(300, 7), (3000, 5)], ids=["too-few-chunks-per-k", "prefilter"])
def test_draft_logq_tries_the_candidates_first(V, k, monkeypatch, poisoned_empty):
    """Where ``draft_logq`` takes the top-k log-sum-exp from the prefilter's candidates (CUDA; here forced in
    the interpreter too), rows with too few chunks per k fall back to the chunk statistics: both paths give
    the reference's log q and log ratio."""
    monkeypatch.setattr(accept, "CANDIDATE_DEVICES", ("cpu", "cuda"))
    tried = []
    real = accept.topk_logq
    monkeypatch.setattr(accept, "topk_logq", lambda *a, **kw: tried.append(real(*a, **kw)) or tried[-1])
    g = torch.Generator().manual_seed(V + k)
    x = torch.randn(9, V, generator=g) * 3
    drafts = torch.where(torch.arange(9) % 2 == 0, x.argmax(-1), torch.randint(0, V, (9,), generator=g))
    got = draft_logq(x, drafts, 0.8, k, None)
    assert [t is None for t in tried] == [V == 300]
    want = ref.log_probs(x, 0.8, k).gather(-1, drafts[:, None]).squeeze(-1)
    assert torch.equal(got.isfinite(), want.isfinite())
    torch.testing.assert_close(got[want.isfinite()], want[want.isfinite()], rtol=0, atol=1e-5)
    assert_log_ratio(lambda logp, ratio: draft_logq(x, drafts, 0.8, k, None, logp, ratio), got, V)


def test_draft_outside_the_vocabulary_has_log_q_minus_inf(poisoned_empty):
    """A draft id outside [0, V) is never read from memory: its log q is -inf, the other rows are exact."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(5, 300, generator=g)
    drafts = torch.tensor([-1, 300, 10**6, 0, 299])
    got = draft_logq(x, drafts, 0.9, None, 64)
    assert torch.all(got[:3] == float("-inf"))
    want = ref.log_probs(x[3:], 0.9, None).gather(-1, drafts[3:, None]).squeeze(-1)
    torch.testing.assert_close(got[3:], want, rtol=0, atol=1e-5)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on NaN logits
@pytest.mark.parametrize("poison", ["nan", "+inf", "all--inf"])
@pytest.mark.parametrize("bv", [None, 16], ids=["whole-row", "chunk16"])
def test_a_row_without_a_distribution_still_draws_a_token_inside_the_vocabulary(poison, bv, poisoned_empty):
    """A row holding a NaN or +inf, or no finite logit, has no distribution: its token is unspecified (the flag
    reports the row), but it is an index into the vocabulary, as the reference's is, so that the lookups that
    read it (the canvas, the next forward's embeddings) stay in bounds; the other rows draw as usual."""
    g = torch.Generator().manual_seed(len(poison) + (bv or 0))
    N, V, bad = 6, 100, [1, 4]
    q = torch.randn(N, V, generator=g) * 3
    p = q + torch.randn(N, V, generator=g)
    p[2] = q[2]  # an empty residual: q's law
    for x, rows in ((q, bad), (p, [4])):  # residual: a bad q row with a fine p row, and one with a bad p row
        if poison == "all--inf":
            x[rows] = float("-inf")
        else:
            x[rows, 37] = float("nan") if poison == "nan" else float("inf")
    u = torch.rand(N, generator=g)
    good = torch.tensor([i not in bad for i in range(N)])
    for T, k in ((1.0, None), (0.7, 5)):
        probs = ref.log_probs(q, T, k).exp()
        for name, tokens, want in (("sample", sample(q, u, T, k, block_v=bv)[0], ref.sample(q, u, T, k)[0]),
                                   ("residual", residual_sample(q, p, u, T, k, block_v=bv),
                                    ref.residual_sample(q, p, u, T, k))):
            assert torch.all((want >= 0) & (want < V)), "the reference's tokens are ids"
            assert torch.all((tokens >= 0) & (tokens < V)), f"{name}, T {T}, top-k {k}: {tokens.tolist()}"
            if name == "sample":
                _assert_same_tokens(tokens[good], want[good], probs[good], u[good])


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


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("V, bv", [(63, None), (63, 16), (125, None)], ids=["V63", "V63-chunk16", "V125"])
def test_greedy_argmax_at_the_end_of_shifted_rows(V, bv, dtype, poisoned_empty):
    """Rows at an odd stride start up to ALIGN - 1 columns into their 16-byte window, so their last columns lie
    past the last whole chunk of V columns: the argmax reads the window's last chunk too, whatever the shift."""
    g = torch.Generator().manual_seed(V + (bv or 0))
    x = torch.randn(9, V + 2, generator=g).to(dtype)[:, :V]  # an odd row stride: every shift into the windows
    x[torch.arange(9), V - 1 - torch.arange(9) % 3] = 50.0  # each row's max in one of its last three columns
    drafts = torch.zeros(9, dtype=torch.long)
    assert torch.equal(draft_logq(x, drafts, 0.0, None, bv), x.float().argmax(-1))


def test_multi_chunk_chi_square():
    """Draws across 8-wide chunks (the crossing chunk, then the token inside it) against the exact law."""
    g = torch.Generator().manual_seed(8)
    q, p = torch.randn(2, 37, generator=g)
    N = 20000
    tokens, _ = sample(q.expand(N, 37), torch.rand(N, generator=g), 1.2, 20, block_v=8)
    assert _chi2_pvalue(torch.bincount(tokens, minlength=37), truncated_log_probs(q, 1.2, 20).exp()) > P_FAIL
    tokens = residual_sample(q.expand(N, 37), p.expand(N, 37), torch.rand(N, generator=g), block_v=8)
    r = (q.softmax(-1) - p.softmax(-1)).clamp_min(0)
    assert _chi2_pvalue(torch.bincount(tokens, minlength=37), r / r.sum()) > P_FAIL


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
            assert logp.dtype == torch.float32
            _assert_same_tokens(tokens, ref.sample(xf, u, T, k)[0], ref.log_probs(xf, T, k).exp(), u)
            full = ref.log_probs(xf, T, k).gather(-1, tokens[:, None]).squeeze(-1)
            torch.testing.assert_close(logp, full, rtol=1e-5, atol=1e-5)
            want_tok, want_logp = ref.sample(x, u, T, k)  # the reference reads 16-bit logits as float32 too
            assert want_logp.dtype == torch.float32 and torch.equal(want_tok, ref.sample(xf, u, T, k)[0])
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


@pytest.mark.parametrize("stages, dtype, T, k", [
    (1, torch.float32, 1.0, None), (1, torch.bfloat16, 1.0, None), (1, torch.float32, 0.7, 5),
    (1, torch.bfloat16, 0.7, 5), (3, torch.float32, 1.0, None), (3, torch.bfloat16, 0.7, 5),
], ids=["prefetch-T1-float32", "prefetch-T1-bfloat16", "prefetch-T0.7-topk5-float32", "prefetch-T0.7-topk5-bfloat16",
        "pipelined-T1-float32", "pipelined-T0.7-topk5-bfloat16"])
def test_persistent_stream_matches_one_program_per_tile(dtype, T, k, stages, monkeypatch, poisoned_empty):
    """The streaming kernels' persistent programs (each looping over its tiles, the next one's loads issued
    before the current one is reduced, or with ``STREAM_STAGES`` > 1 a loop that Triton pipelines) write
    bit-identically what one program per tile writes: every tile, the ragged last row block and the edge
    chunks included, with more tiles than programs (one per SM); the top-k prefilter's chunk maxima too."""
    from sigmafast.kernels import topk, vocab

    monkeypatch.setattr(vocab, "resident_programs", lambda *args: 1)
    g = torch.Generator().manual_seed(3)
    device = triton_device()
    # 16 chunks of 64 columns; 3 row blocks (48 tiles) for the interpreter's 4 programs, 19 for a GPU's SMs
    N, V = (300 if device == "cpu" else 2400), 1000
    q = (torch.randn(N, V, generator=g) * 3).to(dtype).to(device)
    p = (q.float() + torch.randn(N, V, generator=g).to(device)).to(dtype)
    q[7, 500:] = float("-inf")  # a row whose later chunks hold nothing
    cfg = vocab.split_config(V, dtype, 64)
    kq, kp = (topk.threshold(x, k, 64) for x in (q, p))

    pre = topk.prefilter_config(V, dtype, 5, 256, 16)  # 63 chunks of 16 in 4 window tiles of 256 per row

    def run(persistent: bool, stages: int) -> list:
        monkeypatch.setattr(vocab, "PERSISTENT", persistent)
        monkeypatch.setattr(vocab, "STREAM_STAGES", stages)
        s_x = q.stride(0) // cfg.unit
        mq, sq = vocab.chunk_stats(q, kq, T, cfg, s_x)
        mp, sp = vocab.chunk_stats(p, kp, T, cfg, s_x)
        m, s = vocab.chunk_stats(q, kq, T, cfg, s_x, p, kp)  # both in one launch, p's rows after q's
        kth, cand, count = topk.prefilter(q[:24], 5, pre, more=p[:24])  # 192 tiles: few rows, interpreted
        return [mq, sq, mp, sp, m, s, *residual.residual_masses(q, p, kq, kp, mq, sq, mp, sp, T, cfg, s_x),
                kth, cand.sort(1).values, count]

    n_tiles = triton.cdiv(N, cfg.block_n) * cfg.nc
    assert vocab.stream_grid(None, n_tiles, (), {}, q.device)[0] < n_tiles, "every program must loop"
    assert vocab.stream_grid(None, 48 * pre[0].nc, (), {}, q.device)[0] < 48 * pre[0].nc
    names = ["q chunk max", "q chunk sum", "p chunk max", "p chunk sum", "paired chunk max", "paired chunk sum",
             "residual masses", "q masses", "lse", "top-k threshold", "top-k candidates", "top-k counts"]
    results = run(True, stages)
    for name, got, want in zip(names, results, run(False, 1)):
        assert not got.isnan().any(), f"{name}: the persistent programs left elements unwritten"
        assert got.shape == want.shape, name
        assert torch.equal(got, want), f"{name} differs from one program per tile"
    mq, sq, mp, sp, m, s = results[:6]
    assert torch.equal(m, torch.cat([mq, mp])) and torch.equal(s, torch.cat([sq, sp])), "paired != separate"


@pytest.mark.parametrize("regs, shared, warps, want", [
    (121, 64, 4, 4),  # the one-tile chunk statistics on sm_90
    (168, 64, 4, 3),  # the persistent ones: 5376 registers per warp
    (255, 0, 8, 1),  # 255 registers round up to 8192 per warp
    (32, 0, 4, 16),  # bound by the 2048 threads
    (64, 100_000, 4, 2),  # bound by shared memory
])
def test_occupancy_counts_registers_threads_and_shared_memory(regs, shared, warps, want):
    from sigmafast.kernels.utils import occupancy

    assert occupancy(regs, shared, warps, max_threads=2048, shared_per_sm=233_472) == want


def test_occupancy_falls_back_when_triton_internals_move():
    """A Triton without ``_init_handles`` / ``n_regs`` (private API) gives a warning and a fixed count, not a
    failed launch; any other error (a compile error) still raises."""
    from sigmafast.kernels.utils import FALLBACK_RESIDENT, measured_or_fallback

    assert measured_or_fallback(lambda: 3, "k") == 3

    def moved() -> int:
        raise AttributeError("'CompiledKernel' object has no attribute 'n_regs'")

    with pytest.warns(RuntimeWarning, match="could not read the registers of Triton kernel k"):
        assert measured_or_fallback(moved, "k") == FALLBACK_RESIDENT

    def broken() -> int:
        raise RuntimeError("compilation failed")

    with pytest.raises(RuntimeError, match="compilation failed"):
        measured_or_fallback(broken, "k")


def test_draft_logq_of_strided_drafts(poisoned_empty):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 300, generator=g)
    d = torch.randint(0, 300, (9,), generator=g)
    drafts = torch.stack([d, torch.full_like(d, 10**6)], 1).to(triton_device())[:, 0]  # stride 2
    got = accept.draft_logq(x.to(drafts.device), drafts, 0.9, None, 64)
    want = ref.log_probs(x, 0.9, None).gather(-1, d[:, None]).squeeze(-1)
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=1e-5)

