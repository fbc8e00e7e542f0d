"""Triton step flag: the non-finite check of a step's outputs in one kernel.

A burst iteration checks that its draft logits and verifier outputs are usable
(``reference.nonfinite``: a row max, a subtraction, a comparison, the used mask,
an ``any``; then an ``or`` of the two checks). An autoregressive step checks
its logits the same way. Each op is a kernel launch in a replayed CUDA graph,
where launches, not bytes, set a small model's step time; here the group is one
kernel (and the burst status that reads the flag is written by the commit,
:mod:`.commit_step`). The engine's steps fold the checks further:
the logits they sample are checked by the sampling kernel itself
(``sampling.sample(..., used=, flag=)``: from each row's total, with no second
read), and the verifier's rows by the decisions' kernel (a NaN ratio q/p,
``decide``); this kernel checks the verifier's outputs of greedy and traced steps.

``_flag_nonfinite_kernel``, grid (row blocks,): BLOCK_M rows per program, each
read in BLOCK_N-wide tiles; NaN is counted as +inf (explicitly: ``tl.maximum``
may drop NaNs on the GPU), so a row is bad exactly when its max is ±inf, as in
the reference. Rows that are not used are never read. The rows are addressed
through up to three leading dimensions with their own strides, for ``values``
and for the ``used`` mask alike, so a slice of a padded logits buffer and a
broadcast mask (0 strides) are read in place. A program that finds a bad row
stores True into the flag (racing programs store the same value); nothing
clears it, and nothing is read on the host.

Compiles once per values dtype and width class: the tiles depend on the width
N only (BLOCK_N = the next power of two in [128, 4096]), and ``STRIDE_UNIT`` is
16 when N and the row strides are multiples of 16 (as in :mod:`.utils`), so
that the loads stay vectorised; every size and stride is in
``do_not_specialize``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from .checks import FLOAT_DTYPES
from .step_checks import check_flag_nonfinite
from .utils import gdc_enter, jit, pdl_meta

_SIZES = ["M", "D1", "D2", "N", "s_x0", "s_x1", "s_x2", "s_u0", "s_u1", "s_u2"]


@jit(do_not_specialize=_SIZES, do_not_specialize_on_alignment=["USED", "FLAG"])
def _flag_nonfinite_kernel(
    X, USED, FLAG,
    M, D1, D2, N, s_x0, s_x1, s_x2, s_u0, s_u1, s_u2,
    HAS_USED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STRIDE_UNIT: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    gdc_enter(USE_GDC)
    N = N * STRIDE_UNIT  # N and the row strides in units of STRIDE_UNIT elements (see utils)
    s_x0, s_x1, s_x2 = s_x0 * STRIDE_UNIT, s_x1 * STRIDE_UNIT, s_x2 * STRIDE_UNIT
    o_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    m_m = o_m < M
    i_2 = o_m % D2  # row -> (i_0, i_1, i_2) over the (D0, D1, D2) leading dims
    i_1 = (o_m // D2) % D1
    i_0 = o_m // D2 // D1
    if HAS_USED:
        m_m = m_m & (tl.load(USED + i_0 * s_u0 + i_1 * s_u1 + i_2 * s_u2, mask=m_m, other=0) != 0)
    p_x = X + (i_0 * s_x0 + i_1 * s_x1 + i_2 * s_x2)[:, None]
    b_max = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    for n0 in range(0, N, BLOCK_N):
        o_n = n0 + tl.arange(0, BLOCK_N)
        m = m_m[:, None] & (o_n < N)[None, :]
        b_x = tl.load(p_x + o_n[None, :], mask=m, other=float("-inf")).to(tl.float32)
        b_x = tl.where(b_x != b_x, float("inf"), b_x)  # NaN counts as +inf
        b_max = tl.maximum(b_max, tl.max(b_x, 1))
    b_bad = m_m & ((b_max == float("inf")) | (b_max == float("-inf")))
    hit = tl.max(b_bad.to(tl.int32), 0)
    tl.store(FLAG, hit.to(tl.uint8), mask=hit > 0)


def config(N: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): row tiles of about 4096 elements, a function of the width only."""
    block_n = min(max(triton.next_power_of_2(N), 128), 4096)
    return max(1, min(4096 // block_n, 32)), block_n, 4


def _leading(values: torch.Tensor, used: Optional[torch.Tensor]):
    """The leading dims of values as at most 3 (size, values stride, used stride) triples, outermost first
    (size-1 dims dropped, adjacent dims merged where both layouts allow); None when more than 3 remain."""
    lead = values.shape[:-1]
    u_strides = used.expand(lead).stride() if used is not None else (0,) * len(lead)
    dims = [(n, s, u) for n, s, u in zip(lead, values.stride()[:-1], u_strides) if n != 1]
    merged: list = []
    for n, s, u in dims:
        if merged and merged[-1][1] == s * n and merged[-1][2] == u * n:
            n0 = merged.pop()[0]
            merged.append((n0 * n, s, u))
        else:
            merged.append((n, s, u))
    return merged if len(merged) <= 3 else None


def launch(values: torch.Tensor, used: Optional[torch.Tensor], flag: torch.Tensor) -> None:
    """Launch the non-finite kernel (no input checks): sets ``flag`` in place."""
    N = values.shape[-1]
    M = math.prod(values.shape[:-1])
    if M == 0:
        return
    if values.stride(-1) != 1 and N > 1:
        values = values.contiguous()
    dims = _leading(values, used)
    if dims is None:  # more than 3 leading dims that do not merge: rows of a copy
        lead = values.shape[:-1]
        used = None if used is None else used.expand(lead).reshape(-1)
        values = values.reshape(-1, N)
        dims = _leading(values, used)
    dims = [(1, 0, 0)] * (3 - len(dims)) + dims
    (_, s_x0, s_u0), (D1, s_x1, s_u1), (D2, s_x2, s_u2) = dims
    unit = 16 if N % 16 == 0 and s_x0 % 16 == 0 and s_x1 % 16 == 0 and s_x2 % 16 == 0 else 1
    block_m, block_n, num_warps = config(N)
    u = used.view(torch.uint8) if used is not None else flag.view(torch.uint8)
    _flag_nonfinite_kernel[(triton.cdiv(M, block_m),)](
        values, u, flag.view(torch.uint8),
        M, D1, D2, N // unit, s_x0 // unit, s_x1 // unit, s_x2 // unit, s_u0, s_u1, s_u2,
        HAS_USED=used is not None, BLOCK_M=block_m, BLOCK_N=block_n, STRIDE_UNIT=unit, num_warps=num_warps,
        **pdl_meta(values.device),
    )


def flag_nonfinite(values: torch.Tensor, used: Optional[torch.Tensor], flag: torch.Tensor) -> None:
    """Set ``flag`` to True, in place, when ``reference.nonfinite(values, used)``; never clear it.

    values: (..., N) float32/float16/bfloat16, N >= 1, read in place with any leading strides (e.g. a
    ``[..., :V]`` slice of a padded buffer; only a non-unit inner stride is copied); used: None (every
    row) or a bool tensor broadcastable to values' leading dims (e.g. (B, 1, R) for values (B, O, R, C));
    flag: () bool. A used row is bad when
    it holds a NaN or +inf, or has no finite entry. ``sigmafast::flag_nonfinite`` op (no host sync).
    """
    check_flag_nonfinite(values, used, flag, FLOAT_DTYPES)
    from . import ops  # noqa: F401  (registers torch.ops.sigmafast.*)

    torch.ops.sigmafast.flag_nonfinite(values, used, flag)
