"""Positional encodings of the double (input, target) position: absolute tables and RoPE.

The absolute encodings ("sinusoidal", "learned") add ``concat(pe(in_pos), pe(out_pos))``
to each token's embedding (:func:`sinusoidal_table`, or a learned table).

With ``pos_encoding="rope"`` (or ``"rope+sinusoidal"`` / ``"rope+learned"``, which
also add an absolute encoding) the double encoding is *relative*: each
head's query is rotated by the target position ``out_pos`` and each key by the
token's own position ``in_pos`` (RoPE, Su et al. 2021), so an attention score
depends on ``out_pos_query - in_pos_key``: how far the visited token sits from
the position being predicted. Keys are rotated once, when computed, so a KV
cache stores rotated keys and the attention kernels take q and k as they are.

``pos_encoding="rope-v"`` (and ``"rope-v+sinusoidal"`` / ``"rope-v+learned"``)
also rotates each value by ``in_pos`` and each head's attention output back by
``out_pos``, so the output is ``sum_i a_i R(in_pos_i - out_pos) v_i``: what a
head reads carries the offset of the token it read from, not only its content.
With plain RoPE the residual stream never sees a position, and the model cannot
tell *where* the visited token it attended to sits. The rotation back is applied
after the attention, per query, so the KV cache (rotated values) and the
attention kernels are unchanged here too.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .kernels.reference_layers import rotate_pairs

ROPE_BASE = 10000.0
PE_SCALE = 0.02 * math.sqrt(2.0)  # channel RMS 0.02, as the token embeddings at init


def sinusoidal_table(n_pos: int, dim: int, scale: float = PE_SCALE) -> torch.Tensor:
    """(n_pos, dim) table: sin on even, cos on odd channels (Vaswani et al.), times ``scale``.

    The default scale gives every channel an RMS of 0.02, the std of the GPT-2
    token-embedding init. At unit amplitude (the original σ-GPT code) the fixed
    encoding outweighs the token embedding ~35:1 after the first LayerNorm, and
    small models barely see the tokens: a tiny left-to-right character model
    stayed at the unigram loss after 300 steps, and beat it by ~0.9 nats once
    scaled (``tests/test_text.py``).
    """
    pos = torch.arange(n_pos, dtype=torch.float64)[:, None]
    i = torch.arange(0, dim, 2, dtype=torch.float64)
    angle = pos / torch.pow(10000.0, i / dim)  # (n_pos, ceil(dim/2))
    table = torch.zeros(n_pos, dim, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angle)
    table[:, 1::2] = torch.cos(angle[:, : dim // 2])
    return (table * scale).float()


class Rotary(NamedTuple):
    """Rotation tables of the queries (by ``out_pos``) and keys (by ``in_pos``): (..., 1, T, D) each, the
    angles' ``[cos, cos]`` and ``[-sin, sin]`` (:func:`~sigmafast.kernels.reference_layers.turn_tables`).

    With ``values`` the values are rotated as the keys, and :meth:`restore` rotates
    each attention output back by its query's angle (``rope-v``).
    """

    cos_q: torch.Tensor
    sin_q: torch.Tensor
    cos_k: torch.Tensor
    sin_k: torch.Tensor
    values: bool = False

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """(..., H, T, D) rotated pairwise (x_i, x_{i + D/2}) by the angles of the (..., 1, T, D) tables
        (:func:`~sigmafast.kernels.reference_layers.rotate_pairs`)."""
        return rotate_pairs(x, cos, sin)

    def apply(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v (..., H, T, D) -> q rotated by ``out_pos``, k (and v with ``values``) by ``in_pos``."""
        q, k = self.rotate(q, self.cos_q, self.sin_q), self.rotate(k, self.cos_k, self.sin_k)
        return q, k, self.rotate(v, self.cos_k, self.sin_k) if self.values else v

    def restore(self, y: torch.Tensor) -> torch.Tensor:
        """(..., H, T, D) attention output, rotated back by ``out_pos`` with ``values``; else unchanged."""
        return rotate_pairs(y, self.cos_q, self.sin_q, back=True) if self.values else y


def rotary_tables(n_pos: int, head_dim: int, base: float = ROPE_BASE) -> tuple[torch.Tensor, torch.Tensor]:
    """(n_pos, head_dim / 2) cos and sin of the RoPE angles pos / base^(2i / head_dim)."""
    inv_freq = torch.pow(base, -torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angle = torch.arange(n_pos, dtype=torch.float64)[:, None] * inv_freq  # (n_pos, D/2)
    return angle.cos().float(), angle.sin().float()

