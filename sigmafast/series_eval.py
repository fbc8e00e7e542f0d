"""Prompted generation error on value tasks (``vertical_rate``, ``series``), as in the σ-GPT paper.

For each prompt fraction f and autoregressive order, every one of
``num_sequences`` distinct validation sequences (``task.val_sequences``: rows
of a synthetic task's validation set, windows of a series that share no value)
is given its task prompt (the aircraft
type for ``vertical_rate``, nothing for ``series``) and its first
``floor(f * n)`` values (n = the number of value positions); the rest is
sampled ``samples_per_sequence`` times with
``sigmafast.generate(..., strategy="autoregressive", order=order)``.

The error of one sample is the mean squared difference, over **all** n value
positions (the paper's "whole sequence"; prompted positions contribute 0),
between the decoded sample and the decoded ground truth (bin centres, in the
task's units: ft for ``vertical_rate``). The table reports the mean and the
standard deviation of this error over all ``num_sequences *
samples_per_sequence`` samples, and the half-width of a 95% confidence interval
of the mean: Student's t quantile (num_sequences - 1 degrees of freedom) times
the standard error of the per-sequence means, since the samples of one
sequence share its ground truth and are not independent.
A non-value token sampled at a value position (BOS, an aircraft type) decodes
as the nearest bin (the top one) and is counted in ``invalid``, the fraction of
generated value tokens that are not values.

A value task exposes ``bins`` (:class:`~sigmafast.tasks.series.UniformBins`)
and ``value_positions`` ((T,) bool). ``model`` is anything ``generate``
accepts: a SigmaGPT, an Engine or an exact oracle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .intervals import t_quantile
from .request import AR_ORDERS, model_limits
from .sampler import generate


@dataclass(frozen=True)
class PromptedResult:
    """Error of one (prompt fraction, order) cell; MSE in squared task units."""

    fraction: float
    order: str
    mse_mean: float
    mse_std: float
    invalid: float  # fraction of generated value tokens that are not value tokens
    num_samples: int
    mse_ci: float = math.nan  # half-width of the 95% CI of mse_mean, over sequences (nan for one sequence)


def sequence_ci(mse: torch.Tensor, num_sequences: int) -> float:
    """Half-width of the 95% CI of ``mse.mean()`` for (num_sequences * S,) errors grouped by sequence
    (sequence-major): t std(per-sequence means) / sqrt(num_sequences), t being Student's 97.5% quantile with
    num_sequences - 1 degrees of freedom (2.262 for 10 sequences); nan for one sequence."""
    if num_sequences < 2:
        return math.nan
    per_sequence = mse.view(num_sequences, -1).mean(dim=1)
    return t_quantile(0.95, num_sequences - 1) * per_sequence.std().item() / math.sqrt(num_sequences)


def prompt_known(task, fraction: float) -> torch.Tensor:
    """(T,) bool: the task's prompt and the first ``floor(fraction * n)`` of its n value positions."""
    values = task.value_positions
    rank = values.long().cumsum(0) - 1  # index of each value position among them
    n_given = math.floor(fraction * int(values.sum()) + 1e-9)  # 0.29 * 100 is 28.999999999999996
    return task.prompt_mask | (values & (rank < n_given))


def _check_value_task(task) -> None:
    if not all(hasattr(task, a) for a in ("bins", "value_positions", "val_sequences")):
        raise TypeError(f"task must be a value task with bins, value_positions and val_sequences (vertical_rate, "
                        f"series), got {getattr(task, 'name', type(task).__name__)!r}")


