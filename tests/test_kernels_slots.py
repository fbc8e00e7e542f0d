"""Triton draft slots and visiting orders (kernels/slots.py) against kernels/reference.py.

Outputs come pre-filled with garbage (``poisoned_empty``), so a slot or step the kernel forgets fails. All five
outputs are exact.
"""

from __future__ import annotations

import pytest
import torch

from helpers import on_triton_device
from sigmafast.kernels import reference as ref
from sigmafast.kernels import slots

draft_slots = on_triton_device(slots.draft_slots)
NAMES = ("positions", "uniforms", "used", "remaining", "orders")

# (B, O, T, R, known fraction, distinct key levels or None)
CASES = [
    (1, 1, 1, 1, 0.0, None),  # one position, unknown
    (1, 1, 1, 1, 1.0, None),  # one position, known: a padding slot and step only
    (3, 5, 17, 16, 0.3, None),  # an R bucket narrower than the canvas
    (2, 2, 40, 40, 0.6, None),  # R = T: every position has a slot and a step
    (4, 3, 12, 5, 0.0, None),  # more unknown positions than slots
    (2, 1, 8, 8, 1.0, None),  # every position known
    (2, 5, 200, 64, 0.0, None),  # several position tiles and comparison passes
    (3, 3, 300, 256, 0.97, None),  # few unknown positions, then known padding
    (2, 4, 130, 128, 0.4, 3),  # three key values only: ties broken by position
]
# long canvases: T² comparisons per order in the interpreter, so one dtype pair and one draw each
LONG_CASES = [
    (1, 5, 1100, 512, 0.2, None),  # the width of GPT-2's canvas
    (2, 1, 2500, 2048, 0.2, None),  # more than two slot passes of 1024 positions, unknown ones in every pass
    (3, 1, 1500, 64, 0.97, None),  # few unknown positions spread over two passes, then known padding
]
DTYPES = [(torch.float32, torch.float32), (torch.float64, torch.float64), (torch.float32, torch.float64)]


def _ids(case) -> str:
    B, O, T, R, frac, levels = case
    return f"B{B}-O{O}-T{T}-R{R}-known{frac}" + (f"-ties{levels}" if levels else "")


def _inputs(case, seed: int, dtypes):
    B, O, T, R, frac, levels = case
    g = torch.Generator().manual_seed(seed)
    known = torch.rand(B, T, generator=g) < frac
    uniforms = torch.rand(B, T, generator=g, dtype=torch.float64).to(dtypes[0])
    keys = torch.rand(B, O, T, generator=g, dtype=torch.float64)
    if levels:
        keys = (keys * levels).floor() / levels
    return known, uniforms, keys.to(dtypes[1]), R


