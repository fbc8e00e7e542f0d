"""Triton bookkeeping of the lossless rule: where each row's residual draw happens, and its splice.

The lossless rule (one order) draws a residual token at each row's first rejected
step n (clamped to the last step when every step was accepted). Around that draw,
PyTorch takes about ten small ops: the clamp, the gathers of the step's slot,
position and uniform, the rejection test; then the comparison with the steps, the
``where`` that puts the residual token at step n, a cast and a sum for the
committed count. On a GPU each is a kernel of the replayed burst iteration.

* ``_residual_pick_kernel``, grid (row tiles,): per row, the step k, its draft's
  slot, the residual uniform at its position and whether the row rejected;
* ``_residual_splice_kernel``, grid (rows, step tiles): the order's tokens with
  the residual token at step n, and (row tile 0) the committed counts
  ``n + rejected``.

Both are integer and copy work, so they are bit-identical to the references.
Compile once per uniforms dtype: the tiles are fixed, every size and stride is in
``do_not_specialize``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_int, check_tensor

BLOCK_B = 64  # rows per program of the pick
BLOCK_R = 256  # steps per program of the splice

_PICK = ["B", "R", "s_ob", "s_sb", "s_ub"]
_SPLICE = ["R", "s_tb"]


@triton.jit(do_not_specialize=_PICK, do_not_specialize_on_alignment=["N", "REM"])
def _residual_pick_kernel(
    N, REM, ORD, SLOT, U, K_OUT, SLOT_OUT, U_OUT, REJ_OUT,
    B, R, s_ob, s_sb, s_ub,
    TILE_B: tl.constexpr,
):
    o_b = tl.program_id(0).to(tl.int64) * TILE_B + tl.arange(0, TILE_B).to(tl.int64)
    m_b = o_b < B
    b_n = tl.load(N + o_b, mask=m_b, other=0).to(tl.int64)
    b_k = tl.minimum(b_n, R - 1)  # the rejected step, or the last one when none was
    b_slot = tl.load(SLOT + o_b * s_sb + b_k, mask=m_b, other=0)
    b_pos = tl.load(ORD + o_b * s_ob + b_k, mask=m_b, other=0).to(tl.int64)
    b_u = tl.load(U + o_b * s_ub + b_pos, mask=m_b, other=0.0)
    b_rej = b_n < tl.load(REM + o_b, mask=m_b, other=0).to(tl.int64)
    tl.store(K_OUT + o_b, b_k, mask=m_b)
    tl.store(SLOT_OUT + o_b, b_slot.to(tl.int64), mask=m_b)
    tl.store(U_OUT + o_b, b_u, mask=m_b)
    tl.store(REJ_OUT + o_b, b_rej.to(tl.uint8), mask=m_b)


@triton.jit(do_not_specialize=_SPLICE, do_not_specialize_on_alignment=["N", "RTOK", "REJ"])
def _residual_splice_kernel(
    TOK, N, RTOK, REJ, TOK_OUT, N_OUT,
    R, s_tb,
    TILE_R: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    o_r = tl.program_id(1).to(tl.int64) * TILE_R + tl.arange(0, TILE_R).to(tl.int64)
    m_r = o_r < R
    n = tl.load(N + i_b).to(tl.int64)
    b_tok = tl.load(TOK + i_b * s_tb + o_r, mask=m_r, other=0)
    b_tok = tl.where(o_r == n, tl.load(RTOK + i_b), b_tok)  # step n: the rejected one, or past the commit
    tl.store(TOK_OUT + i_b * R + o_r, b_tok, mask=m_r)
    if tl.program_id(1) == 0:
        tl.store(N_OUT + i_b, n + tl.load(REJ + i_b).to(tl.int64))


def pick_launch(n, remaining, orders, slots, u_residual):
    """Launch the pick (no checks): (k, slot at k, uniform at k's position, rejected), (B,) each."""
    B, R = orders.shape
    device = orders.device
    k = torch.empty(B, dtype=torch.int64, device=device)
    slot = torch.empty(B, dtype=torch.int64, device=device)
    u = torch.empty(B, dtype=u_residual.dtype, device=device)
    rejected = torch.empty(B, dtype=torch.bool, device=device)
    if B == 0:
        return k, slot, u, rejected
    n, remaining = n.contiguous(), remaining.contiguous()  # read at row b
    _residual_pick_kernel[(triton.cdiv(B, BLOCK_B),)](
        n, remaining, orders, slots, u_residual, k, slot, u, rejected.view(torch.uint8),
        B, R, orders.stride(0), slots.stride(0), u_residual.stride(0), TILE_B=BLOCK_B, num_warps=2,
    )
    return k, slot, u, rejected


def splice_launch(tokens, n, r_tok, rejected):
    """Launch the splice (no checks): tokens (B, R) with ``r_tok`` at step n, and n + rejected (B,)."""
    B, R = tokens.shape
    out = torch.empty(B, R, dtype=tokens.dtype, device=tokens.device)
    n_commit = torch.empty(B, dtype=torch.int64, device=tokens.device)
    if B == 0:
        return out, n_commit
    n, r_tok, rejected = n.contiguous(), r_tok.contiguous(), rejected.contiguous()  # read at row b
    _residual_splice_kernel[(B, triton.cdiv(R, BLOCK_R))](
        tokens, n, r_tok, rejected.view(torch.uint8), out, n_commit, R, tokens.stride(0), TILE_R=BLOCK_R,
        num_warps=4,
    )
    return out, n_commit


def residual_pick(n, remaining, orders, slots, u_residual):
    """Where the lossless rule draws each row's residual token.

    n, remaining: (B,) int64, a row's accepted and remaining counts; orders, slots: (B, R) int64, the
    order's positions and the drafts' slots by step; u_residual: (B, T) float32/float64 by position.
    Returns k = min(n, R - 1) (B,) int64, the slot at step k (B,) int64, the uniform at step k's position
    (B,) and rejected = n < remaining (B,) bool; from the ``sigmafast::residual_pick`` op.
    """
    if not isinstance(orders, torch.Tensor) or orders.ndim != 2 or orders.shape[1] < 1:
        raise ValueError(f"orders must be a (B, R) tensor with R >= 1, got "
                         f"{getattr(orders, 'shape', type(orders).__name__)}")
    B, R = orders.shape
    device = orders.device
    for name, t in (("n", n), ("remaining", remaining)):
        check_int(name, t, (B,), device)
    check_tensor("orders", orders, (B, R), (torch.int64,), device)
    check_tensor("slots", slots, (B, R), (torch.int64,), device)
    if not isinstance(u_residual, torch.Tensor) or u_residual.ndim != 2:
        raise ValueError(f"u_residual must be a (B, T) tensor, got "
                         f"{getattr(u_residual, 'shape', type(u_residual).__name__)}")
    check_tensor("u_residual", u_residual, (B, u_residual.shape[1]), (torch.float32, torch.float64), device)
    from . import ops  # noqa: F401  (registers torch.ops.sigmafast.*)

    return torch.ops.sigmafast.residual_pick(n, remaining, orders, slots, u_residual)


def residual_splice(tokens, n, r_tok, rejected):
    """The lossless commit's tokens and count: ``tokens`` (B, R) int64 with ``r_tok`` (B,) int64 at step n
    (B,) int64 (past the commit, or past R, where the row did not reject), and n + rejected (B,) int64
    (``rejected``: (B,) bool); from the ``sigmafast::residual_splice`` op."""
    if not isinstance(tokens, torch.Tensor) or tokens.ndim != 2:
        raise ValueError(f"tokens must be a (B, R) tensor, got {getattr(tokens, 'shape', type(tokens).__name__)}")
    B, R = tokens.shape
    device = tokens.device
    check_tensor("tokens", tokens, (B, R), (torch.int64,), device)
    check_int("n", n, (B,), device)
    check_int("r_tok", r_tok, (B,), device)
    check_tensor("rejected", rejected, (B,), (torch.bool,), device)
    from . import ops  # noqa: F401  (registers torch.ops.sigmafast.*)

    return torch.ops.sigmafast.residual_splice(tokens, n, r_tok, rejected)
