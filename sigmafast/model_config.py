"""The σ-GPT architecture's configuration: a validated dataclass and named presets.

``SigmaGPTConfig`` is re-exported by :mod:`sigmafast.model` (its home in nanoGPT's layout); the position
encodings it names are described in :mod:`sigmafast.positions`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Optional

def known_fields(cls, d: dict) -> dict:
    """``d`` when every key is a field of the dataclass ``cls`` (a stored config), else a ValueError."""
    unknown = set(d) - {f.name for f in fields(cls)}
    if unknown:
        raise ValueError(f"unknown {cls.__name__} fields: {sorted(unknown)}")
    return d


POS_ENCODINGS = (
    "sinusoidal", "learned",
    "rope", "rope+sinusoidal", "rope+learned",
    "rope-v", "rope-v+sinusoidal", "rope-v+learned",
)
EMBEDDING_INITS = ("normal", "orthogonal")
FINAL_NORMS = ("layernorm", "scalar")

PRESETS: dict[str, dict] = {
    "tiny": dict(n_layer=2, n_head=2, n_embd=64),
    "small": dict(n_layer=4, n_head=4, n_embd=128),
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024),
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, block_size=1024),
}


@dataclass
class SigmaGPTConfig:
    vocab_size: int = 50257
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True
    pos_encoding: str = "sinusoidal"
    bos_token_id: Optional[int] = None
    embedding_init: str = "normal"  # "orthogonal": orthonormal token rows, at the normal init's norm
    mlp_ratio: int = 4  # MLP hidden width / n_embd; 0: attention-only blocks (no MLP, no second LayerNorm)
    final_norm: str = "layernorm"  # "scalar": the final LayerNorm has one learned gain, no per-channel affine

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"SigmaGPTConfig.{name} must be a positive int, got {value!r}")
        if not isinstance(self.mlp_ratio, int) or isinstance(self.mlp_ratio, bool) or self.mlp_ratio < 0:
            raise ValueError(f"SigmaGPTConfig.mlp_ratio must be an int >= 0, got {self.mlp_ratio!r}")
        if self.vocab_size < 2:
            raise ValueError(f"SigmaGPTConfig.vocab_size must be >= 2 (one id is BOS), got {self.vocab_size}")
        if self.n_embd % (2 * self.n_head) != 0:
            raise ValueError(
                f"SigmaGPTConfig.n_embd ({self.n_embd}) must be divisible by 2*n_head ({2 * self.n_head}): "
                "the embedding is split in two positional halves and into heads"
            )
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) \
                or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"SigmaGPTConfig.dropout must be a number in [0, 1), got {self.dropout!r}")
        if not isinstance(self.bias, bool):
            raise ValueError(f"SigmaGPTConfig.bias must be True or False, got {self.bias!r}")
        if self.pos_encoding not in POS_ENCODINGS:
            raise ValueError(
                f"SigmaGPTConfig.pos_encoding must be one of {POS_ENCODINGS}, got {self.pos_encoding!r}"
            )
        if self.embedding_init not in EMBEDDING_INITS:
            raise ValueError(
                f"SigmaGPTConfig.embedding_init must be one of {EMBEDDING_INITS}, got {self.embedding_init!r}"
            )
        if self.final_norm not in FINAL_NORMS:
            raise ValueError(f"SigmaGPTConfig.final_norm must be one of {FINAL_NORMS}, got {self.final_norm!r}")
        if self.bos_token_id is None:
            self.bos_token_id = self.vocab_size - 1
        if isinstance(self.bos_token_id, bool) or not isinstance(self.bos_token_id, int) \
                or not 0 <= self.bos_token_id < self.vocab_size:
            raise ValueError(
                f"SigmaGPTConfig.bos_token_id must be an int in [0, vocab_size={self.vocab_size}), "
                f"got {self.bos_token_id!r}"
            )

    @property
    def start_pos(self) -> int:
        """The reserved position index of the BOS start token."""
        return self.block_size

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def rotary(self) -> bool:
        """Whether queries and keys are rotated by their positions."""
        return self.pos_encoding.startswith("rope")

    @property
    def rotary_values(self) -> bool:
        """Whether values are rotated too, and attention outputs rotated back (``rope-v``)."""
        return self.pos_encoding.startswith("rope-v")

    @property
    def absolute(self) -> Optional[str]:
        """The absolute encoding added to the embeddings ("sinusoidal", "learned") or None."""
        name = self.pos_encoding.split("+")[-1]
        return None if name.startswith("rope") else name

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "SigmaGPTConfig":
        return cls(**known_fields(cls, d))

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "SigmaGPTConfig":
        """Architecture from a named preset; task-specific fields come from ``overrides``."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; expected one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})