def _assert_equal(got, want):
    assert len(got) == len(want) == len(NAMES)
    for name, g, w in zip(NAMES, got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        assert torch.equal(g, w), name


@pytest.mark.parametrize("dtypes", DTYPES, ids=["f32", "f64", "u32-keys64"])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_draft_slots_match_reference(case, dtypes, poisoned_empty):
    for seed in range(2):
        known, uniforms, keys, R = _inputs(case, seed, dtypes)
        _assert_equal(draft_slots(known, uniforms, keys, R), ref.draft_slots(known, uniforms, keys, R))


@pytest.mark.parametrize("case", LONG_CASES, ids=_ids)
def test_draft_slots_of_long_canvases_match_reference(case, poisoned_empty):
    known, uniforms, keys, R = _inputs(case, 0, DTYPES[1])
    _assert_equal(draft_slots(known, uniforms, keys, R), ref.draft_slots(known, uniforms, keys, R))


def test_visiting_orders_of_strided_keys(poisoned_empty):
    """Keys as views with strides in every dimension (every other order of a larger draw, a permuted tensor)."""
    g = torch.Generator().manual_seed(3)
    known = torch.rand(3, 70, generator=g) < 0.5
    uniforms = torch.rand(3, 70, generator=g)
    for keys in (torch.rand(3, 10, 70, generator=g, dtype=torch.float64)[:, ::2],
                 torch.rand(70, 5, 3, generator=g).permute(2, 1, 0)):
        _assert_equal(draft_slots(known, uniforms, keys, 32), ref.draft_slots(known, uniforms, keys, 32))


def test_draft_slots_list_unknown_then_known_positions():
    """An independent check, row by row: the slots hold the unknown positions in increasing order, then the
    known ones, and the used mask and count follow the unknown positions; each order lists the unknown
    positions by increasing key (equal keys by position), then the known positions in increasing order."""
    known = torch.tensor([[True, False, True, False, False, True], [False, True, True, True, True, False]])
    uniforms = torch.arange(12, dtype=torch.float32).view(2, 6) / 12
    keys = torch.tensor([[[0.9, 0.7, 0.1, 0.2, 0.7, 0.0], [0.5, 0.3, 0.5, 0.6, 0.1, 0.5]],
                         [[0.2, 0.0, 0.0, 0.0, 0.0, 0.1], [0.4, 0.9, 0.8, 0.7, 0.6, 0.4]]])
    positions, u, used, remaining, orders = draft_slots(known, uniforms, keys, 4)
    assert positions.tolist() == [[1, 3, 4, 0], [0, 5, 1, 2]]
    assert torch.equal(u, uniforms.gather(1, positions))
    assert used.tolist() == [[True, True, True, False], [True, True, False, False]]
    assert remaining.tolist() == [3, 2]
    assert orders.tolist() == [[[3, 1, 4, 0], [4, 1, 3, 0]], [[5, 0, 1, 2], [0, 5, 1, 2]]]


def test_draft_slots_of_an_empty_batch():
    out = draft_slots(torch.zeros(0, 5, dtype=torch.bool), torch.zeros(0, 5), torch.zeros(0, 2, 5), 3)
    assert [t.shape for t in out] == [(0, 3), (0, 3), (0, 3), (0,), (0, 2, 3)]


_K = torch.zeros(2, 5, dtype=torch.bool)
_U = torch.zeros(2, 5)
_KEYS = torch.zeros(2, 1, 5)


@pytest.mark.parametrize(
    "known, uniforms, keys, R, match",
    [
        (_K, _U, _KEYS, 0, "R must be an int in"),
        (_K, _U, _KEYS, 6, "R must be an int in"),
        (_K, _U, _KEYS, True, "R must be an int in"),
        (_K, _U, _KEYS, 2.0, "R must be an int in"),
        (torch.zeros(5, dtype=torch.bool), torch.zeros(5), _KEYS, 2, "known must be a"),
        (torch.zeros(2, 5, dtype=torch.uint8), _U, _KEYS, 2, "known must be a"),
        (_K, torch.zeros(2, 4), _KEYS, 2, "uniforms must be a"),
        (_K, torch.zeros(2, 5, dtype=torch.float16), _KEYS, 2, "uniforms must be a"),
        (_K, torch.zeros(5, 2).t(), _KEYS, 2, "unit stride"),
        (_K, _U, torch.zeros(2, 5), 2, "keys must be a"),
        (_K, _U, torch.zeros(2, 0, 5), 2, "keys must be a"),
        (_K, _U, torch.zeros(2, 1, 5, dtype=torch.float16), 2, "keys must be a"),
        (_K, _U, torch.zeros(3, 1, 5), 2, "keys must be a"),
        (_K, _U, torch.zeros(2, 1, 4), 2, "keys must be a"),
    ],
    ids=["R0", "R-over-T", "R-bool", "R-float", "known-1d", "known-uint8", "uniforms-shape", "uniforms-fp16",
         "uniforms-strided", "keys-2d", "keys-no-orders", "keys-fp16", "keys-batch", "keys-width"],
)
def test_draft_slots_reject_bad_input(known, uniforms, keys, R, match):
    with pytest.raises(ValueError, match=match):
        slots.draft_slots(known, uniforms, keys, R)
