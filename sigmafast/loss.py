"""Linear + cross-entropy over row chunks: the LM-head loss without (N, V) logits.

``linear_cross_entropy(hidden, weight, targets)`` equals
``F.cross_entropy(hidden @ weight.T, targets, ignore_index=-1)`` but never holds
more than :func:`default_chunk_elements` logits at a time. With gradients it
computes them during the forward, chunk by chunk (Liger-Kernel's fused
linear cross-entropy, in PyTorch):

    d loss / d logits_n = (softmax(logits_n) - onehot(y_n)) / N_valid

    d hidden_n  = (d logits_n) @ W            (one chunk of rows at a time)
    d W        += (d logits_n)^T @ hidden_n

so the backward is a scaling of the stored ``(N, C)`` and ``(V, C)`` gradients.
Two options serve the diffusion baseline: ``adjust(logits, *row_args)`` edits
each chunk's logits with parameter-free terms (``row_args`` are per-row
tensors, chunked alongside), and ``row_weight`` weights each row's loss; the
gradient is then ``row_weight_n (softmax(adjusted_n) - onehot(y_n)) / N_valid``.
Peak extra memory is about three chunks of float32 logits (logits, their
softmax and the gradient) instead of ``3 N V`` floats: 6.6 GB → 0.4 GB for a
32 × 1024 batch over GPT-2's 50257 tokens. The CPU's chunks are smaller, as the
sampler's row blocks are (``kernels.row_blocks`` says why): at ``small``'s width,
4096 rows of 50257 took 2.95 s forward and backward in chunks of 2^25 logits and
2.24 s in chunks of 2^22 (one Intel Xeon thread).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .kernels import row_blocks

LOSS_CHUNK_ELEMENTS = row_blocks.DEVICE_BLOCK_ELEMENTS  # logits per chunk off the CPU (128 MiB in float32)
IGNORE_INDEX = -1


LOSS_WEIGHTINGS = ("uniform", "visited")


def step_weights(weighting: str, seq_len: int) -> Optional[torch.Tensor]:
    """(seq_len,) float32 weight of the target at each step of a σ-GPT sequence, mean 1; None for "uniform".

    "visited": proportional to the number of tokens visited before the target, ``k + 1/2`` at step k. Every
    step's conditional keeps its optimum (the loss is a weighted sum of separate conditionals); the
    gradient moves to the late steps, whose many visited tokens make them the hardest (permutation: a value
    seen among 90 must get almost no mass).
    """
    if weighting not in LOSS_WEIGHTINGS:
        raise ValueError(f"loss weighting must be one of {LOSS_WEIGHTINGS}, got {weighting!r}")
    if weighting == "uniform":
        return None
    w = torch.arange(seq_len, dtype=torch.float32) + 0.5
    return w / w.mean()


def default_chunk_elements(device: torch.device) -> int:
    """Logits per chunk when the caller gives none: the sampler's row blocks' size, smaller on the CPU."""
    return row_blocks.block_elements(device)


def chunk_rows(vocab_size: int, chunk_elements: int = LOSS_CHUNK_ELEMENTS) -> int:
    """Rows per chunk so that one chunk holds at most ``chunk_elements`` logits."""
    return max(1, chunk_elements // vocab_size)


def _chunk_loss(h, weight, y, adjust, args, w) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, C) hidden, (V, C) weight, (n,) targets[, per-row args, (n,) weights] -> summed loss and
    (n, V) logits, float32 at least."""
    logits = h @ weight.T  # (n, V)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if adjust is not None:
        logits = adjust(logits, *args)
    if w is None:
        return F.cross_entropy(logits, y, ignore_index=IGNORE_INDEX, reduction="sum"), logits
    ce = F.cross_entropy(logits, y, ignore_index=IGNORE_INDEX, reduction="none")
    return (ce * w.to(ce.dtype)).sum(), logits


