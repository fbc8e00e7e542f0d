"""Shared pieces of the Triton kernels: input checks, vocabulary helpers, cascade attention.

Burst and verification attention are one kernel. The queries of a (b, h) are
flattened into M = S·G rows, G segments of S consecutive tokens (verification:
G = O orders of S = R tokens; burst: G = R segments of S = 1 token). Row m
attends to the cache prefix ``[0, cache_lens[b])`` and, causally, to the keys
of its own segment up to itself (burst: only its own key, the diagonal term).

One program owns a tile of BLOCK_M consecutive rows. It streams the cache tiles
of its KV split through one online softmax (each cache tile is read once per
query tile, and query tiles of the same (b, h) run side by side, so DRAM sees
the prefix about once), then continues the same online softmax over the
causal suffix keys of the tile's segments. With several KV splits, the split
that owns the suffix is split 0; the fp32 partial outputs and log-sum-exps are
merged by a second small kernel. fp32 inputs use IEEE fp32 dots (never TF32),
so the fp32 path is as exact as the reference.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

MAX_HEAD_DIM = 256
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_float(name: str, t: torch.Tensor, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")


def check_same(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.shape != ref.shape:
        raise ValueError(f"{name} must have the shape of {ref_name} {tuple(ref.shape)}, got {tuple(t.shape)}")
    if t.dtype != ref.dtype:
        raise ValueError(f"{name} must have the dtype of {ref_name} ({ref.dtype}), got {t.dtype}")
    if t.device != ref.device:
        raise ValueError(f"{name} must be on {ref.device} like {ref_name}, got {t.device}")


def check_int(name: str, t: torch.Tensor, shape: tuple, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in (torch.int32, torch.int64) or tuple(t.shape) != tuple(shape):
        raise ValueError(
            f"{name} must be an int32/int64 tensor of shape {tuple(shape)}, got {t.dtype} {tuple(t.shape)}"
        )
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")


def check_attention_inputs(q, k, v, k_cache, v_cache, cache_lens, ndim: int) -> None:
    """Validate q, k, v (..., H, R, D) of rank ``ndim`` against caches (B, H, L, D) and lens (B,)."""
    check_float("q", q, ndim)
    check_same("k", k, "q", q)
    check_same("v", v, "q", q)
    check_float("k_cache", k_cache, 4)
    check_same("v_cache", v_cache, "k_cache", k_cache)
    B, H, D = q.shape[0], q.shape[-3], q.shape[-1]
    if k_cache.dtype != q.dtype or k_cache.device != q.device:
        raise ValueError(
            f"k_cache must match q's dtype/device ({q.dtype}, {q.device}), got {k_cache.dtype}, {k_cache.device}"
        )
    if (k_cache.shape[0], k_cache.shape[1], k_cache.shape[3]) != (B, H, D):
        raise ValueError(f"k_cache must have shape (B={B}, H={H}, L, D={D}), got {tuple(k_cache.shape)}")
    if D > MAX_HEAD_DIM:
        raise ValueError(f"head dim D={D} is over the supported maximum {MAX_HEAD_DIM}")
    check_int("cache_lens", cache_lens, (B,), q.device)


def kth_largest(logits: torch.Tensor, top_k: Optional[int]) -> Optional[torch.Tensor]:
    """(N,) float32 k-th largest logit per row of (N, V) logits, None when top-k keeps all."""
    if top_k is None or top_k >= logits.shape[-1]:
        return None
    return logits.topk(top_k, dim=-1).values[..., -1].float().contiguous()  # (N,)


def rows_per_program(block_v: int, budget: int = 4096) -> int:
    """Rows per program so that a (rows, BLOCK_V) chunk holds about ``budget`` elements."""
    return max(1, min(budget // block_v, 256))


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors to fill; a small stand-in in the CPU interpreter."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


@triton.jit
def load_logits(ptr, o_v, m_v, kth, temperature, HAS_TOPK: tl.constexpr):
    """Logits as fp32, -inf where masked or below the top-k threshold, over the temperature."""
    b_x = tl.load(ptr + o_v, mask=m_v, other=float("-inf")).to(tl.float32)
    if HAS_TOPK:
        b_x = tl.where(b_x < kth, float("-inf"), b_x)
    return tl.math.div_rn(b_x, temperature)  # IEEE division, as torch's logits / temperature


@triton.jit
def online_lse(b_m, b_s, b_x):
    """Fold a (BLOCK_N, BLOCK_V) chunk into per-row running max and sum of exp."""
    m_new = tl.maximum(b_m, tl.max(b_x, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    b_s = b_s * tl.exp(b_m - m_use) + tl.sum(tl.exp(b_x - m_use[:, None]), 1)
    return m_new, b_s


@triton.jit
def _cascade_attn_kernel(
    Q, K, V, KC, VC, LENS, O, O_PART, LSE_PART,
    s_qb, s_qg, s_qs, s_qh, s_qd,
    s_kb, s_kg, s_ks, s_kh, s_kd,
    s_vb, s_vg, s_vs, s_vh, s_vd,
    s_cb, s_ch, s_cl, s_cd,
    s_wb, s_wh, s_wl, s_wd,
    s_ob, s_og, s_os, s_oh, s_od,
    H, M, D, L, SEG, tiles_per_split, sm_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PREC: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)
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

    p_q = Q + i_b * s_qb + i_h * s_qh + row_g[:, None] * s_qg + row_s[:, None] * s_qs + o_d[None, :] * s_qd
    b_q = tl.load(p_q, mask=m_row[:, None] & m_d[None, :], other=0.0)  # (BLOCK_M, BLOCK_D)

    b_m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # prefix: this split's share of cache[:len_b]
    cache_len = tl.minimum(tl.load(LENS + i_b).to(tl.int32), L)  # lengths over L mean the whole cache
    lo = pid_s * tiles_per_split * BLOCK_N
    hi = tl.minimum(lo + tiles_per_split * BLOCK_N, cache_len)
    o_n = tl.arange(0, BLOCK_N)
    kc_base = KC + i_b * s_cb + i_h * s_ch
    vc_base = VC + i_b * s_wb + i_h * s_wh
    for start in range(lo, hi, BLOCK_N):
        o_l = start + o_n
        m_l = o_l < hi
        o_l64 = o_l.to(tl.int64)
        b_kt = tl.load(kc_base + o_l64[None, :] * s_cl + o_d[:, None] * s_cd,
                       mask=m_l[None, :] & m_d[:, None], other=0.0)  # (BLOCK_D, BLOCK_N)
        b_v = tl.load(vc_base + o_l64[:, None] * s_wl + o_d[None, :] * s_wd,
                      mask=m_l[:, None] & m_d[None, :], other=0.0)  # (BLOCK_N, BLOCK_D)
        b_s = tl.dot(b_q, b_kt, input_precision=DOT_PREC) * qk_scale
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
    for start in range(seg_lo, seg_hi, BLOCK_N):
        o_t = start + o_n
        m_t = o_t < seg_hi
        o_t64 = o_t.to(tl.int64)
        col_g = (o_t // SEG).to(tl.int64)
        col_s = (o_t % SEG).to(tl.int64)
        p_k = K + i_b * s_kb + i_h * s_kh + col_g[None, :] * s_kg + col_s[None, :] * s_ks + o_d[:, None] * s_kd
        p_v = V + i_b * s_vb + i_h * s_vh + col_g[:, None] * s_vg + col_s[:, None] * s_vs + o_d[None, :] * s_vd
        b_kt = tl.load(p_k, mask=m_t[None, :] & m_d[:, None], other=0.0)
        b_v = tl.load(p_v, mask=m_t[:, None] & m_d[None, :], other=0.0)
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
    if SPLIT == 1:
        p_o = O + i_b * s_ob + i_h * s_oh + row_g[:, None] * s_og + row_s[:, None] * s_os + o_d[None, :] * s_od
        tl.store(p_o, b_o.to(O.dtype.element_ty), mask=m_out)
    else:
        # partial buffers: (SPLIT, B*H, M, BLOCK_D) and (SPLIT, B*H, M), contiguous
        row = (pid_s * tl.num_programs(1) + pid_bh).to(tl.int64) * M + o_m64
        tl.store(O_PART + row[:, None] * BLOCK_D + o_d[None, :], b_o, mask=m_out)
        tl.store(LSE_PART + row, tl.where(b_l > 0.0, b_m + tl.log2(l_safe), float("-inf")), mask=m_row)


@triton.jit
def _combine_kernel(
    O_PART, LSE_PART, O,
    s_ob, s_og, s_os, s_oh, s_od,
    H, M, D, SEG, n_splits,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Merge the KV splits' normalised partial outputs by their base-2 log-sum-exps."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
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
        row = (i_s * tl.num_programs(1) + pid_bh).to(tl.int64) * M + o_m64
        b_lse = tl.load(LSE_PART + row, mask=m_row, other=float("-inf"))
        b_o = tl.load(O_PART + row[:, None] * BLOCK_D + o_d[None, :], mask=m_row[:, None] & m_d[None, :],
                      other=0.0)  # columns >= D of the partials are never written
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
    p_o = O + i_b * s_ob + i_h * s_oh + row_g[:, None] * s_og + row_s[:, None] * s_os + o_d[None, :] * s_od
    tl.store(p_o, b_o.to(O.dtype.element_ty), mask=m_row[:, None] & m_d[None, :])


def _split_parts(t: torch.Tensor) -> tuple:
    """Strides (b, g, s, h, d) of a burst (B, H, R, D) or verify (B, O, H, R, D) tensor view."""
    if t.ndim == 4:  # (B, H, R, D): G = R segments of S = 1 token
        return t.stride(0), t.stride(2), 0, t.stride(1), t.stride(3)
    return t.stride(0), t.stride(1), t.stride(3), t.stride(2), t.stride(4)


def cascade_attention(q, k, v, k_cache, v_cache, cache_lens, scale, out, num_splits=None):
    """Launch the cascade kernel. q/k/v/out: (B, H, R, D) (burst) or (B, O, H, R, D) (verify)."""
    B, H, L, D = k_cache.shape
    if q.ndim == 4:
        G, S = q.shape[2], 1
    else:
        G, S = q.shape[1], q.shape[3]
    M = G * S
    BLOCK_D = max(16, triton.next_power_of_2(D))
    if q.dtype == torch.float32:  # ieee fp32 dots run on FMA units: smaller tiles, no spills
        BLOCK_M = min(64 if BLOCK_D <= 64 else 32, max(16, triton.next_power_of_2(M)))
        BLOCK_N = 32 if BLOCK_D <= 64 else 16
        num_warps, num_stages = 8, 2
    else:
        BLOCK_M = min(64, max(16, triton.next_power_of_2(M)))
        BLOCK_N = 64 if BLOCK_D <= 128 else 32
        num_warps, num_stages = (4 if BLOCK_D <= 64 else 8), 3
    n_m = triton.cdiv(M, BLOCK_M)
    n_tiles = triton.cdiv(L, BLOCK_N)
    if num_splits is None:
        programs = B * H * n_m
        target = 2 * num_sms(q.device)
        num_splits = 1 if programs >= target else min(triton.cdiv(target, programs), 32)
    num_splits = max(1, min(int(num_splits), max(n_tiles, 1)))
    tiles_per_split = triton.cdiv(max(n_tiles, 1), num_splits)
    num_splits = triton.cdiv(max(n_tiles, 1), tiles_per_split)
    sm_scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    dot_prec = "ieee" if q.dtype == torch.float32 else "tf32"

    if num_splits > 1:
        o_part = torch.empty((num_splits, B * H, M, BLOCK_D), dtype=torch.float32, device=q.device)
        lse_part = torch.empty((num_splits, B * H, M), dtype=torch.float32, device=q.device)
    else:
        o_part = lse_part = out  # unused
    grid = (n_m, B * H, num_splits)
    _cascade_attn_kernel[grid](
        q, k, v, k_cache, v_cache, cache_lens, out, o_part, lse_part,
        *_split_parts(q), *_split_parts(k), *_split_parts(v),
        *k_cache.stride(), *v_cache.stride(), *_split_parts(out),
        H, M, D, L, S, tiles_per_split, sm_scale,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, SPLIT=num_splits, DOT_PREC=dot_prec,
        num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        _combine_kernel[(n_m, B * H)](
            o_part, lse_part, out, *_split_parts(out), H, M, D, S, num_splits,
            BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D, num_warps=4,
        )
    return out
