"""Triton draft slots and visiting orders: what a burst iteration drafts and the orders it verifies along.

A burst iteration drafts at R slots: a row's unknown positions in increasing
order, then (padding up to the R bucket) its known positions in increasing
order, which is ``known.to(int8).argsort(stable=True)[:, :R]``. Each of its O
orders then visits the row's unknown positions by increasing random key, and its
known positions after them: the first R entries of
``keys.masked_fill(known, 2.0).argsort(stable=True)``. Eagerly that is a cast, two
sorts, a masked fill, a gather, a not, a sum, an arange and a comparison: more
than ten kernels on CUDA. Both depend only on the known mask and the iteration's
random draws, so ``_draft_slots_kernel`` does them in one launch, over a grid of
B + B·O·⌈T / 32⌉ programs:

* programs 0..B-1 write a row's slots: a first pass over its known mask counts
  the unknown positions; a second computes every position's slot with two
  running prefix sums (unknown positions first, then known ones) and scatters
  the position and its uniform to the slots below R; then the used mask
  ``arange(R) < remaining`` and the count. Every slot gets exactly one position.
* the other programs each rank a tile of 32 positions of one order by counting,
  over the whole row, the positions that sort before each one (a smaller masked
  key, or the same key and a smaller position: the stable sort's order), and
  write each position whose rank is below R at that rank. The ranks of a row are
  a permutation of 0..T-1, so every one of the R steps is written exactly once.
  That is T² comparisons per order (a million for T = 1024, 256 per thread),
  which a GPU does in about a microsecond.

The branch is on the program id only. Compiles once per (uniforms, keys) dtype
pair: the tiles are fixed and every size and stride is in ``do_not_specialize``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_draft_slots
from .utils import gdc_enter, pdl_meta

BLOCK_T = 1024  # positions per pass of a slots program
BLOCK_I = 32  # positions ranked per orders program
BLOCK_J = 64  # positions compared with them per pass
KNOWN_KEY = 2.0  # the key of a known position: after every uniform key in [0, 1)

_SIZES = ["B", "T", "R", "O", "n_tiles", "s_nb", "s_nt", "s_ub", "s_kb", "s_ko", "s_kt", "s_ob", "s_oo"]


@triton.jit
def _slots_row(KNOWN, U, POS, U_OUT, USED, REM, i_b, T, R, s_nb, s_ub, TILE_T: tl.constexpr):
    """Row i_b's R slots: positions, their uniforms, the used mask and the unknown count."""
    p_k = KNOWN + i_b * s_nb
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


@triton.jit
def _order_tile(KEYS, KNOWN, ORD, i_b, i_o, i_t, T, R, s_nb, s_nt, s_kb, s_ko, s_kt, s_ob, s_oo,
                TILE_I: tl.constexpr, TILE_J: tl.constexpr, FILL: tl.constexpr):
    """The steps of order i_o of row i_b at which the positions of tile i_t come (those below R)."""
    p_k = KEYS + i_b * s_kb + i_o * s_ko
    p_n = KNOWN + i_b * s_nb
    o_i = i_t * TILE_I + tl.arange(0, TILE_I)
    m_i = o_i < T
    b_ki = tl.load(p_k + o_i * s_kt, mask=m_i, other=0.0)
    b_ki = tl.where(tl.load(p_n + o_i * s_nt, mask=m_i, other=0) != 0, FILL, b_ki)  # (TILE_I,) the masked keys

    rank = tl.zeros([TILE_I], tl.int32)
    for j0 in range(0, T, TILE_J):
        o_j = j0 + tl.arange(0, TILE_J)
        m_j = o_j < T
        b_kj = tl.load(p_k + o_j * s_kt, mask=m_j, other=0.0)
        b_kj = tl.where(tl.load(p_n + o_j * s_nt, mask=m_j, other=0) != 0, FILL, b_kj)  # (TILE_J,)
        less = b_kj[None, :] < b_ki[:, None]
        tie = (b_kj[None, :] == b_ki[:, None]) & (o_j[None, :] < o_i[:, None])
        before = (less | tie) & m_j[None, :]  # (TILE_I, TILE_J) position j sorts before position i
        rank += tl.sum(before.to(tl.int32), 1)
    p_o = ORD + i_b * s_ob + i_o * s_oo + rank.to(tl.int64)
    tl.store(p_o, o_i.to(tl.int64), mask=m_i & (rank < R))


