import math

import pytest
import torch
import torch.nn.functional as F

from sigmafast import orders
from sigmafast.loss import linear_cross_entropy
from sigmafast.model import SigmaGPT
from sigmafast.model_config import PRESETS, SigmaGPTConfig
from sigmafast.kernels.reference_layers import turn_tables
from sigmafast.positions import PE_SCALE, Rotary, rotary_tables, sinusoidal_table


def tiny_config(**kw) -> SigmaGPTConfig:
    return SigmaGPTConfig.from_preset("tiny", **{"vocab_size": 11, "block_size": 16, **kw})


def inputs(B=3, T=9, V=11, seed=0, block_size=16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V - 1, (B, T), generator=g)
    order = orders.random(B, T, generator=g)
    return orders.shuffle(x, order, bos=V - 1, start_pos=block_size)


@pytest.fixture(params=["sinusoidal", "learned", "rope", "rope+sinusoidal", "rope-v"])
def model(request):
    torch.manual_seed(0)
    return SigmaGPT(tiny_config(pos_encoding=request.param)).eval()


@pytest.mark.parametrize("B,T", [(1, 1), (3, 9), (2, 16)], ids=["1x1", "3x9", "full-block"])
def test_shapes(model, B, T):
    tokens, in_pos, out_pos, targets = inputs(B, T)
    logits, loss = model(tokens, in_pos, out_pos)
    assert logits.shape == (B, T, 11) and loss is None
    logits2, loss = model(tokens, in_pos, out_pos, targets)
    assert torch.equal(logits, logits2) and loss.shape == ()


def test_out_pos_alone_changes_logits(model):
    tokens, in_pos, out_pos, _ = inputs()
    base, _ = model(tokens, in_pos, out_pos)
    other_out = out_pos.clone()
    other_out[:, 4] = (out_pos[:, 4] + 1) % 9
    changed, _ = model(tokens, in_pos, other_out)
    assert not torch.allclose(changed[:, 4], base[:, 4])
    assert torch.equal(changed[:, :4], base[:, :4])  # causal: earlier rows never see row 4


def test_in_pos_alone_changes_logits(model):
    tokens, in_pos, out_pos, _ = inputs()
    base, _ = model(tokens, in_pos, out_pos)
    other_in = in_pos.clone()
    other_in[:, 3] = (in_pos[:, 3] + 2) % 9
    changed, _ = model(tokens, other_in, out_pos)
    assert not torch.allclose(changed[:, 3:], base[:, 3:])
    assert torch.equal(changed[:, :3], base[:, :3])


def test_loss_matches_hand_computed_cross_entropy(model):
    tokens, in_pos, out_pos, targets = inputs(seed=1)
    targets = targets.clone()
    targets[0, 2] = -1  # ignored
    logits, loss = model(tokens, in_pos, out_pos, targets)
    logp = torch.log_softmax(logits.double(), dim=-1)
    keep = targets != -1
    picked = logp.gather(-1, targets.clamp(min=0)[..., None])[..., 0]  # (B, T)
    expected = -(picked * keep).sum() / keep.sum()
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=1e-6)


