"""Discrete-diffusion noise processes: forward corruption, closed-form marginals, reverse steps, losses.

Continuous time t ∈ [0, 1] with the linear schedule α_t = 1 - t: α_t is the
probability that a token is still clean at time t (α_0 = 1: data, α_1 = 0:
pure noise). Tokens are corrupted independently. Let M be the absorbing MASK
id (the task's BOS id, never in data) and K = V - 1 the number of data ids
(every id but M).

**Uniform (D3PM, Austin et al. 2021, the σ-GPT paper's baseline).** Between
times s < t a token is kept with probability α_t/α_s and otherwise resampled
uniformly over the K data ids (``Q = a I + (1 - a)/K 11ᵀ`` on data ids). These
transitions compose, so

    q(x_t | x_0) = α_t δ(x_0) + (1 - α_t) / K        over the K data ids.

Reverse step t -> s with the x0-parameterisation p_θ(x_0 | x_t):

    p(x_s | x_t) = Σ_{x_0} q(x_s | x_t, x_0) p_θ(x_0 | x_t),
    q(x_s | x_t, x_0) = q(x_t | x_s) q(x_s | x_0) / q(x_t | x_0).

With w(v) = p_θ(v | x_t) / q(x_t | x_0 = v), W = Σ_v w(v) and
A(v) = q(x_t | x_s = v) = α_t/α_s δ(v = x_t) + (1 - α_t/α_s)/K, the sum is

    p(x_s = v | x_t) = A(v) [α_s w(v) + (1 - α_s) W / K]       (:func:`uniform_posterior`)

which costs O(V) per token; at s = 0 it reduces to p_θ(x_0 | x_t).
Training loss: the x0 cross-entropy over every position, E_t E_q[-log
p_θ(x_0 | x_t)], i.e. D3PM's auxiliary term alone (the λ -> ∞ limit of its
hybrid loss). It is the quantity the x0-parameterised reverse step needs
(a calibrated p_θ(x_0 | x_t)), it has no variance from the ELBO weights, and
it costs one cross-entropy; the price is that it is not a likelihood bound, so
the uniform model's validation loss is not comparable to σ-GPT's nats/token.

**Absorbing (MDLM, Sahoo et al. 2024; LLaDA).** A token jumps to M and stays:

    q(x_t | x_0) = α_t δ(x_0) + (1 - α_t) δ(M).

Reverse step t -> s for a masked token: unmask with probability
(α_s - α_t)/(1 - α_t) (= 1/k from t = k/S to s = (k-1)/S) to a token drawn
from p_θ(x_0 | x_t), else stay masked; clean tokens are carried over. The
model never predicts M (its logit is -inf). Training loss: MDLM's
continuous-time NELBO per token,

    L = E_{t ~ U(0,1)} E_q [ -α'_t / (1 - α_t) Σ_{i: x_t^i = M} -log p_θ(x_0^i | x_t) ] / T,

with -α'_t/(1 - α_t) = 1/t here: an upper bound on -log p(x)/T in nats per
token, comparable to σ-GPT's validation loss.

Training times are drawn with MDLM's low-discrepancy sampler (one uniform
offset per batch, t_i = (u + i/B) mod 1, mapped to [t_min, 1]), which lowers
the variance of the 1/t weight.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

NOISES = ("uniform", "absorbing")
T_MIN = 1e-3  # smallest training time: bounds the absorbing weight 1/t


def check_noise(noise: str) -> str:
    if noise not in NOISES:
        raise ValueError(f"noise must be one of {NOISES}, got {noise!r}")
    return noise


def alpha(t: torch.Tensor) -> torch.Tensor:
    """Keep probability α_t = 1 - t of the linear schedule."""
    return 1.0 - t


def data_ids(vocab_size: int, mask_id: int, device=None) -> torch.Tensor:
    """(V,) bool: True on every id but the MASK / BOS id."""
    ids = torch.ones(vocab_size, dtype=torch.bool, device=device)
    ids[mask_id] = False
    return ids


def uniform_tokens(u: torch.Tensor, vocab_size: int, mask_id: int) -> torch.Tensor:
    """Uniforms in [0, 1) -> data ids uniform over the K = V - 1 ids that are not ``mask_id``."""
    r = (u * (vocab_size - 1)).long().clamp_max(vocab_size - 2)
    return r + (r >= mask_id).long()


def corrupt(x0: torch.Tensor, t: torch.Tensor, noise: str, vocab_size: int, mask_id: int,
            u_keep: torch.Tensor, u_token: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A draw of x_t ~ q(x_t | x_0) from given uniforms.

    x0 (B, T) ids, t (B,) times, u_keep (B, T) and, for "uniform", u_token (B, T)
    in [0, 1). Position i stays clean iff u_keep < α_t.
    """
    keep = u_keep < alpha(t)[:, None]  # (B, T)
    if check_noise(noise) == "absorbing":
        return torch.where(keep, x0, torch.full_like(x0, mask_id))
    return torch.where(keep, x0, uniform_tokens(u_token, vocab_size, mask_id))


def marginal(x0: torch.Tensor, t: torch.Tensor, noise: str, vocab_size: int, mask_id: int) -> torch.Tensor:
    """(B, T, V) closed-form q(x_t | x_0) for x0 (B, T) and t (B,) (see the module docstring)."""
    a = alpha(t).double()[:, None, None]  # (B, 1, 1)
    clean = F.one_hot(x0, vocab_size).double()  # (B, T, V)
    if check_noise(noise) == "absorbing":
        masked = F.one_hot(torch.full_like(x0, mask_id), vocab_size).double()
        return a * clean + (1 - a) * masked
    spread = data_ids(vocab_size, mask_id, x0.device).double() / (vocab_size - 1)  # (V,)
    return a * clean + (1 - a) * spread


