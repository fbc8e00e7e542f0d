"""Triton lossless bookkeeping (kernels/lossless.py) against kernels/reference.py.

Outputs come pre-filled with garbage (``poisoned_empty``). Everything is integer or copied, so every output
is compared exactly.
"""

from __future__ import annotations

import pytest
import torch

from helpers import on_triton_device
from sigmafast.kernels import lossless
from sigmafast.kernels import reference as ref

residual_pick = on_triton_device(lossless.residual_pick)
residual_splice = on_triton_device(lossless.residual_splice)

# (B, R, T): rows over one program's tile (64), steps over one program's tile (256), one step, R = T
CASES = [(1, 1, 1), (3, 5, 9), (70, 16, 40), (2, 300, 300), (5, 7, 7)]


def _ids(case) -> str:
    return "B{}-R{}-T{}".format(*case)


def _inputs(case, seed: int, u_dtype=torch.float64):
    """Counts n in [0, R] (every step accepted included), remaining counts around them, and the sampler's
    layouts: the order a strided view of a (B, 1, T) sort, the slots of a (B, 1, R) tensor."""
    B, R, T = case
    g = torch.Generator().manual_seed(seed)
    orders = torch.rand(B, 1, T, generator=g).argsort(-1)[..., :R][:, 0]  # (B, R), row stride T
    slots = torch.randint(0, R, (B, 1, R), generator=g)[:, 0]
    n = torch.randint(0, R + 1, (B,), generator=g)
    remaining = (n + torch.randint(0, 3, (B,), generator=g)).clamp(max=T)
    u = torch.rand(B, T, generator=g, dtype=torch.float64).to(u_dtype)
    return n, remaining, orders, slots, u


@pytest.mark.parametrize("u_dtype", [torch.float32, torch.float64], ids=["u32", "u64"])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_residual_pick_matches_reference(case, u_dtype, poisoned_empty):
    for seed in range(3):
        args = _inputs(case, seed, u_dtype)
        got, want = residual_pick(*args), ref.residual_pick(*args)
        for name, g, w in zip(("k", "slot", "u", "rejected"), got, want):
            assert g.dtype == w.dtype and torch.equal(g, w), name


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_residual_splice_matches_reference(case, poisoned_empty):
    B, R, T = case
    for seed in range(3):
        n, remaining, *_ = _inputs(case, seed)
        g = torch.Generator().manual_seed(seed + 10)
        tokens = torch.randint(0, 50, (B, 2, R), generator=g)[:, 1]  # a strided (B, R) view
        r_tok = torch.randint(100, 150, (B,), generator=g)
        rejected = n < remaining
        got, want = residual_splice(tokens, n, r_tok, rejected), ref.residual_splice(tokens, n, r_tok, rejected)
        for name, g_, w in zip(("tokens", "n_commit"), got, want):
            assert g_.dtype == w.dtype and torch.equal(g_, w), name


def test_residual_pick_and_splice_by_hand():
    """Row 0 rejected at step 1; row 1 accepted all 3 of its 3 remaining steps (R = 3: the draw happens at
    the clamped step 2 and is never committed); row 2 accepted both of its 2 remaining steps in R = 3."""
    orders = torch.tensor([[4, 0, 2], [1, 3, 0], [2, 4, 1]])
    slots = torch.tensor([[0, 1, 2], [2, 0, 1], [1, 0, 2]])
    n, remaining = torch.tensor([1, 3, 2]), torch.tensor([3, 3, 2])
    u = torch.arange(15, dtype=torch.float32).view(3, 5) / 15
    k, slot, u_k, rejected = residual_pick(n, remaining, orders, slots, u)
    assert k.tolist() == [1, 2, 2] and slot.tolist() == [1, 1, 2]
    assert u_k.tolist() == [u[0, 0].item(), u[1, 0].item(), u[2, 1].item()]
    assert rejected.tolist() == [True, False, False]
    tokens = torch.tensor([[7, 8, 9], [7, 8, 9], [7, 8, 9]])
    new, n_commit = residual_splice(tokens, n, torch.tensor([50, 51, 52]), rejected)
    assert new.tolist() == [[7, 50, 9], [7, 8, 9], [7, 8, 52]]  # row 2: step 2 is past its commit
    assert n_commit.tolist() == [2, 3, 2]


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: lossless.residual_pick(torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long),
                                        torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, 0, dtype=torch.long),
                                        torch.zeros(2, 4)), "R >= 1"),
        (lambda: lossless.residual_pick(torch.zeros(3, dtype=torch.long), torch.zeros(2, dtype=torch.long),
                                        torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long),
                                        torch.zeros(2, 4)), "n must be"),
        (lambda: lossless.residual_pick(torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long),
                                        torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long),
                                        torch.zeros(2, 4, dtype=torch.float16)), "u_residual must be"),
        (lambda: lossless.residual_splice(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, dtype=torch.long),
                                          torch.zeros(2, dtype=torch.long), torch.zeros(2)), "rejected must be"),
        (lambda: lossless.residual_splice(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long),
                                          torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.bool)),
         "tokens must be"),
    ],
    ids=["R0", "n-shape", "u-fp16", "rejected-float", "tokens-float"],
)
def test_lossless_ops_reject_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()