def test_run_layers_reproduces_forward(model):
    tokens, in_pos, out_pos, _ = inputs()

    def attend(layer, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    x = model.embed(tokens, in_pos, out_pos)
    hidden = model.run_layers(x, attend, model.rotary(in_pos, out_pos))
    logits, _ = model(tokens, in_pos, out_pos)
    torch.testing.assert_close(model.lm_head(hidden), logits)


@pytest.mark.parametrize("chunk_elements", [2**25, 11 * 4, 11 * 5, 1], ids=["one-chunk", "4-rows", "5-rows", "1-row"])
def test_chunked_loss_matches_full_cross_entropy(model, chunk_elements):
    tokens, in_pos, out_pos, targets = inputs(B=3, T=9, seed=2)
    targets = targets.clone()
    targets[1, :5] = -1  # ignored rows, some of them inside a chunk
    model.double().train()

    def grads(loss_fn):
        model.zero_grad(set_to_none=True)
        loss = loss_fn()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    full, g_full = grads(lambda: model(tokens, in_pos, out_pos, targets)[1] * 3.0)
    hidden_fn = model.hidden_states

    def chunked():
        return linear_cross_entropy(hidden_fn(tokens, in_pos, out_pos), model.lm_head.weight, targets,
                                    chunk_elements=chunk_elements) * 3.0

    loss, g_chunked = grads(chunked)
    torch.testing.assert_close(loss, full, rtol=1e-12, atol=1e-12)
    assert g_full.keys() == g_chunked.keys()
    for name in g_full:
        torch.testing.assert_close(g_chunked[name], g_full[name], rtol=1e-10, atol=1e-12)
    with torch.no_grad():
        torch.testing.assert_close(model.loss(tokens, in_pos, out_pos, targets) * 3.0, full, rtol=1e-12, atol=1e-12)


def test_rope_scores_depend_only_on_the_offset():
    cos, sin = turn_tables(*rotary_tables(40, 8))
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, 1, 8, generator=g).unbind(0)  # (1, 1, D) each

    def score(out_pos: int, in_pos: int) -> torch.Tensor:
        rq = Rotary.rotate(q, cos[out_pos][None, None], sin[out_pos][None, None])
        rk = Rotary.rotate(k, cos[in_pos][None, None], sin[in_pos][None, None])
        return (rq * rk).sum()

    for offset in (0, 3, -5):
        scores = torch.stack([score(p + offset, p) for p in range(6, 30, 4)])
        torch.testing.assert_close(scores, scores[0].expand_as(scores), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(score(9, 6), score(9, 7))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_rotate_is_the_pairwise_rotation_bit_for_bit(dtype):
    """``Rotary.rotate`` (four ops on the [cos, cos] and [-sin, sin] tables) and ``restore`` against the
    pairwise formulas x_i cos -+ x_{i + D/2} sin, written out: equal to the last bit in every dtype."""
    cos, sin = (t.to(dtype) for t in rotary_tables(300, 16))
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(3, 2, 40, 16, generator=g) * 3).to(dtype)  # (B, H, T, D)
    pos = torch.randint(0, 300, (3, 1, 40), generator=g)
    c, s = cos[pos], sin[pos]  # (B, 1, T, D/2)
    x1, x2 = x.chunk(2, dim=-1)
    turn = [t[pos] for t in turn_tables(cos, sin)]
    assert torch.equal(Rotary.rotate(x, *turn), torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1))
    back = Rotary(*turn, *turn, values=True).restore(x)
    assert torch.equal(back, torch.cat([x1 * c + x2 * s, x2 * c - x1 * s], dim=-1))


def test_rope_keeps_norms_and_has_no_absolute_table():
    model = SigmaGPT(tiny_config(pos_encoding="rope"))
    assert not hasattr(model, "pe_table") and not hasattr(model, "wpe_in")
    assert model.config.rotary and model.config.absolute is None
    both = SigmaGPT(tiny_config(pos_encoding="rope+learned"))
    assert both.config.absolute == "learned" and hasattr(both, "wpe_in")
    x = torch.randn(2, 2, 5, 32)  # (B, H, T, D)
    pos = torch.tensor([[0, 3, 7, 16, 2], [1, 1, 9, 4, 12]])
    rot = model.rotary(pos, pos)
    q, _, v = rot.apply(x, x, x)
    torch.testing.assert_close(q.norm(dim=-1), x.norm(dim=-1))
    assert v is x  # plain rope leaves the values alone


