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
  within each order, all orders sharing the cached prefix. It returns a
  :class:`Verified` handle holding every layer's keys and values.
- :meth:`NeuralSession.commit` takes that handle and the chosen order's
  tokens, writes the first ``n`` into the canvas and appends their inputs'
  keys and values (never recomputed).

A session owns static buffers: the (B, T) canvas and known mask, the
full-length :class:`~sigmafast.cache.KVCache` and the last token; every update
is in place, so a step over a session can be captured as a CUDA graph.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import kernels
from .cache import KVCache
from .model import ScalarGainNorm, SublayerEnds


HEAD_ALIGN = 64  # on CUDA the LM head's output rows are padded to a multiple of this many logits


def norm_params(norm: nn.Module, C: int) -> Optional[tuple]:
    """(weight, bias, eps) of the model's norms over C channels as the fused kernels take them: a
    LayerNorm, or a ScalarGainNorm (its gain as a stride-0 weight); None for any other module."""
    if isinstance(norm, nn.LayerNorm) and tuple(norm.normalized_shape) == (C,):
        return norm.weight, norm.bias, norm.eps
    if isinstance(norm, ScalarGainNorm) and norm.n_embd == C:
        return norm.weight.expand(C), None, 1e-5
    return None


class FusedEnds(SublayerEnds):
    """The sublayer ends as Triton kernels, for steps nothing traces. In a narrow model (C <=
    ``kernels.checks.FUSED_END_WIDTH``) the output projection or the whole MLP, the residual add, the
    next norm and the next block's QKV projection are one kernel (``kernels.linear_add_norm``,
    ``kernels.mlp_add_norm``) with ``narrow=True`` (``Engine(fused_ends=True)``, opt-in); in a wider one,
    or with ``narrow=False`` (the engine's default: faster on an H200), the matmuls stay cuBLAS's and the
    add + norm is one kernel (``kernels.add_layer_norm``); there ``gelu=True`` (``Engine(fused_gelu=True)``,
    opt-in) makes the MLP's first matmul and its GELU one kernel (``kernels.linear_gelu``).
    Modules in training mode (dropout) and norms that :func:`norm_params` does not know run as they are."""

    def __init__(self, narrow: bool = True, gelu: bool = False) -> None:
        self.narrow = narrow
        self.gelu = gelu  # the MLP's first matmul with its GELU in one kernel (kernels.linear_gelu), where cuBLAS ends

    def attention(self, x, y, attn, rotary, norm, next_qkv=None, qkv_out=None):
        params = norm_params(norm, x.shape[-1])
        if params is None or attn.training:
            return super().attention(x, y, attn, rotary, norm)
        y = attn.merge_heads(y, rotary)
        if not (self.narrow and _narrow(x, attn.c_proj)):
            return (*kernels.add_layer_norm(x, attn.c_proj(y), *params, backend="triton"), None)
        nxt = _next_projection(x.shape[:-1], x, next_qkv, qkv_out)
        s, h = kernels.linear_add_norm(x, y, attn.c_proj.weight, attn.c_proj.bias, *params, **nxt, backend="triton")
        return s, h, nxt.get("next_out")

    def mlp(self, x, h, mlp, norm, next_qkv=None, qkv_out=None):
        params = norm_params(norm, x.shape[-1])
        if params is None or mlp.training:
            return super().mlp(x, h, mlp, norm)
        one_layout = (mlp.c_fc.bias is None) == (mlp.c_proj.bias is None)
        if not (self.narrow and one_layout and _narrow(x, mlp.c_fc, mlp.c_proj)):
            fc = mlp.c_fc
            if self.gelu and fc.weight.is_contiguous() and fc.weight.dtype == h.dtype:
                y = mlp.c_proj(kernels.linear_gelu(h, fc.weight, fc.bias, backend="triton"))
            else:
                y = mlp(h)
            return (*kernels.add_layer_norm(x, y, *params, backend="triton"), None)
        nxt = _next_projection(x.shape[:-1], x, next_qkv, qkv_out)
        s, h = kernels.mlp_add_norm(x, h, mlp.c_fc.weight, mlp.c_fc.bias, mlp.c_proj.weight, mlp.c_proj.bias,
                                    *params, **nxt, backend="triton")
        return s, h, nxt.get("next_out")


