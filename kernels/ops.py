"""The Triton launchers as PyTorch custom ops (``torch.ops.sigmafast.*``), so that torch.compile traces
through them without a graph break.

=================================  ==========================================================
op                                 inputs -> outputs
=================================  ==========================================================
``sigmafast::burst_attention``     q, k, v (B, H, R, D), caches (B, H, L, D), lens (B,) -> like q
``sigmafast::verify_attention``    q, k, v (B, O, H, R, D), caches, lens -> like q
``sigmafast::draft_logq``          logits (N, V), drafts (N,), their log p and a log-ratio output (N,)
                                   or None -> (N,) float32 log q (int64 argmax at T=0); writes
                                   log q - log p
``sigmafast::lm_head_logq``        hidden (N, C), weight (V, C), drafts (N,), log p, output -> as
                                   ``draft_logq``
``sigmafast::sample``              logits (N, V), uniforms (N,), used (N,) or None, flag () or None
                                   -> tokens (N,) int64, float32 log-probs (N,); sets flag when a used
                                   row is not finite
``sigmafast::residual_sample``     q_logits, p_logits (N, V), uniforms (N,) -> tokens (N,) int64
``sigmafast::decide``              q/p ratios (or argmax), drafts, uniforms (B, O, R), lengths (B,),
                                   flag () or None -> accept (B, O, R), n_accept, first_reject (B, O),
                                   best, n_best (B,); sets flag at a NaN ratio of a valid step
``sigmafast::add_layer_norm``      x, y (..., C), weight, bias (C,) or None -> x + y, LayerNorm(x + y)
``sigmafast::linear_gelu``         x (..., K), weight (F, K), bias (F,) or None -> gelu(linear(x)) (..., F)
``sigmafast::linear_add_norm``     x (..., C), y (..., K), weight (C, K), bias, LayerNorm weight and bias,
                                   next projection's weight, bias and output or None -> x + linear(y),
                                   LayerNorm of it (C <= 256); writes the next projection of the latter
``sigmafast::mlp_add_norm``        x, h (..., C), MLP weights and biases, then as ``linear_add_norm``
                                   -> x + mlp(h), LayerNorm of it (C <= 256); writes the next projection
``sigmafast::feed_embedding``      last token/position (B,), tokens or None, orders (B, G, S), tables,
                                   weight, bias, first block's projection weight, bias and output or
                                   None -> x, LayerNorm(x) (B, G, S, C); writes the projection of the latter
``sigmafast::rotary_``             q, k, v (..., H, T, D) (k, v optional), positions (..., T), cos/sin
                                   tables, sign -> None; rotates q, k, v in place (RoPE)
``sigmafast::draft_slots``         known (B, T), uniforms (B, T), keys (B, O, T), R -> positions, uniforms,
                                   used (B, R), remaining (B,), visiting orders (B, O, R)
``sigmafast::residual_pick``       n, remaining (B,), orders, slots (B, R), uniforms (B, T), draft
                                   logits (B, R', V), verifier rows (B, R, X) -> uniform, committed
                                   count (B,), draft row (B, V), verifier row (B, X): the lossless
                                   residual draw
``sigmafast::gather_drafts``       positions, drafts, log-probs (B, R), canvas, known, uniforms (B, T),
                                   orders (B, O, S) -> tokens, log-probs, uniforms, slots (B, O, S)
``sigmafast::commit``              orders, choice, n, tokens, keys, values, flag () and status (3,) or
                                   None, residual token and step (B,) or None -> None; writes the
                                   canvas, known, last token/position, KV caches and lens, and the burst
                                   status after them into status
``sigmafast::flag_nonfinite``      values (..., N), used (broadcast to ...) or None, flag () -> None;
                                   sets flag when a used row is not finite
``sigmafast::plan_step``           steps (W, B, T), step () -> (W, B) column step; advances step
=================================  ==========================================================

Every op but ``commit``, ``rotary_``, ``flag_nonfinite``, ``sample``, ``decide``, ``linear_add_norm``,
``mlp_add_norm``, ``feed_embedding``, ``draft_logq`` and ``lm_head_logq`` is functional: it returns new
tensors and mutates none of its inputs. ``commit`` declares the session buffers and the status it writes
in place (``mutates_args``), ``rotary_`` the tensors it rotates, the next three their flag, the next three the next
projection's output, and the last two their log ratio. An op that mutates declares no argument defaults: in
torch 2.11 its ADInplaceOrView kernel indexes the arguments after the dispatcher has dropped the trailing
ones left at their defaults (an ``IndexError`` whenever the mutated argument is a trailing None; 2.13 fills
them back in first).
The ops do not check their inputs: the public functions of ``attention``,
``accept`` and ``sampling`` (and :mod:`sigmafast.kernels`, which calls them)
validate in Python first, then call the op. Importing this module imports
triton, so :mod:`sigmafast.kernels` imports it only on the Triton path.
(No ``from __future__ import annotations`` here: ``custom_op`` reads the
schema from the annotations.)
"""