def uniform_posterior(p0: torch.Tensor, x_t: torch.Tensor, alpha_t: torch.Tensor, alpha_s: torch.Tensor,
                      mask_id: int) -> torch.Tensor:
    """(B, T, V) reverse law p(x_s | x_t) of uniform noise from the x0 law p0 (B, T, V).

    ``alpha_t`` < ``alpha_s`` are (B,) keep probabilities; p0 must be 0 on ``mask_id``.
    The result is 0 on ``mask_id`` and sums to 1 (see the module docstring). Its one (B, T, V) temporary
    becomes the result: no one-hot of x_t, and no second copy of the vocabulary axis.
    """
    K = p0.shape[-1] - 1
    a_t, a_s = alpha_t[:, None, None], alpha_s[:, None, None]  # (B, 1, 1)
    a_ts = a_t / a_s
    at = x_t.unsqueeze(-1)  # (B, T, 1): the one id where δ(v = x_t) is 1
    off_t, off_step = (1 - a_t) / K, (1 - a_ts) / K  # q(x_t | x_0 = v), q(x_t | x_s = v) at v != x_t
    w = p0 / off_t  # (B, T, V), the one temporary of this size
    w.scatter_(-1, at, p0.gather(-1, at) / (off_t + a_t))
    spread = (1 - a_s) / K * w.sum(-1, keepdim=True)  # (B, T, 1): (1 - α_s) W / K
    post = w.mul_(a_s).add_(spread)  # α_s w(v) + (1 - α_s) W / K
    on_step = post.gather(-1, at) * (off_step + a_ts)
    post.mul_(off_step).scatter_(-1, at, on_step)  # times A(v)
    post[..., mask_id] = 0
    return post.div_(post.sum(-1, keepdim=True))


class DiffusionBatch(NamedTuple):
    """One training or validation batch: clean x0, noised x_t (B, T) and times t (B,)."""

    x0: torch.Tensor
    x_t: torch.Tensor
    t: torch.Tensor

    def to(self, device) -> "DiffusionBatch":
        device = torch.device(device)
        if device.type == "cuda":
            return DiffusionBatch(*(x.pin_memory().to(device, non_blocking=True) for x in self))
        return DiffusionBatch(*(x.to(device) for x in self))


def sample_times(batch_size: int, generator: Optional[torch.Generator], device=None) -> torch.Tensor:
    """(B,) low-discrepancy times in [T_MIN, 1]: (u + i/B) mod 1, one uniform u per batch."""
    u = torch.rand((), generator=generator, device=device)
    strata = (u + torch.arange(batch_size, device=device) / batch_size) % 1.0
    return T_MIN + (1.0 - T_MIN) * strata


def noisy_batch(x0: torch.Tensor, noise: str, vocab_size: int, mask_id: int,
                generator: Optional[torch.Generator]) -> DiffusionBatch:
    """Times, then u_keep (B, T), then u_token (B, T) (uniform noise only), drawn from ``generator``."""
    B, T = x0.shape
    device = x0.device
    t = sample_times(B, generator, device)
    u_keep = torch.rand(B, T, generator=generator, device=device)
    u_token = torch.rand(B, T, generator=generator, device=device) if noise == "uniform" else None
    return DiffusionBatch(x0, corrupt(x0, t, noise, vocab_size, mask_id, u_keep, u_token), t)


def loss_weights(x_t: torch.Tensor, t: torch.Tensor, noise: str, mask_id: int) -> Optional[torch.Tensor]:
    """(B, T) per-token loss weights: the MDLM NELBO's -α'_t / (1 - α_t) = 1/t on masked tokens
    (absorbing), or None (uniform: plain x0 cross-entropy)."""
    if check_noise(noise) == "absorbing":
        return (x_t == mask_id).to(t.dtype) / t[:, None]
    return None


def add_uniform_log_likelihood(logits: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """(..., V) logits plus log q(x_t | x_0 = v) of uniform noise, for tokens x_t and times t of shape (...).

    q is α_t + (1 - α_t)/K at v = x_t and (1 - α_t)/K elsewhere (K = V - 1 data ids); only two
    values per row, so no (..., V) temporary beyond the result. Right for the data ids; the
    MASK id, which x_0 never takes, gets a finite value to be masked.
    """
    a = alpha(t).double()
    off = ((1 - a) / (logits.shape[-1] - 1)).log()  # (...)
    on = (a + (1 - a) / (logits.shape[-1] - 1)).log()
    index = x_t[..., None]
    out = logits + off[..., None].to(logits.dtype)
    return out.scatter(-1, index, logits.gather(-1, index) + on[..., None].to(logits.dtype))


def diffusion_loss(logits: torch.Tensor, batch: DiffusionBatch, noise: str, mask_id: int) -> torch.Tensor:
    """Scalar training loss from x0 logits (B, T, V): MDLM NELBO (absorbing) or x0-CE (uniform).

    The plain reference of :meth:`DiffusionGPT.loss`, which never builds the logits.
    """
    B, T, V = logits.shape
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)).reshape(B * T, V)
    ce = F.cross_entropy(logits, batch.x0.reshape(B * T), reduction="none").view(B, T)
    weight = loss_weights(batch.x_t, batch.t, noise, mask_id)
    return ce.mean() if weight is None else (ce * weight.to(ce.dtype)).mean()
