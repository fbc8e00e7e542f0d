"""Fixed-step ancestral sampling of a :class:`DiffusionGPT`, with the calling conventions of
:func:`sigmafast.generate` (prompts, ``known`` infilling, generator, temperature, top-k, stats).

S steps walk the time grid t_k = k/S from k = S down to 1; step k runs the
model once on (x_{t_k}, t_k) and draws x_{t_{k-1}} from the x0-parameterised
reverse law (:mod:`sigmafast.diffusion.noise`). Known positions are clamped to
their tokens at every step (the clean tokens are given to the model as is).
Temperature and top-k act on p_θ(x_0 | x_t); ``temperature=0`` takes its
argmax (the unmasking decisions and the uniform posterior stay random).

Randomness protocol: every draw is a float64 (B, T) tensor from the caller's
``generator`` (:func:`sigmafast.request.draw`), over all positions.

- absorbing: per step, ``u_unmask`` then ``u_token``; an unknown masked position
  is unmasked iff u_unmask < 1/k, to the token drawn by inverse CDF with u_token.
- uniform: ``u_init`` once (x_1 uniform over the data ids), then per step
  ``u_token``, the inverse-CDF uniform of the reverse law.

The step loop reads nothing on the host; the steps set a () bool flag on the device when the logits of
an unknown position are not finite, read once after the loop (a ``ValueError``, as in
``sigmafast.generate``). ``stats.accepted[b, k]`` counts the positions unmasked (absorbing) or changed
(uniform) at step k.
"""

from __future__ import annotations

import numbers
import time
from typing import Optional

import torch

from .. import kernels
from ..kernels.reference import inverse_cdf, process_logits
from ..request import SampleStats, check_return_stats, draw, inference, nonfinite_error, prepare
from .model import DiffusionGPT
from .noise import alpha, uniform_posterior, uniform_tokens

__all__ = ["generate"]


def _check_model(model) -> DiffusionGPT:
    if not isinstance(model, DiffusionGPT):
        raise TypeError(
            f"sigmafast.diffusion.generate needs a DiffusionGPT (a checkpoint trained with --objective diffusion), "
            f"got {type(model).__name__}; sample a σ-GPT with sigmafast.generate"
        )
    return model


def _check_steps(steps, seq_len: int) -> int:
    if steps is None:
        return max(seq_len, 1)
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral):
        raise TypeError(f"steps must be an int or None, got {type(steps).__name__}")
    steps = int(steps)  # a NumPy integer too, as max_new_tokens and top_k
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    return steps


def x0_probs(logits: torch.Tensor, temperature: float, top_k: Optional[int]) -> torch.Tensor:
    """(B, T, V) p_θ(x_0 | x_t) after temperature and top-k, in float32; one-hot argmax when greedy."""
    logits = logits.float()
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return torch.softmax(process_logits(logits, temperature, top_k), dim=-1)


def _absorbing_step(model, x, masked, k: int, t, req, flag):
    """One reverse step from t_k; returns the new tokens, mask and the (B,) unmasked counts."""
    B, T = x.shape
    logits = model(x, t)  # (B, T, V)
    u_unmask = draw(req.generator, (B, T), x.device)
    u_token = draw(req.generator, (B, T), x.device)
    tokens, _ = kernels.sample(logits.reshape(B * T, -1), u_token.reshape(B * T), req.temperature, req.top_k,
                               used=masked.reshape(B * T), flag=flag)
    unmask = masked & (u_unmask < 1.0 / k)  # (B, T); 1/k = (α_s - α_t) / (1 - α_t)
    return torch.where(unmask, tokens.view(B, T), x), masked & ~unmask, unmask.sum(1)


