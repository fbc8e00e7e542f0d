"""Shared fixtures of the sampler tests: tiny random σ-GPT models."""

from __future__ import annotations

import torch

from sigmafast import SigmaGPT, SigmaGPTConfig


def tiny_model(vocab_size: int = 5, block_size: int = 8, seed: int = 0, std: float = 0.3,
               dtype: torch.dtype = torch.float64, n_embd: int = 32) -> SigmaGPT:
    """A 2-layer random model whose weights are scaled up (``std``) so that its
    conditionals are far from uniform and depend on the visited tokens and order."""
    torch.manual_seed(seed)
    config = SigmaGPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=2, n_head=2, n_embd=n_embd)
    model = SigmaGPT(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
    return model.to(dtype).eval()
