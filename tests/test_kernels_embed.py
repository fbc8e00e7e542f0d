"""Triton σ-GPT input embedding + first LayerNorm (kernels/embed.py) against kernels/reference.py.

Outputs come pre-filled with NaN (``poisoned_empty``). The embedding ``x`` must equal the reference's
exactly (one rounding of the sum in the table dtype); its LayerNorm is compared per dtype. The
engine tests at the end check the fused feed against the model's own ``embed`` and ``ln_1`` for
every absolute encoding.
"""

from __future__ import annotations

import pytest
import torch

from helpers import on_triton_device, record_block_linears, tiny_model, triton_device
from sigmafast.engine import NeuralSession
from sigmafast.kernels import embed
from sigmafast.kernels import reference_layers as ref

feed_embedding = on_triton_device(embed.feed_embedding)

# (B, G, S, C, tables, norm): G groups of S steps; tables "two" (learned), "shared" (sinusoidal), "none"
CASES = [
    (1, 1, 1, 2, "two", "affine"),  # one row, the narrowest width
    (2, 3, 5, 24, "two", "affine"),  # ragged steps, non-power-of-two width
    (3, 7, 1, 64, "shared", "no-bias"),  # a burst draft: one step per group, only the last token fed
    (2, 5, 17, 100, "shared", "scalar-gain"),  # odd step count, one gain for every channel (stride 0)
    (1, 2, 33, 768, "none", "none"),  # GPT-2's width, no absolute encoding, no affine
    (0, 3, 4, 32, "two", "affine"),  # no rows
]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-3, atol=2e-3)}
NEXT_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-2, atol=1e-2)}
DEVICE = triton_device()
V, P = 13, 21


def _ids(case) -> str:
    B, G, S, C, tables, norm = case
    return f"B{B}-G{G}-S{S}-C{C}-{tables}-{norm}"