def _uniform_step(model, x, known, k: int, steps: int, t, req, flag):
    """One reverse step from t_k to t_{k-1}; returns the new tokens and the (B,) changed counts."""
    B, T = x.shape
    logits = model(x, t)  # (B, T, V)
    kernels.flag_nonfinite(logits, ~known, flag)
    s = torch.full_like(t, (k - 1) / steps)
    post = uniform_posterior(x0_probs(logits, req.temperature, req.top_k), x, alpha(t), alpha(s), model.mask_id)
    u_token = draw(req.generator, (B, T), x.device)
    new = inverse_cdf(post.reshape(B * T, -1), u_token.reshape(B * T)).view(B, T)
    new = torch.where(known, x, new)
    return new, (new != x).sum(1)


def generate(model, idx: torch.Tensor, max_new_tokens: Optional[int] = None, temperature: float = 1.0,
             top_k: Optional[int] = None, *, steps: Optional[int] = None, known: Optional[torch.Tensor] = None,
             generator: Optional[torch.Generator] = None, return_stats: bool = False):
    """Sample the unknown positions of a canvas in ``steps`` model calls; returns (B, T) [and stats]. The
    arguments before ``steps`` are :func:`sigmafast.generate`'s (nanoGPT's), positional too.

    - Prompt: ``idx`` (B, P) at positions 0..P-1 plus ``max_new_tokens`` -> (B, P + max_new_tokens).
    - Infilling: ``idx`` (B, T) canvas and ``known`` (B, T) bool; known tokens are returned unchanged.

    ``steps`` >= 1 (default T, the canvas length; more steps than tokens unmask fewer at once). Stats are a
    :class:`~sigmafast.request.SampleStats` with ``forward_calls == steps``
    (0 when nothing is unknown), ``iterations`` = steps per row and
    ``burst_lengths`` None.
    """
    model = _check_model(model)
    req = prepare(model.backbone, idx, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                  known=known, generator=generator)
    check_return_stats(return_stats)
    B, T = req.canvas.shape
    S = _check_steps(steps, T)
    if bool((req.known & (req.canvas == model.mask_id)).any()):
        raise ValueError(f"known tokens must not be the MASK / BOS id {model.mask_id}")
    t0 = time.perf_counter()
    canvas, known_now = req.canvas, req.known
    counts = []
    with inference(model):
        if T > 0 and not bool(known_now.all()):  # one host read, before the loop
            flag = torch.zeros((), dtype=torch.bool, device=canvas.device)
            canvas, counts = _run(model, canvas, known_now, S, req, flag)
            if bool(flag):  # one read after the loop, of the flag the steps set on the device
                raise nonfinite_error("logits")
    calls = len(counts)
    accepted = torch.stack(counts, 1) if counts else torch.zeros(B, 0, dtype=torch.long, device=canvas.device)
    if canvas.is_cuda:
        torch.cuda.synchronize(canvas.device)
    stats = SampleStats(torch.full((B,), calls, dtype=torch.long, device=canvas.device), calls, accepted, None,
                        time.perf_counter() - t0)
    return (canvas, stats) if return_stats else canvas


def _run(model: DiffusionGPT, canvas: torch.Tensor, known: torch.Tensor, steps: int, req, flag):
    """The S reverse steps from t = 1; returns the final tokens and the per-step (B,) counts; sets the () bool
    ``flag`` when the logits of an unknown position are not finite."""
    B, T = canvas.shape
    device = canvas.device
    counts = []
    if model.noise == "absorbing":
        x = torch.where(known, canvas, torch.full_like(canvas, model.mask_id))
        masked = ~known
        for k in range(steps, 0, -1):
            t = torch.full((B,), k / steps, device=device)
            x, masked, n = _absorbing_step(model, x, masked, k, t, req, flag)
            counts.append(n)
        return x, counts
    u_init = draw(req.generator, (B, T), device)
    x = torch.where(known, canvas, uniform_tokens(u_init, model.config.vocab_size, model.mask_id))
    for k in range(steps, 0, -1):
        t = torch.full((B,), k / steps, device=device)
        x, n = _uniform_step(model, x, known, k, steps, t, req, flag)
        counts.append(n)
    return x, counts
