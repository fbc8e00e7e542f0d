"""Triton ends of a narrow model's sublayers: the output projection or the whole MLP, the residual add and
the next LayerNorm, in one kernel each.

A block's sublayer ends with a matmul whose output is added to the residual
stream and normalised for the next sublayer. Eagerly that is an addmm and the
fused add + LayerNorm (:mod:`.layer_norm`) after attention, and an addmm, a
GELU, an addmm and the add + LayerNorm after the MLP: 6 kernels per block.
In a narrow model (C <= 256, the ``tiny`` and ``small`` presets) they are all
launch-bound, and a program can hold whole rows, so each end becomes one
kernel: 2 per block, 4 fewer per block and forward (32 per burst iteration of
the 4-layer ``small`` model, which runs 8 block forwards).

- ``_linear_add_norm_kernel``: ``s = x + (y W^T + b)``, ``LayerNorm(s)``, with
  y (N, K) (the attention heads' outputs) and W (C, K) (``c_proj``).
- ``_mlp_add_norm_kernel``: ``s = x + (gelu(h W1^T + b1) W2^T + b2)``,
  ``LayerNorm(s)``, with h (N, C), W1 (F, C) and W2 (C, F); the (BLOCK_M, F)
  hidden activations never leave the program (F streamed in BLOCK_F chunks).

Either kernel may also compute the next block's QKV projection of the
LayerNorm it just took (``next_weight``, written into ``next_out``): the
sublayer end that feeds a block then takes that block's first matmul too (one
kernel fewer per block; the embedding kernel takes the first block's,
:mod:`.embed`).

Grid (row blocks,), BLOCK_M rows per program (64 in 16-bit dtypes, 16 in
float32), BLOCK_C >= C (a power of two) columns. Roundings follow the eager
ops: each matmul's output (with its bias) is rounded to the input dtype, the
GELU (exact, erf) is taken in float32 of that, the sum is rounded, and the
LayerNorm's statistics are float32 (the shared ``layer_norm.normalize``).
float32 dots are "ieee", as torch's matmul without TF32. Compiles once per
dtype and model (the widths are constexprs; the row count and strides are in
``do_not_specialize``; with and without the next projection are the two
variants).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import FLOAT_DTYPES, FUSED_END_WIDTH
from .layer_norm import normalize, residual_rows
from .step_checks import check_linear_add_norm, check_mlp_add_norm
from .utils import gdc_enter, pdl_meta

MAX_WIDTH = FUSED_END_WIDTH  # C: whole rows per program (wider models keep cuBLAS and the add + LayerNorm kernel)
MAX_INNER = 16384  # K and F
LIMITS = dict(dtypes=FLOAT_DTYPES, max_width=MAX_WIDTH, max_inner=MAX_INNER, unit_stride=True)  # for step_checks
SQRT1_2 = tl.constexpr(0.7071067811865476)  # 1/sqrt(2), a constexpr: a kernel may read it


@triton.jit
def _add_norm_store(b_y, X, S, H, LW, LB, WQ, BQ, Q, o_m, o_c, N, s_x, s_w, s_q, eps,
                    C: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, Q3: tl.constexpr,
                    BLOCK_Q: tl.constexpr, HAS_QB: tl.constexpr, DOT_PREC: tl.constexpr):
    """The residual sum of the (BLOCK_M, BLOCK_C) float32 update and rows ``o_m`` of X, stored to S, and its
    LayerNorm to H (both contiguous (N, C)); with Q3 > 0, also the next block's QKV projection of that
    LayerNorm, ``H WQ^T + BQ`` (WQ (Q3, C)), stored to rows of Q (row stride s_q) in BLOCK_Q-wide chunks."""
    m_m, m_c = o_m < N, o_c < C
    m = m_m[:, None] & m_c[None, :]
    b_y = b_y.to(S.dtype.element_ty).to(tl.float32)  # the eager matmul's output rounding
    b_x = tl.load(X + o_m[:, None] * s_x + o_c[None, :], mask=m, other=0.0).to(tl.float32)
    b_s = (b_x + b_y).to(S.dtype.element_ty)  # the eager add's rounding
    tl.store(S + o_m[:, None] * C + o_c[None, :], b_s, mask=m)
    b_h = normalize(b_s.to(tl.float32), o_c, LW, LB, s_w, eps, C, HAS_W, HAS_B).to(H.dtype.element_ty)
    tl.store(H + o_m[:, None] * C + o_c[None, :], b_h, mask=m)
    project_rows(b_h, WQ, BQ, Q, o_m, m_m, o_c, m_c, s_q, C, Q3, BLOCK_Q, HAS_QB, DOT_PREC)


@triton.jit
def project_rows(b_h, WQ, BQ, Q, o_m, m_m, o_c, m_c, s_q, C: tl.constexpr, Q3: tl.constexpr, BLOCK_Q: tl.constexpr,
                 HAS_QB: tl.constexpr, DOT_PREC: tl.constexpr):
    """The next block's QKV projection ``b_h WQ^T + BQ`` of the (BLOCK_M, BLOCK_C) normalised rows ``b_h`` (in
    the output dtype; columns past C zero), WQ (Q3, C) contiguous, stored to rows ``o_m`` (int64) of Q (row
    stride s_q) in BLOCK_Q-wide chunks, the output rounded once as the eager addmm's. Nothing when Q3 == 0: not
    even compiled, as the rows' tile may then be narrower than the 16 columns a tl.dot needs."""
    if Q3 > 0:
        for q0 in range(0, Q3, BLOCK_Q):
            o_q = q0 + tl.arange(0, BLOCK_Q).to(tl.int64)
            m_q = o_q < Q3
            b_wt = tl.load(WQ + o_q[None, :] * C + o_c[:, None], mask=m_c[:, None] & m_q[None, :], other=0.0)
            b_p = tl.dot(b_h, b_wt, input_precision=DOT_PREC)  # (BLOCK_M, BLOCK_Q)
            if HAS_QB:
                b_p += tl.load(BQ + o_q, mask=m_q, other=0.0).to(tl.float32)[None, :]
            tl.store(Q + o_m[:, None] * s_q + o_q[None, :], b_p.to(Q.dtype.element_ty),
                     mask=m_m[:, None] & m_q[None, :])


