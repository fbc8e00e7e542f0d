"""Triton RoPE: a layer's queries, keys (and values) rotated in place in one kernel, or its output back.

RoPE rotates the channel pairs (x_i, x_{i + D/2}) of each head by the angles
of a position: queries by their target position, keys (and, with ``rope-v``,
values) by their own, and ``rope-v`` rotates each attention output back by its
query's. Eagerly each rotation is a split, four products, a sum, a difference
and a concatenation, after two gathers of the cos and sin tables: about thirty
kernels per layer and forward, four times a small model's other kernels in a
replayed burst iteration (benchmarks/RESULTS.md). ``_rotary_kernel``, grid
(row tiles, tensors), does one layer's rotations in one launch: program
(i, p) reads BLOCK_N rows' positions and their table rows once, then rotates
those rows of tensor p (q, k or v) head by head, in place, in float32.

In place, the tensors keep their layout: q, k and v stay views of the QKV
projection (so the KV cache and the attention kernels read them as before)
and the attention output keeps the layout that makes its reshape free.
Compiles once per dtype and head dim: ``BLOCK_D2`` (half the head dim, to a
power of two) is the one shape constexpr; the rotation's sign (+1 forward,
-1 back) and every size and stride are run-time arguments.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .checks import FLOAT_DTYPES
from .step_checks import check_rotary
from .utils import gdc_enter, jit, pdl_meta

BLOCK_N = 16  # rows (tokens) per program

_STRIDES = [f"s_{t}{d}" for t in "qkv" for d in "bht"] + [f"s_{t}{d}" for t in "pr" for d in "bt"]
_STRIDES += ["s_cos", "s_sin"]


@triton.jit
def _rotate_rows(X, s_xb, s_xh, s_xt, i_b, i_t, m_n, b_cos, b_sin, H, D2, o_d):
    """Rotate rows (i_b, :, i_t) of X (B, H, T, D) by the (BLOCK_N, BLOCK_D2) angles, head by head."""
    m = m_n[:, None] & (o_d < D2)[None, :]
    p_x = X + i_b[:, None] * s_xb + i_t[:, None] * s_xt + o_d[None, :]  # (BLOCK_N, BLOCK_D2), first halves
    for h in range(0, H):
        p_h = p_x + h * s_xh
        b_x1 = tl.load(p_h, mask=m, other=0.0)
        b_x2 = tl.load(p_h + D2, mask=m, other=0.0)
        x1, x2 = b_x1.to(tl.float32), b_x2.to(tl.float32)
        tl.store(p_h, (x1 * b_cos - x2 * b_sin).to(b_x1.dtype), mask=m)
        tl.store(p_h + D2, (x2 * b_cos + x1 * b_sin).to(b_x1.dtype), mask=m)


@jit(do_not_specialize=_STRIDES + ["N", "T", "H", "D2", "sign"],
     do_not_specialize_on_alignment=["POS_Q", "POS_K"])
def _rotary_kernel(
    Q, K, V, POS_Q, POS_K, COS, SIN,
    s_qb, s_qh, s_qt, s_kb, s_kh, s_kt, s_vb, s_vh, s_vt, s_pb, s_pt, s_rb, s_rt, s_cos, s_sin,
    N, T, H, D2, sign,
    BLOCK: tl.constexpr, BLOCK_D2: tl.constexpr, USE_GDC: tl.constexpr,
):
    gdc_enter(USE_GDC)
    pid_p = tl.program_id(1)  # 0: q (its target positions), 1: k, 2: v (their own positions)
    o_n = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    m_n = o_n < N
    i_b = o_n // T
    i_t = o_n % T
    o_d = tl.arange(0, BLOCK_D2)
    m_q = o_n < tl.where(pid_p == 0, N, 0)  # the loads of the other tensor's positions are masked off
    m_k = o_n < tl.where(pid_p == 0, 0, N)
    b_pq = tl.load(POS_Q + i_b * s_pb + i_t * s_pt, mask=m_q, other=0)
    b_pk = tl.load(POS_K + i_b * s_rb + i_t * s_rt, mask=m_k, other=0)
    b_pos = tl.where(pid_p == 0, b_pq, b_pk).to(tl.int64)  # (BLOCK,)
    m_a = m_n[:, None] & (o_d < D2)[None, :]
    b_cos = tl.load(COS + b_pos[:, None] * s_cos + o_d[None, :], mask=m_a, other=1.0).to(tl.float32)
    b_sin = tl.load(SIN + b_pos[:, None] * s_sin + o_d[None, :], mask=m_a, other=0.0).to(tl.float32) * sign
    if pid_p == 0:
        _rotate_rows(Q, s_qb, s_qh, s_qt, i_b, i_t, m_n, b_cos, b_sin, H, D2, o_d)
    elif pid_p == 1:
        _rotate_rows(K, s_kb, s_kh, s_kt, i_b, i_t, m_n, b_cos, b_sin, H, D2, o_d)
    else:
        _rotate_rows(V, s_vb, s_vh, s_vt, i_b, i_t, m_n, b_cos, b_sin, H, D2, o_d)


def _rows(t: torch.Tensor) -> Optional[torch.Tensor]:
    """A (..., H, T, D) tensor as a (B, H, T, D) view (its leading dims collapsed), None when they do not
    collapse into one stride or the head dim is strided."""
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        return None
    try:
        return t.view(-1, *t.shape[-3:])
    except RuntimeError:
        return None


def _positions(p: torch.Tensor) -> torch.Tensor:
    """(..., T) positions as (B, T) with any strides (an expanded tensor stays a view)."""
    try:
        return p.view(-1, p.shape[-1])
    except RuntimeError:
        return p.reshape(-1, p.shape[-1])


def launch(q, k, v, pos_q, pos_k, cos, sin, sign: float) -> bool:
    """Rotate q (and k, v when given) in place (no input checks); False, launching nothing, when a tensor's
    layout cannot be rotated in place (the caller then rotates it out of place)."""
    xs = [_rows(t) for t in (q, k, v) if t is not None]
    if any(x is None for x in xs):
        return False
    B, H, T, D = xs[0].shape
    N = B * T
    if N == 0 or H == 0:
        return True
    pq = _positions(pos_q)
    pk = _positions(pos_k) if pos_k is not None else pq
    xq, xk, xv = (xs + [xs[0]] * 3)[:3]
    _rotary_kernel[(triton.cdiv(N, BLOCK_N), len(xs))](
        xq, xk, xv, pq, pk, cos, sin,
        *(s for x in (xq, xk, xv) for s in (x.stride(0), x.stride(1), x.stride(2))),
        pq.stride(0), pq.stride(1), pk.stride(0), pk.stride(1), cos.stride(0), sin.stride(0),
        N, T, H, D // 2, float(sign),
        BLOCK=BLOCK_N, BLOCK_D2=triton.next_power_of_2(max(D // 2, 1)), num_warps=4, **pdl_meta(xq.device),
    )
    return True


def rotary_(q, k, v, pos_q, pos_k, cos, sin, sign: float = 1.0) -> None:
    """Rotate q, and k and v when given, in place: RoPE by the angles of table rows ``pos_q`` (for q) and
    ``pos_k`` (for k and v), times ``sign`` (-1 rotates back).

    q, k, v: (..., H, T, D) float32/float16/bfloat16 with the same shape and dtype, D even (k and v may
    be None); pos_q, pos_k: (..., T) int32/int64 in [0, n_pos); cos, sin: (n_pos, D / 2) with unit inner
    stride (e.g. halves of the model's (n_pos, D) tables), the angles' cosines and sines. A tensor whose
    leading dims do not collapse into one stride is rotated out of place and copied back.
    ``sigmafast::rotary_`` op (no host sync).
    """
    check_rotary(q, k, v, pos_q, pos_k, cos, sin, FLOAT_DTYPES)
    from . import ops  # noqa: F401  (registers torch.ops.sigmafast.*)

    torch.ops.sigmafast.rotary_(q, k, v, pos_q, pos_k, cos, sin, float(sign))
