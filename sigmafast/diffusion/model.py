"""DiffusionGPT: the σ-GPT backbone run bidirectionally with a timestep embedding.

The backbone is an unchanged :class:`~sigmafast.model.SigmaGPT` (same weights,
same checkpoint layout under ``backbone.``). A token at position i gets the
double positional encoding with in_pos = out_pos = i, plus an embedding of the
diffusion time t shared by every token of the row, and the blocks run with
full (non-causal) attention through :meth:`SigmaGPT.run_layers`. The head
gives p_θ(x_0 | x_t) at every position; the MASK / BOS id is never predicted.

Uniform noise, ``parameterization="factored"`` (the default): token i of x_t
is a noisy copy of x_0^i alone, so the exact posterior factors as

    p(x_0^i = v | x_t) ∝ p(x_0^i = v | x_t^{-i}) q(x_t^i | x_0^i = v),

and the model adds the known log q(x_t^i | x_0^i = v) = log(α_t δ(v = x_t^i) +
(1 - α_t)/K) to the network's logits, which then only have to learn the
first factor. ``"plain"`` leaves the whole law to the network, which must then
learn the likelihood term itself; it is steep in t near t = 0 (its log-odds
grow like log(2/t)), and a tiny network learns it with errors of several
points where the last reverse steps use it (see ``tests/test_diffusion.py``).
Absorbing noise needs no such term: a clean token is carried over exactly.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..model import SigmaGPT, check_ids
from ..model_config import SigmaGPTConfig, known_fields
from ..loss import linear_cross_entropy
from .noise import NOISES, add_uniform_log_likelihood, loss_weights

OBJECTIVES = ("sigma", "diffusion")
PARAMETERIZATIONS = ("factored", "plain")
TIME_SCALE = 1000.0  # t ∈ [0, 1] is embedded as the "step" 1000 t, as in DDPM


@dataclass
class DiffusionConfig:
    noise: str = "uniform"
    parameterization: str = "factored"  # uniform noise only; see the module docstring

    def __post_init__(self) -> None:
        if self.noise not in NOISES:
            raise ValueError(f"DiffusionConfig.noise must be one of {NOISES}, got {self.noise!r}")
        if self.parameterization not in PARAMETERIZATIONS:
            raise ValueError(f"DiffusionConfig.parameterization must be one of {PARAMETERIZATIONS}, "
                             f"got {self.parameterization!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DiffusionConfig":
        # checkpoints older than the field are "plain"
        return cls(**{"parameterization": "plain", **known_fields(cls, d)})


def timestep_features(t: torch.Tensor, dim: int) -> torch.Tensor:
    """(B,) times in [0, 1] -> (B, dim) sinusoidal features of TIME_SCALE * t (sin half, cos half)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    angle = TIME_SCALE * t.float()[:, None] * freqs  # (B, half)
    return torch.cat([torch.sin(angle), torch.cos(angle)], dim=-1)


