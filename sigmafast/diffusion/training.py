"""What the trainer (:mod:`sigmafast.train`) runs for ``objective="diffusion"``: the noised batch and
loss of one micro-step, and the validation loss."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..signals import check_stop
from .model import DiffusionGPT
from .noise import DiffusionBatch, noisy_batch


def make_batch(model: DiffusionGPT, x0: torch.Tensor, generator: Optional[torch.Generator]) -> DiffusionBatch:
    """x0 (B, T) noised with ``model``'s process; times and noise drawn from ``generator``."""
    return noisy_batch(x0, model.noise, model.config.vocab_size, model.mask_id, generator)


def get_batch(model: DiffusionGPT, task, batch_size: int, generator: torch.Generator, device) -> DiffusionBatch:
    """A training batch: ``batch_size`` train rows of ``task``, then their noise, drawn from ``generator``."""
    x0 = task.sample_batch(batch_size, "train", generator)  # (B, T)
    return make_batch(model, x0, generator).to(device)


@torch.no_grad()
def estimate_val_loss(model: DiffusionGPT, xs, generator: torch.Generator, autocast, device,
                      should_stop: Optional[Callable[[], bool]] = None) -> float:
    """Mean loss over the clean batches ``xs``, noised from ``generator`` (seed it identically at every
    evaluation to score the same noised batches): the NELBO in nats/token for absorbing noise,
    the x0 cross-entropy for uniform noise. ``should_stop`` is called before each batch; when it returns
    true the evaluation is abandoned with :class:`~sigmafast.signals.EvaluationStopped`."""
    total = torch.zeros((), device=device)
    for x in xs:
        check_stop(should_stop)
        batch = make_batch(model, x, generator).to(device)
        with autocast:
            loss = model.loss(*batch)
        total += loss.float()
    return (total / len(xs)).item()
