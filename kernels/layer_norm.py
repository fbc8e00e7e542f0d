"""Triton residual add + LayerNorm: ``s = x + y`` and ``LayerNorm(s)`` in one kernel.

Every transformer block adds a residual update and normalises the sum for the
next sublayer: eagerly that is an add kernel, then a LayerNorm kernel that
reads the sum back. In an inference step these are tiny launch-bound kernels
(an H200 profile of a GPT-2 burst iteration counted 50 LayerNorms at about
4 µs each, plus as many adds; benchmarks/RESULTS.md), so fusing the pair
removes one launch per residual, 2 per layer and step.

``_add_layer_norm_kernel``, grid (row blocks,): BLOCK_N rows of C channels per
program; the sum is rounded to the input dtype and written (as the eager add
would), and the statistics are taken in float32 over the rounded values:
mean, then the variance of the centred values (two passes over registers, no
cancellation). ``weight`` may be a stride-0 expansion (one gain for every
channel, as ``ScalarGainNorm``); ``bias`` may be absent.

Compiles once per dtype and width (and per affine layout: with or without a
bias): BLOCK_C = next power of two >= C and the rows per program depend on C
only; the row count and strides are in ``do_not_specialize``, the row strides
in units of ``STRIDE_UNIT`` (16 when C and the inputs' row strides allow it,
as in :mod:`.attention`) so that the rows' loads stay vectorised. The outputs
are contiguous.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .checks import FLOAT_DTYPES
from .step_checks import check_add_layer_norm
from .utils import gdc_enter, pdl_meta

MAX_WIDTH = 16384


@triton.jit(do_not_specialize=["N", "s_x", "s_y", "s_w"])
def _add_layer_norm_kernel(
    X, Y, W, B, S, H,
    N, s_x, s_y, s_w, eps,
    C: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    STRIDE_UNIT: tl.constexpr, USE_GDC: tl.constexpr,
):
    gdc_enter(USE_GDC)
    s_x, s_y = s_x * STRIDE_UNIT, s_y * STRIDE_UNIT  # in units of STRIDE_UNIT elements (see utils)
    pid = tl.program_id(0)
    o_n = (pid * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    o_c = tl.arange(0, BLOCK_C)
    m_c = o_c < C
    m = (o_n < N)[:, None] & m_c[None, :]
    b_x = tl.load(X + o_n[:, None] * s_x + o_c[None, :], mask=m, other=0.0)
    b_y = tl.load(Y + o_n[:, None] * s_y + o_c[None, :], mask=m, other=0.0)
    b_s = (b_x.to(tl.float32) + b_y.to(tl.float32)).to(S.dtype.element_ty)  # the eager add's rounding
    tl.store(S + o_n[:, None] * C + o_c[None, :], b_s, mask=m)
    b_h = normalize(b_s.to(tl.float32), o_c, W, B, s_w, eps, C, HAS_W, HAS_B)
    tl.store(H + o_n[:, None] * C + o_c[None, :], b_h.to(H.dtype.element_ty), mask=m)


@triton.jit
def normalize(b_v, o_c, W, B, s_w, eps, C: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr):
    """(BLOCK_N, BLOCK_C) float32 rows (columns >= C ignored) -> their LayerNorm, float32: the mean,
    then the variance of the centred values (no cancellation), then the optional gain and bias."""
    m_c = o_c < C
    mean = tl.sum(tl.where(m_c[None, :], b_v, 0.0), 1) / C
    b_d = tl.where(m_c[None, :], b_v - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(b_d * b_d, 1) / C + eps)
    b_h = b_d * rstd[:, None]
    if HAS_W:
        b_h = b_h * tl.load(W + o_c.to(tl.int64) * s_w, mask=m_c, other=0.0).to(tl.float32)[None, :]
    if HAS_B:
        b_h = b_h + tl.load(B + o_c, mask=m_c, other=0.0).to(tl.float32)[None, :]
    return b_h


def config(C: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_C, num_warps): about 4096 elements per program, a function of the width only."""
    block_c = triton.next_power_of_2(C)
    block_n = max(1, min(4096 // block_c, 16))
    return block_n, block_c, 4 if block_n * block_c <= 4096 else 8


def _rows(t: torch.Tensor) -> torch.Tensor:
    """(..., W) -> (N, W) with a unit inner stride (a view when the leading dims collapse)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 or t2.shape[-1] <= 1 else t2.contiguous()


def residual_rows(x: torch.Tensor, y: torch.Tensor):
    """The rows (N, C) and (N, W) of the residual stream x (..., C) and of the update's input y (..., W),
    with unit inner strides, and new outputs s and h shaped like x: the launchers' common start."""
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return _rows(x), _rows(y), s, h


def launch(x, y, weight, bias, eps):
    """Launch the kernel (no input checks): returns (x + y, LayerNorm(x + y)), shaped like x."""
    C = x.shape[-1]
    x2, y2, s, h = residual_rows(x, y)
    N = x2.shape[0]
    if N == 0:
        return s, h
    s2, h2 = s.view(N, C), h.view(N, C)
    block_n, block_c, num_warps = config(C)
    unit = 16 if C % 16 == 0 and x2.stride(0) % 16 == 0 and y2.stride(0) % 16 == 0 else 1
    _add_layer_norm_kernel[(triton.cdiv(N, block_n),)](
        x2, y2, weight if weight is not None else x2, bias if bias is not None else x2, s2, h2,
        N, x2.stride(0) // unit, y2.stride(0) // unit, weight.stride(0) if weight is not None else 0, float(eps),
        C=C, BLOCK_N=block_n, BLOCK_C=block_c, HAS_W=weight is not None, HAS_B=bias is not None,
        STRIDE_UNIT=unit, num_warps=num_warps, **pdl_meta(x2.device),
    )
    return s, h


def add_layer_norm(
    x: torch.Tensor,
    y: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    eps: float = 1e-5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual sum and its LayerNorm over the last dimension.

    x, y: (..., C) float32/float16/bfloat16, same shape and dtype; weight, bias: (C,) or None
    (weight may be a stride-0 expansion of one gain). Returns ``s = x + y`` and
    ``F.layer_norm(s, (C,), weight, bias, eps)``, both (..., C) in x's dtype, from the
    ``sigmafast::add_layer_norm`` op.
    """
    bias = check_add_layer_norm(x, y, weight, bias, eps, FLOAT_DTYPES, MAX_WIDTH)
    from . import ops  # noqa: F401  (registers torch.ops.sigmafast.*)

    return torch.ops.sigmafast.add_layer_norm(x, y, weight, bias, float(eps))