def _narrow(x: torch.Tensor, *layers: nn.Linear) -> bool:
    """Whether the fused sublayer-end kernels take x's width (its last dimension) and dtype and these layers'
    weights."""
    return x.shape[-1] <= kernels.checks.FUSED_END_WIDTH and all(
        layer.weight.is_contiguous() and layer.weight.dtype == x.dtype for layer in layers)


def _next_projection(lead: tuple, x: torch.Tensor, layer: Optional[nn.Linear], out: Optional[torch.Tensor]) -> dict:
    """The fused kernels' next-projection arguments for rows of x's width and dtype with leading dims ``lead``:
    ``layer`` (the next block's ``c_attn``, or None) and its output, ``out`` or a new (*lead, 3C) tensor; none
    when there is no layer or the kernel cannot take it."""
    if layer is None or not _narrow(x, layer):
        return {}
    if out is None:
        out = x.new_empty(*lead, layer.weight.shape[0])
    return dict(next_weight=layer.weight, next_bias=layer.bias, next_out=out)


def traced() -> bool:
    """Under autograd or torch.compile, where the eager fast paths step aside: the fused ops have no
    backward, and an out= write or an in-place custom op is functionalised into whole-buffer copies."""
    return torch.is_grad_enabled() or torch.compiler.is_compiling()


