"""Triton draft slots: the positions a burst iteration drafts, their uniforms, the used mask and the counts.

A burst iteration drafts at R slots: a row's unknown positions in increasing
order, then (padding up to the R bucket) its known positions in increasing
order, which is ``known.to(int8).argsort(stable=True)[:, :R]``. Eagerly that
slot list, the uniforms gathered along it, the remaining counts
``(~known).sum(1)`` and the used mask ``arange(R) < remaining`` are seven small
kernels (a cast, a sort, a gather, a not, a sum, an arange, a comparison).
``_draft_slots_kernel``, grid (B,), does them in one: a first pass over the
row's known mask counts its unknown positions; a second computes every
position's slot with two running prefix sums (unknown positions first, then
known ones) and scatters the position and its uniform to the slots below R.
Every slot gets exactly one position, so nothing is left unwritten.

Compiles once per uniforms dtype: the tile is fixed and every size and stride
is in ``do_not_specialize``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_tensor

BLOCK_T = 1024  # positions per pass


@triton.jit(do_not_specialize=["T", "R", "s_kb", "s_ub"])
def _draft_slots_kernel(
    KNOWN, U, POS, U_OUT, USED, REM,
    T, R, s_kb, s_ub,
    TILE_T: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    p_k = KNOWN + i_b * s_kb
    o_t0 = tl.arange(0, TILE_T)
    n_unknown = tl.full((), 0, tl.int32)
    for t0 in range(0, T, TILE_T):
        o_t = t0 + o_t0
        b_unk = tl.load(p_k + o_t, mask=o_t < T, other=1) == 0  # (TILE_T,) lanes past T count as known
        n_unknown += tl.sum(b_unk.to(tl.int32), 0)

    unk_before = tl.full((), 0, tl.int32)
    known_before = tl.full((), 0, tl.int32)
    o_out = i_b * R
    for t0 in range(0, T, TILE_T):
        o_t = t0 + o_t0
        m_t = o_t < T
        b_unk = tl.load(p_k + o_t, mask=m_t, other=1) == 0
        b_kn = (b_unk == 0) & m_t
        c_unk = tl.cumsum(b_unk.to(tl.int32), 0)  # inclusive prefix counts within the tile
        c_kn = tl.cumsum(b_kn.to(tl.int32), 0)
        slot = tl.where(b_unk, unk_before + c_unk - 1, n_unknown + known_before + c_kn - 1)
        m_slot = m_t & (slot < R)
        p_slot = o_out + slot.to(tl.int64)
        tl.store(POS + p_slot, o_t.to(tl.int64), mask=m_slot)
        b_u = tl.load(U + i_b * s_ub + o_t, mask=m_slot, other=0.0)
        tl.store(U_OUT + p_slot, b_u, mask=m_slot)
        unk_before += tl.sum(b_unk.to(tl.int32), 0)
        known_before += tl.sum(b_kn.to(tl.int32), 0)

    for r0 in range(0, R, TILE_T):
        o_r = r0 + o_t0
        tl.store(USED + o_out + o_r, (o_r < n_unknown).to(tl.uint8), mask=o_r < R)
    tl.store(REM + i_b, n_unknown.to(tl.int64))


def launch(known: torch.Tensor, uniforms: torch.Tensor, R: int):
    """Launch the kernel (no input checks): (positions, uniforms (B, R), used (B, R) bool, remaining (B,))."""
    B, T = known.shape
    device = known.device
    positions = torch.empty(B, R, dtype=torch.int64, device=device)
    u_out = torch.empty(B, R, dtype=uniforms.dtype, device=device)
    used = torch.empty(B, R, dtype=torch.bool, device=device)
    remaining = torch.empty(B, dtype=torch.int64, device=device)
    if B == 0:
        return positions, u_out, used, remaining
    _draft_slots_kernel[(B,)](
        known.view(torch.uint8), uniforms, positions, u_out, used.view(torch.uint8), remaining,
        T, R, known.stride(0), uniforms.stride(0), TILE_T=BLOCK_T, num_warps=4,
    )
    return positions, u_out, used, remaining


def draft_slots(known: torch.Tensor, uniforms: torch.Tensor, R: int):
    """The R draft slots of a burst iteration.

    known: (B, T) bool; uniforms: (B, T) float32/float64 by position; R: int in [1, T]. Returns
    positions (B, R) int64 (a row's unknown positions in increasing order, then its known ones), the
    uniforms at them (B, R), used (B, R) bool (slot r < the row's unknown count) and remaining (B,)
    int64 (the unknown counts); from the ``sigmafast::draft_slots`` op.
    """
    if not isinstance(known, torch.Tensor) or known.ndim != 2:
        raise ValueError(f"known must be a (B, T) tensor, got {getattr(known, 'shape', type(known).__name__)}")
    B, T = known.shape
    if isinstance(R, bool) or not isinstance(R, int) or not 1 <= R <= T:
        raise ValueError(f"R must be an int in [1, T = {T}], got {R!r}")
    check_tensor("known", known, (B, T), (torch.bool,), known.device)
    check_tensor("uniforms", uniforms, (B, T), (torch.float32, torch.float64), known.device)
    from . import ops  # noqa: F401  (registers torch.ops.sigmafast.*)

    return torch.ops.sigmafast.draft_slots(known, uniforms, R)