def _check_args(fractions, orders, samples_per_sequence, num_sequences, generator) -> None:
    if not fractions or not all(isinstance(f, (int, float)) and not isinstance(f, bool) and 0 <= f < 1
                                for f in fractions):
        raise ValueError(f"fractions must be a non-empty sequence of numbers in [0, 1), got {fractions!r}")
    if not orders or not all(isinstance(o, str) and o in AR_ORDERS for o in orders):
        raise ValueError(f"orders must be a non-empty sequence of {AR_ORDERS}, got {orders!r}")
    for name, values in (("fractions", fractions), ("orders", orders)):
        if len(set(values)) < len(values):  # a repeat would sample its cells again, to show one of them
            raise ValueError(f"{name} must not repeat a value, got {values!r}")
    for name, value in (("samples_per_sequence", samples_per_sequence), ("num_sequences", num_sequences)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")


@torch.no_grad()
def evaluate_prompted(
    model,
    task,
    fractions: Sequence[float] = (0.0, 0.1, 0.5),
    orders: Sequence[str] = ("left-to-right", "random", "fractal"),
    samples_per_sequence: int = 20,
    num_sequences: int = 50,
    generator: Optional[torch.Generator] = None,
    temperature: float = 1.0,
) -> list[PromptedResult]:
    """One :class:`PromptedResult` per (fraction, order), fractions outermost (see the module docstring).

    The validation sequences are ``task.val_sequences(num_sequences, generator)``; all draws come
    from ``generator`` (the global RNG when None), so a seeded generator gives a reproducible table.
    """
    _check_value_task(task)
    _check_args(fractions, orders, samples_per_sequence, num_sequences, generator)
    _, _, device = model_limits(model)
    truth = task.val_sequences(num_sequences, generator).to(device)  # (N, T), distinct
    rows = truth.repeat_interleave(samples_per_sequence, dim=0)  # (N * S, T)
    value_pos = task.value_positions.to(device)
    true_values = task.bins.decode(rows[:, value_pos])  # (N * S, n)
    results = []
    for fraction in fractions:
        known = prompt_known(task, fraction).to(device).expand_as(rows)
        generated = (~known[:, value_pos]).sum()
        for order in orders:
            out = generate(model, rows, known=known, strategy="autoregressive", order=order,
                           generator=generator, temperature=temperature)
            sampled = out[:, value_pos]
            mse = (task.bins.decode(sampled) - true_values).square().mean(dim=1)  # (N * S,)
            bad = (sampled >= task.bins.n_bins) | (sampled < 0)
            std = mse.std() if mse.numel() > 1 else torch.zeros((), dtype=mse.dtype, device=device)
            stats = torch.stack([mse.mean(), std, bad.sum() / generated.clamp_min(1)]).tolist()
            results.append(PromptedResult(float(fraction), order, stats[0], stats[1], stats[2], mse.numel(),
                                          sequence_ci(mse, num_sequences)))
    return results


def markdown_table(results: Sequence[PromptedResult], unit: str = "") -> str:
    """Orders as rows, prompt fractions as columns, cells ``mean ± std [95% CI of the mean]`` (and the
    invalid share if any)."""
    fractions = sorted({r.fraction for r in results})
    orders = list(dict.fromkeys(r.order for r in results))
    cell = {(r.order, r.fraction): r for r in results}
    label = f"MSE ({unit}²)" if unit else "MSE"
    lines = ["| order \\ prompt | " + " | ".join(f"{100 * f:g}%" for f in fractions) + " |",
             "|---" * (len(fractions) + 1) + "|"]
    for order in orders:
        cells = []
        for f in fractions:
            r = cell.get((order, f))
            if r is None:
                cells.append("")
                continue
            text = f"{r.mse_mean:.4g} ± {r.mse_std:.3g}"
            if math.isfinite(r.mse_ci):
                text += f" [{r.mse_mean - r.mse_ci:.3g}, {r.mse_mean + r.mse_ci:.3g}]"
            cells.append(text + (f" ({100 * r.invalid:.2g}% invalid)" if r.invalid > 0 else ""))
        lines.append(f"| {order} | " + " | ".join(cells) + " |")
    n = results[0].num_samples if results else 0
    return (f"{label}, mean ± std over {n} samples per cell [95% CI of the mean, from the per-sequence means]"
            "\n\n" + "\n".join(lines))
