"""Peak-memory estimates, checked before anything big is allocated.

:func:`training_peak_bytes` estimates one training process's peak from the
model config alone; :func:`sampling_peak_bytes` the largest tensors of one
burst iteration, :func:`decoding_peak_bytes` those of autoregressive sampling
(its KV cache). :func:`available_bytes` reads what the device has free, and
the ``check_*_memory`` functions turn an estimate that exceeds it into a
one-line ``ValueError`` naming what reduces it; :func:`check_canvas_memory`
runs before a sampler builds its canvas.

The estimates count only the dominant terms: the activation term is within
10% of the bytes autograd saves (``tests/test_memory.py``), and allocator
slack, the CUDA context and the interpreter come on top. An estimate above the
available memory therefore means the run clearly does not fit.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch

from .loss import LOSS_CHUNK_ELEMENTS
from .model import SigmaGPTConfig

GIB = 2**30
FP32_BYTES = 4
ADAMW_BYTES_PER_PARAM = 16  # fp32 weight, gradient, exp_avg and exp_avg_sq
ACTIVATIONS_ATTENTION = 6  # saved (token, channel) elements per layer's attention, see training_peak_bytes
ACTIVATIONS_OUTSIDE = 2  # final LayerNorm in and out (the embeddings' sum is the first block's input)
LOSS_COPIES = 3  # a chunk's logits, their softmax and their gradient, fp32 (chunks of LOSS_CHUNK_ELEMENTS)
BLOCK_COPIES = 4  # a row block's logits, probabilities, CDF and signs, fp32 (kernels.row_blocks, reference path)
SCORE_COPIES = 2  # the reference attention's (B, O, H, R, L + R) scores and their softmax
LOSS_WEIGHT_GRADS = 2  # the chunked loss's (V, C) fp32 weight gradient, and its scaled copy in the backward
SAMPLING_CHECK_FLOOR = 256 * 2**20  # smaller estimates skip reading the free memory
CANVAS_BYTES = 8 + 1 + 8  # per token: the int64 canvas, the bool known mask, an int64 temporary while building them
TRAINING_FLAGS = ("--batch-size (raise --grad-accum to keep the tokens per step), --seq-len, or the model "
                  "(--preset, --n-embd, --n-layer)")


def model_state_elements(config: SigmaGPTConfig) -> int:
    """Parameters plus buffers of ``SigmaGPT(config)``, counted without building it.

    Per block (4 + 2 r) C^2 weights (q/k/v 3, projection 1, MLP r + r for ``mlp_ratio`` r)
    and (9 + r) C biases and LayerNorm parameters (2 C without biases); an attention-only
    block (r = 0) has no MLP and no second LayerNorm (6 C, or C). The token embedding is
    tied to the LM head (V C); absolute positions are two learned (T + 1, C / 2) tables or one
    sinusoidal buffer, and RoPE keeps two (T + 1, D) tables of cosines and sines (head dim D); the
    final LayerNorm has 2 C parameters (C without biases, 1 scalar).
    """
    C, n_pos, r = config.n_embd, config.block_size + 1, config.mlp_ratio
    norms = 1 + (r > 0)
    per_layer = (4 + 2 * r) * C * C + ((4 + r + (r > 0) + 2 * norms) * C if config.bias else norms * C)
    absolute = {"learned": n_pos * C, "sinusoidal": n_pos * (C // 2)}.get(config.absolute, 0)
    positions = absolute + (2 * n_pos * config.head_dim if config.rotary else 0)
    final_norm = 1 if config.final_norm == "scalar" else 2 * C if config.bias else C
    return config.vocab_size * C + positions + config.n_layer * per_layer + final_norm


def loss_chunk_rows(vocab_size: int) -> int:
    """Rows of logits per chunk of the chunked cross-entropy."""
    return max(1, LOSS_CHUNK_ELEMENTS // vocab_size)


def training_peak_bytes(config: SigmaGPTConfig, batch_size: int, seq_len: int, activation_bytes: int = FP32_BYTES
                        ) -> int:
    """Estimated peak bytes of one training process (one micro-batch of ``batch_size`` x ``seq_len``).

    With P parameters (+ buffers), L layers, width C, batch B, length T, vocabulary V
    and ``activation_bytes`` s per activation (4 in fp32, 2 under bf16 autocast)::

        16 P                                    fp32 weights, gradients, AdamW's two moments
      + s B T C ((8 + 2 r - n) L)               activations saved for the backward
      + 4 B T C (n L + 2)                       the LayerNorms' inputs (the residual stream) and the final
                                                norm's output: float32 even under autocast
      + 4 (3 min(B T, rows) V + B T C + 2 V C)  chunked loss: logits, softmax, gradient of a chunk; the
                                                stored gradients of the hidden states and of the weight
      + s ((4 + 2 r) C^2 L + V C)               under autocast (s < 4) only: the 16-bit copies of the
                                                matmuls' weights that autocast keeps for the backward

    Per layer and (token, channel), nanoGPT-style (Korthikanti et al. 2022, table 2,
    without dropout masks): the attention block saves its LayerNorm input, the q/k/v
    projection input, q, k, v and the attention output (about 5 + the LayerNorm's 1);
    the MLP saves its input, the r C GELU input and the r C GELU output (1 + 2 r, for
    ``mlp_ratio`` r), the second LayerNorm 1: 16 in all at r = 4, 6 for an attention-only
    block (r = 0), of which the n LayerNorm inputs (n = 2, or 1 without an MLP) are float32
    under autocast (layer_norm runs in float32). Attention is fused (scaled_dot_product_attention), so no
    T x T matrix is stored. ``rows = max(1, 2**25 // V)``: the loss never holds more
    than 2**25 logits at a time.
    """
    B, T = batch_size, seq_len
    states = ADAMW_BYTES_PER_PARAM * model_state_elements(config)
    C, L, V = config.n_embd, config.n_layer, config.vocab_size
    per_layer = ACTIVATIONS_ATTENTION + (2 + 2 * config.mlp_ratio if config.mlp_ratio else 0)
    norms = 1 + (config.mlp_ratio > 0)
    low, fp32 = (per_layer - norms) * L, norms * L + ACTIVATIONS_OUTSIDE  # elements per (token, channel)
    activations = B * T * C * (activation_bytes * low + FP32_BYTES * fp32)
    loss = FP32_BYTES * (LOSS_COPIES * min(B * T, loss_chunk_rows(V)) * V + B * T * C + LOSS_WEIGHT_GRADS * V * C)
    casts = activation_bytes * ((4 + 2 * config.mlp_ratio) * C * C * L + V * C) if activation_bytes < FP32_BYTES else 0
    return states + activations + loss + casts


def sampling_peak_bytes(config: SigmaGPTConfig, batch_size: int, num_orders: int, seq_len: int,
                        param_bytes: int, block_elements: Optional[int] = None) -> int:
    """Estimated bytes of the largest tensors of one burst iteration.

    With B rows, O orders, T positions (R <= T remaining), width C, L layers,
    vocabulary V and ``param_bytes`` s::

        16 B O T                  order keys (float64) and their argsort (int64)
      + s B O T C (2 L + 6)       verification: every layer's keys and values, and the activations of one layer
      + 4 B T V                   the draft's logits, whole (the Triton path: its residual reads them)
        or 16 N                   (the reference path, ``block_elements`` N) ``BLOCK_COPIES`` float32
        + 2 s B O H T (2 T + 1)   temporaries of a block of rows of logits (``kernels.row_blocks``), and
                                  the verifier attention's scores and their softmax, ``SCORE_COPIES``
                                  (H heads; R <= T queries over the T + 1 cache slots and R drafts)

    Neither path writes the (B, O, R, V) verifier logits whole: the Triton kernels score the
    drafts from hidden states in chunks, the reference a block of rows at a time, and the
    reference path draws the drafts from hidden states a block at a time too. The Triton
    attention keeps no scores; the reference's (``kernels.reference.verify_attention``) are the
    largest tensors of a long canvas (a prompt's prefill is such a verification, of one order).
    """
    B, O, T = batch_size, num_orders, seq_len
    keys = 16 * B * O * T
    verify = param_bytes * B * O * T * config.n_embd * (2 * config.n_layer + 6)
    if block_elements is None:
        logits = FP32_BYTES * B * T * config.vocab_size
    else:
        scores = SCORE_COPIES * param_bytes * B * O * config.n_head * T * (2 * T + 1)
        logits = BLOCK_COPIES * FP32_BYTES * block_elements + scores
    return keys + verify + logits


def decoding_peak_bytes(config: SigmaGPTConfig, batch_size: int, seq_len: int, param_bytes: int,
                        prefill: int = 0) -> int:
    """Estimated bytes of autoregressive sampling's largest tensors: with B rows, T positions, width C,
    L layers, H heads, vocabulary V, ``param_bytes`` s and ``prefill`` M::

        2 s L B (T + 1) C         the KV cache, keys and values at full length (and its scratch slot)
      + 6 s B C                   one step's activations
      + 4 B V                     one step's logits, float32
      + CANVAS_BYTES B T          the canvas and its known mask
      + 2 s B H M (T + 1 + M)     the reference attention's scores and their softmax (``SCORE_COPIES``) in the
                                  prefill of a prompt of M tokens (the queries against every cache slot and the
                                  prompt; pass M = 0 where the attention keeps no scores: the Triton path)
    """
    B, T, C, M = batch_size, seq_len, config.n_embd, prefill
    cache = 2 * param_bytes * config.n_layer * B * (T + 1) * C
    scores = SCORE_COPIES * param_bytes * B * config.n_head * M * (T + 1 + M)
    return cache + 6 * param_bytes * B * C + FP32_BYTES * B * config.vocab_size + CANVAS_BYTES * B * T + scores


def density_peak_bytes(config: SigmaGPTConfig, batch_size: int, seq_len: int, param_bytes: int,
                       reference: bool) -> int:
    """Estimated bytes of one forward that returns (B, T, V) probabilities (``conditional_density``,
    ``log_likelihood``): a one-order burst's (:func:`sampling_peak_bytes`; ``reference``: the reference
    attention's scores too) with the logits whole, plus ``s B T V`` for them in the model's dtype and two float32
    copies (their upcast and the probabilities)::

        sampling_peak_bytes(O = 1) - 4 B T V + (s + 8) B T V
    """
    B, T, V = batch_size, seq_len, config.vocab_size
    base = sampling_peak_bytes(config, B, 1, T, param_bytes, block_elements=0 if reference else None)
    if not reference:
        base -= FP32_BYTES * B * T * V  # the burst's draft logits, counted below in the model's dtype
    return base + (param_bytes + 2 * FP32_BYTES) * B * T * V


def _meminfo_available() -> Optional[int]:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def available_bytes(device: torch.device) -> Optional[int]:
    """Free memory of ``device``: CUDA's free bytes and those that PyTorch's caching allocator holds unused (freed
    tensors, e.g. a training step's, which ``mem_get_info`` counts as taken), the CPU's available RAM; None when
    unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free) + max(0, int(cached))
    if device.type != "cpu":
        return None
    available = _meminfo_available()
    if available is not None:
        return available
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_training_memory(config: SigmaGPTConfig, batch_size: int, seq_len: int, device: torch.device,
                          activation_bytes: int = FP32_BYTES, available: Optional[int] = None) -> int:
    """The :func:`training_peak_bytes` estimate; a ``ValueError`` naming the flags that reduce it when it
    exceeds the available memory of ``device`` (read now unless ``available`` is given)."""
    need = training_peak_bytes(config, batch_size, seq_len, activation_bytes)
    return _check_fits(need, device, available, "training", " (estimated peak)", TRAINING_FLAGS)


def check_sampling_memory(config: SigmaGPTConfig, batch_size: int, num_orders: int, seq_len: int,
                          device: torch.device, param_bytes: int, block_elements: Optional[int] = None,
                          available: Optional[int] = None, *, what: Optional[str] = None,
                          remedy: Optional[str] = None) -> int:
    """The :func:`sampling_peak_bytes` estimate; a ``ValueError`` naming ``remedy`` (by default the batch, and
    ``num_orders`` when it is above 1; the trainer's validity sampling names its own flag) when it exceeds the
    available memory of ``device``. The free memory is read (unless ``available`` is given) only for estimates above
    ``SAMPLING_CHECK_FLOOR``: small calls cost nothing."""
    need = sampling_peak_bytes(config, batch_size, num_orders, seq_len, param_bytes, block_elements)
    what = what or f"num_orders={num_orders} with {batch_size} rows of {seq_len} tokens"
    if remedy is None:  # one order cannot be fewer (and the lossless rule takes exactly one)
        remedy = "num_orders or the batch" if num_orders > 1 else "the batch"
    return _check_fits(need, device, available, what, " per burst iteration", remedy, sampling=True)


def check_decoding_memory(config: SigmaGPTConfig, batch_size: int, seq_len: int, device: torch.device,
                          param_bytes: int, available: Optional[int] = None, prefill: int = 0) -> int:
    """The :func:`decoding_peak_bytes` estimate; a ``ValueError`` naming the batch when it exceeds the
    available memory of ``device`` (read only for estimates above ``SAMPLING_CHECK_FLOOR``)."""
    need = decoding_peak_bytes(config, batch_size, seq_len, param_bytes, prefill)
    what = f"autoregressive sampling of {batch_size} rows of {seq_len} tokens"
    return _check_fits(need, device, available, what, " (its KV cache at full length)", "the batch", sampling=True)


def check_density_memory(config: SigmaGPTConfig, batch_size: int, seq_len: int, device: torch.device,
                         param_bytes: int, reference: bool, available: Optional[int] = None) -> int:
    """The :func:`density_peak_bytes` estimate; a ``ValueError`` naming the batch when it exceeds the available
    memory of ``device`` (read only for estimates above ``SAMPLING_CHECK_FLOOR``)."""
    need = density_peak_bytes(config, batch_size, seq_len, param_bytes, reference)
    what = f"the probabilities of {batch_size} rows of {seq_len} tokens over {config.vocab_size} values"
    return _check_fits(need, device, available, what, " (one forward)", "the batch (the rows of idx)", sampling=True)


def check_canvas_memory(batch_size: int, seq_len: int, device: torch.device, available: Optional[int] = None) -> int:
    """``CANVAS_BYTES`` per token of a (``batch_size``, ``seq_len``) canvas; a ``ValueError`` naming the rows of
    ``idx`` when even that exceeds the available memory of ``device``: checked before the canvas is built, so
    that a huge batch (an ``expand``-ed ``idx`` costs nothing) fails with a message, not in the allocator."""
    need = CANVAS_BYTES * batch_size * seq_len
    what = f"a canvas of {batch_size} rows of {seq_len} tokens"
    return _check_fits(need, device, available, what, " before sampling starts", "the batch (the rows of idx)",
                       sampling=True)


def _check_fits(need: int, device: torch.device, available: Optional[int], what: str, per: str, remedy: str,
                sampling: bool = False) -> int:
    """``need``; a ``ValueError`` "<what> needs about X GiB<per> but <device> has Y GiB available: reduce
    <remedy>" when it exceeds the available memory of ``device`` (read now unless ``available`` is given).
    ``sampling``: a sampling call's estimate, whose free memory is read only above ``SAMPLING_CHECK_FLOOR``
    (small calls cost nothing)."""
    if sampling and available is None and need < SAMPLING_CHECK_FLOOR:
        return need
    have = available_bytes(device) if available is None else available
    if have is not None and need > have:
        raise ValueError(
            f"{what} needs about {need / GIB:.1f} GiB{per} but {device} has {have / GIB:.1f} GiB available: "
            f"reduce {remedy}"
        )
    return need