@triton.jit
def linear_tile(X, W, o_m, o_n, m_m, m_n, s_x, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr):
    """The (BLOCK_M, BLOCK_N) float32 tile ``X W^T`` of rows ``o_m`` of X (row stride s_x) and rows ``o_n`` of W
    (contiguous (N, K)), both int64 with their masks, over K in BLOCK_K chunks."""
    b_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
        m_k = o_k < K
        b_x = tl.load(X + o_m[:, None] * s_x + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0)
        b_wt = tl.load(W + o_n[None, :] * K + o_k[:, None], mask=m_k[:, None] & m_n[None, :], other=0.0)
        b_acc = tl.dot(b_x, b_wt, b_acc, input_precision=DOT_PREC)
    return b_acc


@triton.jit
def addmm_gelu(b_acc, BIAS, o_n, m_n, Y, HAS_BIAS: tl.constexpr):
    """The exact (erf) GELU, in float32, of the float32 tile ``b_acc`` plus the bias of columns ``o_n`` (masked:
    0) rounded to Y's dtype first, as the eager addmm's output is."""
    if HAS_BIAS:
        b_acc += tl.load(BIAS + o_n, mask=m_n, other=0.0).to(tl.float32)[None, :]
    b_a = b_acc.to(Y.dtype.element_ty).to(tl.float32)
    return 0.5 * b_a * (1.0 + tl.math.erf(b_a * SQRT1_2))


@triton.jit(do_not_specialize=["N", "s_x", "s_y", "s_w", "s_q"])
def _linear_add_norm_kernel(
    X, Y, W, BIAS, LW, LB, S, H, WQ, BQ, Q,
    N, s_x, s_y, s_w, s_q, eps,
    C: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, Q3: tl.constexpr, BLOCK_Q: tl.constexpr,
    HAS_QB: tl.constexpr, DOT_PREC: tl.constexpr, USE_GDC: tl.constexpr,
):
    gdc_enter(USE_GDC)
    o_m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    o_c = tl.arange(0, BLOCK_C).to(tl.int64)
    m_m, m_c = o_m < N, o_c < C
    b_acc = linear_tile(Y, W, o_m, o_c, m_m, m_c, s_y, K, BLOCK_M, BLOCK_C, BLOCK_K, DOT_PREC)
    if HAS_BIAS:
        b_acc += tl.load(BIAS + o_c, mask=m_c, other=0.0).to(tl.float32)[None, :]
    _add_norm_store(b_acc, X, S, H, LW, LB, WQ, BQ, Q, o_m, o_c, N, s_x, s_w, s_q, eps, C, HAS_W, HAS_B, Q3, BLOCK_Q,
                    HAS_QB, DOT_PREC)


