"""Triton visiting orders: the orders a burst iteration verifies its drafts along.

Each of a row's O orders visits its unknown positions by increasing random key,
then (padding up to the R bucket) its known positions in increasing order: the
first R entries of ``keys.masked_fill(known, 2.0).argsort(stable=True)``. Eagerly
that is a masked fill and a segmented sort, which on CUDA is several kernels (a
copy, an index fill, the sort). ``_visit_orders_kernel``, grid (B * O, position
tiles), is one: each program ranks its tile of positions by counting, over the
whole row, the positions that sort before each one (a smaller masked key, or the
same key and a smaller position: the stable sort's order), and writes each
position whose rank is below R at that rank. The ranks of a row are a
permutation of 0..T-1, so every one of the R steps is written exactly once.

The work is T² comparisons per order (a million for T = 1024, spread over 32
programs of 32 positions: 256 per thread), which a GPU does in about a
microsecond, against a sort of T keys. sm_90 (Triton 3.6): 124 registers, no
spills. Compiles once per keys dtype: the tiles are fixed and every size and
stride is in ``do_not_specialize``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_tensor

BLOCK_I = 32  # positions ranked per program
BLOCK_J = 64  # positions compared with them per pass
KNOWN_KEY = 2.0  # the key of a known position: after every uniform key in [0, 1)


@triton.jit(do_not_specialize=["T", "R", "O", "s_kb", "s_ko", "s_kt", "s_nb", "s_nt", "s_ob", "s_oo"])
def _visit_orders_kernel(
    KEYS, KNOWN, ORD,
    T, R, O, s_kb, s_ko, s_kt, s_nb, s_nt, s_ob, s_oo,
    TILE_I: tl.constexpr, TILE_J: tl.constexpr, FILL: tl.constexpr,
):
    i_bo = tl.program_id(0)
    i_b = (i_bo // O).to(tl.int64)
    i_o = (i_bo % O).to(tl.int64)
    p_k = KEYS + i_b * s_kb + i_o * s_ko
    p_n = KNOWN + i_b * s_nb
    o_i = tl.program_id(1) * TILE_I + tl.arange(0, TILE_I)
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


def launch(keys: torch.Tensor, known: torch.Tensor, R: int) -> torch.Tensor:
    """Launch the kernel (no input checks): (B, O, R) int64 orders."""
    B, O, T = keys.shape
    orders = torch.empty(B, O, R, dtype=torch.int64, device=keys.device)
    if B * O == 0:
        return orders
    _visit_orders_kernel[(B * O, triton.cdiv(T, BLOCK_I))](
        keys, known.view(torch.uint8), orders,
        T, R, O, *keys.stride(), *known.stride(), orders.stride(0), orders.stride(1),
        TILE_I=BLOCK_I, TILE_J=BLOCK_J, FILL=KNOWN_KEY, num_warps=4,
    )
    return orders


def visit_orders(keys: torch.Tensor, known: torch.Tensor, R: int) -> torch.Tensor:
    """The first R steps of a burst iteration's visiting orders.

    keys: (B, O, T) float32/float64 order keys in [0, 1); known: (B, T) bool (any strides);
    R: int in [1, T]. Returns (B, O, R) int64 positions: each order's unknown positions by increasing
    key (ties by position), then the row's known positions in increasing order, as
    ``keys.masked_fill(known[:, None], 2.0).argsort(-1, stable=True)[..., :R]``; from the
    ``sigmafast::visit_orders`` op.
    """
    if not isinstance(keys, torch.Tensor) or keys.ndim != 3:
        raise ValueError(f"keys must be a (B, O, T) tensor, got {getattr(keys, 'shape', type(keys).__name__)}")
    B, O, T = keys.shape
    if isinstance(R, bool) or not isinstance(R, int) or not 1 <= R <= T:
        raise ValueError(f"R must be an int in [1, T = {T}], got {R!r}")
    check_tensor("keys", keys, (B, O, T), (torch.float32, torch.float64), keys.device, unit_stride=False)
    check_tensor("known", known, (B, T), (torch.bool,), keys.device, unit_stride=False)
    from . import ops  # noqa: F401  (registers torch.ops.sigmafast.*)

    return torch.ops.sigmafast.visit_orders(keys, known, R)
