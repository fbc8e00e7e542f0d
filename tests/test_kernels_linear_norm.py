"""Triton sublayer ends (kernels/linear_norm.py) against kernels/reference.py, and the engine's use of them.

Outputs come pre-filled with NaN (``poisoned_empty``), so an element the kernel
forgets fails. Tolerances per dtype: float32 to 1e-5 (the dots are "ieee");
float16 against the float32 reference from the same float16 inputs, to a few
of float16's roundings (the kernel rounds the matmuls' outputs as eager does,
but accumulates in another order).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import sigmafast
from helpers import (count_variants, engine_tokens_and_kernels, on_triton_device, record_block_linears, tiny_model,
                     triton_device)
from sigmafast import SigmaGPT, SigmaGPTConfig, kernels
from sigmafast.engine import FusedEnds
from sigmafast.kernels import linear_norm
from sigmafast.kernels import reference_layers as ref

DEVICE = triton_device()
mlp_add_norm = on_triton_device(linear_norm.mlp_add_norm)

# (leading shape, C, inner width K or F, norm, linear biases, layout)
CASES = [
    ((1,), 8, 32, "affine", True, "contiguous"),  # one row, narrower than one 16-wide tile
    ((7,), 24, 40, "no-bias", True, "strided"),  # odd rows and widths, rows of a wider buffer
    ((2, 3, 5), 64, 256, "scalar-gain", False, "contiguous"),  # (B, O, R) leading dims, one gain (stride 0)
    ((17,), 100, 300, "none", True, "strided"),  # ragged row block, non-power-of-two C and F
    ((33,), 128, 512, "affine", True, "contiguous"),  # the `small` preset's widths
    ((5,), 128, 129, "affine", True, "contiguous"),  # a last inner chunk one wide
    ((3,), 256, 1024, "affine", False, "contiguous"),  # the widest fused width
    ((0, 4), 32, 64, "affine", True, "contiguous"),  # no rows
]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-2, atol=1e-2)}


def _ids(case) -> str:
    lead, C, inner, norm, biases, layout = case
    return f"{'x'.join(map(str, lead))}-C{C}-I{inner}-{norm}-{'bias' if biases else 'nobias'}-{layout}"


def _rows(g, lead, width, dtype, strided, scale=1.0):
    t = torch.randn(*lead, 2 * width if strided else width, generator=g) * scale
    return t.to(dtype)[..., :width]


def _norm(g, C, kind, dtype):
    w, b = (torch.rand(C, generator=g) + 0.5).to(dtype), torch.randn(C, generator=g).to(dtype)
    return {"affine": (w, b), "no-bias": (w, None), "scalar-gain": (w[:1].expand(C), None), "none": (None, None)}[kind]


def _linear(g, out, inner, dtype, bias):
    """Weights of unit-variance outputs, so that both dtypes' tolerances read the same."""
    w = (torch.randn(out, inner, generator=g) / inner**0.5).to(dtype)
    return w, torch.randn(out, generator=g).to(dtype) if bias else None


def _f32(*ts):
    return [None if t is None else t.float() for t in ts]


def _next(g, lead, C, dtype, biases, layout, with_next) -> dict:
    """The next block's QKV projection (3C, C), its bias, and its output, on the Triton device: (..., 3C) rows
    of a wider buffer when strided, as the verify pass's one buffer for every layer. None without one."""
    if not with_next:
        return dict(next_weight=None, next_bias=None, next_out=None)
    weight, bias = _dev(*_linear(g, 3 * C, C, dtype, biases))
    out = torch.empty(*lead, 4 * C if layout == "strided" else 3 * C, dtype=dtype, device=DEVICE)[..., :3 * C]
    return dict(next_weight=weight, next_bias=bias, next_out=out)


def _dev(*ts):
    return [None if t is None else t.to(DEVICE) for t in ts]


def _check(s, h, x, want_s, want_h, nxt, dtype):
    s, h = s.cpu(), h.cpu()
    assert s.shape == x.shape and h.shape == x.shape and s.dtype == dtype and h.dtype == dtype
    torch.testing.assert_close(s.float(), want_s, **TOL[dtype])
    torch.testing.assert_close(h.float(), want_h, **TOL[dtype])
    if nxt["next_weight"] is not None:
        want = torch.nn.functional.linear(want_h, *(t.cpu().float() for t in (nxt["next_weight"], nxt["next_bias"])
                                                    if t is not None))
        torch.testing.assert_close(nxt["next_out"].cpu().float(), want, **TOL[dtype])