@triton.jit(do_not_specialize=["N", "s_x", "s_y", "s_w", "s_q"])
def _mlp_add_norm_kernel(
    X, Y, W1, W2, B1, B2, LW, LB, S, H, WQ, BQ, Q,
    N, s_x, s_y, s_w, s_q, eps,
    C: tl.constexpr, F: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_F: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, Q3: tl.constexpr, BLOCK_Q: tl.constexpr,
    HAS_QB: tl.constexpr, DOT_PREC: tl.constexpr, USE_GDC: tl.constexpr,
):
    gdc_enter(USE_GDC)
    o_m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    o_c = tl.arange(0, BLOCK_C).to(tl.int64)
    m_m, m_c = o_m < N, o_c < C
    b_h = tl.load(Y + o_m[:, None] * s_y + o_c[None, :], mask=m_m[:, None] & m_c[None, :], other=0.0)
    b_acc = tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32)
    for f0 in range(0, F, BLOCK_F):
        o_f = f0 + tl.arange(0, BLOCK_F).to(tl.int64)
        m_f = o_f < F
        b_w1t = tl.load(W1 + o_f[None, :] * C + o_c[:, None], mask=m_c[:, None] & m_f[None, :], other=0.0)
        b_a = tl.dot(b_h, b_w1t, input_precision=DOT_PREC)  # (BLOCK_M, BLOCK_F) pre-activations
        b_g = addmm_gelu(b_a, B1, o_f, m_f, Y, HAS_BIAS).to(W2.dtype.element_ty)  # masked columns: 0
        b_w2t = tl.load(W2 + o_c[None, :] * F + o_f[:, None], mask=m_f[:, None] & m_c[None, :], other=0.0)
        b_acc = tl.dot(b_g, b_w2t, b_acc, input_precision=DOT_PREC)  # (BLOCK_M, BLOCK_C)
    if HAS_BIAS:
        b_acc += tl.load(B2 + o_c, mask=m_c, other=0.0).to(tl.float32)[None, :]
    _add_norm_store(b_acc, X, S, H, LW, LB, WQ, BQ, Q, o_m, o_c, N, s_x, s_w, s_q, eps, C, HAS_W, HAS_B, Q3, BLOCK_Q,
                    HAS_QB, DOT_PREC)


def rows_per_program(dtype: torch.dtype) -> tuple[int, int]:
    """(BLOCK_M, num_warps). Every program streams all the weights from L2 whatever its row count, so 16-bit
    programs take 64 rows on 8 warps (a quarter of the L2 traffic of 16-row tiles when a verify pass has
    thousands of rows, about the same latency when it has few; 4 warps spilled with the next projection);
    float32 ones (the ieee dots: tests and exactness, not speed) take 16 on 4."""
    if dtype == torch.float32:
        return 16, 4
    return 64, 8