@pytest.mark.parametrize("pos_encoding", ["rope", "rope-v"])
def test_rope_v_outputs_carry_the_offset_of_what_was_read(pos_encoding):
    """With rope-v a head's output is sum_i a_i R(in_pos_i - out_pos) v_i: it moves with the offsets
    and only with them. Plain rope's output (given the weights) does not see positions at all."""
    model = SigmaGPT(tiny_config(pos_encoding=pos_encoding))
    v = torch.randn(1, 2, 4, 32, generator=torch.Generator().manual_seed(0))  # (B, H, T, D)
    weights = torch.tensor([0.1, 0.2, 0.3, 0.4])

    def read(in_pos: list[int], out_pos: int) -> torch.Tensor:
        rot = model.rotary(torch.tensor([in_pos]), torch.tensor([[out_pos] * 4]))
        _, _, rv = rot.apply(v, v, v)
        y = (weights[:, None] * rv).sum(-2, keepdim=True).expand_as(rv)  # every query reads the same mix
        return rot.restore(y)

    base = read([0, 3, 5, 9], 7)
    torch.testing.assert_close(read([6, 9, 11, 15], 13), base, rtol=1e-5, atol=1e-5)  # same offsets
    moved = read([0, 3, 6, 9], 7)  # one visited token elsewhere
    assert torch.allclose(moved, base, atol=1e-5) == (pos_encoding == "rope")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(n_embd=60, n_head=4), "divisible by 2\\*n_head"),
        (dict(vocab_size=1), "vocab_size must be >= 2"),
        (dict(block_size=0), "block_size must be a positive int"),
        (dict(n_layer=2.0), "n_layer must be a positive int"),
        (dict(dropout=1.0), "dropout must be a number in"),
        (dict(dropout="0.1"), "dropout must be a number in"),
        (dict(dropout=None), "dropout must be a number in"),
        (dict(bias="no"), "bias must be True or False"),
        (dict(bias=None), "bias must be True or False"),
        (dict(bos_token_id=True), "bos_token_id must be an int in"),
        (dict(pos_encoding="alibi"), "pos_encoding must be one of"),
        (dict(bos_token_id=11), "bos_token_id must be an int in"),
        (dict(embedding_init="xavier"), "embedding_init must be one of"),
        (dict(mlp_ratio=-1), "mlp_ratio must be an int >= 0"),
        (dict(mlp_ratio=2.0), "mlp_ratio must be an int >= 0"),
        (dict(mlp_ratio=True), "mlp_ratio must be an int >= 0"),
        (dict(final_norm="rmsnorm"), "final_norm must be one of"),
    ],
    ids=["odd-heads", "vocab", "block", "float-layers", "dropout", "str-dropout", "none-dropout", "str-bias",
         "none-bias", "bool-bos", "pos-encoding", "bos-range", "embedding-init",
         "negative-mlp-ratio", "float-mlp-ratio", "bool-mlp-ratio", "final-norm"],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SigmaGPTConfig(**{"vocab_size": 11, "block_size": 16, "n_layer": 1, "n_head": 2, "n_embd": 8, **kwargs})


def test_bos_defaults_to_last_id():
    assert SigmaGPTConfig(vocab_size=7, n_layer=1, n_head=1, n_embd=4).bos_token_id == 6


def test_config_round_trip_and_unknown_fields():
    cfg = tiny_config(bos_token_id=3)
    assert SigmaGPTConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown SigmaGPTConfig fields"):
        SigmaGPTConfig.from_dict({**cfg.to_dict(), "n_layers": 3})


@pytest.mark.parametrize("pos_encoding", ["sinusoidal", "rope"])
def test_attention_only_blocks_equal_blocks_with_a_zero_mlp(pos_encoding):
    """``mlp_ratio=0`` drops each block's MLP and second LayerNorm: the same forward and loss as the
    standard model with those weights copied and its MLP output projection zeroed."""
    torch.manual_seed(0)
    bare = SigmaGPT(tiny_config(pos_encoding=pos_encoding, mlp_ratio=0)).eval()
    full = SigmaGPT(tiny_config(pos_encoding=pos_encoding)).eval()
    assert not any(".mlp." in n or ".ln_2." in n for n, _ in bare.named_parameters())
    missing, unexpected = full.load_state_dict(bare.state_dict(), strict=False)
    assert not unexpected and missing and all(".mlp." in n or ".ln_2." in n for n in missing)
    with torch.no_grad():
        for block in full.h:
            block.mlp.c_proj.weight.zero_()
            block.mlp.c_proj.bias.zero_()
    tok, inp, outp, tgt = inputs()
    torch.testing.assert_close(bare(tok, inp, outp)[0], full(tok, inp, outp)[0], rtol=0, atol=0)
    torch.testing.assert_close(bare.loss(tok, inp, outp, tgt), full.loss(tok, inp, outp, tgt), rtol=0, atol=0)
    cfg = tiny_config(pos_encoding=pos_encoding, mlp_ratio=0)
    assert bare.num_params(non_embedding=False) == full.num_params(non_embedding=False) - cfg.n_layer * (
        8 * cfg.n_embd**2 + 7 * cfg.n_embd)