@pytest.mark.parametrize("end", ["projection", "mlp"])
@pytest.mark.parametrize("with_next", [False, True], ids=["", "next-qkv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_sublayer_end_matches_reference(case, dtype, with_next, end, poisoned_empty):
    """Both kernels: the projection's y is (..., K) (K = the case's inner width), the MLP's h is (..., C) with
    a hidden width F = the inner width."""
    lead, C, inner, norm, biases, layout = case
    projection = end == "projection"
    kernel, want = ((linear_norm.linear_add_norm, ref.linear_add_norm) if projection
                    else (linear_norm.mlp_add_norm, ref.mlp_add_norm))
    for seed in range(2):
        g = torch.Generator().manual_seed(seed)
        x = _rows(g, lead, C, dtype, layout == "strided", 3.0)
        y = _rows(g, lead, inner if projection else C, dtype, projection and layout == "strided")
        shapes = [(C, inner)] if projection else [(inner, C), (C, inner)]
        linears = [t for out, inn in shapes for t in _linear(g, out, inn, dtype, biases)]  # weight, bias, ...
        nw, nb = _norm(g, C, norm, dtype)
        nxt = _next(g, lead, C, dtype, biases, layout, with_next)
        s, h = kernel(*_dev(x, y, *linears, nw, nb), 1e-5, **nxt)
        _check(s, h, x, *want(*_f32(x, y, *linears, nw, nb), 1e-5), nxt, dtype)


def test_mlp_add_norm_uses_the_exact_gelu():
    """An independent check of the activation: one hidden unit, weights of 1, so that x + gelu(h) is read
    off the sum; erf's GELU, not the tanh approximation (they differ by up to 5e-4 near |h| = 2)."""
    h = torch.linspace(-4, 4, 33)[:, None].expand(33, 16).contiguous()
    one = torch.zeros(1, 16)
    one[0, 0] = 1.0
    s, _ = mlp_add_norm(torch.zeros(33, 16), h, one, None, one.t().contiguous(), None, None, None, 1e-5)
    exact = 0.5 * h[:, 0].double() * (1 + torch.erf(h[:, 0].double() / 2**0.5))
    torch.testing.assert_close(s[:, 0].double(), exact, rtol=0, atol=1e-6)
    assert torch.equal(s[:, 1:], torch.zeros(33, 15))


def _bad(**kw):
    x = torch.zeros(3, 8)
    args = dict(x=x, y=torch.zeros(3, 4), weight=torch.zeros(8, 4), bias=None, norm_weight=None, norm_bias=None,
                eps=1e-5, next_weight=None, next_bias=None, next_out=None)
    args.update(kw)
    return args


@pytest.mark.parametrize("bad,match", [
    (dict(x=torch.zeros(3, 300), norm_weight=None), r"x's last dimension must be in \[1, 256\]"),
    (dict(x=torch.zeros(3, 8, dtype=torch.float64)), "x must be float32"),
    (dict(y=torch.zeros(2, 4)), r"y must be a \(3, 'K'\) torch.float32 tensor"),
    (dict(y=torch.zeros(3, 4, dtype=torch.float16)), "y must be a"),
    (dict(weight=torch.zeros(8, 5)), r"weight must be a contiguous \(8, 4\)"),
    (dict(weight=torch.zeros(4, 8).t()), "weight must be a contiguous"),
    (dict(bias=torch.zeros(4)), r"bias must be None or a \(8,\)"),
    (dict(norm_weight=torch.ones(9)), r"weight must be None or a \(8,\) torch.float32"),
    (dict(norm_bias=torch.ones(8, dtype=torch.float64)), r"bias must be None or a \(8,\) torch.float32"),
    (dict(eps=0.0), "eps must be a positive float"),
    (dict(next_bias=torch.zeros(24)), "next_bias and next_out need a next_weight"),
    (dict(next_weight=torch.zeros(24, 9)), r"next_weight must be a contiguous \(24, 8\)"),
    (dict(next_weight=torch.zeros(24, 8)), r"next_out must be a \(3, 24\) torch.float32 tensor"),
    (dict(next_weight=torch.zeros(24, 8), next_out=torch.zeros(24, 3).t()), "with unit inner stride"),
    (dict(x=torch.zeros(2, 3, 8), y=torch.zeros(2, 3, 4), next_weight=torch.zeros(24, 8),
          next_out=torch.zeros(3, 2, 24).transpose(0, 1)), r"next_out's rows must be one strided \(N, 24\) view"),
])
def test_linear_add_norm_rejects_bad_inputs(bad, match):
    with pytest.raises(ValueError, match=match):
        linear_norm.linear_add_norm(**_bad(**bad))


@pytest.mark.parametrize("bad,match", [
    (dict(h=torch.zeros(3, 9)), "h must have the shape of x"),
    (dict(fc_weight=torch.zeros(16, 9)), r"fc_weight must be a contiguous \(16, 8\)"),
    (dict(fc_weight=torch.zeros(16)), r"fc_weight must be an \(F, 8\) tensor"),
    (dict(proj_weight=torch.zeros(16, 8)), r"proj_weight must be a contiguous \(8, 16\)"),
    (dict(proj_weight=torch.zeros(8, 16, dtype=torch.float16)), "proj_weight must be a contiguous"),
    (dict(fc_bias=torch.zeros(16)), "fc_bias and proj_bias must be both given or both None"),
    (dict(fc_bias=torch.zeros(8), proj_bias=torch.zeros(8)), r"fc_bias must be None or a \(16,\)"),
])
def test_mlp_add_norm_rejects_bad_inputs(bad, match):
    args = dict(x=torch.zeros(3, 8), h=torch.zeros(3, 8), fc_weight=torch.zeros(16, 8), fc_bias=None,
                proj_weight=torch.zeros(8, 16), proj_bias=None)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        linear_norm.mlp_add_norm(**args)


@pytest.mark.parametrize("kw", [dict(), dict(final_norm="scalar"), dict(mlp_ratio=0), dict(mlp_ratio=3, bias=False),
                                dict(n_embd=272)],
                         ids=["narrow", "scalar-final-norm", "attention-only", "no-bias-ratio-3", "wide"])
def test_fused_ends_match_the_plain_blocks(kw):
    """run_layers with the fused sublayer ends (the kernels above; add + LayerNorm alone above 256 channels)
    gives the hidden states of the plain blocks."""
    device = triton_device()
    model = _random_model(**kw).to(device)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, model.config.n_embd, generator=g).to(device)
    with torch.no_grad():
        want = model.run_layers(x, attend)
        got = model.run_layers(x, attend, ends=FusedEnds())
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # every layer's QKV projection into one buffer (the verify pass), the later layers' by the ends
        qkv = [torch.full((2, 2, 3, 5, 3 * model.config.n_embd), float("nan"), device=device) for _ in range(2)]
        want = model.run_layers(x, attend, qkv_out=qkv[0])
        got = model.run_layers(x, attend, qkv_out=qkv[1], ends=FusedEnds())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(qkv[1], qkv[0], rtol=1e-5, atol=1e-5)


def test_fused_ends_match_the_plain_blocks_in_float16():
    """The 16-bit layout (64-row programs on 8 warps) through run_layers: the fused float16 model against the
    plain blocks in float32 from the same float16 weights and inputs, to float16's rounding."""
    model = _random_model(n_embd=64, n_layer=3).half().float()  # float16 weights
    x = torch.randn(2, 40, 64, generator=torch.Generator().manual_seed(1)).half()  # 80 rows: two programs
    with torch.no_grad():
        want = model.float().run_layers(x.float(), attend)
        got = model.half().to(DEVICE).run_layers(x.to(DEVICE), attend, ends=FusedEnds())
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.cpu().float(), want, rtol=2e-2, atol=2e-2)