def blocks(C: int, inner: int, dtype: torch.dtype) -> tuple[int, int]:
    """(BLOCK_C, BLOCK_inner): whole rows, and inner chunks of about 8192 16-bit weights or 4096 float32 ones
    (at least 16 for tl.dot; float32 MLP chunks of 8192 spill at C = 64 with the next projection)."""
    block_c = max(16, triton.next_power_of_2(C))
    budget = 4096 if dtype == torch.float32 else 8192
    return block_c, min(max(16, triton.next_power_of_2(inner)), max(16, budget // block_c))


def _launch(kernel, x, y, weights, biases, norm_weight, norm_bias, eps, inner: int, next_weight, next_bias, next_out):
    C = x.shape[-1]
    x2, y2, s, h = residual_rows(x, y)
    N = x2.shape[0]
    if N == 0:
        return s, h
    block_c, block_i = blocks(C, inner, x.dtype)
    block_m, num_warps = rows_per_program(x.dtype)
    q3 = 0 if next_weight is None else next_weight.shape[0]
    q2 = x2 if next_out is None else next_out.view(N, q3)
    dummy = x2
    kernel[(triton.cdiv(N, block_m),)](
        x2, y2, *weights, *(b if b is not None else dummy for b in biases),
        norm_weight if norm_weight is not None else dummy, norm_bias if norm_bias is not None else dummy,
        s.view(N, C), h.view(N, C), next_weight if next_weight is not None else dummy,
        next_bias if next_bias is not None else dummy, q2,
        N, x2.stride(0), y2.stride(0), norm_weight.stride(0) if norm_weight is not None else 0, q2.stride(0),
        float(eps), C, inner, block_m, block_c, block_i,
        HAS_BIAS=biases[0] is not None, HAS_W=norm_weight is not None, HAS_B=norm_bias is not None, Q3=q3,
        BLOCK_Q=blocks(C, max(q3, 1), x.dtype)[1], HAS_QB=next_bias is not None,
        DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32", num_warps=num_warps, **pdl_meta(x.device),
        maxnreg=192 if x.dtype == torch.float32 else None,  # ptxas 3.9 held a float32 variant to 80 and spilled
    )
    return s, h


def linear_launch(x, y, weight, bias, norm_weight, norm_bias, eps, next_weight=None, next_bias=None, next_out=None):
    """Launch the projection's kernel (no input checks): (s, LayerNorm(s)), s = x + linear(y), like x; writes
    ``next_out`` when ``next_weight`` is given."""
    return _launch(_linear_add_norm_kernel, x, y, (weight,), (bias,), norm_weight, norm_bias, eps, y.shape[-1],
                   next_weight, next_bias, next_out)


def mlp_launch(x, h, fc_weight, fc_bias, proj_weight, proj_bias, norm_weight, norm_bias, eps, next_weight=None,
               next_bias=None, next_out=None):
    """Launch the MLP's kernel (no input checks): (s, LayerNorm(s)), s = x + mlp(h), like x; writes
    ``next_out`` when ``next_weight`` is given."""
    return _launch(_mlp_add_norm_kernel, x, h, (fc_weight, proj_weight), (fc_bias, proj_bias), norm_weight,
                   norm_bias, eps, fc_weight.shape[0], next_weight, next_bias, next_out)


def linear_add_norm(x, y, weight, bias=None, norm_weight=None, norm_bias=None, eps=1e-5, *, next_weight=None,
                    next_bias=None, next_out=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual sum ``s = x + F.linear(y, weight, bias)`` and ``F.layer_norm(s, (C,), norm_weight,
    norm_bias, eps)``.

    x: (..., C) float32/float16/bfloat16 with C <= 256; y: (..., K) like x's leading dims and dtype;
    weight: contiguous (C, K); bias, norm_bias: (C,) or None; norm_weight: (C,) (may be a stride-0
    expansion of one gain) or None. Returns s and its LayerNorm, (..., C) each in x's dtype, from the
    ``sigmafast::linear_add_norm`` op. With ``next_weight`` (contiguous (Q, C), the next block's QKV
    projection) and ``next_bias`` ((Q,) or None), also writes ``F.linear(LayerNorm(s), next_weight,
    next_bias)`` into ``next_out`` ((..., Q), rows of one stride).
    """
    norm_bias = check_linear_add_norm(x, y, weight, bias, norm_weight, norm_bias, eps, next_weight, next_bias,
                                      next_out, **LIMITS)
    from . import ops  # noqa: F401  (registers torch.ops.sigmafast.*)

    return torch.ops.sigmafast.linear_add_norm(x, y, weight, bias, norm_weight, norm_bias, float(eps), next_weight,
                                               next_bias, next_out)


def mlp_add_norm(x, h, fc_weight, fc_bias, proj_weight, proj_bias, norm_weight=None, norm_bias=None, eps=1e-5, *,
                 next_weight=None, next_bias=None, next_out=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual sum ``s = x + F.linear(F.gelu(F.linear(h, fc_weight, fc_bias)), proj_weight, proj_bias)``
    and ``F.layer_norm(s, (C,), norm_weight, norm_bias, eps)``.

    x, h: (..., C) float32/float16/bfloat16 with C <= 256, same shape and dtype; fc_weight: contiguous
    (F, C); proj_weight: contiguous (C, F); fc_bias (F,) and proj_bias (C,) both given or both None;
    norm_weight, norm_bias and the optional next projection as in :func:`linear_add_norm`. Returns s and
    its LayerNorm, (..., C) each in x's dtype, from the ``sigmafast::mlp_add_norm`` op.
    """
    norm_bias = check_mlp_add_norm(x, h, fc_weight, fc_bias, proj_weight, proj_bias, norm_weight, norm_bias, eps,
                                   next_weight, next_bias, next_out, **LIMITS)
    from . import ops  # noqa: F401  (registers torch.ops.sigmafast.*)

    return torch.ops.sigmafast.mlp_add_norm(x, h, fc_weight, fc_bias, proj_weight, proj_bias, norm_weight,
                                            norm_bias, float(eps), next_weight, next_bias, next_out)
