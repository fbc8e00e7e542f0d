"""The top-k threshold (kernels/topk.py: chunk-max prefilter; kernels/radix.py: radix select) against
``reference.kth_largest`` (torch.topk): exact equality in every dtype, over ragged chunks, one-element rows, ties,
infinities, NaN, signed zeros and rows whose candidates overflow."""

from __future__ import annotations

import zlib

import pytest
import torch

from helpers import assert_log_ratio, on_triton_device, triton_device
from sigmafast.kernels import reference as ref
from sigmafast.kernels import radix, topk

kth_largest = on_triton_device(topk.kth_largest)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _rows(kind, N, V, g):
    x = torch.randn(N, V, generator=g) * 4
    if kind == "negative":  # every key has its sign bit flipped: the low bits are ones
        x = -x.abs() - 1
    elif kind == "ties":
        x = (x * 0.5).round()
    elif kind == "neg-inf":  # the k-th largest may be -inf
        x[:, : (2 * V) // 3] = float("-inf")
    elif kind == "zeros":  # +0.0 and -0.0 compare equal, and have different keys
        x = torch.where(torch.rand(N, V, generator=g) < 0.5, torch.zeros(()), -torch.zeros(()))
        x[:, ::7] = 1.0
    elif kind == "huge":  # the float extremes and +inf
        x[:, ::5] = float("inf")
        x[:, 1::5] = torch.finfo(torch.float16).max
        x[:, 2::5] = -torch.finfo(torch.float16).max
    elif kind == "equal":  # every value ties: every column is a candidate
        x = x[:, :1].expand(N, V).clone()
    elif kind == "nan":  # row i holds i NaNs of either sign (torch.topk ranks them above +inf)
        for i in range(N):
            cols = torch.randperm(V, generator=g)[:i]
            x[i, cols] = torch.where(torch.arange(i) % 2 == 0, float("nan"), -float("nan"))
    elif kind == "one-chunk":  # the top values share one chunk: many candidates
        x[:, 200:330] += 100.0
    return x


CASES = [
    # (kind, N, V, top_k, block_v)
    ("randn", 1, 2, 1, None),  # one row, two columns
    ("randn", 7, 5, 4, None),  # k = V - 1
    ("randn", 3, 300, 1, 64),  # the max, ragged last chunk
    ("randn", 33, 300, 50, 64),
    ("randn", 4, 5000, 50, None),  # default chunk
    ("randn", 3, 9000, 7, None),  # default chunk: an interior chunk between two edge ones
    ("negative", 5, 257, 13, 32),
    ("ties", 17, 200, 10, 32),
    ("ties", 6, 200, 199, 16),
    ("neg-inf", 9, 300, 150, 64),
    ("zeros", 8, 100, 20, 16),
    ("huge", 5, 333, 70, 8),
]


def _cid(c):
    kind, N, V, k, bv = c
    return f"{kind}-N{N}-V{V}-k{k}" + (f"-chunk{bv}" if bv else "")


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("case", CASES, ids=_cid)
def test_kth_largest_matches_topk(case, dtype, poisoned_empty):
    kind, N, V, k, block_v = case
    g = torch.Generator().manual_seed(zlib.crc32(_cid(case).encode()))
    x = _rows(kind, N, V, g).to(dtype)
    got = kth_largest(x, k, block_v)
    assert got.dtype == torch.float32 and got.shape == (N,)
    torch.testing.assert_close(got, ref.kth_largest(x, k).float(), rtol=0, atol=0)


# the cases where kth_largest takes the prefilter (elsewhere it takes the radix select: the test above)
RADIX_ALONE = [pytest.param(c, dtype, id=f"{_cid(c)}-{name}") for c in CASES for name, dtype in DTYPES.items()
               if topk.prefilter_config(c[2], dtype, c[3], c[4]) is not None]


@pytest.mark.parametrize("case,dtype", RADIX_ALONE)
def test_radix_select_matches_topk(case, dtype, poisoned_empty):
    """The radix select on its own, where ``kth_largest`` takes the prefilter."""
    kind, N, V, k, block_v = case
    g = torch.Generator().manual_seed(zlib.crc32(_cid(case).encode()))
    x = _rows(kind, N, V, g).to(dtype)
    got = on_triton_device(radix.radix_kth_largest)(x, k, block_v)
    torch.testing.assert_close(got, ref.kth_largest(x, k).float(), rtol=0, atol=0)


# V = 3000 has 24 chunks of 128 columns in every dtype (its aligned windows span up to V + 7 columns)
PREFILTER_CASES = [
    # (kind, N, V, top_k, block_v, chunk, cap, path)
    ("randn", 1, 3000, 1, None, None, None, "prefilter"),  # one row, the max
    ("randn", 3, 3000, 24, None, None, None, "prefilter"),  # k = NC
    ("randn", 3, 3000, 25, None, None, None, "radix"),  # k = NC + 1: the fallback
    ("randn", 2, 9000, 50, None, None, None, "prefilter"),  # an interior program between two edge ones
    ("randn", 4, 3000, 30, 64, 16, None, "prefilter"),  # 188 chunks: several collect programs
    ("randn", 3, 3000, 10, None, 32, 4, "prefilter"),  # cap < k: the candidates overflow, the row is scanned
    ("negative", 3, 1000, 13, None, 16, None, "prefilter"),
    ("ties", 5, 1000, 10, None, 32, None, "prefilter"),  # ties at the threshold
    ("equal", 3, 3000, 7, None, None, None, "prefilter"),  # 3000 candidates > CAP: scanned over 2 tiles
    ("neg-inf", 4, 3000, 40, None, 32, None, "prefilter"),  # ~32 finite chunks: t0 = -inf, all candidates
    ("neg-inf", 3, 1000, 400, None, 2, None, "prefilter"),  # the k-th largest is -inf
    ("nan", 5, 1000, 3, None, 32, None, "prefilter"),  # NaN of both signs, the k-th largest NaN in 2 rows
    ("one-chunk", 3, 3000, 5, None, None, None, "prefilter"),  # 130 candidates in one or two chunks
    ("one-chunk", 2, 3000, 20, None, 32, 64, "prefilter"),  # ... more than cap
    ("zeros", 4, 1000, 20, None, 16, None, "prefilter"),  # +0.0 and -0.0 tie, with different keys
    ("huge", 3, 1000, 70, None, 8, None, "prefilter"),
    ("randn", 3, 301, 3, 32, 16, None, "prefilter"),  # V not a multiple of 16, 32-column programs
]


def _pid(c):
    kind, N, V, k, bv, chunk, cap, path = c
    opts = "".join(f"-{name}{v}" for name, v in (("tile", bv), ("chunk", chunk), ("cap", cap)) if v)
    return f"{path}-{kind}-N{N}-V{V}-k{k}{opts}"


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("case", PREFILTER_CASES, ids=_pid)
def test_prefilter_matches_topk(case, dtype, poisoned_empty):
    kind, N, V, k, block_v, chunk, cap, path = case
    """Down to one chunk per unit of k (``chunks_per_k=1``: the loosest bound the prefilter is exact with)."""
    assert (topk.prefilter_config(V, dtype, k, block_v, chunk, 1) is not None) == (path == "prefilter")
    g = torch.Generator().manual_seed(zlib.crc32(_pid(case).encode()))
    x = _rows(kind, N, V, g).to(dtype)
    got = kth_largest(x, k, block_v, chunk, **({"cap": cap} if cap else {}), chunks_per_k=1)
    assert got.dtype == torch.float32 and got.shape == (N,)
    torch.testing.assert_close(got, ref.kth_largest(x, k).float(), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("k, block_v, chunk", [(9, 32, None), (30, None, 8), (9, None, None)],
                         ids=["prefilter-tile32", "prefilter-chunk8", "radix"])
def test_kth_largest_strided_rows(k, block_v, chunk, dtype, poisoned_empty):
    g = torch.Generator().manual_seed(3)
    full = torch.randn(6, 301, generator=g).to(dtype)
    x = full[1:, 3:290]  # an offset view with an odd row stride
    assert (topk.prefilter_config(287, dtype, k, block_v, chunk, 1) is None) == (block_v is None and chunk is None)
    got = kth_largest(x, k, block_v, chunk, chunks_per_k=1)
    torch.testing.assert_close(got, ref.kth_largest(x, k).float(), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_prefilter_needs_chunks_per_k_chunks_by_default(dtype):
    """GPT-2's 50257 columns make 393 chunks of 128: the prefilter up to top-k 98, radix select above."""
    assert topk.prefilter_config(50257, dtype, 98, None) is not None
    assert topk.prefilter_config(50257, dtype, 99, None) is None
    assert topk.prefilter_config(50257, dtype, 99, None, None, 1) is not None


def test_kth_largest_empty_batch_and_k_equal_to_v(poisoned_empty):
    x = torch.randn(3, 10)
    assert kth_largest(x[:0], 4).shape == (0,)  # radix select
    assert kth_largest(x[:0], 1, chunk=2).shape == (0,)  # prefilter (7 window chunks of 2 columns)
    torch.testing.assert_close(kth_largest(x, 10), x.min(-1).values, rtol=0, atol=0)


def test_launchers_threshold_is_the_kth_largest(poisoned_empty):
    """``topk.threshold`` (``kth_largest`` on CUDA, torch.topk in the interpreter) gives the same float32
    values, and None when top-k keeps every column."""
    threshold = on_triton_device(topk.threshold)
    x = _rows("ties", 20, 300, torch.Generator().manual_seed(4)).to(torch.bfloat16)
    torch.testing.assert_close(threshold(x, 30, 64), ref.kth_largest(x, 30).float(), rtol=0, atol=0)
    assert threshold(x, None) is None and threshold(x, 300) is None


@pytest.mark.parametrize("dtype, temperature", [(torch.float32, 1.0)] + [(d, 0.7) for d in DTYPES.values()],
                         ids=["fp32-T1"] + [f"{n}-T0.7" for n in DTYPES])
@pytest.mark.parametrize("case", [c for c in PREFILTER_CASES if c[-1] == "prefilter" and c[0] not in ("nan", "huge")],
                         ids=_pid)
def test_topk_log_q_from_the_candidates_matches_the_reference(case, dtype, temperature, poisoned_empty):
    """log q under top-k with the log-sum-exp taken over the prefilter's candidates (or over the whole row
    when they overflow), against the reference's log-softmax of the processed row (finite logits only:
    non-finite ones are flagged before any acceptance). Drafts include each row's argmax, columns below
    the threshold (log q -inf) and ids outside the vocabulary."""
    from sigmafast.kernels import accept

    kind, N, V, k, block_v, chunk, cap, _ = case
    g = torch.Generator().manual_seed(zlib.crc32(_pid(case).encode()) + 1)
    x = _rows(kind, N, V, g).to(dtype)
    drafts = torch.randint(0, V, (N,), generator=g)
    drafts[0] = x[0].float().argmax()
    if N > 2:
        drafts[1], drafts[2] = -1, V  # outside the vocabulary
    got = on_triton_device(accept.topk_logq)(x, drafts, temperature, k, block_v, chunk,
                                             **({"cap": cap} if cap else {}), chunks_per_k=1)
    want = ref.log_probs(x.float(), temperature, k).gather(-1, drafts.clamp(0, V - 1)[:, None]).squeeze(-1)
    want = torch.where((drafts >= 0) & (drafts < V), want, float("-inf"))
    assert got.dtype == torch.float32 and got.shape == (N,)
    assert torch.equal(got.isfinite(), want.isfinite()), f"finite where the reference is not: {got} {want}"
    torch.testing.assert_close(got[want.isfinite()], want[want.isfinite()], rtol=1e-6, atol=1e-5)
    assert torch.all(got[~want.isfinite()] == float("-inf"))
    assert_log_ratio(lambda logp, ratio: on_triton_device(accept.topk_logq)(
        x, drafts, temperature, k, block_v, chunk, **({"cap": cap} if cap else {}), chunks_per_k=1, draft_logp=logp,
        log_ratio=ratio), got, N)


def test_topk_log_q_is_the_same_in_any_candidate_order(monkeypatch, poisoned_empty):
    """On a GPU the prefilter appends a row's candidates by atomic slots, in an order that varies from run to
    run: log q and the log ratio must not depend on it, bit for bit (the same seed, the same tokens)."""
    from sigmafast.kernels import accept

    g = torch.Generator().manual_seed(21)
    N, V, k = 16, 3000, 60
    x = torch.randn(N, V, generator=g)
    drafts = torch.where(torch.arange(N) % 2 == 0, x.argmax(-1), torch.randint(0, V, (N,), generator=g))
    logp = -5 * torch.rand(N, generator=g)

    def call():
        ratio = torch.empty(N, device=triton_device())
        logq = on_triton_device(accept.topk_logq)(x, drafts, 0.9, k, None, 16, chunks_per_k=1,
                                                  draft_logp=logp.to(ratio.device), log_ratio=ratio)
        return logq, ratio.cpu()

    first = call()
    real = accept.prefilter

    def shuffled(*args, **kwargs):
        kth, cand, count = real(*args, **kwargs)
        assert int(count.max()) <= cand.shape[1]  # no overflow: every row sums its candidates
        for i, c in enumerate(count.tolist()):
            cand[i, :c] = cand[i, :c][torch.randperm(c, generator=g).to(cand.device)]
        return kth, cand, count

    monkeypatch.setattr(accept, "prefilter", shuffled)
    for _ in range(3):
        again = call()
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
    want = ref.log_probs(x, 0.9, k).gather(-1, drafts[:, None]).squeeze(-1)
    torch.testing.assert_close(first[0][want.isfinite()], want[want.isfinite()], rtol=1e-6, atol=1e-5)
    x[3, 7] = float("nan")  # a row that is not finite keeps a NaN log q (the decisions flag it)
    assert call()[0].isnan().tolist() == [i == 3 for i in range(N)]


def test_topk_log_q_needs_the_prefilter():
    """Too few chunks per k: no candidates to sum over (draft_logq then takes the chunk statistics)."""
    from sigmafast.kernels import accept

    x = torch.randn(2, 300)
    assert accept.topk_logq(x, torch.zeros(2, dtype=torch.long), 1.0, 200) is None


# (x rows kind, y rows kind, N_X, N_Y, V, top_k, chunk, cap, y's row padding): the second tensor's rows after the
# first's; x's rows are views with a row stride of V + 13
PAIR_CASES = [
    ("randn", "negative", 3, 5, 3000, 10, None, None, 13),  # the prefilter
    ("randn", "equal", 2, 3, 1000, 7, 16, 32, 13),  # the second tensor's candidates overflow: its rows are scanned
    ("ties", "randn", 4, 1, 300, 9, None, None, 13),  # the radix select
    ("randn", "randn", 0, 3, 3000, 5, None, None, 13),  # an empty first tensor
    ("randn", "ties", 1, 4, 1000, 5, 16, None, 13),  # one row first (its row stride is never used)
    ("negative", "randn", 1, 3, 300, 9, None, None, 13),  # ... in the radix select
    ("randn", "randn", 3, 2, 1000, 6, 16, None, 600),  # row strides that differ: both copied to one
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", PAIR_CASES, ids=lambda c: "{}-{}-N{}+{}-V{}-k{}".format(*c[:6]))
def test_kth_largest_of_a_pair_matches_each(case, dtype, poisoned_empty):
    """``more=``: the rows of a second tensor of the same dtype (the residual's p after q) in the same
    launches; its thresholds follow the first's, each row's as alone."""
    kind_x, kind_y, n_x, n_y, V, k, chunk, cap, pad_y = case
    g = torch.Generator().manual_seed(n_x * 10 + n_y)
    x, y = (_rows(kind, n, V + pad, g).to(dtype)[:, 8:V + 8]  # 16-byte aligned views: no copy by the launcher
            for kind, n, pad in ((kind_x, n_x, 13), (kind_y, n_y, pad_y)))
    got = kth_largest(x, k, None, chunk, **({"cap": cap} if cap else {}), chunks_per_k=1, more=y)
    want = torch.cat([ref.kth_largest(x, k).float(), ref.kth_largest(y, k).float()])
    assert got.shape == (n_x + n_y,)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_overflow_scans_reach_the_last_columns_of_shifted_rows(dtype, poisoned_empty):
    """Rows whose candidates overflow ``cap`` are scanned whole, in SCAN_V-column steps over their aligned
    windows: a row at an odd stride starts up to ALIGN - 1 columns into its window, so with V = SCAN_V - 1 its
    last columns lie past the first SCAN_V window columns. The k-th largest and the top-k log q both count them."""
    from sigmafast.kernels import accept

    N, V, k = 8, topk.SCAN_V - 1, 3
    g = torch.Generator().manual_seed(5)
    x = torch.randn(N, V + 2, generator=g).to(dtype)[:, :V]  # an odd row stride: every shift into the windows
    x[:, V - 1] = 30.0 + torch.arange(N)  # each row's two largest values in its last columns
    x[:, V - 2] = 20.0 + torch.arange(N)
    x[torch.arange(N), torch.randint(0, V - 2, (N,), generator=g)] = 10.0
    got = kth_largest(x, k, cap=2, chunks_per_k=1)  # k > cap: every row overflows
    torch.testing.assert_close(got, ref.kth_largest(x, k).float(), rtol=0, atol=0)
    drafts = torch.where(torch.arange(N) % 2 == 0, V - 1, x.float().argmin(-1))  # its max, or below the threshold
    logq = on_triton_device(accept.topk_logq)(x, drafts, 0.8, k, cap=2, chunks_per_k=1)
    want = ref.log_probs(x.float(), 0.8, k).gather(-1, drafts[:, None]).squeeze(-1)
    assert torch.equal(logq.isfinite(), want.isfinite())
    torch.testing.assert_close(logq[want.isfinite()], want[want.isfinite()], rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("extra", [-1, 0, 1], ids=["cap-1", "cap", "cap+1"])
def test_candidate_counts_around_the_cap(extra, dtype, poisoned_empty):
    """Rows with cap - 1, cap and cap + 1 candidates (the k largest values, one per chunk, above all the others):
    up to cap they are summed from the list, one more overflows it (the last slot is not stored) and the row is
    scanned; the k-th largest and the top-k log q are exact either way."""
    from sigmafast.kernels import accept

    N, V, cap = 4, 1000, 8
    k = cap + extra
    g = torch.Generator().manual_seed(k)
    x = -1 - 9 * torch.rand(N, V, generator=g)
    for i in range(N):  # k positive values in k distinct 16-column chunks
        x[i, torch.randperm(V // 16, generator=g)[:k] * 16 + i] = 1 + torch.rand(k, generator=g) * 4
    x = x.to(dtype)
    _, _, count = topk.prefilter(x, k, topk.prefilter_config(V, dtype, k, None, 16, 1), cap)
    assert count.tolist() == [k] * N
    got = kth_largest(x, k, None, 16, cap=cap, chunks_per_k=1)
    torch.testing.assert_close(got, ref.kth_largest(x, k).float(), rtol=0, atol=0)
    drafts = torch.where(torch.arange(N) % 2 == 0, x.float().argmax(-1), torch.randint(0, V, (N,), generator=g))
    logq = on_triton_device(accept.topk_logq)(x, drafts, 0.8, k, None, 16, cap=cap, chunks_per_k=1)
    want = ref.log_probs(x.float(), 0.8, k).gather(-1, drafts[:, None]).squeeze(-1)
    assert torch.equal(logq.isfinite(), want.isfinite())
    torch.testing.assert_close(logq[want.isfinite()], want[want.isfinite()], rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_an_overflowing_candidate_is_stored_nowhere(dtype, monkeypatch):
    """A row with cap + 1 candidates overflows its list: the candidate given slot ``cap`` is dropped, not written
    into the first slot of the next row's list (on a GPU that row may have filled it already) nor, for the last
    row, past the end of the (N, cap) list, here followed by a guard row that must stay untouched."""
    N, V, cap = 3, 1000, 8
    k = cap + 1
    g = torch.Generator().manual_seed(2)
    x = -1 - 9 * torch.rand(N, V, generator=g)
    for i in range(N):  # k positive values in k distinct 16-column chunks: k candidates per row
        x[i, torch.randperm(V // 16, generator=g)[:k] * 16 + i] = 1 + torch.rand(k, generator=g) * 4
    x = x.to(dtype).to(triton_device())
    real_empty, lists = torch.empty, []

    def empty(*size, **kwargs):  # the candidate lists, followed by a guard row
        if size == (N, cap) and kwargs.get("dtype") == torch.int32:
            lists.append(real_empty(N + 1, cap, **kwargs).fill_(-7))
            return lists[-1][:N]
        return real_empty(*size, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    _, cand, count = topk.prefilter(x, k, topk.prefilter_config(V, dtype, k, None, 16, 1), cap)
    assert count.tolist() == [k] * N and len(lists) == 1
    assert torch.all(lists[0][N] == -7), "a candidate was stored past the end of its row's list"
