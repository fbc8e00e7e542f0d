"""Plain PyTorch references of the model-layer kernels: a step's small ops that the Triton path fuses.

A residual add and its LayerNorm (``add_layer_norm``), the MLP's first matmul and GELU (``linear_gelu``), a
narrow model's sublayer ends (``linear_add_norm``, ``mlp_add_norm``), the input embedding with the first
LayerNorm (``feed_embedding``), and RoPE (``turn_tables``, ``rotate_pairs``, ``rotary_``), which the model's
own positional encodings use too. As in :mod:`sigmafast.kernels.reference` (the sampler's ops), each is the
ground truth of its kernel's tests and the CPU path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def add_layer_norm(x, y, weight=None, bias=None, eps=1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + y`` and ``F.layer_norm(s, (C,), weight, bias, eps)``, both (..., C) like x."""
    s = x + y
    return s, F.layer_norm(s, (s.shape[-1],), weight, bias, eps)


def linear_gelu(x, weight, bias=None) -> torch.Tensor:
    """``F.gelu(F.linear(x, weight, bias))``, (..., K) -> (..., F): the first half of the MLP."""
    return F.gelu(F.linear(x, weight, bias))


def linear_add_norm(x, y, weight, bias=None, norm_weight=None, norm_bias=None, eps=1e-5, *, next_weight=None,
                    next_bias=None, next_out=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_layer_norm(x, F.linear(y, weight, bias), norm_weight, norm_bias, eps)``: the end of an attention
    sublayer (its output projection, the residual add and the next norm). With ``next_weight``, also
    ``next_out[:] = F.linear(norm, next_weight, next_bias)`` (the next block's QKV projection)."""
    s, h = add_layer_norm(x, F.linear(y, weight, bias), norm_weight, norm_bias, eps)
    if next_weight is not None:
        next_out.copy_(F.linear(h, next_weight, next_bias))
    return s, h


def mlp_add_norm(x, h, fc_weight, fc_bias, proj_weight, proj_bias, norm_weight=None, norm_bias=None, eps=1e-5, *,
                 next_weight=None, next_bias=None, next_out=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``linear_add_norm(x, F.gelu(F.linear(h, fc_weight, fc_bias)), proj_weight, proj_bias, ...)``: the end
    of an MLP sublayer."""
    return linear_add_norm(x, F.gelu(F.linear(h, fc_weight, fc_bias)), proj_weight, proj_bias, norm_weight,
                           norm_bias, eps, next_weight=next_weight, next_bias=next_bias, next_out=next_out)


def feed_inputs(last_tok, last_pos, tokens, orders) -> tuple[torch.Tensor, torch.Tensor]:
    """The (B, G, S) tokens and input positions fed along ``orders``: step s gets step s - 1's token and
    position, step 0 the (B,) last token and position (``tokens`` may be None when S == 1)."""
    B, G, S = orders.shape
    tok, pos = last_tok[:, None, None].expand(B, G, 1), last_pos[:, None, None].expand(B, G, 1)
    if S == 1:
        return tok, pos
    return torch.cat([tok, tokens[..., :-1]], dim=-1), torch.cat([pos, orders[..., :-1]], dim=-1)


def feed_embedding(last_tok, last_pos, tokens, orders, wte, pe_in, pe_out, weight=None, bias=None, eps=1e-5, *,
                   next_weight=None, next_bias=None, next_out=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x = wte[token] + concat(pe_in[in_pos], pe_out[orders])`` of the inputs fed along the (B, G, S)
    ``orders`` (:func:`feed_inputs`), and ``h = F.layer_norm(x, (C,), weight, bias, eps)``. With
    ``next_weight``, also ``next_out[:] = F.linear(h, next_weight, next_bias)`` (the first block's QKV
    projection)."""
    tok, in_pos = feed_inputs(last_tok, last_pos, tokens, orders)
    x = F.embedding(tok, wte)
    if pe_in is not None:
        x = x + torch.cat([F.embedding(in_pos, pe_in), F.embedding(orders, pe_out)], dim=-1)
    h = F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    if next_weight is not None:
        next_out.copy_(F.linear(h, next_weight, next_bias))
    return x, h


def turn_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., D/2) cos and sin -> (..., D) ``[cos, cos]`` and ``[-sin, sin]``, the tables of
    :func:`rotate_pairs`."""
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, back: bool = False) -> torch.Tensor:
    """(..., D) ``x`` with its channel pairs (x_i, x_{i + D/2}) rotated by the angles whose (..., D) tables
    (broadcast) are ``cos`` = [cos, cos] and ``sin`` = [-sin, sin] (:func:`turn_tables`), or by minus them
    when ``back``: x_i cos -+ x_{i + D/2} sin and x_{i + D/2} cos +- x_i sin, bit for bit, in four ops (a
    swap of the halves, two products, a sum) instead of the pairwise formula's seven. RoPE's one formula:
    the model's (``positions.Rotary``) and the rotary kernel's reference."""
    x1, x2 = x.chunk(2, dim=-1)
    swapped = torch.cat([x2, x1], dim=-1)
    return x * cos - swapped * sin if back else x * cos + swapped * sin


def rotary_(q, k, v, pos_q, pos_k, cos, sin, sign: float = 1.0) -> None:
    """Rotate q (..., H, T, D), and k and v when not None, in place: the channel pairs (x_i, x_{i + D/2})
    of each head by the angles of rows ``pos_q`` (..., T) (``pos_k`` for k and v) of the (n_pos, D/2)
    cos and sin tables, times ``sign``; in the tensors' dtype, as the model's RoPE."""
    for x, pos in ((q, pos_q), (k, pos_k), (v, pos_k)):
        if x is not None:
            c, s = turn_tables(cos[pos], sin[pos] * sign)
            x.copy_(rotate_pairs(x, c.unsqueeze(-3).to(x.dtype), s.unsqueeze(-3).to(x.dtype)))
