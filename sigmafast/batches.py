"""The trainer's batches: every draw is a pure function of ``(seed, stream, step, micro-step index)``.

Resuming therefore reproduces an uninterrupted run exactly, and a DDP run, whose rank r takes its own
slice of a step's micro-steps, sees the same global batch as a single process with the same ``grad_accum``.
"""

from __future__ import annotations

import numpy as np
import torch

from . import orders
from .train_config import TrainConfig

TRAIN_STREAM, VAL_STREAM, SAMPLE_STREAM = 0, 1, 2


def stream_generator(seed: int, stream: int, step: int = 0, index: int = 0) -> torch.Generator:
    """A generator seeded by ``(seed, stream, step, index)``: every draw of a run is a pure function of them."""
    state = np.random.SeedSequence([seed, stream, step, index]).generate_state(1, np.uint64)[0]
    return torch.Generator().manual_seed(int(state) & (2**63 - 1))


def get_batch(task, cfg: TrainConfig, step: int, index: int, start_pos: int, device: torch.device):
    """Micro-batch ``index`` of optimiser step ``step``: shuffled (tokens, in_pos, out_pos, targets)."""
    g = stream_generator(cfg.seed, TRAIN_STREAM, step, index)
    x = task.sample_batch(cfg.batch_size, "train", g)  # (B, T)
    fraction = curriculum_l2r(step, cfg)
    order = orders.make_orders(cfg.order, *x.shape, generator=g, fraction=fraction)
    batch = orders.shuffle(x, order, task.bos, start_pos)
    if device.type == "cuda":
        return tuple(t.pin_memory().to(device, non_blocking=True) for t in batch)
    return tuple(t.to(device) for t in batch)


def curriculum_l2r(step: int, cfg: TrainConfig) -> float:
    """Scheduled left-to-right share of the batch at ``step`` (0 unless ``order == "curriculum"``)."""
    if cfg.order != "curriculum":
        return 0.0
    return orders.curriculum_fraction(step, cfg.curriculum_iters, cfg.curriculum_start)


def make_val_batches(task, cfg: TrainConfig) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed validation batches ``(x, random order)``, identical at every evaluation."""
    g = stream_generator(cfg.seed, VAL_STREAM)
    batches = []
    for _ in range(cfg.eval_iters):
        x = task.sample_batch(cfg.batch_size, "val", g)
        batches.append((x, orders.random(*x.shape, generator=g)))
    return batches
