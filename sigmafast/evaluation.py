"""Validation losses and sampled validity, as the trainer reports them."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from . import diffusion, orders
from .intervals import wilson_interval
from .model import SigmaGPT
from .signals import check_stop


@torch.no_grad()
def estimate_val_loss(model: SigmaGPT, batches, order: str, bos: int, autocast, device,
                      should_stop: Optional[Callable[[], bool]] = None) -> float:
    """Mean loss over ``batches`` in their random order or in left-to-right order.

    ``should_stop`` is called before each batch; when it returns true the evaluation is abandoned with
    :class:`~sigmafast.signals.EvaluationStopped`."""
    total = torch.zeros((), device=device)
    for x, rand in batches:
        check_stop(should_stop)
        sigma = rand if order == "random" else orders.left_to_right(*x.shape)
        tokens, in_pos, out_pos, targets = orders.shuffle(x, sigma, bos, model.config.start_pos)
        with autocast:
            loss = model.loss(tokens.to(device), in_pos.to(device), out_pos.to(device), targets.to(device))
        total += loss.float()
    return (total / len(batches)).item()


PROPORTIONS = ("valid", "correct", "optimal")  # task.evaluate's fractions of the sampled sequences


def metrics_line(metrics: dict, n: int) -> str:
    """The metrics of ``n`` sampled sequences for a log line: each proportion of sequences with its Wilson 95%
    interval and ``n`` (``valid 0.625 [0.386, 0.815] of 16``), the others as values."""
    parts = []
    for name, value in metrics.items():
        part = f"{name} {float(value):.3f}"
        if name in PROPORTIONS:
            low, high = wilson_interval(round(float(value) * n), n)
            part += f" [{low:.3f}, {high:.3f}] of {n}"
        parts.append(part)
    return " ".join(parts)


def numeric_metrics(metrics) -> bool:
    return isinstance(metrics, dict) and bool(metrics) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in metrics.values()
    )


@torch.no_grad()
def sample_validity(model: torch.nn.Module, task, canvas: torch.Tensor, seed: int, device,
                    should_stop: Optional[Callable[[], bool]] = None) -> dict:
    """``task.evaluate`` of sequences sampled around the task's prompt: autoregressively in random
    order for a σ-GPT, in T steps for a diffusion model.

    A σ-GPT samples through a fresh :class:`~sigmafast.runner.Engine` (the weights change between
    evaluations; no CUDA graphs are kept), on the reference kernels off CUDA (the Triton interpreter is for
    the kernels' tests): the same tokens as ``naive.generate`` under the same generator, with a KV cache
    instead of T full forwards. ``should_stop`` is called before sampling and, for a σ-GPT, after every
    sampling step; when it returns true the evaluation is abandoned with
    :class:`~sigmafast.signals.EvaluationStopped`."""
    from .kernels import use_backend
    from .runner import Engine
    from .sampler import generate

    check_stop(should_stop)
    known = task.prompt_mask.to(device).expand(canvas.shape)  # (N, T)
    g = torch.Generator(device=device).manual_seed(seed)
    if diffusion.objective_of(model) == "diffusion":
        samples = diffusion.generate(model, canvas.to(device), known=known, generator=g)
    else:
        with use_backend("auto" if torch.device(device).type == "cuda" else "reference"):
            samples = generate(Engine(model, cuda_graphs=False), canvas.to(device), known=known,
                               strategy="autoregressive", generator=g,
                               on_iteration=None if should_stop is None else lambda *_: check_stop(should_stop))
    return task.evaluate(samples.cpu())
