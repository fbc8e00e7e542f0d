"""The reference path's vocabulary-wide ops (the CPU path), a block of rows at a time.

The sampler's references (:mod:`.reference`) are row-wise, so running them on
blocks of rows gives each row the values it gets in one call. What changes is
the size of their (rows, V) temporaries: a burst's 1280 rows of GPT-2's
vocabulary make 257 MB per float32 temporary, and on Linux every allocation
above glibc's largest mmap threshold (32 MB) is a fresh mapping, page-faulted
in as it is written. Blocks of at most ``CPU_BLOCK_ELEMENTS`` float32 values
per temporary reuse the same memory and stay in cache: the acceptance of 1280
drafts (``small`` model, V = 50257, one Intel Xeon thread) took 508 ms in one
call and 349 ms by 64-row blocks, its log-softmax alone 160 against 49 ms. On a
GPU (the reference path there: float64, or no usable Triton) the caching
allocator has no such cost, and the blocks are larger (``DEVICE_BLOCK_ELEMENTS``),
for fewer launches. The training loss's chunks (``sigmafast.loss``) take the
same sizes, for the same reason.

``scores_from_hidden`` and ``sample_from_hidden`` also compute the logits
block by block, so neither a burst's (B, O, R, V) verifier logits nor its
(B, R, V) draft logits are materialised whole on this path. A block's matmul
may round differently from the whole one's (BLAS blocking); every other value
is the same.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import reference

CPU_BLOCK_ELEMENTS = 1 << 22  # float32 values per block on the CPU (16 MiB): under glibc's raised mmap threshold
DEVICE_BLOCK_ELEMENTS = 1 << 25  # elsewhere, as the Triton path's matmul chunks (accept.CHUNK_ELEMENTS)


def block_elements(device: torch.device) -> int:
    """float32 values per block of a (rows, V) temporary on ``device`` (also the training loss's chunks)."""
    return CPU_BLOCK_ELEMENTS if device.type == "cpu" else DEVICE_BLOCK_ELEMENTS


def block_rows(V: int, dtype: torch.dtype, device: torch.device) -> int:
    """Rows per block of (rows, V) temporaries in ``dtype`` (float32 at least, as the references compute)
    on ``device``."""
    return max(1, block_elements(device) * 4 // (max(V, 1) * max(dtype.itemsize, 4)))


def _by_rows(fn, n: int, *rows: torch.Tensor):
    """``fn(*rows)`` for (N, ...) tensors ``rows``, run on blocks of ``n`` rows of each: its (N, ...) output,
    or tuple of outputs, concatenated."""
    if rows[0].shape[0] <= n:
        return fn(*rows)
    parts = [fn(*block) for block in zip(*(t.split(n) for t in rows))]
    if isinstance(parts[0], tuple):
        return tuple(torch.cat(p) for p in zip(*parts))
    return torch.cat(parts)


def sample(logits, uniforms, temperature=1.0, top_k=None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`reference.sample` of (N, V) ``logits`` and (N,) ``uniforms``, by blocks of rows."""
    n = block_rows(logits.shape[-1], logits.dtype, logits.device)
    return _by_rows(lambda x, u: reference.sample(x, u, temperature, top_k), n, logits, uniforms)


def residual_sample(q_logits, p_logits, uniforms, temperature=1.0, top_k=None) -> torch.Tensor:
    """:func:`reference.residual_sample` of (N, V) ``q_logits`` and ``p_logits``, by blocks of rows."""
    n = block_rows(q_logits.shape[-1], q_logits.dtype, q_logits.device)
    return _by_rows(lambda q, p, u: reference.residual_sample(q, p, u, temperature, top_k), n, q_logits, p_logits,
                    uniforms)


def draft_scores(logits, drafts, temperature=1.0, top_k=None) -> torch.Tensor:
    """:func:`reference.draft_scores` of (..., V) ``logits`` and (...) ``drafts``, by blocks of rows."""
    V = logits.shape[-1]
    n = block_rows(V, logits.dtype, logits.device)
    return _by_rows(lambda x, d: reference.draft_scores(x, d, temperature, top_k), n, logits.reshape(-1, V),
                    drafts.reshape(-1)).view(drafts.shape)


def scores_from_hidden(hidden, weight, drafts, vocab_size: int, temperature=1.0, top_k: Optional[int] = None
                       ) -> torch.Tensor:
    """:func:`reference.draft_scores` of the logits ``(hidden @ weight.T)[..., :vocab_size]`` ((..., C) and
    (V', C)) for the (...) ``drafts``, the logits computed by blocks of rows."""
    n = block_rows(weight.shape[0], hidden.dtype, hidden.device)
    return _by_rows(lambda h, d: reference.draft_scores((h @ weight.T)[:, :vocab_size], d, temperature, top_k), n,
                    hidden.reshape(-1, hidden.shape[-1]), drafts.reshape(-1)).view(drafts.shape)


def sample_from_hidden(hidden, weight, uniforms, vocab_size: int, temperature=1.0, top_k: Optional[int] = None,
                       used: Optional[torch.Tensor] = None, flag: Optional[torch.Tensor] = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`reference.sample` of the logits ``(hidden @ weight.T)[:, :vocab_size]`` ((N, C) and (V', C)) with
    (N,) ``uniforms``, the logits computed by blocks of rows; with a () bool ``flag``, also
    :func:`reference.flag_nonfinite` of each block's logits (``used``: None or the (N,) bool rows to check)."""
    n = block_rows(weight.shape[0], hidden.dtype, hidden.device)

    def block(h, u, *rows_used):
        logits = (h @ weight.T)[:, :vocab_size]
        if flag is not None:
            reference.flag_nonfinite(logits, rows_used[0] if rows_used else None, flag)
        return reference.sample(logits, u, temperature, top_k)

    return _by_rows(block, n, hidden, uniforms, *(() if used is None else (used,)))
