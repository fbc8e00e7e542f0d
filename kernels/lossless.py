"""Triton bookkeeping of the lossless rule: where each row's residual draw happens, and what it commits.

The lossless rule (one order) draws a residual token at each row's first rejected
step n (clamped to the last step when every step was accepted). Around that draw,
PyTorch takes about ten small ops: the clamp, the gathers of the step's slot,
position and uniform, the rejection test; then the comparison with the steps, the
``where`` that puts the residual token at step n, a cast and a sum for the
committed count. On a GPU each is a kernel of the replayed burst iteration.

``_residual_pick_kernel``, grid (row tiles, column tiles): per row, at the step
k, the residual uniform of its position and the committed count ``n + rejected``
(a row rejected when ``n < remaining``), and the two rows the residual is drawn
from, copied: the draft logits at the slot and the verifier's row (hidden state
or logits) at step k (two gathers, and on CUDA a copy: the draft row is written
with the source's padded row stride, the stride of the LM head's rows, so that
the residual sampler's q and p rows share one stride as it needs). The residual
token itself is spliced in at step n by the commit (``commit(...,
residual=, residual_step=)``), so no kernel writes the order's tokens.

Integer and copy work, so bit-identical to the reference. Compiles once per
uniforms dtype: the tiles are fixed, every size and stride is in
``do_not_specialize``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_residual_pick
from .utils import gdc_enter, jit, pdl_meta

BLOCK_B = 4  # rows per program of the pick
BLOCK_W = 1024  # row columns per program of the pick's copies

_PICK = ["B", "R", "s_ob", "s_sb", "s_ub", "W_D", "W_V", "s_db", "s_dr", "s_vb", "s_vr", "s_pd", "s_pv"]


@triton.jit
def _copy_rows(SRC, DST, o_b, m_b, row, o_w, W, s_b, s_r, s_out):
    """Columns o_w (< W) of rows ``row`` (TILE_B,) of the (B, R, W) SRC into the (B, W) rows of DST."""
    m = m_b[:, None] & (o_w < W)[None, :]
    x = tl.load(SRC + (o_b * s_b + row * s_r)[:, None] + o_w[None, :], mask=m)
    tl.store(DST + (o_b * s_out)[:, None] + o_w[None, :], x, mask=m)


@jit(do_not_specialize=_PICK, do_not_specialize_on_alignment=["N", "REM"])
def _residual_pick_kernel(
    N, REM, ORD, SLOT, U, DRAFT, VERIFIER, U_OUT, N_OUT, D_OUT, V_OUT,
    B, R, s_ob, s_sb, s_ub, W_D, W_V, s_db, s_dr, s_vb, s_vr, s_pd, s_pv,
    TILE_B: tl.constexpr, TILE_W: tl.constexpr, USE_GDC: tl.constexpr,
):
    gdc_enter(USE_GDC)
    o_b = tl.program_id(0).to(tl.int64) * TILE_B + tl.arange(0, TILE_B).to(tl.int64)
    m_b = o_b < B
    b_n = tl.load(N + o_b, mask=m_b, other=0).to(tl.int64)
    b_k = tl.minimum(b_n, R - 1)  # the rejected step, or the last one when none was
    b_slot = tl.load(SLOT + o_b * s_sb + b_k, mask=m_b, other=0).to(tl.int64)
    if tl.program_id(1) == 0:
        b_pos = tl.load(ORD + o_b * s_ob + b_k, mask=m_b, other=0).to(tl.int64)
        b_u = tl.load(U + o_b * s_ub + b_pos, mask=m_b, other=0.0)
        b_rej = b_n < tl.load(REM + o_b, mask=m_b, other=0).to(tl.int64)
        tl.store(U_OUT + o_b, b_u, mask=m_b)
        tl.store(N_OUT + o_b, b_n + b_rej.to(tl.int64), mask=m_b)
    o_w = tl.program_id(1).to(tl.int64) * TILE_W + tl.arange(0, TILE_W).to(tl.int64)
    _copy_rows(DRAFT, D_OUT, o_b, m_b, b_slot, o_w, W_D, s_db, s_dr, s_pd)
    _copy_rows(VERIFIER, V_OUT, o_b, m_b, b_k, o_w, W_V, s_vb, s_vr, s_pv)


def rows_like(src: torch.Tensor) -> torch.Tensor:
    """Empty (B, W) rows for rows of the (B, R, W) ``src``, with its row stride when its rows are unit-stride
    views of a padded buffer (as the LM head's logits are), else contiguous."""
    B, _, W = src.shape
    stride = src.stride(1) if src.stride(-1) == 1 and src.stride(1) >= W else W
    return torch.empty(B, stride, dtype=src.dtype, device=src.device)[:, :W]


def pick_launch(n, remaining, orders, slots, u_residual, drafts, verifier):
    """Launch the pick (no checks): at step k, the uniform of its position and the committed count, (B,) each,
    then the draft row at its slot (B, V) and the verifier's row at k (B, X)."""
    B, R = orders.shape
    device = orders.device
    u = torch.empty(B, dtype=u_residual.dtype, device=device)
    n_commit = torch.empty(B, dtype=torch.int64, device=device)
    d_row, v_row = rows_like(drafts), rows_like(verifier)
    if B == 0:
        return u, n_commit, d_row, v_row
    n, remaining = n.contiguous(), remaining.contiguous()  # read at row b
    drafts, verifier = (t if t.stride(-1) == 1 else t.contiguous() for t in (drafts, verifier))
    W_D, W_V = drafts.shape[2], verifier.shape[2]
    grid = (triton.cdiv(B, BLOCK_B), max(1, triton.cdiv(max(W_D, W_V), BLOCK_W)))
    _residual_pick_kernel[grid](
        n, remaining, orders, slots, u_residual, drafts, verifier, u, n_commit,
        d_row, v_row, B, R, orders.stride(0), slots.stride(0), u_residual.stride(0), W_D, W_V,
        *drafts.stride()[:2], *verifier.stride()[:2], d_row.stride(0), v_row.stride(0),
        TILE_B=BLOCK_B, TILE_W=BLOCK_W, num_warps=4, **pdl_meta(orders.device),
    )
    return u, n_commit, d_row, v_row


def residual_pick(n, remaining, orders, slots, u_residual, drafts, verifier):
    """Where the lossless rule draws each row's residual token, and the two rows it draws it from.

    n, remaining: (B,) int64, a row's accepted and remaining counts; orders, slots: (B, R) int64, the
    order's positions and the drafts' slots by step; u_residual: (B, T) float32/float64 by position;
    drafts: (B, R', V) the draft logits by slot; verifier: (B, R, X) the verifier's outputs by step
    (hidden states or logits). At step k = min(n, R - 1), returns the uniform of its position (B,), the
    committed count n + rejected (B,) int64 (rejected: n < remaining; the residual token then goes at step
    n), the draft logits at its slot (B, V) and the verifier's row at k (B, X), the rows with their source's
    row stride when it is padded; from the ``sigmafast::residual_pick`` op.
    """
    check_residual_pick(n, remaining, orders, slots, u_residual, drafts, verifier)
    from . import ops  # noqa: F401  (registers torch.ops.sigmafast.*)

    return torch.ops.sigmafast.residual_pick(n, remaining, orders, slots, u_residual, drafts, verifier)
