"""Triton burst and verification attention: one cascade kernel, a split-KV combine, their launcher.

Both ops are one kernel. The queries of a (b, h) are flattened into M = G·S
rows, G segments of S consecutive tokens:

* verification: G = O orders of S = R tokens; token r of order o attends to
  ``cache[:cache_lens[b]]`` and causally to tokens ``0..r`` of its own order;
* burst: G = R segments of S = 1 token; query r attends to the cache and to
  its own key only (the diagonal self term).

One program owns a tile of BLOCK_M consecutive rows, so a tile spans several
orders when R is small. It streams the cache tiles of its KV split through one
online softmax, then continues the same online softmax over the causal suffix
keys of its segments (cascade attention: prefix and suffix meet in one
log-sum-exp; the split that owns the suffix is split 0). With several KV splits
the fp32 partial outputs and base-2 log-sum-exps are merged by a second small
kernel. fp32 inputs use IEEE fp32 dots (never TF32), so the fp32 path agrees
with the reference to a few ulps (the GPU's division and exp2 are approximate).

Prefix traffic: per-order attention (SDPA over ``[cache; suffix]`` per order)
reads O·L·D keys and values per (b, h). Here it is ceil(O·R / BLOCK_M)·L·D
from L2 and, since the query tiles of one (b, h) run side by side, about L·D
from DRAM; for O·R <= BLOCK_M exactly one read.

Compiles once per dtype and head dim: the tiles (BLOCK_M, BLOCK_N, BLOCK_D) and
launch options depend on those only; the split count is a runtime argument
(``HAS_SPLITS`` is the one data-shape constexpr, so at most two variants);
by default the splits fill whole waves of the programs an SM holds, from the
compiled kernel's registers and shared memory (``utils.resident_programs``: 3
for 16-bit D = 64 on sm_90, 1 for D = 128, whose 8 warps of 161 registers fill
12 of the 16 warps' registers an SM has; on an H200, B = 8, 96 (b, h) tiles,
4 splits, one wave of 3 per SM, ran 4% faster than 3 splits at L = 4096 and
13% at L = 16384) and each gets at least ``utils.min_split_keys`` cache keys,
since below that the combine costs more than the split saves;
every size and stride is in ``do_not_specialize``. The launcher makes the
innermost (head-dim) stride 1 and, for D % 16 == 0, every other stride a
multiple of 16 (copying the rare input that is not), so ``STRIDE_UNIT`` too is
a function of D alone.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from .checks import check_attention, check_same
from .utils import gdc_enter, in_units, jit, min_split_keys, num_sms, pdl_meta, resident_programs, strides

MAX_HEAD_DIM = 256
SPLIT_WAVE_PROGRAMS = 3  # the CPU interpreter's stand-in for the programs an SM holds (sm_90, D = 64, 16-bit: 3)

_STRIDES = [f"s_{t}{d}" for t in "qkvo" for d in "bgsh"] + [f"s_{t}{d}" for t in "cw" for d in "bhl"]


@jit(do_not_specialize=_STRIDES + ["H", "M", "N_M", "L", "SEG", "tiles_per_split"],
     do_not_specialize_on_alignment=["LENS"])
def _cascade_attn_kernel(
    Q, K, V, KC, VC, LENS, O, O_PART, LSE_PART,
    s_qb, s_qg, s_qs, s_qh, s_kb, s_kg, s_ks, s_kh, s_vb, s_vg, s_vs, s_vh, s_ob, s_og, s_os, s_oh,
    s_cb, s_ch, s_cl, s_wb, s_wh, s_wl,
    H, M, N_M, D, L, SEG, tiles_per_split, sm_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_SPLITS: tl.constexpr, STRIDE_UNIT: tl.constexpr, DOT_PREC: tl.constexpr, USE_GDC: tl.constexpr,
):
    gdc_enter(USE_GDC)
    pid = tl.program_id(0)  # (b, h) major, query tile minor: one (b, h)'s tiles run side by side
    pid_m = pid % N_M
    pid_bh = pid // N_M
    pid_s = tl.program_id(1)
    i_b = (pid_bh // H).to(tl.int64)
    i_h = (pid_bh % H).to(tl.int64)
    qk_scale = sm_scale * 1.4426950408889634  # exp2 domain

    o_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    m_row = o_m < M
    m_d = o_d < D
    o_m64 = o_m.to(tl.int64)
    row_g = (o_m // SEG).to(tl.int64)  # segment (order) and position in it; int32 division
    row_s = (o_m % SEG).to(tl.int64)

    # strides come in units of STRIDE_UNIT elements (see utils); the head-dim stride is 1
    s_qb, s_qg, s_qs, s_qh = s_qb * STRIDE_UNIT, s_qg * STRIDE_UNIT, s_qs * STRIDE_UNIT, s_qh * STRIDE_UNIT
    s_kb, s_kg, s_ks, s_kh = s_kb * STRIDE_UNIT, s_kg * STRIDE_UNIT, s_ks * STRIDE_UNIT, s_kh * STRIDE_UNIT
    s_vb, s_vg, s_vs, s_vh = s_vb * STRIDE_UNIT, s_vg * STRIDE_UNIT, s_vs * STRIDE_UNIT, s_vh * STRIDE_UNIT
    s_ob, s_og, s_os, s_oh = s_ob * STRIDE_UNIT, s_og * STRIDE_UNIT, s_os * STRIDE_UNIT, s_oh * STRIDE_UNIT
    s_cb, s_ch, s_cl = s_cb * STRIDE_UNIT, s_ch * STRIDE_UNIT, s_cl * STRIDE_UNIT
    s_wb, s_wh, s_wl = s_wb * STRIDE_UNIT, s_wh * STRIDE_UNIT, s_wl * STRIDE_UNIT

    p_q = Q + i_b * s_qb + i_h * s_qh + row_g[:, None] * s_qg + row_s[:, None] * s_qs  # (BLOCK_M, 1)
    b_q = tl.load(p_q + o_d[None, :], mask=m_row[:, None] & m_d[None, :], other=0.0)  # (BLOCK_M, BLOCK_D)

    b_m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # prefix: this split's share of cache[:len_b]
    cache_len = tl.minimum(tl.load(LENS + i_b).to(tl.int32), L)  # lengths over L mean the whole cache
    lo = pid_s * tiles_per_split * BLOCK_N
    hi = tl.minimum(lo + tiles_per_split * BLOCK_N, cache_len)
    o_n = tl.arange(0, BLOCK_N)
    p_kc = KC + i_b * s_cb + i_h * s_ch
    p_vc = VC + i_b * s_wb + i_h * s_wh
    for start in range(lo, hi, BLOCK_N):
        o_l = start + o_n
        m_l = o_l < hi
        o_l64 = o_l.to(tl.int64)
        b_kt = tl.load(p_kc + o_l64[None, :] * s_cl + o_d[:, None],
                       mask=m_l[None, :] & m_d[:, None], other=0.0)  # (BLOCK_D, BLOCK_N)
        b_v = tl.load(p_vc + o_l64[:, None] * s_wl + o_d[None, :],
                      mask=m_l[:, None] & m_d[None, :], other=0.0)  # (BLOCK_N, BLOCK_D)
        b_s = tl.dot(b_q, b_kt, input_precision=DOT_PREC) * qk_scale  # (BLOCK_M, BLOCK_N)
        b_s = tl.where(m_l[None, :], b_s, float("-inf"))
        m_new = tl.maximum(b_m, tl.max(b_s, 1))
        alpha = tl.exp2(b_m - m_new)
        b_p = tl.exp2(b_s - m_new[:, None])
        b_l = b_l * alpha + tl.sum(b_p, 1)
        b_acc = b_acc * alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=DOT_PREC)
        b_m = m_new

    # causal suffix within each segment (split 0 only): keys [seg start of first row, last row]
    seg_lo = ((pid_m * BLOCK_M) // SEG) * SEG
    seg_hi = tl.where(pid_s == 0, tl.minimum(pid_m * BLOCK_M + BLOCK_M, M), seg_lo)
    p_k = K + i_b * s_kb + i_h * s_kh
    p_v = V + i_b * s_vb + i_h * s_vh
    for start in range(seg_lo, seg_hi, BLOCK_N):
        o_t = start + o_n
        m_t = o_t < seg_hi
        o_t64 = o_t.to(tl.int64)
        col_g = (o_t // SEG).to(tl.int64)
        col_s = (o_t % SEG).to(tl.int64)
        b_kt = tl.load(p_k + col_g[None, :] * s_kg + col_s[None, :] * s_ks + o_d[:, None],
                       mask=m_t[None, :] & m_d[:, None], other=0.0)  # (BLOCK_D, BLOCK_N)
        b_v = tl.load(p_v + col_g[:, None] * s_vg + col_s[:, None] * s_vs + o_d[None, :],
                      mask=m_t[:, None] & m_d[None, :], other=0.0)  # (BLOCK_N, BLOCK_D)
        b_s = tl.dot(b_q, b_kt, input_precision=DOT_PREC) * qk_scale
        keep = (col_g[None, :] == row_g[:, None]) & (o_t64[None, :] <= o_m64[:, None]) & m_t[None, :]
        b_s = tl.where(keep, b_s, float("-inf"))
        m_new = tl.maximum(b_m, tl.max(b_s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(b_m - m_use)
        b_p = tl.exp2(b_s - m_use[:, None])
        b_l = b_l * alpha + tl.sum(b_p, 1)
        b_acc = b_acc * alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=DOT_PREC)
        b_m = m_new

    l_safe = tl.where(b_l == 0.0, 1.0, b_l)
    b_o = b_acc / l_safe[:, None]
    m_out = m_row[:, None] & m_d[None, :]
    if HAS_SPLITS:
        # partial buffers: (n_splits, B*H, M, BLOCK_D) and (n_splits, B*H, M), contiguous
        row = (pid_s * (tl.num_programs(0) // N_M) + pid_bh).to(tl.int64) * M + o_m64
        tl.store(O_PART + row[:, None] * BLOCK_D + o_d[None, :], b_o, mask=m_out)
        tl.store(LSE_PART + row, tl.where(b_l > 0.0, b_m + tl.log2(l_safe), float("-inf")), mask=m_row)
    else:
        p_o = O + i_b * s_ob + i_h * s_oh + row_g[:, None] * s_og + row_s[:, None] * s_os
        tl.store(p_o + o_d[None, :], b_o.to(O.dtype.element_ty), mask=m_out)


@triton.jit(do_not_specialize=["s_ob", "s_og", "s_os", "s_oh", "H", "M", "N_M", "SEG", "n_splits"])
def _combine_kernel(
    O_PART, LSE_PART, O,
    s_ob, s_og, s_os, s_oh,
    H, M, N_M, D, SEG, n_splits,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, STRIDE_UNIT: tl.constexpr, USE_GDC: tl.constexpr,
):
    """Merge the KV splits' normalised partial outputs by their base-2 log-sum-exps."""
    gdc_enter(USE_GDC)
    pid = tl.program_id(0)
    pid_m = pid % N_M
    pid_bh = pid // N_M
    n_bh = tl.num_programs(0) // N_M
    i_b = (pid_bh // H).to(tl.int64)
    i_h = (pid_bh % H).to(tl.int64)
    o_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    m_row = o_m < M
    o_m64 = o_m.to(tl.int64)
    b_m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for i_s in range(0, n_splits):
        row = (i_s * n_bh + pid_bh).to(tl.int64) * M + o_m64
        b_lse = tl.load(LSE_PART + row, mask=m_row, other=float("-inf"))  # (BLOCK_M,)
        b_o = tl.load(O_PART + row[:, None] * BLOCK_D + o_d[None, :], mask=m_row[:, None] & m_d[None, :],
                      other=0.0)  # (BLOCK_M, BLOCK_D); columns >= D of the partials are never written
        m_new = tl.maximum(b_m, b_lse)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(b_m - m_use)
        b_w = tl.exp2(b_lse - m_use)
        b_acc = b_acc * alpha[:, None] + b_w[:, None] * b_o
        b_l = b_l * alpha + b_w
        b_m = m_new
    b_o = b_acc / tl.where(b_l == 0.0, 1.0, b_l)[:, None]
    row_g = (o_m // SEG).to(tl.int64)
    row_s = (o_m % SEG).to(tl.int64)
    s_ob, s_og, s_os, s_oh = s_ob * STRIDE_UNIT, s_og * STRIDE_UNIT, s_os * STRIDE_UNIT, s_oh * STRIDE_UNIT
    p_o = O + i_b * s_ob + i_h * s_oh + row_g[:, None] * s_og + row_s[:, None] * s_os  # (BLOCK_M, 1)
    tl.store(p_o + o_d[None, :], b_o.to(O.dtype.element_ty), mask=m_row[:, None] & m_d[None, :])


def config(dtype: torch.dtype, head_dim: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D, num_warps, num_stages): a function of the dtype and head dim only.

    16-bit: 64 query rows per tile, so that up to 64 queries (a burst of R <= 64, or O·R <= 64
    verification rows) share one read of each cache tile, and one Hopper warpgroup MMA (m64) covers
    the tile; the op stays bound by the cache read even when a small R leaves most rows empty.
    fp32 (IEEE dots on the FMA units): smaller tiles. No variant spills registers on sm_90
    (``benchmarks/compile_sm90.py``): with 4 warps the D = 128 tile needed 255 registers and 88 bytes
    of stack, with 8 warps it needs 208 and none."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    if dtype == torch.float32:
        return (64, 32, block_d, 8, 2) if block_d <= 64 else (32, 16, block_d, 8, 2)
    if block_d <= 64:
        return (64, 64, block_d, 4, 3)
    return (64, 64, block_d, 8, 3) if block_d <= 128 else (64, 32, block_d, 8, 2)


def stride_unit(head_dim: int) -> int:
    """The kernels' ``STRIDE_UNIT``: 16 when the head dim is a multiple of 16 (then every stride of a
    sane layout is), else 1."""
    return 16 if head_dim % 16 == 0 else 1


def _split_parts(st: tuple) -> tuple:
    """Strides (b, g, s, h) of a burst (B, H, R, D) or verify (B, O, H, R, D) tensor's ``strides``."""
    if len(st) == 4:  # (B, H, R, D): G = R segments of S = 1 token
        return st[0], st[2], 0, st[1]
    return st[0], st[1], st[3], st[2]


def _ready(t: torch.Tensor, unit: int) -> torch.Tensor:
    """``t`` with a unit head-dim stride and every other stride a multiple of ``unit``."""
    st = strides(t)
    if st[-1] in (0, 1) and all(s % unit == 0 for s in st[:-1]):
        return t
    return t.contiguous()


def cascade_attention(q, k, v, k_cache, v_cache, cache_lens, scale=None, out=None, num_splits=None):
    """Launch the cascade kernel (no input checks). q/k/v/out: (B, H, R, D) (burst) or (B, O, H, R, D)
    (verify); returns ``out`` (a new tensor like q when None)."""
    if out is None:
        out = torch.empty_like(q)
    if q.numel() == 0:
        return out
    B, H, L, D = k_cache.shape
    G, S = (q.shape[2], 1) if q.ndim == 4 else (q.shape[1], q.shape[3])
    M = G * S
    BLOCK_M, BLOCK_N, BLOCK_D, num_warps, num_stages = config(q.dtype, D)
    unit = stride_unit(D)
    q, k, v, k_cache, v_cache = (_ready(t, unit) for t in (q, k, v, k_cache, v_cache))
    cache_lens = cache_lens.contiguous()  # read at row b
    dst = _ready(out, unit)
    n_m = triton.cdiv(M, BLOCK_M)
    n_tiles = max(triton.cdiv(L, BLOCK_N), 1)
    sm_scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    o_strides = in_units(unit, *_split_parts(strides(dst)))

    def args(o_part, lse_part, tiles_per_split):
        return (q, k, v, k_cache, v_cache, cache_lens, dst, o_part, lse_part,
                *in_units(unit, *_split_parts(strides(q)), *_split_parts(strides(k)), *_split_parts(strides(v))),
                *o_strides, *in_units(unit, *strides(k_cache)[:3], *strides(v_cache)[:3]),
                H, M, n_m, D, L, S, tiles_per_split, sm_scale)

    meta = dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, HAS_SPLITS=True, STRIDE_UNIT=unit,
                DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32", num_warps=num_warps, num_stages=num_stages,
                **pdl_meta(q.device))
    if num_splits is None:  # whole waves of the programs an SM holds, each split over min_split_keys keys or more
        num_splits = max(1, min(32, n_tiles * BLOCK_N // min_split_keys(q.device)))
        if num_splits > 1:
            per_sm = SPLIT_WAVE_PROGRAMS
            if q.is_cuda:
                scratch = torch.empty(4, dtype=torch.float32, device=q.device)  # the partials' dtype
                per_sm = resident_programs(_cascade_attn_kernel, args(scratch, scratch, 1), meta, q.device)
            num_splits = max(1, min(num_splits, per_sm * num_sms(q.device) // (B * H * n_m)))
    tiles_per_split = triton.cdiv(n_tiles, max(1, min(int(num_splits), n_tiles)))
    num_splits = triton.cdiv(n_tiles, tiles_per_split)
    if num_splits > 1:
        o_part = torch.empty((num_splits, B * H, M, BLOCK_D), dtype=torch.float32, device=q.device)
        lse_part = torch.empty((num_splits, B * H, M), dtype=torch.float32, device=q.device)
    else:
        o_part = lse_part = dst  # unused
    # (b, h) and query tiles share grid axis 0 (up to 2^31 - 1 programs): axis 1 would cap B·H at 65535
    _cascade_attn_kernel[(B * H * n_m, num_splits)](*args(o_part, lse_part, tiles_per_split),
                                                    **{**meta, "HAS_SPLITS": num_splits > 1})
    if num_splits > 1:
        _combine_kernel[(B * H * n_m,)](
            o_part, lse_part, dst, *o_strides, H, M, n_m, D, S, num_splits,
            BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D, STRIDE_UNIT=unit, num_warps=4 if BLOCK_D <= 128 else 8,  # no spills
            **pdl_meta(q.device),
        )
    if dst is not out:
        out.copy_(dst)
    return out


def _attention(ndim, q, k, v, k_cache, v_cache, cache_lens, scale, out, num_splits) -> torch.Tensor:
    check_attention(q, k, v, k_cache, v_cache, cache_lens, ndim, max_head_dim=MAX_HEAD_DIM, scale=scale)
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                   or num_splits < 1):
        raise ValueError(f"num_splits must be None or an int >= 1, got {num_splits!r}")
    if out is not None:  # eager only: launch straight into ``out``
        check_same("out", out, "q", q)
        return cascade_attention(q, k, v, k_cache, v_cache, cache_lens, scale, out, num_splits)
    from . import ops  # noqa: F401  (registers torch.ops.sigmafast.*)

    op = torch.ops.sigmafast.burst_attention if ndim == 4 else torch.ops.sigmafast.verify_attention
    return op(q, k, v, k_cache, v_cache, cache_lens, None if scale is None else float(scale), num_splits)


def burst_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_lens: torch.Tensor,
    scale: Optional[float] = None,
    *,
    out: Optional[torch.Tensor] = None,
    num_splits: Optional[int] = None,
) -> torch.Tensor:
    """Attention of R queries over ``cache[:cache_lens[b]]`` and their own key only.

    q, k, v: (B, H, R, D) float32/float16/bfloat16, any strides; k_cache,
    v_cache: (B, H, L, D); cache_lens: (B,) int32/int64 with values in [0, L]
    (0 gives ``v``; over L means all of it). scale defaults to 1/sqrt(D).
    Returns (B, H, R, D) in q's dtype from the ``sigmafast::burst_attention``
    op, or written into ``out`` when given (a direct, eager launch).
    ``num_splits`` forces the number of KV splits (default: enough to fill the
    device).
    """
    return _attention(4, q, k, v, k_cache, v_cache, cache_lens, scale, out, num_splits)


def verify_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_lens: torch.Tensor,
    scale: Optional[float] = None,
    *,
    out: Optional[torch.Tensor] = None,
    num_splits: Optional[int] = None,
) -> torch.Tensor:
    """Causal attention of O orders of R tokens sharing one KV-cache prefix.

    q, k, v: (B, O, H, R, D) float32/float16/bfloat16, any strides; k_cache,
    v_cache: (B, H, L, D); cache_lens: (B,) int32/int64 in [0, L]. scale
    defaults to 1/sqrt(D). Returns (B, O, H, R, D) in q's dtype from the
    ``sigmafast::verify_attention`` op, or written into ``out`` when given.
    ``num_splits`` forces the number of KV splits.
    """
    return _attention(5, q, k, v, k_cache, v_cache, cache_lens, scale, out, num_splits)
