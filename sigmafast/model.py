"""σ-GPT: a GPT-2 style causal transformer with a double positional encoding.

Each input token carries the position it sits at (``in_pos``) and the position
of the token it must predict (``out_pos``). The embedding of a token is

    wte[token] + concat(pe(in_pos), pe(out_pos))          each half n_embd / 2

Position ``block_size`` is reserved for the BOS start token, so a sequence of T
tokens in order σ is fed as tokens ``[BOS, x_σ1 … x_σ(T-1)]``, in_pos
``[START, σ1 … σ(T-1)]``, out_pos ``[σ1 … σT]`` and targets ``[x_σ1 … x_σT]``
(see :func:`sigmafast.orders.shuffle`).

The positional encodings (absolute tables, RoPE and its value-rotating variant
``rope-v``) live in :mod:`sigmafast.positions`.

The per-layer pieces (``CausalSelfAttention.qkv`` / ``.project``, ``MLP``) work
on any number of leading dimensions, so the KV-cached inference path can run
burst ``(B, R, C)`` and multi-order ``(B, O, R, C)`` activations through the
same weights with its own attention function (:meth:`SigmaGPT.run_layers`).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .kernels.reference_layers import turn_tables
from .loss import linear_cross_entropy
from .model_config import SigmaGPTConfig
from .positions import Rotary, rotary_tables, sinusoidal_table

def linear_into(x: torch.Tensor, layer: nn.Linear, out: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` for (..., C) ``x``, written into the contiguous (..., N) ``out`` by one matmul."""
    x2, o2 = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
    if layer.bias is None:
        torch.mm(x2, layer.weight.t(), out=o2)
    else:
        torch.addmm(layer.bias, x2, layer.weight.t(), out=o2)
    return out


