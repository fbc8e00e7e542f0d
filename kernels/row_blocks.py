"""The reference path's vocabulary-wide ops (the CPU path), a block of rows at a time.

The sampler's references (:mod:`.reference`) are row-wise, so running them on
blocks of rows gives each row the values it gets in one call. What changes is
the size of their (rows, V) temporaries: a burst's 1280 rows of GPT-2's
vocabulary make 257 MB per float32 temporary, and on Linux every allocation
above glibc's largest mmap threshold (32 MB) is a fresh mapping, page-faulted
in as it is written. Blocks of at most ``BLOCK_BYTES`` per temporary reuse the
same memory and stay in cache: the acceptance of 1280 drafts (``small`` model,
V = 50257, one Intel Xeon thread) took 508 ms in one call and 349 ms by 64-row
blocks, its log-softmax alone 160 against 49 ms. On a GPU (the reference path
there: float64, or no usable Triton) the caching allocator has no such cost,
and the blocks are larger (``DEVICE_BLOCK_BYTES``), for fewer launches.

``scores_from_hidden`` also computes the logits block by block, so the
(B, O, R, V) logits of a burst are never materialised whole on this path
either. A block's matmul may round differently from the whole one's (BLAS
blocking); every other value is the same.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import reference

BLOCK_BYTES = 1 << 24  # per (rows, V) temporary on the CPU: under glibc's mmap threshold once it is raised
DEVICE_BLOCK_BYTES = 1 << 27  # elsewhere: as the Triton path's matmul chunks (accept.CHUNK_ELEMENTS)


def block_rows(V: int, dtype: torch.dtype, device: torch.device) -> int:
    """Rows per block of (rows, V) temporaries in ``dtype`` (float32 at least, as the references compute)
    on ``device``."""
    budget = BLOCK_BYTES if device.type == "cpu" else DEVICE_BLOCK_BYTES
    return max(1, budget // (max(V, 1) * max(dtype.itemsize, 4)))


def sample(logits, uniforms, temperature=1.0, top_k=None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`reference.sample` of (N, V) ``logits`` and (N,) ``uniforms``, by blocks of rows."""
    n = block_rows(logits.shape[-1], logits.dtype, logits.device)
    if logits.shape[0] <= n:
        return reference.sample(logits, uniforms, temperature, top_k)
    parts = [reference.sample(x, u, temperature, top_k) for x, u in zip(logits.split(n), uniforms.split(n))]
    tokens, logp = zip(*parts)
    return torch.cat(tokens), torch.cat(logp)


def residual_sample(q_logits, p_logits, uniforms, temperature=1.0, top_k=None) -> torch.Tensor:
    """:func:`reference.residual_sample` of (N, V) ``q_logits`` and ``p_logits``, by blocks of rows."""
    n = block_rows(q_logits.shape[-1], q_logits.dtype, q_logits.device)
    if q_logits.shape[0] <= n:
        return reference.residual_sample(q_logits, p_logits, uniforms, temperature, top_k)
    return torch.cat([reference.residual_sample(q, p, u, temperature, top_k)
                      for q, p, u in zip(q_logits.split(n), p_logits.split(n), uniforms.split(n))])


def draft_scores(logits, drafts, temperature=1.0, top_k=None) -> torch.Tensor:
    """:func:`reference.draft_scores` of (..., V) ``logits`` and (...) ``drafts``, by blocks of rows."""
    V = logits.shape[-1]
    n = block_rows(V, logits.dtype, logits.device)
    if drafts.numel() <= n:
        return reference.draft_scores(logits, drafts, temperature, top_k)
    rows, flat = logits.reshape(-1, V), drafts.reshape(-1)
    return torch.cat([reference.draft_scores(x, d, temperature, top_k)
                      for x, d in zip(rows.split(n), flat.split(n))]).view(drafts.shape)


def scores_from_hidden(hidden, weight, drafts, vocab_size: int, temperature=1.0, top_k: Optional[int] = None
                       ) -> torch.Tensor:
    """:func:`reference.draft_scores` of the logits ``(hidden @ weight.T)[..., :vocab_size]`` ((..., C) and
    (V', C)) for the (...) ``drafts``, the logits computed by blocks of rows."""
    n = block_rows(weight.shape[0], hidden.dtype, hidden.device)
    rows, flat = hidden.reshape(-1, hidden.shape[-1]), drafts.reshape(-1)
    parts = [reference.draft_scores((h @ weight.T)[:, :vocab_size], d, temperature, top_k)
             for h, d in zip(rows.split(n), flat.split(n))]
    return (parts[0] if len(parts) == 1 else torch.cat(parts)).view(drafts.shape)
