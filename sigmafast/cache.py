"""A static KV cache with ragged per-row lengths for burst and multi-order sampling."""

from __future__ import annotations

import torch
import torch.nn as nn

from . import kernels


class KVCache(nn.Module):
    """Keys and values of every processed input, per layer, row and head.

    Buffers ``k``, ``v``: (n_layer, B, H, L_max + 1, D); ``lens``: (B,) int64,
    the number of valid entries of each row. The extra last slot is a scratch
    slot that receives the masked-out writes of :meth:`append`, so appends
    are plain scatters with no host sync.

    - Burst read and the multi-order verify read use :meth:`layer`: one
      ``(B, H, L_max + 1, D)`` prefix per row shared by all queries and orders
      (never copied per order), masked by ``lens``.
    - :meth:`append` writes ``n[b]`` new entries of each row at ``lens[b]``.
    - :meth:`select` drops finished rows from the batch.
    """

    def __init__(self, n_layer: int, batch_size: int, n_head: int, max_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device=None) -> None:
        super().__init__()
        shape = (n_layer, batch_size, n_head, max_len + 1, head_dim)
        self.max_len = max_len
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("lens", torch.zeros(batch_size, dtype=torch.long, device=device), persistent=False)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, H, L_max + 1, D) key and value buffers of layer i (valid up to ``lens``)."""
        return self.k[i], self.v[i]

    def append(self, k_new: torch.Tensor, v_new: torch.Tensor, n: torch.Tensor) -> None:
        """Append entries ``r < n[b]`` of k_new, v_new (n_layer, B, H, R, D) after each row's ``lens[b]``."""
        kernels.reference.append_kv(self.k, self.v, self.lens, k_new, v_new, n)

    def select(self, rows: torch.Tensor) -> None:
        """Keep only the given batch rows (B',), in that order (a gather of the buffers)."""
        self.k, self.v, self.lens = self.k[:, rows], self.v[:, rows], self.lens[rows]