from typing import Optional

import torch
from torch import Tensor

from .accept import draft_logq
from .lm_head import lm_head_logq
from .attention import cascade_attention
from .along import launch as gather_drafts_launch
from .slots import launch as draft_slots_launch
from .lossless import pick_launch as residual_pick_launch
from .lossless import rows_like
from .rotary import launch as rotary_launch
from .reference_layers import rotary_ as rotary_reference
from .commit_step import launch as commit_launch
from .decide import launch as decide_launch
from .embed import launch as feed_embedding_launch
from .flags import launch as flag_nonfinite_launch
from .plan import launch as plan_step_launch
from .fc_gelu import launch as linear_gelu_launch
from .layer_norm import launch as add_layer_norm_launch
from .linear_norm import linear_launch as linear_add_norm_launch
from .linear_norm import mlp_launch as mlp_add_norm_launch
from .sampling import launch


def _like_q(q, k, v, k_cache, v_cache, cache_lens, scale=None, num_splits=None) -> Tensor:
    return torch.empty_like(q)


@torch.library.custom_op("sigmafast::burst_attention", mutates_args=())
def _burst_attention(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, cache_lens: Tensor,
                     scale: Optional[float] = None, num_splits: Optional[int] = None) -> Tensor:
    return cascade_attention(q, k, v, k_cache, v_cache, cache_lens, scale, None, num_splits)


@torch.library.custom_op("sigmafast::verify_attention", mutates_args=())
def _verify_attention(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, cache_lens: Tensor,
                      scale: Optional[float] = None, num_splits: Optional[int] = None) -> Tensor:
    return cascade_attention(q, k, v, k_cache, v_cache, cache_lens, scale, None, num_splits)


_burst_attention.register_fake(_like_q)
_verify_attention.register_fake(_like_q)


def _scores(rows: Tensor, temperature: float) -> Tensor:
    return rows.new_empty(rows.shape[0], dtype=torch.int64 if temperature == 0 else torch.float32)


@torch.library.custom_op("sigmafast::draft_logq", mutates_args=("log_ratio",))
def _draft_logq(logits: Tensor, drafts: Tensor, temperature: float, top_k: Optional[int], block_v: Optional[int],
                draft_logp: Optional[Tensor], log_ratio: Optional[Tensor]) -> Tensor:
    return draft_logq(logits, drafts, temperature, top_k, block_v, draft_logp, log_ratio)


@_draft_logq.register_fake
def _(logits, drafts, temperature, top_k, block_v, draft_logp, log_ratio):
    return _scores(logits, temperature)


@torch.library.custom_op("sigmafast::lm_head_logq", mutates_args=("log_ratio",))
def _lm_head_logq(hidden: Tensor, weight: Tensor, drafts: Tensor, temperature: float,
                  draft_logp: Optional[Tensor], log_ratio: Optional[Tensor]) -> Tensor:
    return lm_head_logq(hidden, weight, drafts, temperature, draft_logp, log_ratio)


@_lm_head_logq.register_fake
def _(hidden, weight, drafts, temperature, draft_logp, log_ratio):
    return _scores(hidden, temperature)


