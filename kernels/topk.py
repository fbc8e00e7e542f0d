"""The k-th largest logit of each row (the top-k threshold), without a sort.

Top-k sampling keeps the logits ``>= kth`` of a row, where ``kth`` is its k-th
largest value (ties with it are kept, as in ``reference.process_logits``). The
reference is ``torch.topk(x, k).values[:, -1]``, which sorts k values per row
and, on a GPU, costs several times the read of the logits (H200, 1280 × 50257
bf16 rows, top-k 50: 560 µs, against ~30 µs for one read).

Keys. Each float maps to a uint32 key with the same order (``radix.order_key32``;
every NaN to the largest key); key 0 marks the columns outside a row.

Chunk-max prefilter (``kth_largest`` when NC >= 4 top_k). Cut each row into NC
chunks of ``CHUNK`` columns and let t0 be the k-th largest chunk maximum. At
least k chunks hold an element >= t0, so the k-th largest element is >= t0:
it and every element above it are candidates (keys >= t0), and it is the k-th
largest candidate. Only the chunks whose max is >= t0 hold candidates: about k
of them (k of GPT-2's 393 chunks) for iid rows, where the top elements rarely
share a chunk, so a row has a little over k candidates. With fewer chunks per k
the chunk maxima bound the threshold loosely and the candidates can overflow
(below), so a row needs ``CHUNKS_PER_K`` chunks per k (top-k 98 for GPT-2).

* ``_chunk_max_kernel``, persistent over the (row, window tile of ``BLOCK_V``)
  tiles (``vocab.stream_grid``): the (N, NC) chunk maximum keys of the aligned
  windows (``vocab.row_window``), one read.
* ``_pivot_kernel``, grid (row blocks,): t0 of each row from its NC maxima;
  zeroes the row's candidate count.
* ``_collect_kernel``, grid (rows, cdiv(NC, 32)), one warp: loops over the set
  bits of the mask of its 32 chunks whose max is >= t0 (a program without any
  returns at once), loads only those chunks and appends each candidate key to
  the row's list of ``CAP`` by an atomic slot (Triton aggregates the atomics
  per warp): about k / NC of a second read (13% for top-k 50).
* ``_cand_select_kernel``, grid (rows,): the k-th largest candidate. A row with
  more than CAP candidates (ties, rows of -inf, adversarial data) bisects over
  its whole row from global memory instead: KEY_BITS reads, for such rows only.

Bisection finds the k-th largest of a set of keys bit by bit from the top: bit
b is kept when at least k keys are >= prefix | b, over the dtype's
``radix.KEY_BITS`` top bits.

With fewer than ``CHUNKS_PER_K`` chunks per k, ``kth_largest`` takes radix
select (``radix.radix_kth_largest``) instead.

``prefilter`` also returns the candidates and their counts: the top-k
acceptance (``accept.topk_logq``) sums its log-sum-exp over them. With
``more=``, a second tensor's rows follow the first's in every kernel (the
residual's q and p: one set of launches).

The launchers call ``threshold``, which takes these kernels on CUDA (the
prefilter is not yet timed on a GPU: benchmarks/bench_kernels.py
``test_topk_threshold``). All sizes, counts and k are run-time arguments
(``do_not_specialize``); the launches are CUDA-graph capturable (no host
syncs, buffers sized from N, V and CAP): each kernel compiles once per dtype.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import reference, vocab
from .utils import gdc_enter, pdl_meta
from .radix import KEY_BITS, low_filled, order_key32, pair_row, pair_rows, radix_kth_largest
from .vocab import in_rows, row_window, split_config, stream_grid, stream_load, stream_tile, window_masks

CHUNK = 128  # columns per chunk maximum
TILE_V = 4096  # columns per chunk-max and collect program
CAP = 1024  # candidate keys kept per row
PIVOT_TILE = 2048  # chunk maxima per pivot program (8 per thread: Triton 3.9 counts 16 through the stack)
SCAN_V = 2048  # columns per step of the overflow path's row scans
CHUNKS_PER_K = 4  # chunks per unit of top_k that the prefilter needs (else radix select)


@triton.jit
def bisect_keys(b_key, k, ROWS: tl.constexpr, BITS: tl.constexpr):
    """(ROWS,) k-th largest of each row of (ROWS, M) uint32 keys (0 = none), in its top BITS bits (below 0)."""
    prefix = tl.zeros([ROWS], tl.uint32)
    bit = tl.full([ROWS], 2147483648, tl.uint32)
    for _i in range(BITS):
        trial = prefix | bit
        cnt = tl.sum((b_key >= trial[:, None]).to(tl.int32), 1)
        prefix = tl.where(cnt >= k, trial, prefix)
        bit = bit >> 1
    return prefix


@triton.jit
def _chunk_max_tile(b_raw, t, CMAX, s_x, N, N_X, V, NC, NT, BLOCK_V: tl.constexpr, CHUNK: tl.constexpr,
                    ALIGN: tl.constexpr):
    """One tile of ``_chunk_max_kernel`` from its raw logits."""
    o_n64, m_n, p, o_b, _, r_shift, _, interior, _ = stream_tile(t, N, N, NT, s_x, V, 1, BLOCK_V, ALIGN, CHUNK,
                                                                 N_X, N_X)
    o_c = p * (BLOCK_V // CHUNK) + tl.arange(0, BLOCK_V // CHUNK)  # (BLOCK_V // CHUNK,) chunk indices
    b_key = order_key32(b_raw.to(tl.float32))
    if not interior:
        b_key = tl.where(in_rows(o_b, r_shift, V), b_key, 0)
    tl.store(CMAX + o_n64 * NC + o_c, tl.max(b_key, 1).to(tl.int32, bitcast=True), mask=m_n & (o_c < NC))


@triton.jit(do_not_specialize=["s_x", "N", "N_X", "V", "NC", "NT", "n_tiles"])
def _chunk_max_kernel(
    X, Y, CMAX, s_x, N, N_X, V, NC, NT, n_tiles,
    BLOCK_V: tl.constexpr, CHUNK: tl.constexpr, STRIDE_UNIT: tl.constexpr, ALIGN: tl.constexpr,
    STAGES: tl.constexpr, USE_GDC: tl.constexpr,
):
    """(N, NC) int32 bits of the max key of each CHUNK-column window chunk (0 where it holds no column) of the
    N_X rows of X, then the N - N_X rows of Y. The (row, window tile of BLOCK_V columns) tiles are streamed as
    in ``vocab._chunk_stats_kernel`` (``STAGES``: its loop pipelining), one row per row block."""
    gdc_enter(USE_GDC)
    s_x = s_x * STRIDE_UNIT
    if STAGES > 1:
        for t in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), num_stages=STAGES):
            b_raw = stream_load(X, t, N, N, NT, s_x, V, 1, BLOCK_V, ALIGN, CHUNK, Y, N_X, N_X, True)
            _chunk_max_tile(b_raw, t, CMAX, s_x, N, N_X, V, NC, NT, BLOCK_V, CHUNK, ALIGN)
    else:
        t = tl.program_id(0)
        step = tl.num_programs(0)
        b_raw = stream_load(X, t, N, N, NT, s_x, V, 1, BLOCK_V, ALIGN, CHUNK, Y, N_X, N_X)
        for _ in range(t, n_tiles, step):
            b_next = stream_load(X, t + step, N, N, NT, s_x, V, 1, BLOCK_V, ALIGN, CHUNK, Y, N_X, N_X)
            _chunk_max_tile(b_raw, t, CMAX, s_x, N, N_X, V, NC, NT, BLOCK_V, CHUNK, ALIGN)
            b_raw = b_next
            t += step


@triton.jit(do_not_specialize=["N", "NC", "top_k"])
def _pivot_kernel(CMAX, T0, COUNT, N, NC, top_k, BLOCK_N: tl.constexpr, NC_PAD: tl.constexpr, BITS: tl.constexpr,
                  USE_GDC: tl.constexpr):
    """Each row's t0, the k-th largest of its chunk maxima (at least 1, above the columns outside the row),
    and a zero candidate count."""
    gdc_enter(USE_GDC)
    o_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    o_n64 = o_n.to(tl.int64)
    o_c = tl.arange(0, NC_PAD)[None, :]
    b_key = tl.load(CMAX + o_n64[:, None] * NC + o_c, mask=m_n[:, None] & (o_c < NC), other=0)
    t0 = tl.maximum(bisect_keys(b_key.to(tl.uint32, bitcast=True), top_k, BLOCK_N, BITS), 1)
    tl.store(T0 + o_n64, t0.to(tl.int32, bitcast=True), mask=m_n)
    tl.store(COUNT + o_n64, tl.zeros([BLOCK_N], tl.int32), mask=m_n)


@triton.jit(do_not_specialize=["s_x", "N", "N_X", "V", "NC"])
def _collect_kernel(
    X, Y, CMAX, T0, COUNT, CAND, s_x, N, N_X, V, NC,
    CHUNK: tl.constexpr, CAP: tl.constexpr, STRIDE_UNIT: tl.constexpr, ALIGN: tl.constexpr, USE_GDC: tl.constexpr,
):
    """Append the keys >= t0 of chunks [32 p, 32 p + 32) of row n (of X's N_X rows then Y's) to the row's
    (CAP,) candidates (the count goes on past CAP), loading only the chunks whose max is >= t0: a loop over
    the set bits of their mask."""
    gdc_enter(USE_GDC)
    n = tl.program_id(0).to(tl.int64)
    o_n64 = n + tl.arange(0, 1)  # (1,) this row
    m_n = o_n64 < N
    X, o_r64 = pair_row(X, Y, n, N_X)
    t0 = tl.load(T0 + n).to(tl.uint32, bitcast=True)
    o_j = tl.arange(0, 32)
    o_c = tl.program_id(1) * 32 + o_j
    b_cm = tl.load(CMAX + n * NC + o_c, mask=o_c < NC, other=0).to(tl.uint32, bitcast=True)
    bits = tl.sum(tl.where(b_cm >= t0, tl.full([32], 1, tl.uint32) << o_j.to(tl.uint32), 0), 0)  # uniform
    o_base, r_shift, end = row_window(o_r64, s_x * STRIDE_UNIT, V, ALIGN)
    # + zeros, not tl.broadcast_to: the interpreters of Triton 3.4 and 3.5 read an atomic's pointers as a
    # contiguous array, past the end of a broadcast (stride-0) one
    p_cnt = COUNT + o_n64[:, None] + tl.zeros([1, CHUNK], tl.int64)
    while bits != 0:  # about k of a row's NC chunks qualify
        low = bits & (0 - bits)  # the lowest set bit; its float's exponent is its index
        c = tl.program_id(1) * 32 + (low.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127
        bits = bits ^ low
        o_b = c * CHUNK + tl.arange(0, CHUNK)[None, :]  # (1, CHUNK) window offsets
        _, m_w, m_v = window_masks(o_b, r_shift, end, m_n, V)
        b_key = order_key32(tl.load(X + o_base[:, None] + o_b, mask=m_w, other=0.0).to(tl.float32))
        m_k = m_v & (b_key >= t0)
        slot = tl.atomic_add(p_cnt, 1, mask=m_k, sem="relaxed")  # the old counts: one slot per candidate
        tl.store(CAND + o_n64[:, None] * CAP + slot, b_key.to(tl.int32, bitcast=True), mask=m_k & (slot < CAP))


@triton.jit
def bisect_row(X, o_n64, m_n, s_x, V, k, SCAN_V: tl.constexpr, STRIDE_UNIT: tl.constexpr, ALIGN: tl.constexpr,
               BITS: tl.constexpr):
    """(1,) k-th largest key of row n, in its top BITS bits, by bisection over the row read from global memory
    once per bit (the overflow path)."""
    o_base, r_shift, end = row_window(o_n64, s_x * STRIDE_UNIT, V, ALIGN)
    prefix = tl.zeros([1], tl.uint32)
    bit = tl.full([1], 2147483648, tl.uint32)
    for _i in range(BITS):
        trial = (prefix | bit)[:, None]
        cnt = tl.zeros([1], tl.int32)
        for start in range(0, V + ALIGN - 1, SCAN_V):
            o_b = start + tl.arange(0, SCAN_V)[None, :]
            _, m_w, m_v = window_masks(o_b, r_shift, end, m_n, V)
            b_key = order_key32(tl.load(X + o_base[:, None] + o_b, mask=m_w, other=0.0).to(tl.float32))
            cnt += tl.sum((m_v & (b_key >= trial)).to(tl.int32), 1)
        prefix = tl.where(cnt >= k, prefix | bit, prefix)
        bit = bit >> 1
    return prefix


@triton.jit(do_not_specialize=["s_x", "N", "N_X", "V", "top_k"])
def _cand_select_kernel(
    X, Y, CAND, COUNT, OUT, s_x, N, N_X, V, top_k,
    CAP: tl.constexpr, SCAN_V: tl.constexpr, STRIDE_UNIT: tl.constexpr, ALIGN: tl.constexpr, BITS: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    """Each row's k-th largest value: of its candidates, or of its whole row (of X's N_X rows then Y's) when
    they overflowed CAP."""
    gdc_enter(USE_GDC)
    n = tl.program_id(0).to(tl.int64)
    o_n64 = n + tl.arange(0, 1)  # (1,) this row
    m_n = o_n64 < N
    count = tl.load(COUNT + o_n64, mask=m_n, other=0)
    if tl.max(count) > CAP:  # uniform: one row per program
        X, o_r64 = pair_row(X, Y, n, N_X)
        prefix = bisect_row(X, o_r64, m_n, s_x, V, top_k, SCAN_V, STRIDE_UNIT, ALIGN, BITS)
    else:
        o_s = tl.arange(0, CAP)[None, :]
        b_key = tl.load(CAND + o_n64[:, None] * CAP + o_s, mask=o_s < count[:, None], other=0)
        prefix = bisect_keys(b_key.to(tl.uint32, bitcast=True), top_k, 1, BITS)
    tl.store(OUT + o_n64, low_filled(prefix.to(tl.int64), 32 - BITS), mask=m_n)


def prefilter_config(V: int, dtype: torch.dtype, top_k: int, block_v: Optional[int] = None,
                     chunk: Optional[int] = None, chunks_per_k: int = CHUNKS_PER_K):
    """(split config of the BLOCK_V-column programs, CHUNK, NC) of the chunk-max prefilter for rows of V ``dtype``
    logits (``block_v`` and ``chunk``, powers of two, override the defaults), or None when it has fewer
    than ``chunks_per_k * top_k`` chunks (radix select then)."""
    cfg = split_config(V, dtype, block_v or min(TILE_V, triton.next_power_of_2(V + 15)))
    chunk = min(chunk or CHUNK, cfg.block_v)
    nc = triton.cdiv(V + cfg.align - 1, chunk)  # chunks of the aligned windows
    return (cfg, chunk, nc) if nc >= chunks_per_k * top_k else None


def kth_largest(logits: torch.Tensor, top_k: int, block_v: Optional[int] = None, chunk: Optional[int] = None,
                cap: int = CAP, chunks_per_k: int = CHUNKS_PER_K, more: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(N,) float32 k-th largest value of each row of (N, V) float32/float16/bfloat16 ``logits``, 1 <= top_k
    <= V (no checks: ``threshold`` is the launchers' entry). Equals ``logits.topk(top_k).values[:, -1]``
    exactly (``reference.kth_largest``). The chunk-max prefilter when the rows have at least
    ``chunks_per_k * top_k`` chunks, else ``radix_kth_largest``. With ``more``, (N', V) rows of the same
    dtype, the same launches cover both: (N + N',) values, ``more``'s after those of ``logits``. The tests
    override the columns per program (``block_v``), per chunk (``chunk``), the candidates per row (``cap``;
    powers of two) and ``chunks_per_k``."""
    V = logits.shape[1]
    config = prefilter_config(V, logits.dtype, top_k, block_v, chunk, chunks_per_k)
    if config is None:
        return radix_kth_largest(logits, top_k, block_v, more)
    return prefilter(logits, top_k, config, cap, more)[0]


