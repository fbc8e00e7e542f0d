"""Triton burst attention: R independent queries over a KV cache plus their own key.

The kernel is the cascade attention of :mod:`sigmafast.kernels.utils` with
segments of one token, so the diagonal self term is one more key in the same
online softmax as the cache tiles. A query tile holds up to BLOCK_M queries of
one (b, h) (64 for 16-bit inputs): for R <= BLOCK_M every cache tile is read
once for all R queries. When B·H·(query tiles) cannot fill the GPU, the cache
is split across programs and the partial results are merged by log-sum-exp.
"""

from __future__ import annotations

from typing import Optional

import torch

from .utils import cascade_attention, check_attention_inputs, check_same


def burst_attention(
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
    """Attention of R queries over ``cache[:cache_lens[b]]`` and their own key only.

    q, k, v: (B, H, R, D) float32/float16/bfloat16, any strides; k_cache,
    v_cache: (B, H, L, D); cache_lens: (B,) int32/int64 with values in [0, L]
    (0 gives ``v``). scale defaults to 1/sqrt(D). Returns (B, H, R, D) in q's
    dtype, written into ``out`` when given. ``num_splits`` forces the number of
    KV splits (default: enough to fill the device).
    """
    check_attention_inputs(q, k, v, k_cache, v_cache, cache_lens, 4)
    if out is None:
        out = torch.empty_like(q)
    else:
        check_same("out", out, "q", q)
    if q.numel() == 0:
        return out
    return cascade_attention(q, k, v, k_cache, v_cache, cache_lens, scale, out, num_splits)
