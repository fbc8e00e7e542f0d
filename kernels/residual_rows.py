"""The residual sampler's two passes over a row, back to back in one program (many rows; opt-in).

Why. The split-V residual (sampling.py) reads q and p twice: ``chunk_stats`` over every row, then
``residual.residual_masses``, which needs the rows' log-sum-exps first. Each pass is a separate launch over all
the rows, so with 1024 GPT-2 rows in bf16 (206 MB of q and p, four times an H200's 50 MB L2) the second pass
reads HBM again: 215 µs at the fifth lend, 22% of copy bandwidth counted as one read.

Here each program owns whole rows. It streams a row's q and p once for their chunk maxima and sums of
exponentials (loads marked ``evict_last``), combines them into the two log-sum-exps in registers, and at
once streams the same row again for the residual's chunk masses (``evict_first``), while the row should still
be in L2 (unmeasured): with about one program per SM the rows in flight take a few tens of MB
(``programs``: the SMs, or more when the L2 holds ``L2_SHARE`` of their row pairs). The loads of the next
tile (across the two passes and into the next row) are issued before the current tile is reduced, as in the
streaming kernels. A program reads tiles of ``BLOCK_V // CHUNK`` consecutive chunks of one row, each chunk of
the split kernels' geometry (``vocab.split_config``), so the outputs are exactly ``residual_masses``' (N, NC)
masses of max(0, q - p) and of q and (N, 2) log-sum-exps, from the same per-element operations, and
sampling's token search (``_residual_kernel``) is unchanged.

One row per program in flight leaves few programs when rows are few: the launcher takes this path only for
at least one row per SM, and only when ``ROWS`` is on, which stays off until a GPU times it against the
split kernels (``benchmarks/bench_kernels.py``'s ``triton-rows``, ``benchmarks/sweep_vocab.py``).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import triton
import triton.language as tl

from . import vocab
from .utils import cuda_props, exp_ftz, gdc_enter, jit, num_sms, pdl_meta, resident_programs
from .vocab import chunk_partials, is_interior, processed, row_window

ROWS = False  # the residual's masses by whole rows when there are at least as many rows as SMs
L2_SHARE = 0.5  # share of the L2 that the programs' rows in flight (q and p) may take


@triton.jit
def _tile_offsets(p, BLOCK_V: tl.constexpr, CHUNK: tl.constexpr):
    """(BLOCK_V // CHUNK, CHUNK) window offsets of tile p of a row: its chunks as rows."""
    return p * BLOCK_V + tl.arange(0, BLOCK_V // CHUNK)[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]


@triton.jit
def _row_tile(ptr, row, p, N, NT, s_x, V, BLOCK_V: tl.constexpr, CHUNK: tl.constexpr, ALIGN: tl.constexpr,
              EVICT: tl.constexpr):
    """Raw logits of tile p of row ``row`` (``vocab.row_window``), no load at all when row >= N or p >= NT;
    lanes outside the row's window are undefined (``_row_values`` masks them)."""
    o_base, _, end = row_window(row + tl.zeros([], tl.int64), s_x, V, ALIGN)
    o_b = _tile_offsets(p, BLOCK_V, CHUNK)
    p_x = ptr + o_base + o_b
    if is_interior(p, V, BLOCK_V, ALIGN) & (row < N):
        b_raw = tl.load(p_x, eviction_policy=EVICT)
    else:
        b_raw = tl.load(p_x, mask=o_b < tl.where((row < N) & (p < NT), end, 0), eviction_policy=EVICT)
    return b_raw


@triton.jit
def _row_values(b_raw, row, p, kth, s_x, V, temperature, BLOCK_V: tl.constexpr, CHUNK: tl.constexpr,
                ALIGN: tl.constexpr, HAS_TOPK: tl.constexpr):
    """``_row_tile``'s raw tile -> processed fp32 logits, -inf outside the row: ``vocab.stream_values``' operations
    with the row's shift a scalar (through ``stream_values``, a (1,) shift took 30% more registers on sm_90). The
    offsets are recomputed rather than carried through the loops, where they would take registers too."""
    _, shift, _ = row_window(row + tl.zeros([], tl.int64), s_x, V, ALIGN)
    b_x = b_raw.to(tl.float32)
    if not is_interior(p, V, BLOCK_V, ALIGN):
        o_v = _tile_offsets(p, BLOCK_V, CHUNK) - shift
        b_x = tl.where((o_v >= 0) & (o_v < V), b_x, float("-inf"))
    return processed(b_x, kth, temperature, HAS_TOPK)


@triton.jit
def _fold_stats(v_m, v_s, b_x, o_c, o_all):
    """Scatter the ``vocab.chunk_partials`` of a (SUB, CHUNK) tile b_x, chunks o_c (SUB,), into the row's
    (NC_PAD,) partials v_m, v_s (columns o_all)."""
    b_m, b_s = chunk_partials(b_x)  # (SUB,) each
    hit = o_c[:, None] == o_all[None, :]  # (SUB, NC_PAD)
    v_m = tl.maximum(v_m, tl.max(tl.where(hit, b_m[:, None], float("-inf")), 0))
    return v_m, v_s + tl.sum(tl.where(hit, b_s[:, None], 0.0), 0)


@triton.jit
def _row_lse(v_m, v_s):
    """A row's log-sum-exp from its (NC_PAD,) chunk partials, as ``vocab.row_masses`` combines them."""
    r_m = tl.max(v_m, 0)
    r_m = tl.where(r_m == float("-inf"), 0.0, r_m)
    return r_m + tl.log(tl.sum(v_s * exp_ftz(v_m - r_m), 0))


@jit(do_not_specialize=["s_x", "N", "NC", "NT"], do_not_specialize_on_alignment=["KQ", "KP"])
def _residual_rows_kernel(
    QL, PL, KQ, KP, RM, QM, LSE, s_x, N, V, NC, NT, temperature,
    BLOCK_V: tl.constexpr, CHUNK: tl.constexpr, NC_PAD: tl.constexpr, HAS_TOPK: tl.constexpr,
    STRIDE_UNIT: tl.constexpr, ALIGN: tl.constexpr, USE_GDC: tl.constexpr,
):
    """(N, NC) chunk masses of max(0, q - p) (RM) and of q (QM) and (N, 2) log-sum-exps of q and p (LSE), as
    ``residual._residual_mass_kernel`` writes them, each program taking rows pid, pid + programs, ...: per row
    NT tiles of q and p (BLOCK_V // CHUNK chunks each) for the chunk statistics, then the same tiles again."""
    gdc_enter(USE_GDC)
    s_x = s_x * STRIDE_UNIT
    SUB: tl.constexpr = BLOCK_V // CHUNK
    o_s = tl.arange(0, SUB)
    o_all = tl.arange(0, NC_PAD)
    step = tl.num_programs(0)
    p_0 = tl.program_id(0) * 0  # tile 0 as an int32 tensor, like the loops' indices
    b_rq = _row_tile(QL, tl.program_id(0), p_0, N, NT, s_x, V, BLOCK_V, CHUNK, ALIGN, "evict_last")
    b_rp = _row_tile(PL, tl.program_id(0), p_0, N, NT, s_x, V, BLOCK_V, CHUNK, ALIGN, "evict_last")
    for row in range(tl.program_id(0), N, step):
        row64 = row + tl.zeros([], tl.int64)  # the loop index is a Python int in the interpreter
        kq = 0.0
        kp = 0.0
        if HAS_TOPK:
            kq = tl.load(KQ + row64).to(tl.float32)
            kp = tl.load(KP + row64).to(tl.float32)
        v_mq = tl.full([NC_PAD], float("-inf"), tl.float32)
        v_sq = tl.zeros([NC_PAD], tl.float32)
        v_mp = tl.full([NC_PAD], float("-inf"), tl.float32)
        v_sp = tl.zeros([NC_PAD], tl.float32)
        for p in range(0, NT):  # pass 1; its last prefetch is pass 2's first tile
            p_next = tl.where(p + 1 < NT, p + 1, 0)
            b_nq = _row_tile(QL, row, p_next, N, NT, s_x, V, BLOCK_V, CHUNK, ALIGN, "evict_last")
            b_np = _row_tile(PL, row, p_next, N, NT, s_x, V, BLOCK_V, CHUNK, ALIGN, "evict_last")
            o_c = p * SUB + o_s
            v_mq, v_sq = _fold_stats(v_mq, v_sq, _row_values(b_rq, row, p, kq, s_x, V, temperature, BLOCK_V, CHUNK,
                                                             ALIGN, HAS_TOPK), o_c, o_all)
            v_mp, v_sp = _fold_stats(v_mp, v_sp, _row_values(b_rp, row, p, kp, s_x, V, temperature, BLOCK_V, CHUNK,
                                                             ALIGN, HAS_TOPK), o_c, o_all)
            b_rq = b_nq
            b_rp = b_np
        lse_q = _row_lse(v_mq, v_sq)
        lse_p = _row_lse(v_mp, v_sp)
        for p in range(0, NT):  # pass 2, meant to hit L2; its last prefetch is the next row's first tile
            last = p + 1 >= NT
            row_next = tl.where(last, row + step, row)
            p_next = tl.where(last, 0, p + 1)
            b_nq = _row_tile(QL, row_next, p_next, N, NT, s_x, V, BLOCK_V, CHUNK, ALIGN, "evict_first")
            b_np = _row_tile(PL, row_next, p_next, N, NT, s_x, V, BLOCK_V, CHUNK, ALIGN, "evict_first")
            b_q = exp_ftz(_row_values(b_rq, row, p, kq, s_x, V, temperature, BLOCK_V, CHUNK, ALIGN, HAS_TOPK) - lse_q)
            b_p = exp_ftz(_row_values(b_rp, row, p, kp, s_x, V, temperature, BLOCK_V, CHUNK, ALIGN, HAS_TOPK) - lse_p)
            o_c = p * SUB + o_s
            o_p = row64 * NC + o_c
            tl.store(RM + o_p, tl.sum(tl.maximum(b_q - b_p, 0.0), 1), mask=o_c < NC)
            tl.store(QM + o_p, tl.sum(b_q, 1), mask=o_c < NC)
            b_rq = b_nq
            b_rp = b_np
        tl.store(LSE + 2 * row64, lse_q)
        tl.store(LSE + 2 * row64 + 1, lse_p)


@contextlib.contextmanager
def by_rows(l2_share: Optional[float] = None) -> Iterator[None]:
    """Inside: ``ROWS`` on (and ``L2_SHARE`` set, when given), for the benchmarks that time this layout."""
    global ROWS, L2_SHARE
    saved = ROWS, L2_SHARE
    ROWS, L2_SHARE = True, L2_SHARE if l2_share is None else l2_share
    try:
        yield
    finally:
        ROWS, L2_SHARE = saved


def use_rows(n_rows: int, device: torch.device) -> bool:
    """Whether the residual of ``n_rows`` rows takes ``residual_masses_rows``: ``ROWS`` on and a row per SM."""
    return ROWS and n_rows >= num_sms(device)


def programs(n_rows: int, row_pair_bytes: int, kernel_programs: int, device: torch.device) -> int:
    """The grid: one program per SM, or more while their rows in flight (``row_pair_bytes`` of q and p each)
    fit ``L2_SHARE`` of the L2, never more than one wave (``kernel_programs`` per SM) nor than the rows."""
    sms = num_sms(device)
    l2 = getattr(cuda_props(device), "L2_cache_size", 0) if device.type == "cuda" else 0
    return max(1, min(n_rows, kernel_programs * sms, max(sms, int(l2 * L2_SHARE) // max(1, row_pair_bytes))))


def residual_masses_rows(q_logits, p_logits, kq, kp, temperature, cfg: vocab.SplitConfig, stride_units: int):
    """``residual.residual_masses``' outputs without ``chunk_stats``' partials, by whole rows: (N, NC) float32
    chunk masses of max(0, q - p) and of q and (N, 2) log-sum-exps of q and p. q and p: (N, V) rows (N > 0) of
    one row stride (``stride_units`` units of ``cfg.unit``), 16-byte aligned; kq, kp: (N,) top-k thresholds
    or None."""
    N, V = q_logits.shape
    rm = torch.empty(N, cfg.nc, dtype=torch.float32, device=q_logits.device)
    qm = torch.empty_like(rm)
    lse = torch.empty(N, 2, dtype=torch.float32, device=q_logits.device)
    sub = max(1, min(vocab.TILE // 2 // cfg.block_v, triton.next_power_of_2(cfg.nc)))  # chunks per tile
    args = (q_logits, p_logits, kq if kq is not None else rm, kp if kp is not None else rm, rm, qm, lse,
            stride_units, N, V, cfg.nc, triton.cdiv(cfg.nc, sub), float(temperature))
    meta = dict(BLOCK_V=sub * cfg.block_v, CHUNK=cfg.block_v, NC_PAD=cfg.nc_pad, HAS_TOPK=kq is not None,
                STRIDE_UNIT=cfg.unit, ALIGN=cfg.align, num_warps=cfg.stream_warps, **pdl_meta(q_logits.device))
    per_sm = resident_programs(_residual_rows_kernel, args, meta, q_logits.device)
    grid = (programs(N, 2 * V * q_logits.element_size(), per_sm, q_logits.device),)
    _residual_rows_kernel[grid](*args, **meta)
    return rm, qm, lse