def _rows(tensors, start: int, stop: int) -> tuple:
    """Rows start:stop of each tensor; None entries stay None."""
    return tuple(None if t is None else t[start:stop] for t in tensors)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, rows, adjust, row_args, row_weight):  # (N, C), (V, C), (N,)
        n_valid = (targets != IGNORE_INDEX).sum().clamp_min(1)
        acc = torch.promote_types(hidden.dtype, torch.float32)
        total = torch.zeros((), dtype=acc, device=hidden.device)
        need_h, need_w = ctx.needs_input_grad[:2]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        for start in range(0, hidden.shape[0], rows):
            h, y = hidden[start:start + rows], targets[start:start + rows]
            (w,) = _rows((row_weight,), start, start + rows)
            loss, logits = _chunk_loss(h, weight, y, adjust, _rows(row_args, start, start + rows), w)
            total += loss
            if grad_h is None and grad_w is None:
                continue
            d_logits = logits.softmax(dim=-1)  # (n, V): softmax - onehot, zero on ignored rows
            valid = y != IGNORE_INDEX
            d_logits.scatter_add_(1, y.clamp_min(0)[:, None], -valid[:, None].to(d_logits.dtype))
            d_logits.mul_(valid[:, None] if w is None else (valid * w)[:, None].to(d_logits.dtype))
            d_logits = d_logits.to(hidden.dtype)
            if grad_h is not None:
                grad_h[start:start + rows] = d_logits @ weight.to(hidden.dtype)
            if grad_w is not None:
                grad_w += (d_logits.T @ h).to(acc)
        ctx.save_for_backward(grad_h, grad_w, n_valid)
        return total / n_valid

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w, n_valid = ctx.saved_tensors
        scale = grad_out / n_valid
        d_h = (grad_h * scale.to(grad_h.dtype)) if grad_h is not None else None
        d_w = (grad_w * scale) if grad_w is not None else None
        return d_h, d_w, None, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         chunk_elements: Optional[int] = None, *,
                         adjust: Optional[Callable[..., torch.Tensor]] = None, row_args: tuple = (),
                         row_weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` against ``targets`` (-1 ignored), chunked over rows.

    hidden (..., C), weight (V, C), targets (...) int64 -> scalar loss (float32, or float64 for float64).
    ``chunk_elements`` defaults to :func:`default_chunk_elements` of hidden's device. ``adjust(logits (n, V), *rows of
    row_args) -> logits`` edits each chunk's logits with terms that carry no gradient; each of
    ``row_args`` and ``row_weight`` has the shape of ``targets``. The loss is
    ``sum_n row_weight_n CE_n / N_valid``.
    """
    if not isinstance(hidden, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError("hidden and weight must be torch.Tensors")
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"weight must be (V, C={hidden.shape[-1]}), got {tuple(weight.shape)}")
    if not isinstance(targets, torch.Tensor):
        raise TypeError(f"targets must be an int64 torch.Tensor, got {type(targets).__name__}")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets must have shape {tuple(hidden.shape[:-1])}, got {tuple(targets.shape)}")
    if targets.dtype != torch.int64:
        raise TypeError(f"targets must be int64, got {targets.dtype}")
    chunk_elements = default_chunk_elements(hidden.device) if chunk_elements is None else chunk_elements
    if isinstance(chunk_elements, bool) or not isinstance(chunk_elements, int):
        raise TypeError(f"chunk_elements must be None or an int, got {type(chunk_elements).__name__}")
    if chunk_elements < 1:
        raise ValueError(f"chunk_elements must be >= 1, got {chunk_elements}")
    if adjust is not None and not callable(adjust):
        raise TypeError(f"adjust must be callable, got {type(adjust).__name__}")
    extras = tuple(row_args) + (() if row_weight is None else (row_weight,))
    for extra in extras:
        if not isinstance(extra, torch.Tensor) or extra.shape != targets.shape:
            raise ValueError(f"row_args and row_weight must be tensors of shape {tuple(targets.shape)}, "
                             f"got {tuple(getattr(extra, 'shape', ())) or type(extra).__name__}")
    rows = chunk_rows(weight.shape[0], chunk_elements)
    hidden, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    row_args = tuple(a.reshape(-1) for a in row_args)
    row_weight = None if row_weight is None else row_weight.reshape(-1)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(hidden, weight, targets, rows, adjust, row_args, row_weight)
    total = sum(_chunk_loss(hidden[i:i + rows], weight, targets[i:i + rows], adjust, _rows(row_args, i, i + rows),
                            _rows((row_weight,), i, i + rows)[0])[0] for i in range(0, hidden.shape[0], rows))
    return total / (targets != IGNORE_INDEX).sum().clamp_min(1)
