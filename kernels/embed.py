"""Triton σ-GPT input embedding + the first LayerNorm, fed along visiting orders, in one kernel.

Step s of a visiting order (σ_0 … σ_{S-1}) is fed the token visited before it,
at its position, and predicts position σ_s; step 0 is fed the session's last
token instead (:mod:`sigmafast.engine`). Its embedding is

    x = wte[token] + concat(pe_in[in_pos], pe_out[σ_s])          (each half C / 2)

and the first block reads ``h = ln_1(x)``. Eagerly that is two ``cat`` of the
inputs, three gathers, a ``cat``, an add and a LayerNorm: eight launch-bound
kernels per forward. ``_feed_embedding_kernel``, grid (row blocks,), does all
of it for BLOCK_N rows per program: it reads each row's token and positions
(the previous step's, or the last token's at s = 0), gathers the three table
rows, rounds the sum to the output dtype (as the eager add) and normalises it
with :func:`.layer_norm.normalize` (float32 statistics).

In a narrow model (C <= 256) the kernel may also compute the first block's QKV
projection of that LayerNorm (``next_weight``), as the sublayer-end kernels of
:mod:`.linear_norm` do for the later blocks (:func:`.linear_norm.project_rows`,
their row tiles): the block's first matmul is then no kernel of its own.

Compiles once per dtype, width, affine layout and projection: BLOCK_N and
BLOCK_C depend on C (:func:`.layer_norm.config`), or on the dtype with the
projection (:func:`.linear_norm.rows_per_program`); the row counts and every stride are in
``do_not_specialize``, the tables' row strides in units of ``STRIDE_UNIT`` (16
when the strides and half-width allow it, as in :mod:`.layer_norm`) so that the
gathered rows are read with wide loads. Token and position values are not checked (an index out
of its table is undefined behaviour, as in any gather kernel): the engine
only feeds canvas tokens and positions.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .checks import FLOAT_DTYPES
from .layer_norm import MAX_WIDTH, config, normalize
from .linear_norm import MAX_INNER, blocks, project_rows, rows_per_program
from .linear_norm import MAX_WIDTH as NEXT_MAX_WIDTH
from .step_checks import check_feed_embedding
from .utils import gdc_enter, pdl_meta


@triton.jit(do_not_specialize=["N", "G", "S", "s_ob", "s_og", "s_os", "s_tb", "s_tg", "s_ts", "s_wte", "s_pi",
                               "s_po", "s_w", "s_q"])
def _feed_embedding_kernel(
    LAST_TOK, LAST_POS, TOK, ORD, WTE, PE_IN, PE_OUT, W, B, X, H, WQ, BQ, Q,
    N, G, S, s_ob, s_og, s_os, s_tb, s_tg, s_ts, s_wte, s_pi, s_po, s_w, s_q, eps,
    C: tl.constexpr, HALF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, HAS_PE: tl.constexpr,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, STRIDE_UNIT: tl.constexpr, Q3: tl.constexpr, BLOCK_Q: tl.constexpr,
    HAS_QB: tl.constexpr, DOT_PREC: tl.constexpr, USE_GDC: tl.constexpr,
):
    gdc_enter(USE_GDC)
    s_wte, s_pi, s_po = s_wte * STRIDE_UNIT, s_pi * STRIDE_UNIT, s_po * STRIDE_UNIT  # vectorised row loads
    pid = tl.program_id(0)
    o_r = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # int32 row index math: N < 2**31 (checked by the launcher)
    m_n = o_r < N
    o_s = (o_r % S).to(tl.int64)
    o_g = ((o_r // S) % G).to(tl.int64)
    o_b = (o_r // (S * G)).to(tl.int64)
    o_n = o_r.to(tl.int64)
    m_first = o_s == 0
    m_prev = m_n & (o_s > 0)
    p_ord = ORD + o_b * s_ob + o_g * s_og
    b_out = tl.load(p_ord + o_s * s_os, mask=m_n, other=0).to(tl.int64)
    b_in = tl.where(m_first, tl.load(LAST_POS + o_b, mask=m_n & m_first, other=0),
                    tl.load(p_ord + (o_s - 1) * s_os, mask=m_prev, other=0)).to(tl.int64)
    b_tok = tl.where(m_first, tl.load(LAST_TOK + o_b, mask=m_n & m_first, other=0),
                     tl.load(TOK + o_b * s_tb + o_g * s_tg + (o_s - 1) * s_ts, mask=m_prev, other=0)).to(tl.int64)

    o_c = tl.arange(0, BLOCK_C)
    m_c = o_c < C
    m = m_n[:, None] & m_c[None, :]
    b_x = tl.load(WTE + b_tok[:, None] * s_wte + o_c[None, :], mask=m, other=0.0).to(tl.float32)
    if HAS_PE:
        m_in = o_c < HALF
        b_pi = tl.load(PE_IN + b_in[:, None] * s_pi + o_c[None, :], mask=m_n[:, None] & m_in[None, :], other=0.0)
        b_po = tl.load(PE_OUT + b_out[:, None] * s_po + (o_c - HALF)[None, :],
                       mask=m & (~m_in)[None, :], other=0.0)
        b_x = b_x + b_pi.to(tl.float32) + b_po.to(tl.float32)  # one nonzero term per column: one rounding
    b_x = b_x.to(X.dtype.element_ty)
    tl.store(X + o_n[:, None] * C + o_c[None, :], b_x, mask=m)
    b_h = normalize(b_x.to(tl.float32), o_c, W, B, s_w, eps, C, HAS_W, HAS_B).to(H.dtype.element_ty)
    tl.store(H + o_n[:, None] * C + o_c[None, :], b_h, mask=m)
    project_rows(b_h, WQ, BQ, Q, o_n, m_n, o_c, m_c, s_q, C, Q3, BLOCK_Q, HAS_QB, DOT_PREC)


def launch(last_tok, last_pos, tokens, orders, wte, pe_in, pe_out, weight, bias, eps, next_weight=None,
           next_bias=None, next_out=None):
    """Launch the kernel (no input checks): returns x and h, (B, G, S, C) each; writes ``next_out`` when
    ``next_weight`` is given."""
    B, G, S = orders.shape
    C = wte.shape[1]
    x = torch.empty(B, G, S, C, dtype=wte.dtype, device=wte.device)
    h = torch.empty_like(x)
    N = B * G * S
    if N == 0:
        return x, h
    last_tok, last_pos = last_tok.contiguous(), last_pos.contiguous()  # read at row b
    if tokens is None:  # S == 1: only the last token is fed
        tokens = orders
    q3 = 0 if next_weight is None else next_weight.shape[0]
    if q3:  # the projection's tl.dot: the sublayer ends' row tiles, 16 columns at least
        (block_n, num_warps), block_c = rows_per_program(wte.dtype), blocks(C, 1, wte.dtype)[0]
    else:
        block_n, block_c, num_warps = config(C)
    q2 = x.view(N, C) if next_out is None else next_out.view(N, q3)
    has_pe = pe_in is not None
    strides = (wte.stride(0), pe_in.stride(0), pe_out.stride(0)) if has_pe else (wte.stride(0), 0, 0)
    unit = 16 if C % 32 == 0 and all(st % 16 == 0 for st in strides) else 1
    _feed_embedding_kernel[(triton.cdiv(N, block_n),)](
        last_tok, last_pos, tokens, orders, wte, pe_in if has_pe else wte, pe_out if has_pe else wte,
        weight if weight is not None else wte, bias if bias is not None else wte, x, h,
        next_weight if q3 else wte, next_bias if next_bias is not None else wte, q2,
        N, G, S, *orders.stride(), *tokens.stride(), *(st // unit for st in strides),
        weight.stride(0) if weight is not None else 0, q2.stride(0), float(eps),
        C=C, HALF=C // 2, BLOCK_N=block_n, BLOCK_C=block_c, HAS_PE=has_pe, HAS_W=weight is not None,
        HAS_B=bias is not None, STRIDE_UNIT=unit, Q3=q3, BLOCK_Q=blocks(C, max(q3, 1), wte.dtype)[1],
        HAS_QB=next_bias is not None, DOT_PREC="ieee" if wte.dtype == torch.float32 else "tf32",
        num_warps=num_warps, maxnreg=192 if q3 and wte.dtype == torch.float32 else None, **pdl_meta(wte.device),
    )
    return x, h


def feed_embedding(
    last_tok: torch.Tensor,
    last_pos: torch.Tensor,
    tokens: Optional[torch.Tensor],
    orders: torch.Tensor,
    wte: torch.Tensor,
    pe_in: Optional[torch.Tensor],
    pe_out: Optional[torch.Tensor],
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    eps: float = 1e-5,
    *,
    next_weight: Optional[torch.Tensor] = None,
    next_bias: Optional[torch.Tensor] = None,
    next_out: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """σ-GPT's first-block input along visiting orders, and its LayerNorm.

    last_tok, last_pos: (B,) the token fed at step 0 and its position; orders: (B, G, S) the
    positions visited (predicted) by each of G groups of S steps; tokens: (B, G, S) the tokens
    at those positions (step s is fed ``tokens[..., s - 1]`` at ``orders[..., s - 1]``; the last
    step's token is never read), or None when S == 1. wte: (V, C) token embeddings; pe_in,
    pe_out: (P, C / 2) position tables, or both None (no absolute encoding); weight, bias: (C,)
    or None (weight may be a stride-0 gain). Returns ``x`` (B, G, S, C) in wte's dtype and
    ``h = F.layer_norm(x, (C,), weight, bias, eps)``, from the ``sigmafast::feed_embedding`` op. With
    ``next_weight`` (contiguous (Q, C), the first block's QKV projection; C <= 256) and ``next_bias`` ((Q,)
    or None), also writes ``F.linear(h, next_weight, next_bias)`` into ``next_out`` ((B, G, S, Q), rows of
    one stride), as ``linear_norm.linear_add_norm`` does for the later blocks.
    """
    bias = check_feed_embedding(last_tok, last_pos, tokens, orders, wte, pe_in, pe_out, weight, bias, eps,
                                next_weight, next_bias, next_out, FLOAT_DTYPES, MAX_WIDTH, NEXT_MAX_WIDTH,
                                MAX_INNER, True)
    from . import ops  # noqa: F401  (registers torch.ops.sigmafast.*)

    return torch.ops.sigmafast.feed_embedding(last_tok, last_pos, tokens, orders, wte, pe_in, pe_out, weight,
                                              bias, float(eps), next_weight, next_bias, next_out)
