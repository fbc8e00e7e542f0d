"""Triton first half of a transformer MLP: ``gelu(x W^T + b)`` in one kernel.

Eagerly the MLP's first matmul and its GELU are two kernels: cuBLAS's addmm
writes the (N, F) pre-activations, then an elementwise GELU reads them back and
writes the activations. In a narrow model at a sampler's row counts both are
a few microseconds, mostly launch and latency: the `small` burst iteration
(4 layers, 128 wide, two forwards) runs 8 such GELU kernels. Here the GELU is
the matmul's epilogue, on the float32 tile in registers.

Grid (row blocks, column blocks), row blocks fastest, so that programs
running together share a tile of W through L2. Each program accumulates its
(BLOCK_M, BLOCK_F) tile over the K columns in BLOCK_K chunks with ``tl.dot``.
Roundings follow the eager ops: the matmul's output with its bias is rounded
to the input dtype, the GELU (exact, erf) is taken in float32 of that and
rounded. float32 dots are "ieee", as torch's matmul without TF32.

Compiles once per dtype and model width (K and the tiles are constexprs; the
row count, F and the row stride are not specialised; with and without a bias
are the two variants).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .checks import FLOAT_DTYPES
from .linear_norm import addmm_gelu, linear_tile
from .step_checks import check_linear_gelu
from .utils import gdc_enter, pdl_meta


@triton.jit(do_not_specialize=["N", "F", "s_x"])
def _linear_gelu_kernel(
    X, W, BIAS, Y, N, F, s_x,
    K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    DOT_PREC: tl.constexpr, USE_GDC: tl.constexpr,
):
    """Y = gelu(X W^T + BIAS) for X (N, K) (row stride s_x), W (F, K) contiguous, Y (N, F) contiguous."""
    gdc_enter(USE_GDC)
    o_m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    o_f = (tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)).to(tl.int64)
    m_m, m_f = o_m < N, o_f < F
    b_acc = linear_tile(X, W, o_m, o_f, m_m, m_f, s_x, K, BLOCK_M, BLOCK_F, BLOCK_K, DOT_PREC)  # (BLOCK_M, BLOCK_F)
    b_g = addmm_gelu(b_acc, BIAS, o_f, m_f, Y, HAS_BIAS)
    tl.store(Y + o_m[:, None] * F + o_f[None, :], b_g.to(Y.dtype.element_ty), mask=m_m[:, None] & m_f[None, :])


def tiles(K: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_F, BLOCK_K, num_warps): 64 x 64 output tiles in 16-bit dtypes (a small model's burst rows
    give a few hundred programs) on 8 warps (sm_90, bf16, K = 128: 127 registers, against 237 on 4 warps, for
    the same 2 programs per SM), 32 x 32 in float32 (the ieee dots: tests and exactness, not speed); K in
    chunks of at most 64 columns, at least 16 for tl.dot."""
    block_k = min(64, max(16, triton.next_power_of_2(K)))
    if dtype == torch.float32:
        return 32, 32, min(block_k, 32), 4
    return 64, 64, block_k, 8


def launch(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """Launch the kernel (no input checks): gelu(linear(x, weight, bias)), (..., F) in x's dtype."""
    K, F = x.shape[-1], weight.shape[0]
    x2 = x.reshape(-1, K)
    if x2.shape[0] > 0 and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    N = x2.shape[0]
    y = torch.empty(N, F, dtype=x.dtype, device=x.device)
    if N == 0:
        return y.view(*x.shape[:-1], F)
    block_m, block_f, block_k, num_warps = tiles(K, x.dtype)
    _linear_gelu_kernel[(triton.cdiv(N, block_m), triton.cdiv(F, block_f))](
        x2, weight, bias if bias is not None else weight, y, N, F, x2.stride(0),
        K=K, BLOCK_M=block_m, BLOCK_F=block_f, BLOCK_K=block_k, HAS_BIAS=bias is not None,
        DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32", num_warps=num_warps, **pdl_meta(x.device),
    )
    return y.view(*x.shape[:-1], F)


def linear_gelu(x, weight, bias=None) -> torch.Tensor:
    """``F.gelu(F.linear(x, weight, bias))`` (exact GELU), in one kernel.

    x: (..., K) float32/float16/bfloat16; weight: contiguous (F, K); bias: (F,) or None, of x's dtype and
    device. Returns (..., F) in x's dtype, from the ``sigmafast::linear_gelu`` op.
    """
    check_linear_gelu(x, weight, bias, dtypes=FLOAT_DTYPES, unit_stride=True)
    from . import ops  # noqa: F401  (registers torch.ops.sigmafast.*)

    return torch.ops.sigmafast.linear_gelu(x, weight, bias)
