"""Triton draft slots (kernels/slots.py) against kernels/reference.py.

Outputs come pre-filled with garbage (``poisoned_empty``), so a slot the kernel forgets fails. All four
outputs are exact.
"""

from __future__ import annotations

import pytest
import torch

from helpers import on_triton_device
from sigmafast.kernels import reference as ref
from sigmafast.kernels import slots

draft_slots = on_triton_device(slots.draft_slots)

# (B, T, R, known fraction)
CASES = [
    (1, 1, 1, 0.0),  # one position, unknown
    (1, 1, 1, 1.0),  # one position, known: a padding slot only
    (3, 17, 16, 0.3),  # an R bucket narrower than the canvas
    (2, 40, 40, 0.6),  # R = T: every position has a slot
    (4, 12, 5, 0.0),  # more unknown positions than slots
    (2, 8, 8, 1.0),  # every position known
    (2, 2500, 2048, 0.2),  # more than two passes of 1024 positions, unknown ones in every pass
    (3, 1500, 64, 0.97),  # few unknown positions spread over two passes, then known padding
]


def _ids(case) -> str:
    B, T, R, frac = case
    return f"B{B}-T{T}-R{R}-known{frac}"


def _inputs(case, seed: int, u_dtype):
    B, T, R, frac = case
    g = torch.Generator().manual_seed(seed)
    known = torch.rand(B, T, generator=g) < frac
    uniforms = torch.rand(B, T, generator=g, dtype=torch.float64).to(u_dtype)
    return known, uniforms, R


@pytest.mark.parametrize("u_dtype", [torch.float32, torch.float64], ids=["u32", "u64"])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_draft_slots_match_reference(case, u_dtype, poisoned_empty):
    for seed in range(2):
        known, uniforms, R = _inputs(case, seed, u_dtype)
        got = draft_slots(known, uniforms, R)
        want = ref.draft_slots(known, uniforms, R)
        for name, g, w in zip(("positions", "uniforms", "used", "remaining"), got, want):
            assert g.shape == w.shape and g.dtype == w.dtype, name
            assert torch.equal(g, w), name


def test_draft_slots_list_unknown_then_known_positions():
    """An independent check, row by row: the slots hold the unknown positions in increasing order, then the
    known ones, and the used mask and count follow the unknown positions."""
    known = torch.tensor([[True, False, True, False, False, True], [False, True, True, True, True, False]])
    uniforms = torch.arange(12, dtype=torch.float32).view(2, 6) / 12
    positions, u, used, remaining = draft_slots(known, uniforms, 4)
    assert positions.tolist() == [[1, 3, 4, 0], [0, 5, 1, 2]]
    assert torch.equal(u, uniforms.gather(1, positions))
    assert used.tolist() == [[True, True, True, False], [True, True, False, False]]
    assert remaining.tolist() == [3, 2]


def test_draft_slots_of_an_empty_batch():
    positions, u, used, remaining = draft_slots(torch.zeros(0, 5, dtype=torch.bool), torch.zeros(0, 5), 3)
    assert positions.shape == u.shape == used.shape == (0, 3) and remaining.shape == (0,)


@pytest.mark.parametrize(
    "known, uniforms, R, match",
    [
        (torch.zeros(2, 5, dtype=torch.bool), torch.zeros(2, 5), 0, "R must be an int in"),
        (torch.zeros(2, 5, dtype=torch.bool), torch.zeros(2, 5), 6, "R must be an int in"),
        (torch.zeros(2, 5, dtype=torch.bool), torch.zeros(2, 5), True, "R must be an int in"),
        (torch.zeros(2, 5, dtype=torch.bool), torch.zeros(2, 5), 2.0, "R must be an int in"),
        (torch.zeros(5, dtype=torch.bool), torch.zeros(5), 2, "known must be a"),
        (torch.zeros(2, 5, dtype=torch.uint8), torch.zeros(2, 5), 2, "known must be a"),
        (torch.zeros(2, 5, dtype=torch.bool), torch.zeros(2, 4), 2, "uniforms must be a"),
        (torch.zeros(2, 5, dtype=torch.bool), torch.zeros(2, 5, dtype=torch.float16), 2, "uniforms must be a"),
        (torch.zeros(2, 5, dtype=torch.bool), torch.zeros(5, 2).t(), 2, "unit stride"),
    ],
    ids=["R0", "R-over-T", "R-bool", "R-float", "known-1d", "known-uint8", "uniforms-shape", "uniforms-fp16",
         "uniforms-strided"],
)
def test_draft_slots_reject_bad_input(known, uniforms, R, match):
    with pytest.raises(ValueError, match=match):
        slots.draft_slots(known, uniforms, R)
