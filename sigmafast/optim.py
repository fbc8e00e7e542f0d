"""The trainer's optimiser and learning-rate schedule."""

from __future__ import annotations

import math
from typing import Optional

import torch

from .train_config import TrainConfig


def learning_rate(it: int, cfg: TrainConfig) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``min_lr`` at ``lr_decay_iters``."""
    if it < cfg.warmup_iters:
        return cfg.lr * (it + 1) / (cfg.warmup_iters + 1)
    if it >= cfg.lr_decay_iters:
        return cfg.min_lr
    ratio = (it - cfg.warmup_iters) / max(1, cfg.lr_decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.lr - cfg.min_lr)


def configure_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device,
                        lr_scales: Optional[tuple[float, float]] = None) -> torch.optim.AdamW:
    """AdamW with weight decay on the >= 2-D weights only; fused on CUDA.

    Each group's ``lr_scale`` multiplies the scheduled learning rate: ``embedding_lr_scale`` for
    the token embedding (tied to the LM head), ``final_norm_lr_scale`` for the final LayerNorm
    (``lr_scales`` replaces the pair). Groups with equal settings are merged, so the default config has two.
    """
    embedding_scale, norm_scale = lr_scales or (cfg.embedding_lr_scale, cfg.final_norm_lr_scale)
    groups: dict[tuple[bool, float], list] = {(True, 1.0): [], (False, 1.0): []}  # (decayed, lr_scale)
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        owner = name.split(".")[-2:-1]  # the module that holds it, [] at the top level
        scale = 1.0
        if owner in (["wte"], ["lm_head"]):
            scale = embedding_scale
        elif owner == ["ln_f"]:
            scale = norm_scale
        groups.setdefault((p.dim() >= 2, scale), []).append(p)
    param_groups = [{"params": ps, "weight_decay": cfg.weight_decay if decayed else 0.0, "lr_scale": scale,
                     "lr": cfg.lr * scale} for (decayed, scale), ps in groups.items() if ps]
    extra = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(param_groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), **extra)


def restore_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device, state: dict,
                      stored_lr_scales: tuple[float, float]) -> torch.optim.AdamW:
    """The optimiser of ``cfg`` (its weight decay, betas and learning-rate scales) holding the per-parameter
    state (Adam moments, step) of ``state``, an optimiser state dict saved with the scales
    ``stored_lr_scales``: the hyper-parameters a resumed run is given take effect, even when new scales
    regroup the parameters."""
    saved = configure_optimizer(model, cfg, device, lr_scales=stored_lr_scales)
    try:
        saved.load_state_dict(state)
    except ValueError as e:
        raise ValueError(f"the checkpoint's optimiser state does not fit this model's parameter groups: {e}") from None
    optimizer = configure_optimizer(model, cfg, device)
    for p, param_state in saved.state.items():
        optimizer.state[p] = param_state
    return optimizer