@torch.library.custom_op("sigmafast::sample", mutates_args=("flag",))
def _sample(logits: Tensor, uniforms: Tensor, temperature: float, top_k: Optional[int], block_v: Optional[int],
            used: Optional[Tensor], flag: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    return launch(logits, None, uniforms, temperature, top_k, block_v, used, flag)


@_sample.register_fake
def _(logits, uniforms, temperature, top_k, block_v, used, flag):
    N = logits.shape[0]
    return logits.new_empty(N, dtype=torch.int64), logits.new_empty(N, dtype=torch.float32)


@torch.library.custom_op("sigmafast::residual_sample", mutates_args=())
def _residual_sample(q_logits: Tensor, p_logits: Tensor, uniforms: Tensor, temperature: float,
                     top_k: Optional[int] = None, block_v: Optional[int] = None) -> Tensor:
    return launch(q_logits, p_logits, uniforms, temperature, top_k, block_v)[0]


@_residual_sample.register_fake
def _(q_logits, p_logits, uniforms, temperature, top_k=None, block_v=None):
    return q_logits.new_empty(q_logits.shape[0], dtype=torch.int64)


@torch.library.custom_op("sigmafast::decide", mutates_args=("flag",))
def _decide(test: Tensor, drafts: Tensor, uniforms: Tensor, lengths: Tensor, greedy: bool,
            paper: bool, flag: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return decide_launch(test, drafts, uniforms, lengths, greedy, paper, flag)


@_decide.register_fake
def _(test, drafts, uniforms, lengths, greedy, paper, flag):
    B, O, R = drafts.shape
    return (drafts.new_empty((B, O, R), dtype=torch.bool), drafts.new_empty((B, O), dtype=torch.int64),
            drafts.new_empty((B, O), dtype=torch.int64), drafts.new_empty((B,), dtype=torch.int64),
            drafts.new_empty((B,), dtype=torch.int64))


@torch.library.custom_op("sigmafast::add_layer_norm", mutates_args=())
def _add_layer_norm(x: Tensor, y: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                    eps: float) -> tuple[Tensor, Tensor]:
    return add_layer_norm_launch(x, y, weight, bias, eps)


@_add_layer_norm.register_fake
def _(x, y, weight, bias, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape)


@torch.library.custom_op("sigmafast::linear_gelu", mutates_args=())
def _linear_gelu(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    return linear_gelu_launch(x, weight, bias)


@_linear_gelu.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("sigmafast::linear_add_norm", mutates_args=("next_out",))
def _linear_add_norm(x: Tensor, y: Tensor, weight: Tensor, bias: Optional[Tensor], norm_weight: Optional[Tensor],
                     norm_bias: Optional[Tensor], eps: float, next_weight: Optional[Tensor],
                     next_bias: Optional[Tensor], next_out: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    return linear_add_norm_launch(x, y, weight, bias, norm_weight, norm_bias, eps, next_weight, next_bias, next_out)


@_linear_add_norm.register_fake
def _(x, y, weight, bias, norm_weight, norm_bias, eps, next_weight, next_bias, next_out):
    return x.new_empty(x.shape), x.new_empty(x.shape)


@torch.library.custom_op("sigmafast::mlp_add_norm", mutates_args=("next_out",))
def _mlp_add_norm(x: Tensor, h: Tensor, fc_weight: Tensor, fc_bias: Optional[Tensor], proj_weight: Tensor,
                  proj_bias: Optional[Tensor], norm_weight: Optional[Tensor], norm_bias: Optional[Tensor],
                  eps: float, next_weight: Optional[Tensor], next_bias: Optional[Tensor],
                  next_out: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    return mlp_add_norm_launch(x, h, fc_weight, fc_bias, proj_weight, proj_bias, norm_weight, norm_bias, eps,
                               next_weight, next_bias, next_out)


@_mlp_add_norm.register_fake
def _(x, h, fc_weight, fc_bias, proj_weight, proj_bias, norm_weight, norm_bias, eps, next_weight, next_bias,
      next_out):
    return x.new_empty(x.shape), x.new_empty(x.shape)


@torch.library.custom_op("sigmafast::feed_embedding", mutates_args=("next_out",))
def _feed_embedding(last_tok: Tensor, last_pos: Tensor, tokens: Optional[Tensor], orders: Tensor, wte: Tensor,
                    pe_in: Optional[Tensor], pe_out: Optional[Tensor], weight: Optional[Tensor],
                    bias: Optional[Tensor], eps: float, next_weight: Optional[Tensor], next_bias: Optional[Tensor],
                    next_out: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    return feed_embedding_launch(last_tok, last_pos, tokens, orders, wte, pe_in, pe_out, weight, bias, eps,
                                 next_weight, next_bias, next_out)


@_feed_embedding.register_fake
def _(last_tok, last_pos, tokens, orders, wte, pe_in, pe_out, weight, bias, eps, next_weight, next_bias, next_out):
    x = wte.new_empty(*orders.shape, wte.shape[1])
    return x, torch.empty_like(x)


@torch.library.custom_op("sigmafast::rotary_", mutates_args=("q", "k", "v"))
def _rotary_(q: Tensor, k: Optional[Tensor], v: Optional[Tensor], pos_q: Tensor, pos_k: Optional[Tensor],
             cos: Tensor, sin: Tensor, sign: float) -> None:
    if not rotary_launch(q, k, v, pos_q, pos_k, cos, sin, sign):  # a layout the kernel cannot rotate in place
        rotary_reference(q, k, v, pos_q, pos_k, cos, sin, sign)


@_rotary_.register_fake
def _(q, k, v, pos_q, pos_k, cos, sin, sign):
    return None


@torch.library.custom_op("sigmafast::residual_pick", mutates_args=())
def _residual_pick(n: Tensor, remaining: Tensor, orders: Tensor, slots: Tensor, u_residual: Tensor,
                   drafts: Tensor, verifier: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return residual_pick_launch(n, remaining, orders, slots, u_residual, drafts, verifier)


@_residual_pick.register_fake
def _(n, remaining, orders, slots, u_residual, drafts, verifier):
    B = orders.shape[0]
    return u_residual.new_empty(B), orders.new_empty(B, dtype=torch.int64), rows_like(drafts), rows_like(verifier)


@torch.library.custom_op("sigmafast::draft_slots", mutates_args=())
def _draft_slots(known: Tensor, uniforms: Tensor, keys: Tensor, R: int
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return draft_slots_launch(known, uniforms, keys, R)


@_draft_slots.register_fake
def _(known, uniforms, keys, R):
    B = known.shape[0]
    return (known.new_empty((B, R), dtype=torch.int64), uniforms.new_empty((B, R)),
            known.new_empty((B, R)), known.new_empty((B,), dtype=torch.int64),
            keys.new_empty((B, keys.shape[1], R), dtype=torch.int64))


@torch.library.custom_op("sigmafast::gather_drafts", mutates_args=())
def _gather_drafts(positions: Tensor, tokens: Tensor, logp: Tensor, canvas: Tensor, known: Tensor, uniforms: Tensor,
                   orders: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return gather_drafts_launch(positions, tokens, logp, canvas, known, uniforms, orders)


@_gather_drafts.register_fake
def _(positions, tokens, logp, canvas, known, uniforms, orders):
    shape = orders.shape
    return (tokens.new_empty(shape), logp.new_empty(shape), uniforms.new_empty(shape),
            orders.new_empty(shape, dtype=torch.int64))


@torch.library.custom_op("sigmafast::commit",
                         mutates_args=("canvas", "known", "last_tok", "last_pos", "k_cache", "v_cache", "lens",
                                       "status"))
def _commit(orders: Tensor, choice: Tensor, n: Tensor, tokens: Tensor, keys: Tensor, values: Tensor, canvas: Tensor,
            known: Tensor, last_tok: Tensor, last_pos: Tensor, k_cache: Tensor, v_cache: Tensor, lens: Tensor,
            flag: Optional[Tensor], status: Optional[Tensor], residual: Optional[Tensor],
            residual_step: Optional[Tensor]) -> None:
    commit_launch(orders, choice, n, tokens, keys, values, canvas, known, last_tok, last_pos, k_cache, v_cache, lens,
                  flag, status, residual, residual_step)


@_commit.register_fake
def _(orders, choice, n, tokens, keys, values, canvas, known, last_tok, last_pos, k_cache, v_cache, lens, flag,
      status, residual, residual_step):
    return None


@torch.library.custom_op("sigmafast::flag_nonfinite", mutates_args=("flag",))
def _flag_nonfinite(values: Tensor, used: Optional[Tensor], flag: Tensor) -> None:
    flag_nonfinite_launch(values, used, flag)


@_flag_nonfinite.register_fake
def _(values, used, flag):
    return None


@torch.library.custom_op("sigmafast::plan_step", mutates_args=("step",))
def _plan_step(steps: Tensor, step: Tensor) -> Tensor:
    return plan_step_launch(steps, step)


@_plan_step.register_fake
def _(steps, step):
    return steps.new_empty(steps.shape[:2])


OPS = ("burst_attention", "verify_attention", "draft_logq", "lm_head_logq", "sample", "residual_sample",
       "decide", "add_layer_norm", "linear_gelu", "linear_add_norm", "mlp_add_norm", "feed_embedding", "rotary_",
       "draft_slots", "gather_drafts", "residual_pick", "commit", "flag_nonfinite", "plan_step")
