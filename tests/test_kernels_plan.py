"""Triton autoregressive plan step (kernels/plan.py) against kernels/reference.py.

Outputs come pre-filled (``poisoned_empty``), so a value the kernel forgets fails. The kernel reads and
advances a counter in place, so the plan and the counter are built on the Triton device.
"""

from __future__ import annotations

import pytest
import torch

import sigmafast
from helpers import count_variants, tiny_model, triton_device
from sigmafast import kernels, steps
from sigmafast.kernels import plan
from sigmafast.kernels import reference as ref

DEVICE = triton_device()

# (W, B, T, layout): "padded" is the sampler's plan padded to a batch bucket (rows along a transposed dim)
CASES = [
    (4, 1, 1, "contiguous"),  # one row, one step
    (4, 3, 9, "contiguous"),
    (4, 5, 17, "padded"),  # strided rows
    (4, 70, 6, "contiguous"),  # W * B = 280 values: more than one 256-wide tile
    (2, 0, 4, "contiguous"),  # no rows: the counter still advances
]


def _ids(case) -> str:
    W, B, T, layout = case
    return f"W{W}-B{B}-T{T}-{layout}"


def _plan(case, seed):
    W, B, T, layout = case
    g = torch.Generator().manual_seed(seed)
    if layout == "padded":
        rows = torch.randint(-(2**40), 2**40, (B, W, T), generator=g)
        return rows.to(DEVICE).transpose(0, 1)  # (W, B, T), strides (T, W * T, 1)
    return torch.randint(-(2**40), 2**40, (W, B, T), generator=g).to(DEVICE)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_plan_step_matches_reference(case, poisoned_empty):
    """Every step of the plan in turn, then one past it and one before it (zeros, where the reference's gather
    would fail)."""
    W, B, T, _ = case
    table = _plan(case, 0)
    step = torch.zeros((), dtype=torch.long, device=DEVICE)
    want_step = step.clone()
    for s in range(T):
        got = plan.plan_step(table, step)
        want = ref.plan_step(table, want_step)
        assert got.shape == (W, B) and got.dtype == torch.int64
        assert torch.equal(got, want) and torch.equal(got.cpu(), table[:, :, s].cpu())
        assert step.item() == want_step.item() == s + 1
    assert torch.equal(plan.plan_step(table, step).cpu(), torch.zeros(W, B, dtype=torch.long))
    assert step.item() == T + 1
    step.fill_(-1)  # before the plan: zeros too, not the memory before it
    assert torch.equal(plan.plan_step(table, step).cpu(), torch.zeros(W, B, dtype=torch.long))
    assert step.item() == 0


@pytest.mark.parametrize("bad,err,match", [
    (dict(steps=torch.zeros(4, 3, dtype=torch.long)), ValueError, r"steps must be a \(W, B, T\) tensor"),
    (dict(steps=torch.zeros(4, 3, 0, dtype=torch.long)), ValueError, "with T >= 1"),
    (dict(steps=torch.zeros(4, 3, 5)), ValueError, "steps must be a .* tensor of torch.int64"),
    (dict(step=torch.zeros(1, dtype=torch.long)), ValueError, r"step must be a \(\) tensor"),
    (dict(step=torch.zeros(())), ValueError, "step must be a .* tensor of torch.int64"),
    (dict(step=0), TypeError, "step must be a torch.Tensor"),
])
def test_plan_step_rejects_bad_inputs(bad, err, match):
    args = dict(steps=torch.zeros(4, 3, 5, dtype=torch.long), step=torch.zeros((), dtype=torch.long))
    args.update(bad)
    with pytest.raises(err, match=match):
        plan.plan_step(**args)


def test_autoregressive_tokens_read_the_plan_with_one_kernel():
    """An autoregressive token on the Triton path reads its plan with the plan-step kernel and samples the
    tokens of the reference engine; a plan from ``steps.ar_plan`` is read at its first unknown step."""
    model = tiny_model(vocab_size=7, block_size=10, seed=3, std=0.5, dtype=torch.float32).to(DEVICE)
    idx = torch.randint(0, 7, (2, 2), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    out = {}
    for backend in ("triton", "reference"):
        with count_variants() as v, kernels.use_backend(backend):
            out[backend] = sigmafast.generate(sigmafast.Engine(model), idx, 8, strategy="autoregressive",
                                              generator=torch.Generator(DEVICE).manual_seed(5))
        assert ("_plan_step_kernel" in v.counts()) == (backend == "triton")
    assert torch.equal(out["triton"], out["reference"])
    visit = torch.arange(10).expand(2, 10).to(DEVICE)
    ar = steps.ar_plan(visit, torch.rand(2, 10, dtype=torch.float64).to(DEVICE), torch.tensor([2, 2]).to(DEVICE))
    now = kernels.plan_step(ar.steps, ar.step, backend="triton")
    assert now[steps.AR_POS].tolist() == [2, 2] and now[steps.AR_LIVE].tolist() == [1, 1] and ar.step.item() == 1


def test_plan_step_of_a_plan_strided_along_t(poisoned_empty):
    """A (W, B, T) plan whose steps are not adjacent (a T-major buffer, permuted): copied before the kernel
    reads it."""
    W, B, T = 4, 3, 9
    table = torch.randint(-(2**40), 2**40, (T, W, B), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    table = table.permute(1, 2, 0)  # strides (B, 1, W * B)
    step = torch.zeros((), dtype=torch.long, device=DEVICE)
    for s in range(T):
        assert torch.equal(plan.plan_step(table, step).cpu(), table[:, :, s].cpu()), s
    assert step.item() == T