def test_scalar_final_norm_is_one_gain_on_a_plain_layernorm():
    torch.manual_seed(0)
    model = SigmaGPT(tiny_config(final_norm="scalar")).eval()
    assert [n for n, _ in model.named_parameters() if n.startswith("ln_f")] == ["ln_f.weight"]
    assert model.ln_f.weight.shape == (1,)
    with torch.no_grad():
        model.ln_f.weight.fill_(2.5)
    x = torch.randn(3, 5, model.config.n_embd)
    torch.testing.assert_close(model.ln_f(x), 2.5 * F.layer_norm(x, (model.config.n_embd,)))
    tok, inp, outp, tgt = inputs()
    loss = model.loss(tok, inp, outp, tgt)
    loss.backward()
    assert model.ln_f.weight.grad is not None and model.ln_f.weight.grad.abs().item() > 0


@pytest.mark.parametrize("vocab_size,n_embd", [(11, 32), (40, 16)], ids=["rows-fit", "more-rows-than-width"])
def test_orthogonal_embedding_init(vocab_size, n_embd):
    torch.manual_seed(0)
    config = SigmaGPTConfig(vocab_size=vocab_size, block_size=8, n_layer=1, n_head=2, n_embd=n_embd,
                            embedding_init="orthogonal")
    w = SigmaGPT(config).wte.weight.detach().double()  # tied to lm_head
    norms = w.norm(dim=1)
    torch.testing.assert_close(norms, torch.full_like(norms, 0.02 * n_embd ** 0.5))
    cos = (w / norms[:, None]) @ (w / norms[:, None]).T
    off = cos - torch.diag(cos.diagonal())
    if vocab_size <= n_embd:
        assert off.abs().max() < 1e-6  # orthonormal rows
    else:
        assert torch.linalg.matrix_rank(w) == n_embd  # orthonormal columns, full rank
    normal = SigmaGPT(tiny_config()).wte.weight.detach()
    assert normal.norm(dim=1).std() > 0  # the default init stays N(0, 0.02)


def test_input_validation(model):
    tokens, in_pos, out_pos, targets = inputs()
    with pytest.raises(TypeError, match="in_pos must be an integer tensor"):
        model(tokens, in_pos.float(), out_pos)
    with pytest.raises(ValueError, match="out_pos must have shape"):
        model(tokens, in_pos, out_pos[:, :-1])
    long = torch.zeros(1, 17, dtype=torch.long)
    with pytest.raises(ValueError, match="exceeds block_size 16"):
        model(long, long, long)
    with pytest.raises(ValueError, match="targets must have shape"):
        model(tokens, in_pos, out_pos, targets[:1])
    V, n_pos = model.config.vocab_size, model.config.block_size + 1
    for bad in (out_pos - 1 - out_pos.max(), out_pos + 1000):  # negative, past the tables: never wrapped
        got = "-[0-9]+" if int(bad.min()) < 0 else "[0-9]{4}"  # one of them
        for args, name in (((tokens, in_pos, bad), "out_pos"), ((tokens, bad, out_pos), "in_pos")):
            for call in (model, model.hidden_states, lambda *a: model.loss(*a, targets)):
                with pytest.raises(ValueError, match=rf"^{name} must be in \[0, {n_pos}\), got {got}$"):
                    call(*args)
    bad_tokens = tokens.clone()
    bad_tokens[1, 2] = V
    with pytest.raises(ValueError, match=rf"^tokens must be in \[0, {V}\), got {V}$"):
        model(bad_tokens, in_pos, out_pos)
    for value in (-2, V):
        bad_targets = targets.clone()
        bad_targets[0, -1] = value
        for call in (model, model.loss):
            with pytest.raises(ValueError, match=rf"^targets must be in \[-1, {V}\) \(-1 ignored\), got {value}$"):
                call(tokens, in_pos, out_pos, bad_targets)


