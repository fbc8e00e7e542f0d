"""Triton drafts along the visiting orders: each order step's draft token, log-prob, uniform and slot.

A burst iteration samples one draft per queried position (R slots, in the order
of ``positions``) and then reads them along each of O visiting orders. Eagerly
that is a scatter of the tokens into the canvas, a zeroed log-prob row and its
scatter, and three gathers along the orders (tokens, log-probs, uniforms), plus
a comparison, a cast and an argmax to find the lossless residual's slot: up to
nine small kernels. ``_gather_drafts_kernel``, grid (B, step tiles), does it in
one: each program writes its row's position -> slot map into a scratch row
(every program of a row writes the same values, so the races are benign),
synchronises its threads, then reads each step's position, known bit, canvas
token, uniform and (at an unknown position) the draft of its slot.

A step at a known position (the padding of the orders after a row's remaining
positions) gets the canvas token, log-prob 0 and slot 0; those steps are never
accepted. Compiles once per dtype set: the tiles are fixed, every size and
stride is in ``do_not_specialize``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_gather_drafts
from .utils import gdc_enter, pdl_meta

BLOCK_R = 256  # slots written per pass
BLOCK_S = 256  # order steps per program

_SIZES = ["T", "R", "O", "S", "s_pb", "s_tb", "s_lb", "s_cb", "s_kb", "s_ub", "s_ob", "s_oo", "s_os"]


@triton.jit(do_not_specialize=_SIZES)
def _gather_drafts_kernel(
    POS, TOK, LOGP, CANVAS, KNOWN, U, ORD, SCRATCH, TOK_O, LOGP_O, U_O, SLOT_O,
    T, R, O, S, s_pb, s_tb, s_lb, s_cb, s_kb, s_ub, s_ob, s_oo, s_os,
    TILE_R: tl.constexpr, TILE_S: tl.constexpr, USE_GDC: tl.constexpr,
):
    gdc_enter(USE_GDC)
    i_b = tl.program_id(0).to(tl.int64)
    p_map = SCRATCH + i_b * T
    for r0 in range(0, R, TILE_R):
        o_r = r0 + tl.arange(0, TILE_R)
        m_r = o_r < R
        b_pos = tl.load(POS + i_b * s_pb + o_r.to(tl.int64), mask=m_r, other=0)
        tl.store(p_map + b_pos, o_r, mask=m_r)
    tl.debug_barrier()  # this program's own map writes are visible to all its threads

    o_i = tl.program_id(1) * TILE_S + tl.arange(0, TILE_S)  # flat (order, step) index, int32
    m_i = o_i < O * S
    o_o = (o_i // S).to(tl.int64)
    o_s = (o_i % S).to(tl.int64)
    b_p = tl.load(ORD + i_b * s_ob + o_o * s_oo + o_s * s_os, mask=m_i, other=0).to(tl.int64)
    b_known = tl.load(KNOWN + i_b * s_kb + b_p, mask=m_i, other=1) != 0
    m_draft = m_i & ~b_known
    b_slot = tl.load(p_map + b_p, mask=m_draft, other=0)
    b_slot = tl.minimum(tl.maximum(b_slot, 0), R - 1).to(tl.int64)  # in bounds whatever the map held
    b_tok = tl.where(b_known, tl.load(CANVAS + i_b * s_cb + b_p, mask=m_i & b_known, other=0),
                     tl.load(TOK + i_b * s_tb + b_slot, mask=m_draft, other=0))
    b_lp = tl.load(LOGP + i_b * s_lb + b_slot, mask=m_draft, other=0.0)
    b_u = tl.load(U + i_b * s_ub + b_p, mask=m_i, other=0.0)
    o_out = i_b * O * S + o_i.to(tl.int64)
    tl.store(TOK_O + o_out, b_tok, mask=m_i)
    tl.store(LOGP_O + o_out, b_lp, mask=m_i)
    tl.store(U_O + o_out, b_u, mask=m_i)
    tl.store(SLOT_O + o_out, b_slot, mask=m_i)  # 0 at a known position (masked load)


def launch(positions, tokens, logp, canvas, known, uniforms, orders):
    """Launch the kernel (no input checks): (tok_o, logp_o, u_o, slot_o), (B, O, S) each."""
    B, O, S = orders.shape
    T, R = canvas.shape[1], positions.shape[1]
    device = orders.device
    tok_o = torch.empty(B, O, S, dtype=tokens.dtype, device=device)
    logp_o = torch.empty(B, O, S, dtype=logp.dtype, device=device)
    u_o = torch.empty(B, O, S, dtype=uniforms.dtype, device=device)
    slot_o = torch.empty(B, O, S, dtype=torch.int64, device=device)
    if B * O * S == 0:
        return tok_o, logp_o, u_o, slot_o
    scratch = torch.empty(B, T, dtype=torch.int32, device=device)
    _gather_drafts_kernel[(B, triton.cdiv(O * S, BLOCK_S))](
        positions, tokens, logp, canvas, known.view(torch.uint8), uniforms, orders, scratch,
        tok_o, logp_o, u_o, slot_o,
        T, R, O, S, positions.stride(0), tokens.stride(0), logp.stride(0), canvas.stride(0), known.stride(0),
        uniforms.stride(0), *orders.stride(), TILE_R=BLOCK_R, TILE_S=BLOCK_S, num_warps=4, **pdl_meta(positions.device),
    )
    return tok_o, logp_o, u_o, slot_o


def gather_drafts(positions, tokens, logp, canvas, known, uniforms, orders):
    """The drafts of a burst iteration read along its visiting orders.

    positions: (B, R) the queried positions (every unknown position of a row among them), tokens: (B, R)
    int64 and logp: (B, R) float their drafts and log-probs; canvas: (B, T) int64, known: (B, T) bool,
    uniforms: (B, T) float by position; orders: (B, O, S) positions. Returns (B, O, S) each: the draft
    token (the canvas token at a known position), its log-prob (0 at a known position), the uniform at
    the position and the draft's slot in ``positions`` (0 at a known position); from the
    ``sigmafast::gather_drafts`` op.
    """
    check_gather_drafts(positions, tokens, logp, canvas, known, uniforms, orders)
    from . import ops  # noqa: F401  (registers torch.ops.sigmafast.*)

    return torch.ops.sigmafast.gather_drafts(positions, tokens, logp, canvas, known, uniforms, orders)
