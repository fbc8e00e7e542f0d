"""Triton autoregressive plan step: read step s of every row's plan and advance s, in one kernel.

An autoregressive token reads what step s samples from its plan
(``sigmafast.steps.ARPlan``: a (W, B, T) int64 tensor of per-step columns, the
position, the live flag, the uniform's bits and the order), then advances the
step counter. Eagerly that is a gather (of an expanded counter) and an in-place
add: two kernels per token. ``_plan_step_kernel``, one program, does both: an
atomic add advances the counter and returns the step it reads, then the
program copies column s of every row (W·B values).

Reading a step outside the plan (s < 0 or s >= T, which the sampler never
does) gives zeros instead of an index error. Compiles once: the sizes and strides are in
``do_not_specialize``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_plan_step
from .utils import gdc_enter, pdl_meta

BLOCK = 256  # values copied per loop step


@triton.jit(do_not_specialize=["WB", "B", "T", "s_w", "s_b"])
def _plan_step_kernel(STEPS, STEP, NOW, WB, B, T, s_w, s_b, TILE: tl.constexpr, USE_GDC: tl.constexpr):
    gdc_enter(USE_GDC)
    s = tl.atomic_add(STEP, 1).to(tl.int64)  # the old value: the step this token reads
    n_read = tl.where((s >= 0) & (s < T), WB, 0)  # nothing read outside the plan
    o = tl.arange(0, TILE)
    for i0 in range(0, WB, TILE):
        o_i = (i0 + o).to(tl.int64)
        b_v = tl.load(STEPS + (o_i // B) * s_w + (o_i % B) * s_b + s, mask=o_i < n_read, other=0)
        tl.store(NOW + o_i, b_v, mask=o_i < WB)


def launch(steps: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Launch the kernel (no input checks): the (W, B) column ``step`` of ``steps``; advances ``step``."""
    W, B, T = steps.shape
    if steps.stride(2) != 1 and T > 1:
        steps = steps.contiguous()
    now = torch.empty(W, B, dtype=torch.int64, device=steps.device)
    _plan_step_kernel[(1,)](steps, step, now, W * B, max(B, 1), T, steps.stride(0), steps.stride(1),
                            TILE=BLOCK, num_warps=4, **pdl_meta(steps.device))
    return now


def plan_step(steps: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Column ``step`` of every row's plan, and the step advanced, in place.

    steps: (W, B, T) int64 (T >= 1); step: () int64 in [0, T), the caller's contract: its value is not read
    on the host (no sync), and out of range the reference raises an index error while the kernel returns
    zeros. Returns now (W, B) int64, ``steps[:, :, step]``, and adds 1 to ``step``; from the
    ``sigmafast::plan_step`` op.
    """
    check_plan_step(steps, step)
    from . import ops  # noqa: F401  (registers torch.ops.sigmafast.*)

    return torch.ops.sigmafast.plan_step(steps, step)
