"""The neural σ-GPT as cached draft / verify conditionals for :mod:`sigmafast.sampler`.

Feeding follows σ-GPT: an input token carries its own position (``in_pos``)
and the position it predicts (``out_pos``); BOS sits at ``config.start_pos``.
After visiting m tokens in order σ the cache holds the inputs
``[BOS→σ1, x_σ1→σ2, …, x_σ(m-1)→σm]`` and the last token ``x_σm`` (at σm) is
kept aside: every next conditional feeds it with the wanted ``out_pos``
(with m = 0 the cache is empty and the last token is BOS at START).

- :meth:`NeuralSession.draft` is one burst forward: the last token once per
  queried position, each copy attending to the cache and to itself only.
- :meth:`NeuralSession.verify` is one forward over O orders at once, causal
  within each order, all orders sharing the cached prefix. It keeps every
  layer's keys and values.
- :meth:`NeuralSession.commit` appends the chosen order's first ``n`` inputs'
  keys and values (computed by verify, never recomputed).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import kernels
from .cache import KVCache


def _logits_dtype(logits: torch.Tensor) -> torch.Tensor:
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


class NeuralConditionals:
    """Adapter of a :class:`~sigmafast.model.SigmaGPT` to the sampler's conditionals protocol."""

    def __init__(self, model) -> None:
        self.model = model
        self.vocab_size = model.config.vocab_size
        self.block_size = model.config.block_size

    def prefill(self, canvas: torch.Tensor, known: torch.Tensor) -> "NeuralSession":
        """Feed each row's known tokens in ascending position order (one forward when any is known)."""
        model, cfg = self.model, self.model.config
        B, T = canvas.shape
        param = next(model.parameters())
        cache = KVCache(cfg.n_layer, B, cfg.n_head, T, cfg.head_dim, dtype=param.dtype, device=param.device)
        last_tok = torch.full((B,), cfg.bos_token_id, dtype=torch.long, device=canvas.device)
        last_pos = torch.full((B,), cfg.start_pos, dtype=torch.long, device=canvas.device)
        session = NeuralSession(model, cache, last_tok, last_pos)
        n_known = known.sum(1)
        m = int(n_known.max())
        if m > 0:
            order = (~known).to(torch.int8).argsort(dim=1, stable=True)[:, :m]  # (B, m) known first, ascending
            session.forward_orders(order[:, None], canvas.gather(1, order)[:, None])
            session.commit(torch.zeros(B, dtype=torch.long, device=canvas.device), n_known, canvas, known)
        return session


class NeuralSession:
    """Cache state of one sampling call."""

    def __init__(self, model, cache: KVCache, last_tok: torch.Tensor, last_pos: torch.Tensor) -> None:
        self.model = model
        self.cache = cache
        self.last_tok = last_tok  # (B,)
        self.last_pos = last_pos  # (B,)
        self._pending: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None

    def select(self, rows: torch.Tensor) -> None:
        """Keep only the given rows (B',) of the batch."""
        self.cache.select(rows)
        self.last_tok, self.last_pos = self.last_tok[rows], self.last_pos[rows]

    def draft(self, positions: torch.Tensor) -> torch.Tensor:
        """(B, R) queried positions -> (B, R, V) logits of p(x_j | visited)."""
        B, R = positions.shape
        model, cache = self.model, self.cache
        x = model.embed(self.last_tok[:, None].expand(B, R), self.last_pos[:, None].expand(B, R), positions)

        def attend(i, q, k, v):  # (B, H, R, D)
            k_cache, v_cache = cache.layer(i)
            return kernels.burst_attention(q, k, v, k_cache, v_cache, cache.lens)

        return _logits_dtype(model.lm_head(model.run_layers(x, attend)))

    @property
    def head_weight(self) -> torch.Tensor:
        """(V, C) LM-head weight, for acceptance straight from hidden states."""
        return self.model.lm_head.weight

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """(..., C) final hidden states -> (..., V) logits (float32 for 16-bit models)."""
        return _logits_dtype(self.model.lm_head(h))

    def verify(self, orders: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        """(B, O, R) orders and draft tokens in visiting order -> (B, O, R, V) verifier logits."""
        return self.head(self.verify_hidden(orders, drafts))

    def verify_hidden(self, orders: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        """:meth:`verify` before the LM head: (B, O, R, C) final hidden states, so that the
        acceptance kernel can score drafts without writing the (B, O, R, V) logits."""
        return self.forward_orders(orders, drafts)

    def forward_orders(self, orders: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        """Feed ``[last, drafts[:-1]]`` along each order; keep each layer's k, v for :meth:`commit`.

        Returns the (B, O, R, C) final hidden states."""
        B, O, R = orders.shape
        model, cache = self.model, self.cache
        tokens = torch.cat([self.last_tok[:, None, None].expand(B, O, 1), drafts[..., :-1]], dim=-1)
        in_pos = torch.cat([self.last_pos[:, None, None].expand(B, O, 1), orders[..., :-1]], dim=-1)
        x = model.embed(tokens, in_pos, orders)  # (B, O, R, C)
        keys, values = [], []

        def attend(i, q, k, v):  # (B, O, H, R, D)
            keys.append(k)
            values.append(v)
            k_cache, v_cache = cache.layer(i)
            return kernels.verify_attention(q, k, v, k_cache, v_cache, cache.lens)

        h = model.run_layers(x, attend)
        self._pending = (orders, torch.stack(keys), torch.stack(values))  # (n_layer, B, O, H, R, D)
        return h

    def commit(self, choice: torch.Tensor, n: torch.Tensor, canvas: torch.Tensor, known: torch.Tensor) -> None:
        """Append the first ``n[b]`` inputs of order ``choice[b]`` of the last verify; the token at
        that order's step ``n[b] - 1`` (read from the updated ``canvas``) becomes the last token."""
        orders, k, v = self._pending
        B = orders.shape[0]
        rows = torch.arange(B, device=orders.device)
        self.cache.append(k[:, rows, choice], v[:, rows, choice], n)  # (n_layer, B, H, R, D)
        chosen = orders[rows, choice]  # (B, R)
        pos = chosen.gather(1, (n - 1).clamp_min(0)[:, None]).squeeze(1)
        moved = n > 0
        self.last_pos = torch.where(moved, pos, self.last_pos)
        self.last_tok = torch.where(moved, canvas.gather(1, pos[:, None]).squeeze(1), self.last_tok)
        self._pending = None