def _random_model(**kw) -> SigmaGPT:
    """An eval-mode model far from the init's near-identity blocks (float32, on the CPU)."""
    torch.manual_seed(0)
    model = SigmaGPT(SigmaGPTConfig(vocab_size=7, block_size=8, **{"n_layer": 2, "n_head": 2, "n_embd": 32, **kw}))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3 if p.dim() >= 2 else 0.5).add_(1.0 if p.dim() == 1 else 0.0)
    return model.eval()


def attend(i, q, k, v):
    """Any attention for run_layers: causal SDPA within the last two dims."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_fused_ends_run_the_modules_in_training_mode():
    """Dropout is on in training mode: the ends run the modules, whose dropout a fused kernel would skip."""
    config = SigmaGPTConfig(vocab_size=7, block_size=8, n_layer=1, n_head=2, n_embd=16, dropout=0.5)
    model = SigmaGPT(config).to(triton_device()).train()
    x = torch.randn(1, 4, 16, device=triton_device())
    y = torch.randn(1, 2, 4, 8, device=triton_device())
    torch.manual_seed(3)
    want = model.h[0].attn.project(y)
    torch.manual_seed(3)
    s, _, qkv = FusedEnds().attention(x, y, model.h[0].attn, None, model.h[0].ln_2)
    torch.testing.assert_close(s, x + want, rtol=0, atol=0)
    assert qkv is None


@pytest.mark.parametrize("mlp_ratio", [4, 0], ids=["mlp", "attention-only"])
def test_fused_ends_take_the_later_blocks_matmuls(mlp_ratio):
    """In a narrow model the fused ends run every matmul but the first block's QKV projection: no module's
    forward runs after the first c_attn (the plain ends run them all)."""
    config = SigmaGPTConfig(vocab_size=7, block_size=8, n_layer=3, n_head=2, n_embd=32, mlp_ratio=mlp_ratio)
    model = SigmaGPT(config).eval().to(DEVICE)
    linears, ran = record_block_linears(model)
    x = torch.randn(2, 5, 32, device=DEVICE)
    with torch.no_grad():
        model.run_layers(x, attend)
        assert sorted(ran) == sorted(linears)
        ran.clear()
        model.run_layers(x, attend, ends=FusedEnds())
    assert ran == ["h.0.attn.c_attn"]


def test_engine_fused_scoring_launches_the_lm_head_kernel_and_keeps_the_tokens():
    """``Engine(scoring="fused")`` scores a burst's drafts with the LM-head stream kernel (the default engine
    with a matmul and the log q kernel), and samples the same tokens; a bad ``scoring`` is refused."""
    model = tiny_model(vocab_size=7, block_size=12, seed=1, std=0.5, dtype=torch.float32).to(DEVICE)
    idx = torch.randint(0, 7, (2, 3), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    out, launched = {}, {}
    for scoring in ("fused", None):
        with count_variants() as v, kernels.use_backend("triton"):
            engine = sigmafast.Engine(model, scoring=scoring)
            out[scoring] = sigmafast.generate(engine, idx, 8, num_orders=3, acceptance="paper",
                                              generator=torch.Generator(DEVICE).manual_seed(5))
        launched[scoring] = set(v.counts())
    assert "_lm_head_stream_kernel" in launched["fused"] and "_logq_finish_kernel" not in launched["fused"]
    assert "_lm_head_stream_kernel" not in launched[None] and "_logq_finish_kernel" in launched[None]
    assert torch.equal(out["fused"], out[None])
    with pytest.raises(ValueError, match="scoring must be None or one of"):
        sigmafast.Engine(model, scoring="cublas")


def test_engine_without_fused_ends_keeps_the_matmuls_and_the_tokens():
    """The default engine (``fused_ends=False``) launches no sublayer-end kernel and samples the same tokens
    as ``Engine(fused_ends=True)``, which launches both."""
    assert sigmafast.Engine(tiny_model(dtype=torch.float32)).fused_ends is False
    model = tiny_model(vocab_size=7, block_size=12, seed=1, std=0.5, dtype=torch.float32).to(DEVICE)
    idx = torch.randint(0, 7, (2, 3), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    (fused, launched), (plain, launched_plain) = (engine_tokens_and_kernels(model, idx, fused_ends=f)
                                                  for f in (True, False))
    ends = {"_linear_add_norm_kernel", "_mlp_add_norm_kernel"}
    assert ends <= launched and "_add_layer_norm_kernel" not in launched
    assert not ends & launched_plain and "_add_layer_norm_kernel" in launched_plain
    assert torch.equal(fused, plain)
    with pytest.raises(TypeError, match="fused_ends must be a bool"):
        sigmafast.Engine(model, fused_ends=1)


def test_linear_add_norm_rounds_the_projection_to_float16_before_the_add(poisoned_empty):
    """Exact products (quarters times small integers), sums past float16's 11 bits: the kernel's residual sum
    is eager's ``x + linear(y)`` bit for bit, the projection rounded to float16 before the add."""
    g = torch.Generator().manual_seed(0)
    N, C, K = 17, 24, 32
    x = ((torch.randn(N, C, generator=g) * 8).round() / 4).half()
    y = ((torch.randn(N, K, generator=g) * 400).round().clamp(-2000, 2000) / 4).half()
    w = torch.randint(-3, 4, (C, K), generator=g).half()
    s, _ = on_triton_device(linear_norm.linear_add_norm)(x, y, w, None, None, None, 1e-5)
    exact = F.linear(y.float(), w.float())
    proj = exact.half()  # eager's one rounding
    assert (exact != proj.float()).any()  # the rounding matters here
    assert torch.equal(s, (x.float() + proj.float()).half())