@triton.jit(do_not_specialize=_SIZES)
def _draft_slots_kernel(
    KNOWN, U, KEYS, POS, U_OUT, USED, REM, ORD,
    B, T, R, O, n_tiles, s_nb, s_nt, s_ub, s_kb, s_ko, s_kt, s_ob, s_oo,
    TILE_T: tl.constexpr, TILE_I: tl.constexpr, TILE_J: tl.constexpr, FILL: tl.constexpr, USE_GDC: tl.constexpr,
):
    gdc_enter(USE_GDC)
    pid = tl.program_id(0)
    if pid < B:
        _slots_row(KNOWN, U, POS, U_OUT, USED, REM, pid.to(tl.int64), T, R, s_nb, s_ub, TILE_T)
    else:
        i_q = pid - B  # (row, order, position tile), tiles fastest
        i_bo = i_q // n_tiles
        _order_tile(KEYS, KNOWN, ORD, (i_bo // O).to(tl.int64), (i_bo % O).to(tl.int64), i_q % n_tiles, T, R,
                    s_nb, s_nt, s_kb, s_ko, s_kt, s_ob, s_oo, TILE_I, TILE_J, FILL)


def launch(known: torch.Tensor, uniforms: torch.Tensor, keys: torch.Tensor, R: int):
    """Launch the kernel (no input checks): positions, uniforms (B, R), used (B, R) bool, remaining (B,) and
    orders (B, O, R)."""
    B, T = known.shape
    O = keys.shape[1]
    device = known.device
    positions = torch.empty(B, R, dtype=torch.int64, device=device)
    u_out = torch.empty(B, R, dtype=uniforms.dtype, device=device)
    used = torch.empty(B, R, dtype=torch.bool, device=device)
    remaining = torch.empty(B, dtype=torch.int64, device=device)
    orders = torch.empty(B, O, R, dtype=torch.int64, device=device)
    if B == 0:
        return positions, u_out, used, remaining, orders
    n_tiles = triton.cdiv(T, BLOCK_I)
    _draft_slots_kernel[(B + B * O * n_tiles,)](
        known.view(torch.uint8), uniforms, keys, positions, u_out, used.view(torch.uint8), remaining, orders,
        B, T, R, O, n_tiles, *known.stride(), uniforms.stride(0), *keys.stride(), orders.stride(0), orders.stride(1),
        TILE_T=BLOCK_T, TILE_I=BLOCK_I, TILE_J=BLOCK_J, FILL=KNOWN_KEY, num_warps=4, **pdl_meta(known.device),
    )
    return positions, u_out, used, remaining, orders


def draft_slots(known: torch.Tensor, uniforms: torch.Tensor, keys: torch.Tensor, R: int):
    """The R draft slots of a burst iteration and its O visiting orders.

    known: (B, T) bool (unit inner stride); uniforms: (B, T) float32/float64 by position (unit inner stride);
    keys: (B, O, T) float32/float64 order keys in [0, 1) (any strides); R: int in [1, T]. Returns

    - positions (B, R) int64: a row's unknown positions in increasing order, then its known ones;
    - the uniforms at them (B, R);
    - used (B, R) bool: slot r < the row's unknown count;
    - remaining (B,) int64: the unknown counts;
    - orders (B, O, R) int64: each order's unknown positions by increasing key (ties by position), then the
      row's known positions in increasing order, as ``keys.masked_fill(known[:, None], 2.0)
      .argsort(-1, stable=True)[..., :R]``;

    from the ``sigmafast::draft_slots`` op.
    """
    check_draft_slots(known, uniforms, keys, R)
    from . import ops  # noqa: F401  (registers torch.ops.sigmafast.*)

    return torch.ops.sigmafast.draft_slots(known, uniforms, keys, R)