class TimestepEmbedding(nn.Module):
    """Sinusoidal features of t -> Linear -> GELU -> Linear, (B,) -> (B, C).

    The output layer starts at zero, so at initialisation the model is the backbone.
    """

    def __init__(self, n_embd: int, bias: bool = True) -> None:
        super().__init__()
        self.n_embd = n_embd
        self.fc = nn.Linear(n_embd, n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        nn.init.normal_(self.fc.weight, mean=0.0, std=0.02)
        nn.init.zeros_(self.proj.weight)
        for layer in (self.fc, self.proj):
            if layer.bias is not None:
                nn.init.zeros_(layer.bias)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        feats = timestep_features(t, self.n_embd).to(self.fc.weight.dtype)  # (B, C)
        return self.proj(F.gelu(self.fc(feats)))


class DiffusionGPT(nn.Module):
    """x0-predictor p_θ(x_0 | x_t, t) on the σ-GPT backbone; see the module docstring."""

    objective = "diffusion"

    def __init__(self, config: SigmaGPTConfig, diffusion: DiffusionConfig) -> None:
        super().__init__()
        if not isinstance(diffusion, DiffusionConfig):
            raise TypeError(f"diffusion must be a DiffusionConfig, got {type(diffusion).__name__}")
        self.backbone = SigmaGPT(config)
        self.diffusion_config = diffusion
        self.time_embed = TimestepEmbedding(config.n_embd, config.bias)
        never = torch.zeros(config.vocab_size, dtype=torch.bool)
        never[config.bos_token_id] = True
        self.register_buffer("never_predicted", never, persistent=False)  # (V,)

    @property
    def config(self) -> SigmaGPTConfig:
        return self.backbone.config

    @property
    def noise(self) -> str:
        return self.diffusion_config.noise

    @property
    def mask_id(self) -> int:
        """The absorbing MASK id: the config's BOS id, which must never occur in data (the trainer gives a
        model of GPT-2 tokens, whose BOS <|endoftext|> is data, one more id for it)."""
        return self.config.bos_token_id

    def num_params(self, non_embedding: bool = True) -> int:
        return self.backbone.num_params(non_embedding) + sum(p.numel() for p in self.time_embed.parameters())

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Bidirectional attention, (B, H, T, D) -> (B, H, T, D)."""
        dropout = self.config.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, is_causal=False, dropout_p=dropout)

    def forward(self, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """(B, T) noised tokens and (B,) times in [0, 1] -> (B, T, V) logits of x_0."""
        logits = self.backbone.lm_head(self.hidden_states(x_t, t))  # (B, T, V)
        B, T = x_t.shape
        return self.adjust_logits(logits, x_t, t[:, None].expand(B, T))

    def loss(self, x0: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The training loss of a noised batch (:func:`~sigmafast.diffusion.noise.diffusion_loss`),
        chunked over rows: the (B, T, V) logits are never materialised."""
        if not isinstance(x0, torch.Tensor) or x0.dtype != torch.int64:
            raise TypeError(f"x0 must be an int64 torch.Tensor, got {getattr(x0, 'dtype', type(x0).__name__)}")
        if x0.shape != x_t.shape:
            raise ValueError(f"x0 must have the shape of x_t {tuple(x_t.shape)}, got {tuple(x0.shape)}")
        check_ids("x0", x0, -1, self.config.vocab_size, "(-1 ignored)")
        hidden = self.hidden_states(x_t, t)  # (B, T, C)
        t_rows = t[:, None].expand(x_t.shape)  # (B, T)
        weight = loss_weights(x_t, t, self.noise, self.mask_id)
        return linear_cross_entropy(hidden, self.backbone.lm_head.weight, x0, adjust=self.adjust_logits,
                                    row_args=(x_t, t_rows), row_weight=weight)

    def hidden_states(self, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """(B, T) noised tokens and (B,) times -> (B, T, C) final hidden states."""
        if not isinstance(x_t, torch.Tensor) or x_t.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"x_t must be a (B, T) integer tensor, got {getattr(x_t, 'dtype', type(x_t).__name__)}")
        if x_t.dim() != 2:
            raise ValueError(f"x_t must have shape (B, T), got {tuple(x_t.shape)}")
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.shape != x_t.shape[:1]:
            raise ValueError(f"t must be a float tensor of shape (B,) = ({x_t.shape[0]},), got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        B, T = x_t.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        check_ids("x_t", x_t, 0, self.config.vocab_size)
        pos = torch.arange(T, device=x_t.device).expand(B, T)
        x = self.backbone.embed(x_t, pos, pos) + self.time_embed(t)[:, None, :]  # (B, T, C)
        return self.backbone.run_layers(x, self.attend, self.backbone.rotary(pos, pos))  # (B, T, C)

    def adjust_logits(self, logits: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """(..., V) network logits with their (...) noised tokens and times -> logits of x_0: the known
        log q(x_t | x_0) added for factored uniform noise, and -inf on the never-predicted MASK/BOS."""
        if self.noise == "uniform" and self.diffusion_config.parameterization == "factored":
            logits = add_uniform_log_likelihood(logits, x_t, t)
        return logits.masked_fill(self.never_predicted, float("-inf"))


def objective_of(model) -> str:
    """The training objective of ``model``: "diffusion" for a :class:`DiffusionGPT`, else "sigma"."""
    return getattr(model, "objective", "sigma")


def make_model(config: SigmaGPTConfig, objective: str = "sigma",
               diffusion: Optional[DiffusionConfig] = None) -> nn.Module:
    """A fresh SigmaGPT (``objective="sigma"``) or DiffusionGPT (needs ``diffusion``)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if objective == "sigma":
        if diffusion is not None:
            raise ValueError("a DiffusionConfig was given for objective 'sigma'")
        return SigmaGPT(config)
    if diffusion is None:
        raise ValueError("objective 'diffusion' needs a DiffusionConfig")
    return DiffusionGPT(config, diffusion)