@pytest.mark.parametrize(
    "name,layers,heads,width", [("gpt2", 12, 12, 768), ("gpt2-medium", 24, 16, 1024)], ids=["124M", "345M"]
)
def test_paper_presets(name, layers, heads, width):
    cfg = SigmaGPTConfig.from_preset(name, vocab_size=50257, bos_token_id=50256)
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size) == (layers, heads, width, 1024)
    with torch.device("meta"):
        n = SigmaGPT(cfg).num_params()
    # GPT-2's 124M / 350M counts include the 1024 x C learned position table, absent here (sinusoidal)
    assert n + 1024 * width == {"gpt2": 124_439_808, "gpt2-medium": 354_823_168}[name]


def test_presets_fix_architecture_only():
    cfg = SigmaGPTConfig.from_preset("tiny", vocab_size=101, block_size=100, n_layer=3)
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd) == (3, PRESETS["tiny"]["n_head"], PRESETS["tiny"]["n_embd"])
    assert cfg.vocab_size == 101 and cfg.block_size == 100 and cfg.bos_token_id == 100
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        SigmaGPTConfig.from_preset("huge")


def test_learned_vs_sinusoidal_positions():
    sin = SigmaGPT(tiny_config(pos_encoding="sinusoidal"))
    learned = SigmaGPT(tiny_config(pos_encoding="learned"))
    half = sin.config.n_embd // 2
    names = {n for n, _ in learned.named_parameters()}
    assert {"wpe_in.weight", "wpe_out.weight"} <= names
    assert learned.wpe_in.weight.shape == (17, half)  # block_size + the START position
    assert not any(n.startswith("wpe") for n, _ in sin.named_parameters())
    assert "pe_table" not in sin.state_dict()
    table = sinusoidal_table(17, half)
    assert torch.allclose(table[5, 0:2], PE_SCALE * torch.tensor([math.sin(5.0), math.cos(5.0)]))
    assert torch.allclose(table[5, 2:4], PE_SCALE * torch.tensor([math.sin(5.0 / 10000 ** (2 / half)),
                                                                  math.cos(5.0 / 10000 ** (2 / half))]))
    assert table.pow(2).mean().sqrt().item() == pytest.approx(0.02, rel=1e-5)  # RMS of the token-embedding init
    pe = sin.pos_embed(torch.tensor([[16, 3]]), torch.tensor([[3, 7]]))  # (1, 2, C)
    assert torch.equal(pe[0, 0], torch.cat([table[16], table[3]]))
    assert torch.equal(pe[0, 1], torch.cat([table[3], table[7]]))


def test_weight_tying():
    model = SigmaGPT(tiny_config())
    assert model.wte.weight is model.lm_head.weight
    tokens, in_pos, out_pos, targets = inputs()
    _, loss = model(tokens, in_pos, out_pos, targets)
    loss.backward()
    assert model.lm_head.weight.grad is not None
    n_all = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    assert model.num_params() == n_all - model.wte.weight.numel()  # the tied matrix counted once


def test_loss_weight_scales_each_target():
    """``loss(..., weight)`` is sum w_n CE_n / N_valid; ones give the plain loss; bad weights are refused."""
    model = SigmaGPT(SigmaGPTConfig(vocab_size=11, block_size=9, n_layer=1, n_head=2, n_embd=16))
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 11, (3, 8), generator=g)
    tok, inp, outp, tgt = orders.shuffle(x, orders.random(3, 8, generator=g), model.config.bos_token_id,
                                         model.config.start_pos)
    tgt[0, 2] = -1
    w = torch.rand(8, generator=g) + 0.5
    logits = model(tok, inp, outp)[0]
    ce = F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), ignore_index=-1, reduction="none").view(3, 8)
    want = (ce * w).sum() / (tgt != -1).sum()
    torch.testing.assert_close(model.loss(tok, inp, outp, tgt, w), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.loss(tok, inp, outp, tgt, torch.ones(3, 8)), model.loss(tok, inp, outp, tgt))
    with pytest.raises(TypeError, match="weight must be a float"):
        model.loss(tok, inp, outp, tgt, torch.ones(8, dtype=torch.long))
    with pytest.raises(ValueError, match="does not broadcast"):
        model.loss(tok, inp, outp, tgt, torch.ones(5))