def prefilter(logits: torch.Tensor, top_k: int, config: tuple, cap: int = CAP,
              more: Optional[torch.Tensor] = None) -> tuple:
    """The chunk-max prefilter of (N, V) ``logits`` (and of ``more``'s rows after them, as in ``kth_largest``)
    under ``prefilter_config``'s ``config``: (N,) float32 k-th largest values, the (N, cap) int32 candidate
    keys (``radix.order_key32``, in no order: every key >= t0 of the row, so every logit >= its k-th largest, while
    the count is at most cap) and the (N,) int32 candidate counts (past cap when they overflowed)."""
    V = logits.shape[1]
    cfg, chunk, nc = config
    x, y, N_X, N, s_x = pair_rows(logits, more, cfg.unit)
    out = torch.empty(N, dtype=torch.float32, device=logits.device)
    count = torch.empty(N, dtype=torch.int32, device=logits.device)
    cand = torch.empty(N, cap, dtype=torch.int32, device=logits.device)
    if N == 0:
        return out, cand, count
    bits = KEY_BITS[logits.dtype]
    cmax = torch.empty(N, nc, dtype=torch.int32, device=logits.device)
    t0 = torch.empty(N, dtype=torch.int32, device=logits.device)
    args = (x, y, cmax, s_x, N, N_X, V, nc, cfg.nc, N * cfg.nc)
    meta = dict(BLOCK_V=cfg.block_v, CHUNK=chunk, STRIDE_UNIT=cfg.unit, ALIGN=cfg.align, STAGES=vocab.STREAM_STAGES,
                num_warps=max(1, min(4, cfg.block_v // 1024)), **pdl_meta(logits.device))
    _chunk_max_kernel[stream_grid(_chunk_max_kernel, N * cfg.nc, args, meta, logits.device)](*args, **meta)
    nc_pad = triton.next_power_of_2(nc)
    rows = max(1, PIVOT_TILE // nc_pad)
    _pivot_kernel[(triton.cdiv(N, rows),)](cmax, t0, count, N, nc, top_k, BLOCK_N=rows, NC_PAD=nc_pad, BITS=bits,
                                           num_warps=8, **pdl_meta(cmax.device))
    _collect_kernel[(N, triton.cdiv(nc, 32))](
        x, y, cmax, t0, count, cand, s_x, N, N_X, V, nc,
        CHUNK=chunk, CAP=cap, STRIDE_UNIT=cfg.unit, ALIGN=cfg.align, num_warps=1, **pdl_meta(x.device),
    )
    _cand_select_kernel[(N,)](x, y, cand, count, out, s_x, N, N_X, V, top_k, CAP=cap, SCAN_V=SCAN_V,
                              STRIDE_UNIT=cfg.unit, ALIGN=cfg.align, BITS=bits, num_warps=4, **pdl_meta(x.device))
    return out, cand, count


def threshold(logits: torch.Tensor, top_k: Optional[int], block_v: Optional[int] = None,
              more: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """The vocabulary launchers' (N,) float32 top-k threshold (None when top-k keeps the whole row), with
    ``more``'s (N', V) rows after them, in the same launches ((N + N',): the residual's q and p):
    ``kth_largest`` on CUDA; ``torch.topk`` in the CPU interpreter, where interpreting the kernels over
    thousands of rows costs minutes (they are tested there on their own)."""
    if top_k is None or top_k >= logits.shape[-1]:
        return None
    if logits.is_cuda:
        return kth_largest(logits, top_k, block_v, more=more)
    rows = (logits,) if more is None else (logits, more)
    return torch.cat([reference.kth_largest(x, top_k).float() for x in rows])