class CausalSelfAttention(nn.Module):
    def __init__(self, config: SigmaGPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.head_dim = config.head_dim
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def qkv(self, x: torch.Tensor, rotary: Optional[Rotary] = None,
            out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(..., T, C) -> q, k, v each (..., H, T, D), rotated as ``rotary`` says when it is given; the
        projection is written into ``out`` (..., T, 3C), contiguous, when it is given."""
        return self.heads(self.c_attn(x) if out is None else linear_into(x, self.c_attn, out), rotary)

    def heads(self, proj: torch.Tensor, rotary: Optional[Rotary] = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The (..., T, 3C) QKV projection -> q, k, v each (..., H, T, D) (views of it unless ``rotary``
        rotates them out of place)."""
        *lead, T, C3 = proj.shape
        q, k, v = proj.split(C3 // 3, dim=-1)
        shape = (*lead, T, self.n_head, self.head_dim)
        q, k, v = (t.view(shape).transpose(-3, -2) for t in (q, k, v))
        if rotary is not None:
            q, k, v = rotary.apply(q, k, v)
        return q, k, v

    @staticmethod
    def merge_heads(y: torch.Tensor, rotary: Optional[Rotary] = None) -> torch.Tensor:
        """(..., H, T, D) attention output -> (..., T, C) input of ``c_proj`` (rotated back by ``rotary``)."""
        if rotary is not None:
            y = rotary.restore(y)
        *lead, H, T, D = y.shape
        return y.transpose(-3, -2).reshape(*lead, T, H * D)

    def project(self, y: torch.Tensor, rotary: Optional[Rotary] = None) -> torch.Tensor:
        """(..., H, T, D) attention output -> (..., T, C) residual update."""
        return self.resid_dropout(self.c_proj(self.merge_heads(y, rotary)))

    def forward(self, x: torch.Tensor, rotary: Optional[Rotary] = None) -> torch.Tensor:
        q, k, v = self.qkv(x, rotary)  # (B, H, T, D)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.project(y, rotary)


class MLP(nn.Module):
    def __init__(self, config: SigmaGPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, config.mlp_ratio * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.mlp_ratio * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: SigmaGPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.has_mlp = config.mlp_ratio > 0
        if self.has_mlp:
            self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
            self.mlp = MLP(config)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The residual stream after the MLP (unchanged in an attention-only block)."""
        return x + self.mlp(self.ln_2(x)) if self.has_mlp else x

    def forward(self, x: torch.Tensor, rotary: Optional[Rotary] = None) -> torch.Tensor:
        return self.feed_forward(x + self.attn(self.ln_1(x), rotary))


class ScalarGainNorm(nn.Module):
    """LayerNorm without per-channel parameters, times one learned gain (``final_norm="scalar"``).

    With the tied LM head, a per-channel gain g makes logit_v = sum_c g_c h_c e_vc, so a hidden
    state built from some token embeddings leaks onto the others even when the rows are
    orthogonal (sum_c e_sc e_vc = 0 but sum_c g_c e_sc e_vc != 0), and a bias adds b . e_v to
    every logit. One scalar keeps only the logits' scale (benchmarks/RESULTS.md, permutation).
    """

    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.n_embd = n_embd
        self.weight = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.n_embd,)) * self.weight


AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def add_norm(x: torch.Tensor, y: torch.Tensor, norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual sum ``x + y`` and ``norm`` of it."""
    s = x + y
    return s, norm(s)


Ended = tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]


class SublayerEnds:
    """How :meth:`SigmaGPT.run_layers` ends each sublayer: its output is added to the residual stream x
    and the norm that follows (the MLP's ``ln_2``, the next block's ``ln_1``, or ``ln_f``) is taken of
    the sum. Each method returns ``(x, norm(x), qkv)``: when the norm feeds a block, ``next_qkv`` is that
    block's ``c_attn``, and an end may apply it to ``norm(x)`` as well (into ``qkv_out`` when given) and
    return the result as ``qkv``; None means the caller applies it. This class runs the modules as they are
    (``qkv`` always None); the engine's subclass fuses them into kernels where it can."""

    def attention(self, x: torch.Tensor, y: torch.Tensor, attn: CausalSelfAttention, rotary: Optional[Rotary],
                  norm: nn.Module, next_qkv: Optional[nn.Linear] = None,
                  qkv_out: Optional[torch.Tensor] = None) -> Ended:
        """x (..., T, C) and the heads' output y (..., H, T, D), projected by ``attn``."""
        return (*add_norm(x, attn.project(y, rotary), norm), None)

    def mlp(self, x: torch.Tensor, h: torch.Tensor, mlp: MLP, norm: nn.Module, next_qkv: Optional[nn.Linear] = None,
            qkv_out: Optional[torch.Tensor] = None) -> Ended:
        """x (..., T, C) and the MLP's input h = ``ln_2(x)``."""
        return (*add_norm(x, mlp(h), norm), None)


def check_ids(name: str, ids: torch.Tensor, low: int, high: int, note: str = "") -> None:
    """``ValueError`` naming ``name`` when an id of ``ids`` lies outside [low, high). Checked on the CPU only,
    and not while compiling: on a GPU it would be a host sync in every step (there the embedding's
    own device-side assert stops an id out of range)."""
    if ids.device.type != "cpu" or ids.numel() == 0 or torch.compiler.is_compiling():
        return
    bad = (ids < low) | (ids >= high)
    if bool(bad.any()):
        raise ValueError(f"{name} must be in [{low}, {high}){' ' + note if note else ''}, got {int(ids[bad][0])}")


class SigmaGPT(nn.Module):
    def __init__(self, config: SigmaGPTConfig) -> None:
        super().__init__()
        if not isinstance(config, SigmaGPTConfig):
            raise TypeError(f"config must be a SigmaGPTConfig, got {type(config).__name__}")
        self.config = config
        half = config.n_embd // 2
        n_pos = config.block_size + 1  # + the START position
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        if config.absolute == "learned":
            self.wpe_in = nn.Embedding(n_pos, half)
            self.wpe_out = nn.Embedding(n_pos, half)
        for name, table in self._position_tables().items():
            self.register_buffer(name, table, persistent=False)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = (ScalarGainNorm(config.n_embd) if config.final_norm == "scalar"
                     else nn.LayerNorm(config.n_embd, bias=config.bias))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying

        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
        if config.embedding_init == "orthogonal":
            self._orthogonal_embedding(self.lm_head.weight)

    def _position_tables(self) -> dict[str, torch.Tensor]:
        """The fixed float32 position tables, by buffer name: the sinusoidal one (n_pos, C / 2), RoPE's turns
        (n_pos, D)."""
        config, n_pos = self.config, self.config.block_size + 1  # + the START position
        tables = {}
        if config.absolute == "sinusoidal":
            tables["pe_table"] = sinusoidal_table(n_pos, config.n_embd // 2)
        if config.rotary:
            tables["rope_turn_cos"], tables["rope_turn_sin"] = turn_tables(*rotary_tables(n_pos, config.head_dim))
        return tables

    def _apply(self, fn, recurse=True):
        """``to``, ``float``, ``cuda``...; then the position tables it replaced are rebuilt in their new dtype and
        device, so that a round trip through 16 bits (``model.bfloat16().float()``) leaves them exact. Tables it
        left in place stay (an engine's captured graphs read them)."""
        before = {name: getattr(self, name) for name in self._buffers}
        super()._apply(fn, recurse)
        for name, table in self._position_tables().items():
            now = getattr(self, name)
            if now is not before[name]:
                setattr(self, name, table.to(device=now.device, dtype=now.dtype))
        return self

    @staticmethod
    @torch.no_grad()
    def _orthogonal_embedding(weight: torch.Tensor) -> None:
        """``orthogonal_`` (orthonormal rows when V <= C, columns otherwise), each row then rescaled to
        the N(0, 0.02) init's expected norm 0.02 sqrt(C).

        A set of visited tokens is read out of the mean of their embeddings (the permutation
        task): with orthogonal rows the mean has no cross-talk between tokens.
        """
        nn.init.orthogonal_(weight)
        weight.mul_(0.02 * math.sqrt(weight.shape[1]) / weight.norm(dim=1, keepdim=True).clamp_min(1e-12))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and self.config.absolute == "learned":
            n -= self.wpe_in.weight.numel() + self.wpe_out.weight.numel()
        return n

    def position_tables(self) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The (block_size + 1, C / 2) tables of the input and output positions' absolute encodings (one
        shared sinusoidal table, or two learned ones), None without an absolute encoding."""
        if self.config.absolute == "learned":
            return self.wpe_in.weight, self.wpe_out.weight
        if self.config.absolute == "sinusoidal":
            return self.pe_table, self.pe_table
        return None

    def pos_embed(self, in_pos: torch.Tensor, out_pos: torch.Tensor) -> Optional[torch.Tensor]:
        """(..., T) positions -> (..., T, C) absolute double positional encoding, None without one."""
        tables = self.position_tables()
        if tables is None:
            return None
        return torch.cat([F.embedding(in_pos, tables[0]), F.embedding(out_pos, tables[1])], dim=-1)

    def embed(self, tokens: torch.Tensor, in_pos: torch.Tensor, out_pos: torch.Tensor) -> torch.Tensor:
        """(..., T) tokens and positions -> (..., T, C) input of the first block."""
        x = self.wte(tokens)
        pe = self.pos_embed(in_pos, out_pos)
        return self.drop(x if pe is None else x + pe)

    def rope_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(n_pos, D/2) cos and sin of the RoPE angles: views of the (n_pos, D) tables (``[cos, cos]`` and
        ``[-sin, sin]``), as the in-place kernels take them."""
        half = self.config.head_dim // 2
        return self.rope_turn_cos[:, :half], self.rope_turn_sin[:, half:]

    def rotary(self, in_pos: torch.Tensor, out_pos: torch.Tensor) -> Optional[Rotary]:
        """(..., T) positions -> the RoPE angles of queries (``out_pos``) and keys (``in_pos``), or None."""
        if not self.config.rotary:
            return None
        tables = (self.rope_turn_cos, self.rope_turn_sin)  # row lookups: a position outside them is an error,
        angles = [F.embedding(out_pos, t).unsqueeze(-3) for t in tables]  # as in the absolute encodings (no wrap)
        angles += [F.embedding(in_pos, t).unsqueeze(-3) for t in tables]  # (..., 1, T, D) each
        return Rotary(*angles, values=self.config.rotary_values)

    def run_layers(self, x: torch.Tensor, attend: AttendFn, rotary: Optional[Rotary] = None,
                   qkv_out: Optional[torch.Tensor] = None, ends: Optional[SublayerEnds] = None,
                   h: Optional[torch.Tensor] = None, proj: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Run every block with a custom attention: ``attend(layer, q, k, v) -> y``.

        x is (..., T, C); q, k, v and y are (..., H, T, D), already rotated by
        ``rotary`` (from :meth:`rotary`) when given, and y is rotated back by it. Layer i's QKV
        projection is written into ``qkv_out[i]`` ((n_layer, ..., T, 3C), contiguous) when it is
        given. Each sublayer's end (its output projection or MLP, the residual add and the norm that
        follows, and maybe the next block's QKV projection) goes through ``ends`` (a :class:`SublayerEnds`,
        which may fuse them; the plain one when None). ``h`` is the first block's ``ln_1(x)`` when the
        caller computed it with x (a fused embedding), else None; ``proj`` is the first block's QKV
        projection of it (..., T, 3C) when the caller computed that too (into ``qkv_out[0]`` when given),
        else None. Returns the final hidden states after ``ln_f``, (..., T, C).
        """
        ends = SublayerEnds() if ends is None else ends
        blocks = list(self.h)
        if h is None and proj is None:
            h = blocks[0].ln_1(x)
        # proj: block i's QKV projection, when the caller (i = 0) or block i - 1's end computed it
        for i, block in enumerate(blocks):
            if proj is None:
                proj = block.attn.c_attn(h) if qkv_out is None else linear_into(h, block.attn.c_attn, qkv_out[i])
            y = attend(i, *block.attn.heads(proj, rotary))
            last = i + 1 == len(blocks)
            norm, nxt = (self.ln_f, None) if last else (blocks[i + 1].ln_1, blocks[i + 1].attn.c_attn)
            nxt_out = None if last or qkv_out is None else qkv_out[i + 1]
            if block.has_mlp:
                x, h, _ = ends.attention(x, y, block.attn, rotary, block.ln_2)
                x, h, proj = ends.mlp(x, h, block.mlp, norm, nxt, nxt_out)
            else:
                x, h, proj = ends.attention(x, y, block.attn, rotary, norm, nxt, nxt_out)
        return h

    def check_inputs(self, tokens: torch.Tensor, in_pos: torch.Tensor, out_pos: torch.Tensor) -> None:
        for name, t in (("tokens", tokens), ("in_pos", in_pos), ("out_pos", out_pos)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype not in (torch.int64, torch.int32):
                raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
            if t.dim() != 2 or t.shape != tokens.shape:
                raise ValueError(f"{name} must have shape (B, T) = {tuple(tokens.shape)}, got {tuple(t.shape)}")
        T = tokens.shape[1]
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        check_ids("tokens", tokens, 0, self.config.vocab_size)
        for name, t in (("in_pos", in_pos), ("out_pos", out_pos)):
            check_ids(name, t, 0, self.config.block_size + 1)  # + the START position

    def hidden_states(self, tokens: torch.Tensor, in_pos: torch.Tensor, out_pos: torch.Tensor) -> torch.Tensor:
        """(B, T) tokens, in_pos, out_pos -> (B, T, C) final hidden states (after ``ln_f``)."""
        self.check_inputs(tokens, in_pos, out_pos)
        x = self.embed(tokens, in_pos, out_pos)  # (B, T, C)
        rotary = self.rotary(in_pos, out_pos)
        for block in self.h:
            x = block(x, rotary)
        return self.ln_f(x)

    def forward(
        self,
        tokens: torch.Tensor,
        in_pos: torch.Tensor,
        out_pos: torch.Tensor,
        targets: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(B, T) tokens, in_pos, out_pos[, targets] -> logits (B, T, V), loss or None.

        Targets equal to -1 are ignored by the loss, ``sum CE / max(1, N_valid)`` as :meth:`loss` (0, not NaN,
        when every target is ignored). Training uses :meth:`loss`, which never materialises the (B, T, V) logits.
        """
        logits = self.lm_head(self.hidden_states(tokens, in_pos, out_pos))  # (B, T, V)
        loss = None
        if targets is not None:
            self._check_targets(targets, tokens)
            logits32 = logits.flatten(0, 1).to(torch.promote_types(logits.dtype, torch.float32))
            total = F.cross_entropy(logits32, targets.flatten(), ignore_index=-1, reduction="sum")
            loss = total / (targets != -1).sum().clamp_min(1)
        return logits, loss

    def loss(self, tokens: torch.Tensor, in_pos: torch.Tensor, out_pos: torch.Tensor,
             targets: torch.Tensor, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Mean cross-entropy of the (B, T) targets (-1 ignored), chunked: no (B, T, V) logits. ``weight``
        (B, T) (or broadcastable to it) scales each target's term: ``sum w_n CE_n / N_valid``."""
        self._check_targets(targets, tokens)
        hidden = self.hidden_states(tokens, in_pos, out_pos)  # (B, T, C)
        if weight is not None:
            if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
                raise TypeError(f"weight must be a float torch.Tensor, got {getattr(weight, 'dtype', type(weight))}")
            try:
                weight = weight.expand_as(targets)
            except RuntimeError:
                raise ValueError(f"weight of shape {tuple(weight.shape)} does not broadcast to the targets' "
                                 f"{tuple(targets.shape)}") from None
        return linear_cross_entropy(hidden, self.lm_head.weight, targets, row_weight=weight)

    def _check_targets(self, targets: torch.Tensor, tokens: torch.Tensor) -> None:
        if not isinstance(targets, torch.Tensor) or targets.dtype != torch.int64:
            raise TypeError(f"targets must be an int64 torch.Tensor, got {getattr(targets, 'dtype', type(targets))}")
        if targets.shape != tokens.shape:
            raise ValueError(f"targets must have shape {tuple(tokens.shape)}, got {tuple(targets.shape)}")
        check_ids("targets", targets, -1, self.config.vocab_size, "(-1 ignored)")
