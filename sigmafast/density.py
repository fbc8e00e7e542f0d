"""Densities of a σ-GPT (or any conditionals object of :mod:`sigmafast.sampler`): p(x_j | known) for every
unknown position in one burst forward, and the exact log-likelihood of a sequence in a given order."""

from __future__ import annotations

import torch

from . import kernels
from .memory import check_density_memory
from .request import inference, is_sigma_gpt, nonfinite_error, prepare
from .sampler import unwrap_model, as_conditionals

__all__ = ["conditional_density", "log_likelihood"]


def conditional_density(model, idx: torch.Tensor, known: torch.Tensor) -> torch.Tensor:
    """(B, T, V) probabilities p(x_j | known) for every unknown j in one burst forward; one-hot
    on known positions. Known tokens are fed in ascending position order."""
    model = unwrap_model(model)
    if not isinstance(known, torch.Tensor):
        raise TypeError(f"known must be a (B, T) bool tensor, got {type(known).__name__}")
    req = prepare(model, idx, known=known)
    B, T = req.canvas.shape
    check_probabilities_memory(model, B, T)
    conds = as_conditionals(model)
    if T == 0:
        return torch.zeros(B, 0, conds.vocab_size, device=req.canvas.device)
    with inference(model):
        session = conds.prefill(req.canvas, req.known)
        positions = torch.arange(T, device=req.canvas.device).expand(B, T)
        logits = session.draft(positions)  # (B, T, V)
        if bool(kernels.reference.nonfinite(logits, ~req.known)):
            raise nonfinite_error("logits")
        p = torch.softmax(kernels.reference.upcast(logits), dim=-1)  # fp32 at least
    del logits
    known = req.known[..., None]  # (B, T, 1)
    return p.masked_fill_(known, 0.0).scatter_add_(-1, req.canvas[..., None], known.to(p.dtype))  # one-hot where known


def check_probabilities_memory(model, batch_size: int, seq_len: int) -> None:
    """A ``ValueError`` naming the batch before a σ-GPT's forward whose (B, T, V) probabilities cannot fit
    (:func:`sigmafast.memory.density_peak_bytes`); nothing for an oracle."""
    if is_sigma_gpt(model):
        param = next(model.parameters())
        reference = kernels.backend_for(param) != "triton"
        check_density_memory(model.config, batch_size, seq_len, param.device, param.element_size(), reference)


def log_likelihood(model, idx: torch.Tensor, order) -> torch.Tensor:
    """(B,) exact log-probability of ``idx`` (B, T) visited in ``order`` (a (B, T) permutation tensor,
    "left-to-right" or "fractal"): teacher forcing, one forward."""
    from . import orders as orders_mod
    from .request import check_order_tensor

    model = unwrap_model(model)
    full = torch.ones_like(idx, dtype=torch.bool) if isinstance(idx, torch.Tensor) else None
    req = prepare(model, idx, known=full)
    x = req.canvas
    B, T = x.shape
    if isinstance(order, str):
        if order not in ("left-to-right", "fractal"):
            raise ValueError(f"order must be 'left-to-right', 'fractal' or a (B, T) tensor, got {order!r}")
        order = orders_mod.make_orders(order, B, T, device=x.device)
    elif isinstance(order, torch.Tensor):
        order = check_order_tensor(order.to(x.device), x.shape)
    else:
        raise TypeError(f"order must be a str or a (B, T) tensor, got {type(order).__name__}")
    if T == 0:  # the empty sequence has probability 1
        return torch.zeros(B, device=x.device)
    check_probabilities_memory(model, B, T)
    with inference(model):
        if is_sigma_gpt(model):
            cfg = model.config
            tokens, in_pos, out_pos, targets = orders_mod.shuffle(x, order, cfg.bos_token_id, cfg.start_pos)
            logits, _ = model(tokens, in_pos, out_pos)
        else:
            session = model.prefill(x, torch.zeros_like(x, dtype=torch.bool))
            targets = x.gather(1, order)
            logits = session.verify(order[:, None], targets[:, None]).logits[:, 0]
    logits = kernels.reference.upcast(logits)
    if bool(kernels.reference.nonfinite(logits)):  # every row is used
        raise nonfinite_error("logits")
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, targets[..., None]).squeeze(-1).sum(-1)
