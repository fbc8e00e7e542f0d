"""Triton visiting orders (kernels/visit.py) against kernels/reference.py.

Outputs come pre-filled with garbage (``poisoned_empty``), so a step the kernel forgets fails. The orders
are exact.
"""

from __future__ import annotations

import pytest
import torch

from helpers import on_triton_device
from sigmafast.kernels import reference as ref
from sigmafast.kernels import visit

visit_orders = on_triton_device(visit.visit_orders)

# (B, O, T, R, known fraction, distinct key levels or None)
CASES = [
    (1, 1, 1, 1, 0.0, None),  # one position, unknown
    (1, 1, 1, 1, 1.0, None),  # one position, known: a padding step only
    (3, 5, 17, 16, 0.3, None),  # an R bucket narrower than the canvas
    (2, 2, 40, 40, 0.6, None),  # R = T: every position has a step
    (2, 5, 200, 64, 0.0, None),  # several position tiles and comparison passes
    (3, 3, 300, 256, 0.97, None),  # few unknown positions, then known padding
    (2, 1, 8, 8, 1.0, None),  # every position known
    (2, 4, 130, 128, 0.4, 3),  # three key values only: ties broken by position
    (1, 5, 1100, 512, 0.2, None),  # the width of GPT-2's canvas
]


def _ids(case) -> str:
    B, O, T, R, frac, levels = case
    return f"B{B}-O{O}-T{T}-R{R}-known{frac}" + (f"-ties{levels}" if levels else "")


def _inputs(case, seed: int, dtype):
    B, O, T, R, frac, levels = case
    g = torch.Generator().manual_seed(seed)
    known = torch.rand(B, T, generator=g) < frac
    keys = torch.rand(B, O, T, generator=g, dtype=torch.float64)
    if levels:
        keys = (keys * levels).floor() / levels
    return keys.to(dtype), known, R


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["keys32", "keys64"])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_visit_orders_match_reference(case, dtype, poisoned_empty):
    for seed in range(2):
        keys, known, R = _inputs(case, seed, dtype)
        got = visit_orders(keys, known, R)
        want = ref.visit_orders(keys, known, R)
        assert got.shape == want.shape and got.dtype == want.dtype
        assert torch.equal(got, want)


def test_visit_orders_of_strided_views(poisoned_empty):
    """Keys and known masks as views with strides in every dimension (every other order of a larger draw,
    transposed tensors)."""
    g = torch.Generator().manual_seed(3)
    views = [
        (torch.rand(3, 10, 70, generator=g, dtype=torch.float64)[:, ::2], torch.rand(3, 70, generator=g) < 0.5),
        (torch.rand(70, 5, 3, generator=g).permute(2, 1, 0), (torch.rand(70, 3, generator=g) < 0.5).t()),
    ]
    for keys, known in views:
        assert torch.equal(visit_orders(keys, known, 32), ref.visit_orders(keys, known, 32))


def test_visit_orders_list_unknown_positions_by_key_then_known_ones():
    """An independent check: unknown positions by increasing key, equal keys by position, then the known
    positions in increasing order."""
    known = torch.tensor([[True, False, True, False, False, True]])
    keys = torch.tensor([[[0.9, 0.7, 0.1, 0.2, 0.7, 0.0], [0.5, 0.3, 0.5, 0.6, 0.1, 0.5]]])
    assert visit_orders(keys, known, 5).tolist() == [[[3, 1, 4, 0, 2], [4, 1, 3, 0, 2]]]


def test_visit_orders_of_an_empty_batch():
    assert visit_orders(torch.zeros(0, 2, 5), torch.zeros(0, 5, dtype=torch.bool), 3).shape == (0, 2, 3)


@pytest.mark.parametrize(
    "keys, known, R, match",
    [
        (torch.zeros(2, 1, 5), torch.zeros(2, 5, dtype=torch.bool), 0, "R must be an int in"),
        (torch.zeros(2, 1, 5), torch.zeros(2, 5, dtype=torch.bool), 6, "R must be an int in"),
        (torch.zeros(2, 1, 5), torch.zeros(2, 5, dtype=torch.bool), True, "R must be an int in"),
        (torch.zeros(2, 5), torch.zeros(2, 5, dtype=torch.bool), 2, "keys must be a"),
        (torch.zeros(2, 1, 5, dtype=torch.float16), torch.zeros(2, 5, dtype=torch.bool), 2, "keys must be a"),
        (torch.zeros(2, 1, 5), torch.zeros(2, 5, dtype=torch.uint8), 2, "known must be a"),
        (torch.zeros(2, 1, 5), torch.zeros(3, 5, dtype=torch.bool), 2, "known must be a"),
    ],
    ids=["R0", "R-over-T", "R-bool", "keys-2d", "keys-fp16", "known-uint8", "known-shape"],
)
def test_visit_orders_reject_bad_input(keys, known, R, match):
    with pytest.raises(ValueError, match=match):
        visit.visit_orders(keys, known, R)
