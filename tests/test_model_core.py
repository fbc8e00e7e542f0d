"""The σ-GPT core against references written out by hand: a left-to-right σ-GPT is a standard GPT, the
GPT-2 initialisation, and where dropout acts."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from sigmafast import orders
from sigmafast.model import SigmaGPT
from sigmafast.model_config import SigmaGPTConfig


def gpt_reference(model: SigmaGPT, x: torch.Tensor) -> torch.Tensor:
    """(B, T) -> (B, T, V) logits of a standard causal GPT (GPT-2 layout, tied head) fed ``[BOS, x_0 … x_T-2]``,
    whose position-t embedding is ``concat(table_in[in_t], table_out[t])`` with in_0 = START, in_t = t - 1:
    what a σ-GPT in left-to-right order must compute. Only the weights are taken from ``model``."""
    cfg = model.config
    B, T = x.shape
    C, H, D = cfg.n_embd, cfg.n_head, cfg.head_dim
    table_in, table_out = model.position_tables()
    in_pos = torch.tensor([cfg.start_pos] + list(range(T - 1)))
    wpe = torch.cat([table_in[in_pos], table_out[torch.arange(T)]], dim=-1)  # (T, C): one position table
    tokens = torch.cat([torch.full((B, 1), cfg.bos_token_id), x[:, :-1]], dim=1)
    emb = model.wte.weight
    h = emb[tokens] + wpe
    causal = torch.ones(T, T, dtype=torch.bool).tril()

    def ln(norm, t):
        return F.layer_norm(t, (C,), norm.weight, norm.bias)

    for block in model.h:
        a = ln(block.ln_1, h)
        q, k, v = (a @ block.attn.c_attn.weight.T + block.attn.c_attn.bias).split(C, dim=-1)
        q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(~causal, -math.inf)
        y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, C)
        h = h + y @ block.attn.c_proj.weight.T + block.attn.c_proj.bias
        a = ln(block.ln_2, h)
        mlp = block.mlp
        u = a @ mlp.c_fc.weight.T + mlp.c_fc.bias
        u = 0.5 * u * (1 + torch.erf(u / math.sqrt(2)))  # exact GELU
        h = h + u @ mlp.c_proj.weight.T + mlp.c_proj.bias
    return ln(model.ln_f, h) @ emb.T  # the LM head is the token embedding


@pytest.mark.parametrize("pos_encoding", ["sinusoidal", "learned"])
def test_left_to_right_sigma_gpt_is_a_standard_gpt(pos_encoding):
    torch.manual_seed(0)
    config = SigmaGPTConfig(vocab_size=13, block_size=12, n_layer=2, n_head=2, n_embd=16, pos_encoding=pos_encoding)
    model = SigmaGPT(config).double().eval()
    with torch.no_grad():  # far from the init, so that every term matters
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 12, (3, 10), generator=g)
    tokens, in_pos, out_pos, targets = orders.shuffle(x, orders.left_to_right(3, 10), config.bos_token_id,
                                                      config.start_pos)
    logits, loss = model(tokens, in_pos, out_pos, targets)
    want = gpt_reference(model, x)
    torch.testing.assert_close(logits, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(loss, F.cross_entropy(want.flatten(0, 1), x.flatten()), rtol=1e-12, atol=1e-12)


def test_gpt2_initialisation():
    """N(0, 0.02) for every matrix and embedding (the learned position tables too), N(0, 0.02 / sqrt(2 n_layer))
    for the residual projections (attention and MLP ``c_proj``), zero biases, unit LayerNorms."""
    torch.manual_seed(0)
    config = SigmaGPTConfig(vocab_size=512, block_size=64, n_layer=4, n_head=4, n_embd=128, pos_encoding="learned")
    model = SigmaGPT(config)
    residual_std = 0.02 / math.sqrt(2 * config.n_layer)
    seen = set()
    for name, p in model.named_parameters():
        p = p.detach().double()
        if name.endswith("bias"):
            assert not p.any(), name
        elif ".ln_" in name or name.startswith("ln_f"):
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            want = residual_std if name.endswith("c_proj.weight") else 0.02
            assert p.std().item() == pytest.approx(want, rel=0.05), name
            assert abs(p.mean().item()) < 0.05 * want, name
            seen.add(name.split(".")[-2])
    assert seen == {"wte", "wpe_in", "wpe_out", "c_attn", "c_proj", "c_fc"}


def test_dropout_acts_at_every_site_in_training_only(monkeypatch):
    """``dropout`` applies to the embedding, the attention weights and both residual branches of every block in
    training mode, and nowhere in eval mode (where the logits are those of the same weights without dropout)."""
    torch.manual_seed(0)
    config = SigmaGPTConfig(vocab_size=11, block_size=16, n_layer=2, n_head=2, n_embd=16, dropout=0.5)
    model = SigmaGPT(config)
    calls = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Dropout):
            module.register_forward_hook(lambda m, i, o, name=name: calls.append((name, m.training, m.p)))
    attention_p = []
    sdpa = F.scaled_dot_product_attention

    def recording_sdpa(*args, **kwargs):
        attention_p.append(kwargs.get("dropout_p", 0.0))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording_sdpa)
    x = torch.randint(0, 10, (2, 9), generator=torch.Generator().manual_seed(1))
    batch = orders.shuffle(x, orders.random(2, 9, generator=torch.Generator().manual_seed(2)), 10, 16)
    sites = {"drop"} | {f"h.{i}.{s}" for i in range(2) for s in ("attn.resid_dropout", "mlp.dropout")}
    model.train()
    first, _ = model(*batch[:3])
    assert {n for n, training, p in calls if training and p == 0.5} == sites and len(calls) == len(sites)
    assert attention_p == [0.5, 0.5]
    assert not torch.equal(model(*batch[:3])[0], first)  # dropout draws anew
    calls.clear(), attention_p.clear()
    model.eval()
    logits, _ = model(*batch[:3])
    assert all(not training for _, training, _ in calls) and attention_p == [0.0, 0.0]
    plain = SigmaGPT(SigmaGPTConfig(**{**config.to_dict(), "dropout": 0.0})).eval()
    plain.load_state_dict(model.state_dict())
    torch.testing.assert_close(logits, plain(*batch[:3])[0], rtol=0, atol=0)


def test_forward_loss_of_a_batch_without_targets_is_zero_as_loss_is():
    """``forward``'s loss, like :meth:`SigmaGPT.loss`, is ``sum CE / max(1, N_valid)``: a micro-batch whose targets
    are all ignored (padding), or empty, gives 0 and zero gradients, not NaN (which would poison a sum of losses)."""
    torch.manual_seed(0)
    model = SigmaGPT(SigmaGPTConfig(vocab_size=11, block_size=16, n_layer=1, n_head=2, n_embd=16))
    x = torch.randint(0, 10, (2, 6), generator=torch.Generator().manual_seed(1))
    tokens, in_pos, out_pos, targets = orders.shuffle(x, orders.left_to_right(2, 6), 10, 16)
    for t in (torch.full_like(targets, -1), targets[:, :0]):
        T = t.shape[1]
        _, loss = model(tokens[:, :T], in_pos[:, :T], out_pos[:, :T], t)
        assert loss.item() == 0.0 and loss.item() == model.loss(tokens[:, :T], in_pos[:, :T], out_pos[:, :T], t).item()
        model.zero_grad(set_to_none=True)
        loss.backward()
        assert all(not p.grad.any() for p in model.parameters() if p.grad is not None)
    targets[0, 1:] = -1
    _, loss = model(tokens, in_pos, out_pos, targets)
    torch.testing.assert_close(loss, model.loss(tokens, in_pos, out_pos, targets))


@pytest.mark.parametrize("pos_encoding", ["sinusoidal", "rope", "rope-v+learned"])
def test_position_tables_are_exact_after_a_round_trip_through_16_bits(pos_encoding):
    """The fixed tables are buffers, cast with the model; casting back rebuilds them instead of widening the
    rounded ones. A cast that changes nothing keeps the very tensors (captured graphs read them)."""
    config = SigmaGPTConfig(vocab_size=11, block_size=40, n_layer=1, n_head=2, n_embd=32, pos_encoding=pos_encoding)
    fresh = dict(SigmaGPT(config).named_buffers())
    model = SigmaGPT(config)
    kept = dict(model.named_buffers())
    model.float()
    assert all(b is kept[name] for name, b in model.named_buffers())
    model.bfloat16()
    assert all(b.dtype == torch.bfloat16 for b in model.buffers())
    model.float()
    assert fresh and all(torch.equal(b, fresh[name]) for name, b in model.named_buffers())