class FusedRotary(NamedTuple):
    """A forward's RoPE as in-place Triton kernels (``kernels.rotary_``): one launch per layer for q, k and
    v, one for ``rope-v``'s rotation back, where :class:`~sigmafast.positions.Rotary` takes about thirty
    small ops. Same interface; it rotates the projection's views in place, so their layout is kept."""

    in_pos: torch.Tensor  # (..., T) positions of keys and values
    out_pos: torch.Tensor  # (..., T) positions of queries
    cos: torch.Tensor  # (n_pos, D/2) the model's tables (``SigmaGPT.rope_tables``)
    sin: torch.Tensor
    values: bool  # rope-v

    def apply(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        kernels.rotary_(q, k, v if self.values else None, self.out_pos, self.in_pos, self.cos, self.sin,
                        backend="triton")
        return q, k, v

    def restore(self, y: torch.Tensor) -> torch.Tensor:
        if self.values:
            kernels.rotary_(y, None, None, self.out_pos, None, self.cos, self.sin, -1.0, backend="triton")
        return y


def _embedding_params(model) -> Optional[tuple]:
    """(wte, pe_in, pe_out, weight, bias, eps) of ``kernels.feed_embedding`` for the model's embedding and
    first ``ln_1``, or None where the kernel does not apply (another norm, or tables of another dtype)."""
    wte = model.wte.weight
    tables = model.position_tables() or (None, None)
    norm = norm_params(model.h[0].ln_1, wte.shape[1])
    if norm is None or any(t is not None and t.dtype != wte.dtype for t in tables):
        return None
    return (wte, *tables, *norm)


class Verified(NamedTuple):
    """What :meth:`NeuralSession.verify` computed, for acceptance and :meth:`NeuralSession.commit`."""

    orders: torch.Tensor  # (B, O, R) visited positions
    hidden: Optional[torch.Tensor]  # (B, O, R, C) final hidden states (neural) or None
    logits: Optional[torch.Tensor]  # (B, O, R, V) verifier logits (oracles) or None
    keys: Optional[torch.Tensor]  # (n_layer, B, O, H, R, D) every layer's keys (neural) or None
    values: Optional[torch.Tensor]


class NeuralConditionals:
    """Adapter of a :class:`~sigmafast.model.SigmaGPT` to the sampler's conditionals protocol."""

    def __init__(self, model, backend: Optional[str] = None) -> None:
        self.model = model
        self.vocab_size = model.config.vocab_size
        self.block_size = model.config.block_size
        param = next(model.parameters())
        self.backend = backend or kernels.backend_for(param)

    def new_session(self, batch_size: int, seq_len: int) -> "NeuralSession":
        """Empty static buffers for ``batch_size`` rows of ``seq_len`` positions."""
        return NeuralSession(self.model, batch_size, seq_len, self.backend)

    def prefill(self, canvas: torch.Tensor, known: torch.Tensor) -> "NeuralSession":
        session = self.new_session(*canvas.shape)
        session.prefill(canvas, known)
        return session


class NeuralSession:
    """Static state of one sampling call: canvas, known mask, KV cache, last token and the burst steps'
    non-finite flag."""

    def __init__(self, model, batch_size: int, seq_len: int, backend: str, head_align: Optional[int] = None,
                 fused_ends: bool = False, scoring=None, fused_gelu: bool = False) -> None:
        cfg = model.config
        param = next(model.parameters())
        device = param.device
        self.model = model
        self.backend = backend
        self.fused_ends = fused_ends  # the narrow models' one-kernel sublayer ends (opt-in: slower on an H200)
        self.fused_gelu = fused_gelu  # the MLPs' first matmul and GELU in one kernel (opt-in, unmeasured)
        # kernels.acceptance_from_hidden's scoring (None: its default), or a scoring.MeasuredScoring that times both
        self.scoring = scoring
        self.cache = KVCache(cfg.n_layer, batch_size, cfg.n_head, seq_len, cfg.head_dim, dtype=param.dtype,
                             device=device)
        self.canvas = torch.zeros(batch_size, seq_len, dtype=torch.long, device=device)
        self.known = torch.ones(batch_size, seq_len, dtype=torch.bool, device=device)
        self.last_tok = torch.full((batch_size,), cfg.bos_token_id, dtype=torch.long, device=device)
        self.last_pos = torch.full((batch_size,), cfg.start_pos, dtype=torch.long, device=device)
        self.n_known = torch.zeros(batch_size, dtype=torch.long, device=device)  # the prefill's known counts
        self.nonfinite = torch.zeros((), dtype=torch.bool, device=device)  # set by a burst step (sticky)
        self.vocab_size = V = cfg.vocab_size
        weight = model.lm_head.weight
        align = head_align or (HEAD_ALIGN if device.type == "cuda" else 1)
        padded = -(-V // align) * align
        # (V', C) LM head whose rows past V are zeros: aligned logits rows for cuBLAS (copied at prefill)
        self.head_weight = weight if padded == V else weight.new_zeros(padded, weight.shape[1])
        self.embedding = _embedding_params(model)

    @property
    def batch_size(self) -> int:
        return self.canvas.shape[0]

    def prefill(self, canvas: torch.Tensor, known: torch.Tensor) -> None:
        """Load the first rows of the buffers with ``canvas``/``known`` (B' <= B; the other rows are
        complete padding) and feed each row's known tokens in ascending position order."""
        m = self.load(canvas, known)
        if m > 0:
            self.feed_known(m)

    def load(self, canvas: torch.Tensor, known: torch.Tensor, most: Optional[int] = None) -> int:
        """Reset the buffers to ``canvas``/``known`` (an empty cache); the largest known count of a row:
        ``most`` when the caller has read it already, else read here (the prefill's one host read)."""
        cfg = self.model.config
        n = canvas.shape[0]
        if self.head_weight is not self.model.lm_head.weight:
            self.head_weight[: self.vocab_size].copy_(self.model.lm_head.weight)
        self.cache.lens.zero_()
        self.canvas.zero_()
        self.known.fill_(True)
        self.canvas[:n].copy_(canvas)
        self.known[:n].copy_(known)
        self.last_tok.fill_(cfg.bos_token_id)
        self.last_pos.fill_(cfg.start_pos)
        self.n_known.zero_()
        self.nonfinite.zero_()
        self.n_known[:n] = known.sum(1)
        return int(self.n_known.max()) if most is None else most

    def feed_known(self, M: int) -> None:
        """Feed each row's ``n_known`` known tokens (ascending positions) into the cache: a static-shape step
        over M >= max ``n_known`` positions (a bucket), the first ``n_known`` of which are committed. The
        steps past them are causal successors (they change nothing before them) and are never committed."""
        order = (~self.known).to(torch.int8).argsort(dim=1, stable=True)[:, :M]  # (B, M) known first
        tokens = self.canvas.gather(1, order)  # (B, M)
        verified = self.verify(order[:, None], tokens[:, None])
        self.commit(verified, torch.zeros_like(self.n_known), self.n_known, tokens)

    def select(self, rows: torch.Tensor) -> None:
        """Keep only the given rows (B',) of the batch (drops the static buffers: never under a graph)."""
        self.cache.select(rows)
        self.canvas, self.known = self.canvas[rows], self.known[rows]
        self.last_tok, self.last_pos = self.last_tok[rows], self.last_pos[rows]

    def feed(self, orders: torch.Tensor, tokens: Optional[torch.Tensor], qkv_out: Optional[torch.Tensor] = None
             ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
        """The first block's input x along (B, G, S) visiting orders, given the tokens at them (None when
        S == 1: only the last token is fed), its ``ln_1(x)`` when fused (else None), (B, G, S, C) each,
        the (B, G, S) input positions when they were needed (a RoPE model, or the unfused path; else
        None), and the first block's QKV projection of ``ln_1(x)`` when the embedding kernel computed it
        (into ``qkv_out``, (B, G, S, 3C), when given), else None. The embedding is one kernel
        (``kernels.feed_embedding``) on the Triton path when nothing traces the step and dropout is off,
        with the projection in a narrow model whose sublayer ends are fused; eight small ops otherwise."""
        model = self.model
        fused = self.embedding is not None and self.backend == "triton" and not traced() and not model.training
        tok = in_pos = None
        if model.config.rotary or not fused:
            tok, in_pos = kernels.reference_layers.feed_inputs(self.last_tok, self.last_pos, tokens, orders)
        if fused:
            wte = self.embedding[0]
            nxt = _next_projection(orders.shape, wte, model.h[0].attn.c_attn, qkv_out) if self.fused_ends else {}
            x, h = kernels.feed_embedding(self.last_tok, self.last_pos, tokens, orders, *self.embedding, **nxt,
                                          backend="triton")
            return x, h, in_pos, nxt.get("next_out")
        return model.embed(tok, in_pos, orders), None, in_pos, None

    def draft(self, positions: torch.Tensor) -> torch.Tensor:
        """(B, R) queried positions -> (B, R, V) logits of p(x_j | visited)."""
        return self.head(self.draft_hidden(positions))

    def draft_hidden(self, positions: torch.Tensor) -> torch.Tensor:
        """(B, R) queried positions -> (B, R, C) final hidden states of :meth:`draft` (before the LM head)."""
        B, R = positions.shape
        model, cache = self.model, self.cache
        x, h, _, proj = self.feed(positions[..., None], None)  # (B, R, 1, C): R orders of one step
        x, h, proj = (t if t is None else t.view(B, R, -1) for t in (x, h, proj))
        rotary = self.rotary(self.last_pos[:, None].expand(B, R), positions)  # in the (B, H, R, D) layout

        def attend(i, q, k, v):  # (B, H, R, D)
            k_cache, v_cache = cache.layer(i)
            return kernels.burst_attention(q, k, v, k_cache, v_cache, cache.lens, backend=self.backend)

        return model.run_layers(x, attend, rotary, ends=self._ends(), h=h, proj=proj)

    def rotary(self, in_pos: torch.Tensor, out_pos: torch.Tensor):
        """The model's RoPE of a forward at (..., T) positions (None without one): in-place kernels on the
        Triton path when nothing traces the step, else the model's own."""
        model = self.model
        if not model.config.rotary:
            return None
        if self._rotates_in_place():
            return FusedRotary(in_pos, out_pos, *model.rope_tables(), model.config.rotary_values)
        return model.rotary(in_pos, out_pos)

    def _rotates_in_place(self) -> bool:
        """Whether a RoPE model's forwards rotate in place (:class:`FusedRotary`)."""
        return self.backend == "triton" and not traced() and not self.model.training

    def _ends(self) -> Optional[SublayerEnds]:
        """The sublayer ends of this step: fused on the Triton path when nothing traces it, else the plain
        ones (None)."""
        return FusedEnds(self.fused_ends, self.fused_gelu) if self.backend == "triton" and not traced() else None

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """(..., C) final hidden states -> (..., V) logits in the model's dtype (a view of the padded
        head's rows on CUDA). The samplers read 16-bit logits as float32 themselves: no float32 copy."""
        return F.linear(h, self.head_weight)[..., : self.vocab_size]

    def verify(self, orders: torch.Tensor, drafts: Optional[torch.Tensor]) -> Verified:
        """Feed ``[last, drafts[:-1]]`` along each of the (B, O, R) orders, causal within each order
        (``drafts`` may be None when R == 1: the last token alone is fed)."""
        B, O, R = orders.shape
        model, cache = self.model, self.cache
        # eager (CUDA graphs): every layer's projection in one buffer, so that commit reads all layers' keys
        # and values from it (a stack of 5-d tensors is one copy kernel per layer on CUDA). An out= matmul:
        # eager only, and not with keys rotated out of place
        shared = not traced() and (not model.config.rotary or self._rotates_in_place())
        c_attn = model.h[0].attn.c_attn
        qkv = c_attn.weight.new_empty(model.config.n_layer, B, O, R, c_attn.weight.shape[0]) if shared else None
        x, h, in_pos, proj = self.feed(orders, drafts, None if qkv is None else qkv[0])  # (B, O, R, C or 3C)
        rotary = None if in_pos is None else self.rotary(in_pos, orders)  # None without RoPE
        keys, values = [], []

        def attend(i, q, k, v):  # (B, O, H, R, D)
            if not shared:
                keys.append(k)
                values.append(v)
            k_cache, v_cache = cache.layer(i)
            return kernels.verify_attention(q, k, v, k_cache, v_cache, cache.lens, backend=self.backend)

        if shared:
            C, H = x.shape[-1], model.config.n_head
            hidden = model.run_layers(x, attend, rotary, qkv_out=qkv, ends=self._ends(), h=h, proj=proj)
            kv = qkv[..., C:].unflatten(-1, (2, H, C // H)).permute(4, 0, 1, 2, 5, 3, 6)  # (2, L, B, O, H, R, D)
            return Verified(orders, hidden, None, kv[0], kv[1])
        hidden = model.run_layers(x, attend, rotary, ends=self._ends(), h=h, proj=proj)  # keys, values stacked once
        return Verified(orders, hidden, None, torch.stack(keys), torch.stack(values))

    def commit(self, verified: Verified, choice: torch.Tensor, n: torch.Tensor, tokens: torch.Tensor,
               status: Optional[torch.Tensor] = None, residual: Optional[torch.Tensor] = None,
               residual_step: Optional[torch.Tensor] = None) -> None:
        """Keep the first ``n[b]`` steps of order ``choice[b]`` of ``verified``: write their tokens
        ``tokens[b, :n[b]]`` ((B, R), or (B, O, R) read at order ``choice[b]``; with (B,) ``residual``
        tokens, ``residual[b]`` at step ``residual_step[b]`` instead) into the canvas, append
        their inputs' keys and values (never recomputed) and make step ``n[b] - 1`` the last token; into a
        (3,) int64 ``status``, also the burst status after it (``kernels.reference.burst_status`` of the
        known mask and ``nonfinite``). One fused op on the Triton path (two kernels instead of about 35
        small ones); the reference under autograd and ``torch.compile``."""
        kernels.commit(verified.orders, choice, n, tokens, verified.keys, verified.values, canvas=self.canvas,
                       known=self.known, last_tok=self.last_tok, last_pos=self.last_pos, k_cache=self.cache.k,
                       v_cache=self.cache.v, lens=self.cache.lens, flag=None if status is None else self.nonfinite,
                       status=status, residual=residual, residual_step=residual_step,
                       backend="reference" if traced() else self.backend)