def _inputs(case, dtype, seed, index_dtype=torch.int64, strided=False):
    B, G, S, C, tables, norm = case
    g = torch.Generator().manual_seed(seed)
    wte = torch.randn(V, C, generator=g).to(dtype)
    pe_in = torch.randn(P, C // 2, generator=g).to(dtype)
    pe_out = torch.randn(P, C // 2, generator=g).to(dtype)
    pe_in, pe_out = {"two": (pe_in, pe_out), "shared": (pe_in, pe_in), "none": (None, None)}[tables]
    w = (torch.rand(C, generator=g) + 0.5).to(dtype)
    b = torch.randn(C, generator=g).to(dtype)
    weight, bias = {"affine": (w, b), "no-bias": (w, None), "scalar-gain": (w[:1].expand(C), None),
                    "none": (None, None)}[norm]
    if strided:  # orders as a slice of wider orders (the sampler's argsort(...)[..., :R]), tokens transposed
        orders = torch.rand(B, G, S + 3, generator=g).argsort(-1)[..., :S].to(index_dtype)
        tokens = torch.randint(0, V, (B, S, G), generator=g).to(index_dtype).transpose(1, 2)
    else:
        orders = torch.randint(0, P, (B, G, S), generator=g).to(index_dtype)
        tokens = torch.randint(0, V, (B, G, S), generator=g).to(index_dtype)
    last_tok = torch.randint(0, V, (B,), generator=g).to(index_dtype)
    last_pos = torch.randint(0, P, (B,), generator=g).to(index_dtype)
    return last_tok, last_pos, tokens if S > 1 else None, orders, wte, pe_in, pe_out, weight, bias


def _projection(case, dtype, seed, strided) -> dict:
    """The first block's QKV projection (3C, C) (with a bias on the first seed), and its output: rows of a
    wider buffer when strided, as the verify pass's one buffer for every layer. Built on the Triton device,
    since the kernel writes it in place."""
    B, G, S, C = case[:4]
    g = torch.Generator().manual_seed(100 + seed)
    weight = (torch.randn(3 * C, C, generator=g) / C**0.5).to(dtype).to(DEVICE)
    bias = torch.randn(3 * C, generator=g).to(dtype).to(DEVICE) if seed == 0 else None
    out = torch.empty(B, G, S, 4 * C if strided else 3 * C, dtype=dtype, device=DEVICE)[..., :3 * C]
    return dict(next_weight=weight, next_bias=bias, next_out=out.fill_(float("nan")))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case,with_next", [(c, w) for c in CASES for w in (False, True) if c[3] <= 256 or not w],
                         ids=lambda v: _ids(v) if isinstance(v, tuple) else "qkv" if v else "")
def test_feed_embedding_matches_reference(case, with_next, dtype, poisoned_empty):
    """With ``qkv``, the kernel also writes the first block's projection of h (up to 256 channels; wider is
    rejected, below), to the sublayer-end kernels' tolerances (float16: a few roundings of the 3C outputs)."""
    for seed, strided in ((0, False), (1, True)):
        args = _inputs(case, dtype, seed, strided=strided)
        nxt = _projection(case, dtype, seed, strided) if with_next else {}
        x, h = feed_embedding(*args, 1e-5, **nxt)
        want_x, _ = ref.feed_embedding(*args, 1e-5)
        assert x.shape == (*case[:3], case[3]) and h.shape == x.shape and x.dtype == dtype and h.dtype == dtype
        assert torch.equal(x, want_x)
        weight, bias = (None if t is None else t.float() for t in args[-2:])
        want_h = torch.nn.functional.layer_norm(want_x.float(), (case[3],), weight, bias, 1e-5)
        torch.testing.assert_close(h.float(), want_h, **TOL[dtype])
        if with_next:
            w, b = (None if t is None else t.cpu().float() for t in (nxt["next_weight"], nxt["next_bias"]))
            torch.testing.assert_close(nxt["next_out"].cpu().float(), torch.nn.functional.linear(want_h, w, b),
                                       **NEXT_TOL[dtype])


def test_feed_embedding_feeds_the_previous_step():
    """An independent check of the feeding rule on one order: step s reads step s - 1's token and
    position, step 0 the last token; the output half reads the step's own position."""
    C = 8
    wte = torch.arange(V, dtype=torch.float32)[:, None].expand(V, C).contiguous()  # row v: all v
    pe = torch.arange(P, dtype=torch.float32)[:, None].expand(P, C // 2) * 100
    orders = torch.tensor([[[4, 9, 2]]])
    tokens = torch.tensor([[[7, 3, 11]]])
    x, _ = feed_embedding(torch.tensor([5]), torch.tensor([20]), tokens, orders, wte, pe, pe * 10, None, None, 1e-5)
    want_tok, want_in, want_out = torch.tensor([5, 7, 3.0]), torch.tensor([20, 4, 9.0]), torch.tensor([4, 9, 2.0])
    assert torch.equal(x[0, 0, :, 0], want_tok + 100 * want_in)
    assert torch.equal(x[0, 0, :, -1], want_tok + 1000 * want_out)


def test_feed_embedding_takes_int32_indices():
    args = _inputs(CASES[1], torch.float32, 4, index_dtype=torch.int32)
    x, _ = feed_embedding(*args, 1e-5)
    want_x, _ = ref.feed_embedding(*(a.long() if a is not None and not a.is_floating_point() else a
                                     for a in args), 1e-5)
    assert torch.equal(x, want_x)


def _bad_args(**bad):
    args = dict(zip(("last_tok", "last_pos", "tokens", "orders", "wte", "pe_in", "pe_out", "weight", "bias"),
                    _inputs(CASES[1], torch.float32, 0)))
    args["eps"] = 1e-5
    args.update(bad)
    return args


@pytest.mark.parametrize("bad,err,match", [
    (dict(orders=torch.zeros(2, 3, dtype=torch.long)), ValueError, "orders must be a \\(B, G, S\\)"),
    (dict(orders=torch.zeros(2, 3, 5)), TypeError, "orders must be an int64 or int32"),
    (dict(orders=torch.zeros(2, 3, 0, dtype=torch.long)), ValueError, "orders must have at least one step"),
    (dict(last_tok=torch.zeros(3, dtype=torch.long)), ValueError, "last_tok must have shape \\(2,\\)"),
    (dict(tokens=None), ValueError, "tokens may be None only"),
    (dict(tokens=torch.zeros(2, 3, 4, dtype=torch.long)), ValueError, "tokens must have shape"),
    (dict(wte=torch.zeros(13, 24, dtype=torch.float64)), ValueError, "wte must be float32"),
    (dict(wte=torch.zeros(13, 23)), ValueError, "wte's width must be even"),
    (dict(pe_in=None), ValueError, "pe_in and pe_out must be both"),
    (dict(pe_out=torch.zeros(21, 12, dtype=torch.float16)), ValueError, "pe_out must be a \\(rows, 12\\)"),
    (dict(weight=torch.ones(23)), ValueError, "weight must be None or a \\(24,\\) torch.float32"),
    (dict(bias=torch.ones(24, dtype=torch.float16)), ValueError, "bias must be None or a \\(24,\\) torch.float32"),
    (dict(eps=-1.0), ValueError, "eps must be a positive float"),
    (dict(next_out=torch.zeros(2, 3, 5, 72)), ValueError, "next_bias and next_out need a next_weight"),
    (dict(next_weight=torch.zeros(72, 24)), ValueError, r"next_out must be a \(2, 3, 5, 72\) torch.float32"),
    (dict(next_weight=torch.zeros(72, 23), next_out=torch.zeros(2, 3, 5, 72)), ValueError,
     r"next_weight must be a contiguous \(72, 24\)"),
    (dict(wte=torch.zeros(13, 260), pe_in=None, pe_out=None, weight=None, bias=None,
          next_weight=torch.zeros(12, 260), next_out=torch.zeros(2, 3, 5, 12)), ValueError,
     "next_weight needs wte's width at most 256"),
])
def test_feed_embedding_rejects_bad_inputs(bad, err, match):
    with pytest.raises(err, match=match):
        embed.feed_embedding(**_bad_args(**bad))


@pytest.mark.parametrize("pos_encoding", ["sinusoidal", "learned", "rope", "rope-v+learned"])
def test_fused_feed_matches_the_model_embedding(pos_encoding):
    """The engine's fused feed (Triton) gives the model's own embedding of the fed inputs and its first
    ``ln_1``; a session's drafts and verification agree with the unfused feed."""
    device = triton_device()
    model = tiny_model(vocab_size=7, block_size=8, dtype=torch.float32, pos_encoding=pos_encoding).to(device)
    B, O, R = 2, 3, 5
    g = torch.Generator().manual_seed(1)
    orders = torch.rand(B, O, 8, generator=g).argsort(-1)[..., :R].to(device)
    drafts = torch.randint(0, 7, (B, O, R), generator=g).to(device)
    canvas = torch.randint(0, 7, (B, 8), generator=g).to(device)
    known = torch.zeros(B, 8, dtype=torch.bool, device=device)
    known[0, :3] = True
    sessions = []
    with torch.no_grad():
        for fused in (True, False):
            session = NeuralSession(model, B, 8, "triton", fused_ends=True)
            if not fused:
                session.embedding = None
            session.prefill(canvas, known)
            sessions.append(session)
        fast, slow = sessions
        assert fast.embedding is not None
        x, h, fed_pos, proj = fast.feed(orders, drafts)
        tok, in_pos = ref.feed_inputs(fast.last_tok, fast.last_pos, drafts, orders)
        if model.config.rotary:  # the fused path computes the input positions only for the RoPE angles
            assert torch.equal(fed_pos, in_pos)
        else:
            assert fed_pos is None
        want = model.embed(tok, in_pos, orders)
        assert torch.equal(x, want)
        torch.testing.assert_close(h, model.h[0].ln_1(want), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(proj, model.h[0].attn.c_attn(model.h[0].ln_1(want)), rtol=1e-5, atol=1e-5)
        assert slow.feed(orders, drafts)[1] is None and slow.feed(orders, drafts)[3] is None
        torch.testing.assert_close(fast.draft(orders[:, 0]), slow.draft(orders[:, 0]), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(fast.verify(orders, drafts).hidden, slow.verify(orders, drafts).hidden,
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fused_ends", [True, False], ids=["fused-ends", "cublas-ends"])
def test_fused_feed_takes_the_first_blocks_projection(fused_ends):
    """In a narrow model with fused sublayer ends, the embedding kernel computes the first block's QKV
    projection, so a session's draft and verification run no module matmul at all (the verification's into
    the one buffer of every layer's projections, whose keys and values commit reads); without the fused ends
    the first c_attn runs as a module."""
    model = tiny_model(vocab_size=7, block_size=12, seed=2, std=0.5, dtype=torch.float32).to(DEVICE)
    _, ran = record_block_linears(model)
    idx = torch.randint(0, 7, (2, 3), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    with torch.no_grad():
        session = NeuralSession(model, 2, 12, "triton", fused_ends=fused_ends)
        session.prefill(torch.zeros(2, 12, dtype=torch.long, device=DEVICE).index_copy_(
            1, torch.arange(3, device=DEVICE), idx), torch.arange(12, device=DEVICE).expand(2, 12) < 3)
        ran.clear()
        positions = torch.arange(3, 12, device=DEVICE).expand(2, 9)
        session.draft(positions)
        orders = positions[:, None, :4].expand(2, 3, 4)
        session.verify(orders, torch.randint(0, 7, (2, 3, 4), generator=torch.Generator().manual_seed(1)).to(DEVICE))
    if fused_ends:
        assert ran == []
    else:
        assert "h.0.attn.c_attn" in ran
