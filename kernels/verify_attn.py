"""Triton multi-order verification attention with a shared, once-read prefix.

Token r of order o attends to ``cache[:cache_lens[b]]`` and causally to tokens
``0..r`` of its own order. The O·R queries of a (b, h) are one flattened row
axis, so a query tile spans several orders when R is small, and each cache tile
is loaded once per tile of BLOCK_M queries (64 for 16-bit inputs) for all the
orders in it; then the same online softmax continues over the tile's causal
suffix (cascade attention: prefix and suffix meet in one log-sum-exp).

Prefix traffic: repeating the prefix per order (SDPA over a concatenated
``[cache; suffix]`` per order, or any per-order attention) reads O·L·D keys and
values per (b, h). Here it is ceil(O·R / BLOCK_M)·L·D from L2 and, since the query tiles
of one (b, h) run next to each other, about L·D from DRAM: O times less. For
O·R <= BLOCK_M it is exactly one read.
"""

from __future__ import annotations

from typing import Optional

import torch

from .utils import cascade_attention, check_attention_inputs, check_same


def verify_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_lens: torch.Tensor,
    scale: Optional[float] = None,
    *,
    out: Optional[torch.Tensor] = None,
    num_splits: Optional[int] = None,
) -> torch.Tensor:
    """Causal attention of O orders of R tokens sharing one KV-cache prefix.

    q, k, v: (B, O, H, R, D) float32/float16/bfloat16, any strides; k_cache,
    v_cache: (B, H, L, D); cache_lens: (B,) int32/int64 in [0, L]. scale
    defaults to 1/sqrt(D). Returns (B, O, H, R, D) in q's dtype, written into
    ``out`` when given. ``num_splits`` forces the number of KV splits.
    """
    check_attention_inputs(q, k, v, k_cache, v_cache, cache_lens, 5)
    if out is None:
        out = torch.empty_like(q)
    else:
        check_same("out", out, "q", q)
    if q.numel() == 0:
        return out
    return cascade_attention(q, k, v, k_cache, v_cache, cache_lens, scale, out, num_splits)
