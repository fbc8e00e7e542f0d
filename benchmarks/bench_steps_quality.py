"""Steps against quality: σ-GPT (random-order AR, burst) against discrete diffusion on the same backbone.

The paper's claim to check: at an equal number of model steps, σ-GPT burst
sampling beats a discrete-diffusion baseline. For the step, permutation and
maze tasks this records the task's primary metric (``valid`` / ``correct``,
with a 95% Wilson interval and n) against the mean number of model steps for

* ``sigma``: the σ-GPT of ``_models.py`` in random-order AR (steps = the
  number of unknown positions), burst lossless, and burst with the paper rule
  for 1/2/5/10 orders (steps = burst iterations; one iteration is a draft and
  a verification pass);
* ``oracle``: the exact oracle (``task.oracle()``) under the same AR and burst
  samplers, the optimum (step and permutation; maze has none, and diffusion no
  oracle analogue);
* ``diffusion-absorbing`` / ``diffusion-uniform``: ``sigmafast.diffusion``
  models with the σ-GPT's task, preset, budget and learning rate, sampled
  with S ∈ {1, 2, 4, 5, 8, 16, 32, 64, T} steps (T = the unknown positions).

Budgets: the default fits a 2-core CPU (64 sequences, 32 for maze, and
S ∈ {1, 4, 5, 16, T}); ``SIGMAFAST_BENCH_FULL=1`` samples 1000 sequences per
point with every S; ``SIGMAFAST_BENCH_SAMPLES=N`` sets the sequences alone.
Models are trained once into the cache (``_models.py``).
``scripts/plot_benchmarks.py`` draws ``steps_quality.png`` and the table.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import sigmafast
from _common import bench_full, device_info, sample_count, summarize
from _models import ModelSpec, spec
from bench_steps import _canvas, timed_sample
from sigmafast import diffusion
from sigmafast.intervals import wilson_interval
from sigmafast.tasks import get_task

TASKS = ("step", "permutation", "maze")
NOISES = ("absorbing", "uniform")
SIGMA_METHODS = [("autoregressive", "lossless", 1, "ar")] + [("burst", "lossless", 1, "burst-lossless")] + [
    ("burst", "paper", n, f"burst-paper-o{n}") for n in (1, 2, 5, 10)
]
# S = 5: the comparison point with σ-GPT burst (<= 5 mean steps on step)
DIFFUSION_STEPS = (1, 2, 4, 5, 8, 16, 32, 64, "T") if bench_full() else (1, 4, 5, 16, "T")


def n_sequences(task_name: str) -> int:
    return sample_count(1000 if bench_full() else 32 if task_name == "maze" else 64)


def diffusion_spec(task_name: str, noise: str) -> ModelSpec:
    """The σ-GPT recipe of ``task_name`` (same preset, budget, lr, position encoding) as a diffusion model."""
    base = spec(task_name)
    overrides = {**base.overrides, "objective": "diffusion", "diffusion_noise": noise}
    return dataclasses.replace(base, name=f"{base.name}-diffusion-{noise}", overrides=overrides)


def cases() -> list:
    out = []
    for task in TASKS:
        for family in ("sigma", "oracle"):
            if family == "oracle" and task == "maze":
                continue
            out += [pytest.param(task, family, m, rule, n, id=f"{task}-{family}-{sid}")
                    for m, rule, n, sid in SIGMA_METHODS]
        for noise in NOISES:
            out += [pytest.param(task, f"diffusion-{noise}", "diffusion", None, s,
                                 id=f"{task}-diffusion-{noise}-S{s}") for s in DIFFUSION_STEPS]
    return out


def _model(models, device, task_name: str, family: str):
    """(model or oracle, task, training summary, device to sample on) of one case."""
    if family == "oracle":
        task = get_task(task_name)
        return task.oracle(), task, {}, torch.device("cpu")
    bm = models.get(task_name, device) if family == "sigma" else models.get_spec(
        diffusion_spec(task_name, family.split("-", 1)[1]), device)
    info = dict(n_params=bm.info["n_params"], preset=bm.spec.preset, train_iters=bm.spec.max_iters,
                train_seconds=bm.info.get("train_seconds"), final_eval=bm.info.get("final_eval"))
    return bm.model, bm.task, info, device


def _sampler(model, family: str, strategy: str, rule, num, steps):
    """generate(canvas, known, generator) -> (tokens, stats) for one method."""
    if family.startswith("diffusion"):
        return lambda canvas, known, g: diffusion.generate(model, canvas, known=known, steps=steps,
                                                           generator=g, return_stats=True)
    return lambda canvas, known, g: sigmafast.generate(model, canvas, known=known, strategy=strategy,
                                                       num_orders=num, acceptance=rule, generator=g,
                                                       return_stats=True)


@pytest.mark.parametrize("task_name,family,strategy,rule,num", cases())
def test_steps_quality(benchmark, task_name, family, strategy, rule, num, models, device):
    model, task, train_info, dev = _model(models, device, task_name, family)
    n = n_sequences(task_name)
    canvas, known = _canvas(task, n, dev)
    n_unknown = (~known).sum(1)
    T = int(n_unknown.max())
    steps = None
    if strategy == "diffusion":
        steps = T if num == "T" else num
        if steps > T:
            pytest.skip(f"S={steps} exceeds the {T} unknown positions")
    sample = _sampler(model, family, strategy, rule, num, steps)
    _, stats, metrics, name, value = timed_sample(benchmark, sample, task, canvas, known, dev)
    successes = round(value * n)
    lo, hi = wilson_interval(successes, n)
    benchmark.extra_info.update(
        kind="steps_quality", task=task_name, seq_len=task.seq_len, family=family, strategy=strategy,
        acceptance=rule if strategy == "burst" else None, num_orders=num if strategy != "diffusion" else None,
        diffusion_steps=steps,
        n_sequences=n, ar_iterations=float(n_unknown.double().mean()), steps_mean=stats.mean_iterations,
        metric_name=name, metric_value=value, metric_ci95=[lo, hi], metrics=metrics,
        **train_info, **summarize(stats, n_unknown), **device_info(dev),
    )
    if strategy == "autoregressive":
        assert torch.equal(stats.iterations.cpu(), n_unknown.cpu()), "AR takes one step per unknown position"
    if strategy == "diffusion":
        assert stats.forward_calls == steps, "diffusion makes one model call per step"
    if family == "oracle":
        assert value == 1.0, f"exact oracle produced invalid {task_name} samples ({metrics})"
