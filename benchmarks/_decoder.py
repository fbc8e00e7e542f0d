"""The anchor of ``bench_engine.py``: a plain static-KV-cache GPT-2 decoder (nanoGPT / gpt-fast style).

Pre-LayerNorm GPT-2 blocks (learned positions, tanh GELU, tied LM head, random
weights). Each layer owns a :class:`KVCache` of static ``(B, H, T, D)`` buffers
written in place at ``input_pos``; attention always covers all T slots under a
causal-mask row, so every decode step has the same shapes and
``torch.compile(mode="reduce-overhead")`` can replay it as a CUDA graph.
Greedy (argmax) decoding on the device: no host sync inside :func:`generate`.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class KVCache(nn.Module):
    def __init__(self, B: int, H: int, T: int, D: int, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.register_buffer("k", torch.zeros(B, H, T, D, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(B, H, T, D, dtype=dtype, device=device), persistent=False)

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Write (B, H, S, D) keys/values at positions ``input_pos`` (S,); return the full buffers."""
        self.k.index_copy_(2, input_pos, k)
        self.v.index_copy_(2, input_pos, v)
        return self.k, self.v


class Block(nn.Module):
    def __init__(self, C: int, H: int) -> None:
        super().__init__()
        self.H = H
        self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.c_attn, self.attn_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.c_fc, self.mlp_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)
        self.kv_cache: KVCache | None = None

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, S, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).view(B, S, 3, self.H, C // self.H).permute(2, 0, 3, 1, 4)
        k, v = self.kv_cache.update(input_pos, k, v)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, S, D) over all T slots
        x = x + self.attn_proj(y.transpose(1, 2).reshape(B, S, C))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class Decoder(nn.Module):
    def __init__(self, n_layer: int, n_head: int, n_embd: int, vocab_size: int, block_size: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in GPT-2
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)
        self.register_buffer("causal", torch.ones(block_size, block_size, dtype=torch.bool).tril(), persistent=False)

    def setup_caches(self, batch_size: int, seq_len: int) -> None:
        """Static caches of ``seq_len`` slots (model dtype and device), kept when the shape is unchanged
        (stale entries are never read: slot j is written before any query at position >= j sees it)."""
        w = self.wte.weight
        if getattr(self, "cache_shape", None) == (batch_size, seq_len):
            return
        for block in self.h:
            block.kv_cache = KVCache(batch_size, block.H, seq_len, w.shape[1] // block.H, w.dtype, w.device)
        self.cache_shape, self.seq_len = (batch_size, seq_len), seq_len

    def forward(self, idx: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """(B, S) tokens at positions ``input_pos`` (S,) -> (B, V) logits of the last one."""
        mask = self.causal[input_pos, : self.seq_len][None, None]  # (1, 1, S, T)
        x = self.wte(idx) + self.wpe(input_pos)
        for block in self.h:
            x = block(x, input_pos, mask)
        return self.lm_head(self.ln_f(x[:, -1]))


def prefill(model: Decoder, idx: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
    return model(idx, input_pos).argmax(-1)  # (B,)


def decode_one_token(model: Decoder, tok: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
    return model(tok[:, None], input_pos).argmax(-1)  # (B,)


def compiled_decode():
    """``decode_one_token`` under ``torch.compile(mode="reduce-overhead", fullgraph=True)`` (CUDA graphs)."""
    return torch.compile(decode_one_token, mode="reduce-overhead", fullgraph=True, dynamic=False)


@torch.no_grad()
def generate(model: Decoder, prompt: torch.Tensor, max_new_tokens: int, decode=decode_one_token) -> torch.Tensor:
    """Greedy continuation of a (B, P) prompt by ``max_new_tokens`` -> (B, P + max_new_tokens)."""
    B, P = prompt.shape
    model.setup_caches(B, P + max_new_tokens)
    out = torch.empty(B, P + max_new_tokens, dtype=torch.long, device=prompt.device)
    out[:, :P] = prompt
    tok = prefill(model, prompt, torch.arange(P, device=prompt.device))
    out[:, P] = tok
    input_pos = torch.tensor([P], device=prompt.device)
    mark_step = getattr(torch.compiler, "cudagraph_mark_step_begin", None)
    for i in range(1, max_new_tokens):
        tok = tok.clone()  # a CUDA-graph output is overwritten by the next replay
        if mark_step is not None and decode is not decode_one_token:
            mark_step()
        tok = decode(model, tok, input_pos)
        out[:, P + i] = tok
        input_pos += 1
    return out
