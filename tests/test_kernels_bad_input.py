"""Bad input to sigmafast.kernels: the same mistake gets the same ``ValueError`` or ``TypeError``, naming the
argument, whichever backend runs (kernels/checks.py, kernels/step_checks.py); the reference still takes what only
it can (float64, any width or stride)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import triton_device
from sigmafast import kernels

DEVICE = triton_device()


def _t(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype in (torch.int64, torch.int32):
        return torch.randint(0, 4, shape, generator=g).to(dtype).to(DEVICE)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


def _commit_args(**change):
    """Keyword arguments of ``kernels.commit``: 2 rows, 1 order of 3 steps, a 1-layer cache of 6 + 1 slots."""
    B, O, R, T, H, D = 2, 1, 3, 6, 2, 4
    args = dict(orders=_t(B, O, R, dtype=torch.int64), choice=torch.zeros(B, dtype=torch.long, device=DEVICE),
                n=torch.ones(B, dtype=torch.long, device=DEVICE), tokens=_t(B, R, dtype=torch.int64),
                keys=_t(1, B, O, H, R, D), values=_t(1, B, O, H, R, D),
                canvas=torch.zeros(B, T, dtype=torch.long, device=DEVICE),
                known=torch.zeros(B, T, dtype=torch.bool, device=DEVICE),
                last_tok=torch.zeros(B, dtype=torch.long, device=DEVICE),
                last_pos=torch.zeros(B, dtype=torch.long, device=DEVICE),
                k_cache=torch.zeros(1, B, H, T + 1, D, device=DEVICE), v_cache=torch.zeros(1, B, H, T + 1, D,
                                                                                            device=DEVICE),
                lens=torch.zeros(B, dtype=torch.long, device=DEVICE))
    args.update(change)
    return args


def _commit(**change):
    def call(backend):
        a = _commit_args(**change)
        return kernels.commit(a.pop("orders"), a.pop("choice"), a.pop("n"), a.pop("tokens"), a.pop("keys"),
                              a.pop("values"), **a, backend=backend)
    return call


def _attention_args(B=2, H=2, R=3, L=5, D=8, O=None):
    g = torch.Generator().manual_seed(0)
    q = torch.randn((B, H, R, D) if O is None else (B, O, H, R, D), generator=g).to(DEVICE)
    cache = torch.randn(B, H, L, D, generator=g).to(DEVICE)
    return [q, q.clone(), q.clone(), cache, cache.clone(), torch.tensor([L] * B, device=DEVICE)]


def _sampler_bad_calls():
    """(id, call(backend), error, match) of the attention, acceptance, sampling and draft ops (kernels/checks.py)."""
    x, u = _t(4, 10), _t(4).abs()
    drafts = x.argmax(-1).view(1, 1, 4)
    scoring = (drafts, u.view(1, 1, 4), u.view(1, 1, 4))
    hidden, weight = _t(1, 1, 4, 6), _t(10, 6)
    known, u_pos, keys = torch.zeros(2, 6, dtype=torch.bool, device=DEVICE), _t(2, 6).abs(), _t(2, 1, 6).abs()
    pos, tok = torch.zeros(2, 3, dtype=torch.long, device=DEVICE), torch.zeros(2, 6, dtype=torch.long, device=DEVICE)
    lengths, more_lengths = torch.tensor([4], device=DEVICE), torch.tensor([4, 4], device=DEVICE)
    step = torch.zeros((), dtype=torch.long, device=DEVICE)

    def attn(i, value, verify=False):
        def call(backend):
            args = _attention_args(O=2 if verify else None)
            for j in (i,) if isinstance(i, int) else i:
                args[j] = value(args[j])
            fn = kernels.verify_attention if verify else kernels.burst_attention
            return fn(*args, backend=backend)
        return call

    return [
        ("temperature-negative", lambda b: kernels.sample(x, u, -1.0, backend=b), ValueError, "temperature must be 0"),
        ("temperature-nan", lambda b: kernels.sample(x, u, float("nan"), backend=b), ValueError, "temperature"),
        ("temperature-tiny", lambda b: kernels.sample(x, u, 1e-40, backend=b), ValueError, "temperature"),
        ("temperature-str", lambda b: kernels.sample(x, u, "1", backend=b), TypeError, "temperature"),
        ("top-k-0", lambda b: kernels.sample(x, u, 1.0, 0, backend=b), ValueError, "top_k must be None or an int"),
        ("top-k-negative", lambda b: kernels.sample(x, u, 1.0, -1, backend=b), ValueError, "top_k"),
        ("top-k-float", lambda b: kernels.sample(x, u, 1.0, 2.0, backend=b), TypeError,
         "top_k must be None or an int >= 1, got float"),
        ("sample-rank", lambda b: kernels.sample(x[None], u, backend=b), ValueError, "logits must have 2 dim"),
        ("sample-uniforms", lambda b: kernels.sample(x, u[:3], backend=b), ValueError, "uniforms must have shape"),
        ("residual-p-rows", lambda b: kernels.residual_sample(x, x[:1], u, backend=b), ValueError, "p_logits must"),
        ("acceptance-lengths", lambda b: kernels.acceptance(x.view(1, 1, 4, 10), *scoring, more_lengths,
                                                            backend=b), ValueError, "lengths must be an int32 or"),
        ("acceptance-lengths-bool", lambda b: kernels.acceptance(x.view(1, 1, 4, 10), *scoring, lengths.bool(),
                                                                 backend=b), ValueError, "lengths must be an int32 or"),
        ("hidden-scoring", lambda b: kernels.acceptance_from_hidden(hidden, weight, *scoring, lengths, scoring="bogus",
                                                                    backend=b), ValueError, "scoring must be one of"),
        ("sample-not-a-tensor", lambda b: kernels.sample(x.tolist(), u, backend=b), TypeError,
         "logits must be a torch.Tensor, got list"),
        ("attention-no-head-dim", lambda b: kernels.burst_attention(*[_t(1, 1, 2, 0)] * 3, *[_t(1, 1, 3, 0)] * 2,
                                                                    lengths, backend=b), ValueError,
         "q must have a nonempty head dim"),
        ("acceptance-rule", lambda b: kernels.acceptance(x.view(1, 1, 4, 10), *scoring, lengths,
                                                         rule="best", backend=b), ValueError, "acceptance rule"),
        ("hidden-weight", lambda b: kernels.acceptance_from_hidden(hidden, weight[:, :5], *scoring, lengths,
                                                                   backend=b), ValueError, "weight must be"),
        ("hidden-vocab", lambda b: kernels.acceptance_from_hidden(hidden, weight, *scoring, lengths,
                                                                  vocab_size=11, backend=b), ValueError, "vocab_size"),
        ("sample-hidden-rank", lambda b: kernels.sample_from_hidden(hidden, weight, u, backend=b), ValueError,
         "hidden must have 2 dim"),
        ("sample-hidden-weight", lambda b: kernels.sample_from_hidden(hidden[0, 0], weight[:, :5], u, backend=b),
         ValueError, "weight must be"),
        ("sample-hidden-uniforms", lambda b: kernels.sample_from_hidden(hidden[0, 0], weight, u[:3], backend=b),
         ValueError, "uniforms must have shape"),
        ("sample-hidden-no-channel", lambda b: kernels.sample_from_hidden(_t(4, 0), _t(10, 0), u, backend=b),
         ValueError, "hidden must have a nonempty last"),
        ("sample-hidden-used", lambda b: kernels.sample_from_hidden(hidden[0, 0], weight, u, used=u > 0, backend=b),
         ValueError, "used is only read with a flag"),
        ("attention-cache-batch", attn((3, 4), lambda c: c[:1]), ValueError, "k_cache must have shape"),
        ("attention-lens-shape", attn(5, lambda n: n[:1]), ValueError, "cache_lens must be an int32/int64"),
        ("attention-lens-float", attn(5, lambda n: n.float()), ValueError, "cache_lens must be an int32/int64"),
        ("attention-rank", attn(0, lambda q: q[0]), ValueError, "q must have 4 dimensions"),
        ("verify-rank", attn(0, lambda q: q[:, 0], verify=True), ValueError, "q must have 5 dimensions"),
        ("attention-int", attn(0, lambda q: q.long()), ValueError, "q must be float32"),
        ("slots-R-over-T", lambda b: kernels.draft_slots(known, u_pos, keys, 7, backend=b), ValueError,
         "R must be an int in \\[1, T = 6\\]"),
        ("slots-keys-width", lambda b: kernels.draft_slots(known, u_pos, keys[..., :5], 4, backend=b), ValueError,
         "keys must be a"),
        ("along-orders-rank", lambda b: kernels.gather_drafts(pos, pos, u_pos[:, :3], tok, known, u_pos, pos,
                                                              backend=b), ValueError, "orders must be a"),
        ("along-canvas-float", lambda b: kernels.gather_drafts(pos, pos, u_pos[:, :3], u_pos, known, u_pos,
                                                               pos[:, None], backend=b), ValueError, "canvas must be"),
        ("plan-step-int32", lambda b: kernels.plan_step(tok[None], step.int(), backend=b), ValueError, "step must be"),
        ("plan-steps-2d", lambda b: kernels.plan_step(tok, step, backend=b),
         ValueError, "steps must be a"),
        ("gelu-weight-width", lambda b: kernels.linear_gelu(x, weight, backend=b), ValueError,
         "weight must be a contiguous \\(10, 10\\)|weight must be a \\(10, 10\\)"),
        ("gelu-bias-length", lambda b: kernels.linear_gelu(x, x, u[:3], backend=b), ValueError,
         "bias must be None or a"),
        ("gelu-x-int", lambda b: kernels.linear_gelu(tok, x, backend=b), ValueError, "x must be float32"),
        ("pick-n-shape", lambda b: kernels.residual_pick(pos[:1, 0], pos[:, 0], pos, pos, u_pos, x.view(2, 2, 10),
                                                         x.view(2, 2, 10), backend=b), ValueError,
         "n must be an int32/int64"),
    ]


def _step_bad_calls():
    """(id, call(backend), error, match) of the fused step ops (kernels/step_checks.py) and a few late checks."""
    x, y, w = _t(3, 8), _t(3, 8, seed=1), _t(8)
    flag = torch.zeros((), dtype=torch.bool, device=DEVICE)
    q = _t(1, 2, 3, 4)
    pos = torch.zeros(1, 3, dtype=torch.long, device=DEVICE)
    cos = _t(5, 2)
    orders, last = torch.zeros(2, 1, 3, dtype=torch.long, device=DEVICE), torch.zeros(2, dtype=torch.long,
                                                                                     device=DEVICE)
    wte, pe = _t(7, 8), _t(5, 4)
    fc, proj = _t(16, 8), _t(8, 16)
    scoring = (torch.zeros(1, 0, 4, dtype=torch.long, device=DEVICE), _t(1, 0, 4), _t(1, 0, 4),
               torch.tensor([4], device=DEVICE))
    attn = (q, q, q, _t(1, 2, 5, 4), _t(1, 2, 5, 4), torch.tensor([5], device=DEVICE))
    return [
        ("norm-y-shape", lambda b: kernels.add_layer_norm(x, w, backend=b), ValueError, "y must have the shape"),
        ("norm-y-dtype", lambda b: kernels.add_layer_norm(x, y.half(), backend=b), ValueError, "y must have the dtype"),
        ("norm-eps", lambda b: kernels.add_layer_norm(x, y, eps=-1.0, backend=b), ValueError, "eps must be a positive"),
        ("norm-int", lambda b: kernels.add_layer_norm(x.long(), y.long(), backend=b), ValueError, "x must be float32"),
        ("norm-weight", lambda b: kernels.add_layer_norm(x, y, w[:4], backend=b), ValueError, "weight must be None"),
        ("norm-x-list", lambda b: kernels.add_layer_norm([1.0], y, backend="reference"), TypeError, "x must be a"),
        ("linear-weight", lambda b: kernels.linear_add_norm(x, y, _t(8, 4), backend=b), ValueError,
         "weight must be a .*\\(8, 8\\)"),
        ("linear-y-rows", lambda b: kernels.linear_add_norm(x, y[:2], _t(8, 8), backend=b), ValueError, "y must be a"),
        ("linear-next-out-alone", lambda b: kernels.linear_add_norm(x, y, _t(8, 8), next_out=x, backend=b),
         ValueError, "next_bias and next_out need a next_weight"),
        ("mlp-biases", lambda b: kernels.mlp_add_norm(x, y, fc, _t(16), proj, None, backend=b), ValueError,
         "fc_bias and proj_bias"),
        ("mlp-h-shape", lambda b: kernels.mlp_add_norm(x, y[:2], fc, None, proj, None, backend=b), ValueError,
         "h must have the shape"),
        ("mlp-proj-shape", lambda b: kernels.mlp_add_norm(x, y, fc, None, fc, None, backend=b), ValueError,
         "proj_weight must be"),
        ("rotary-odd-dim", lambda b: kernels.rotary_(_t(1, 2, 3, 5), None, None, pos, None, cos, cos, backend=b),
         ValueError, "head dim must be even"),
        ("rotary-positions", lambda b: kernels.rotary_(q, None, None, pos[:, :2], None, cos, cos, backend=b),
         ValueError, "pos_q must be"),
        ("rotary-sin", lambda b: kernels.rotary_(q, None, None, pos, None, cos, cos[:4], backend=b), ValueError,
         "sin must have the shape"),
        ("rotary-k-dtype", lambda b: kernels.rotary_(q, q.half(), None, pos, pos, cos, cos, backend=b), ValueError,
         "k must be None or a tensor like q"),
        ("embed-tokens", lambda b: kernels.feed_embedding(last, last, None, orders, wte, pe, pe, backend=b),
         ValueError, "tokens may be None only"),
        ("embed-pe-pair", lambda b: kernels.feed_embedding(last, last, orders, orders, wte, pe, None, backend=b),
         ValueError, "pe_in and pe_out"),
        ("embed-odd-width", lambda b: kernels.feed_embedding(last, last, orders, orders, _t(7, 7), None, None,
                                                             backend=b), ValueError, "wte's width must be even"),
        ("embed-float-orders", lambda b: kernels.feed_embedding(last, last, orders, orders.float(), wte, pe, pe,
                                                                backend=b), TypeError, "orders must be an int64"),
        ("flag-int", lambda b: kernels.flag_nonfinite(x, None, flag.long(), backend=b), ValueError,
         "flag must be a \\(\\) bool tensor"),
        ("flag-used-shape", lambda b: kernels.flag_nonfinite(x, flag.expand(4), flag, backend=b), ValueError,
         "used must be None or a bool tensor"),
        ("flag-values-int", lambda b: kernels.flag_nonfinite(x.long(), None, flag, backend=b), ValueError,
         "values must be a"),
        ("flag-values-list", lambda b: kernels.flag_nonfinite([1.0], None, flag, backend="reference"), TypeError,
         "values must be a"),
        ("commit-tokens-float", _commit(tokens=_t(2, 3)), ValueError, "tokens must be an int32/int64"),
        ("commit-keys-shape", _commit(keys=_t(1, 2, 1, 2, 3, 5)), ValueError, "keys must be a float tensor"),
        ("commit-status-alone", _commit(status=torch.zeros(3, dtype=torch.long, device=DEVICE)), ValueError,
         "flag and status must be given together"),
        ("commit-cache-rows", _commit(v_cache=torch.zeros(1, 2, 2, 6, 4, device=DEVICE)), ValueError,
         "v_cache must match k_cache"),
        ("commit-residual-alone", _commit(residual=torch.zeros(2, dtype=torch.long, device=DEVICE)), ValueError,
         "residual and residual_step must be given together"),
        ("commit-residual-step-shape", _commit(residual=torch.zeros(2, dtype=torch.long, device=DEVICE),
                                               residual_step=torch.zeros(1, dtype=torch.long, device=DEVICE)),
         ValueError, "residual_step must be"),
        ("acceptance-no-order", lambda b: kernels.acceptance(_t(1, 0, 4, 10), *scoring, backend=b), ValueError,
         "at least one order"),
        ("hidden-no-order", lambda b: kernels.acceptance_from_hidden(_t(1, 0, 4, 6), _t(10, 6), *scoring, backend=b),
         ValueError, "at least one order"),
        ("residual-p-dtype", lambda b: kernels.residual_sample(x, y.half(), _t(3).abs(), backend=b), ValueError,
         "p_logits must have the dtype of q_logits"),
        ("attention-scale-str", lambda b: kernels.burst_attention(*attn, "a", backend=b), ValueError,
         "scale must be None or a positive"),
        ("attention-scale-negative", lambda b: kernels.burst_attention(*attn, -1.0, backend=b), ValueError,
         "scale must be None or a positive"),
        ("verify-scale-nan", lambda b: kernels.verify_attention(q[:, None], q[:, None], q[:, None], *attn[3:],
                                                                float("nan"), backend=b), ValueError, "scale"),
    ]


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("case", _sampler_bad_calls() + _step_bad_calls(), ids=lambda c: c[0])
def test_both_backends_reject_bad_input_alike(case, backend):
    _, call, error, match = case
    with pytest.raises(error, match=match):
        call(backend)


def test_the_reference_takes_float64_any_width_and_strided_weights():
    """What only the reference can run stays accepted: float64, a row wider than the Triton kernels hold, and
    a transposed (non-contiguous) weight."""
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(2, 300, generator=g, dtype=torch.float64), torch.randn(2, 300, generator=g, dtype=torch.float64)
    s, h = kernels.add_layer_norm(x, y, backend="reference")
    torch.testing.assert_close(h, F.layer_norm(x + y, (300,)))
    weight = torch.randn(300, 300, generator=g, dtype=torch.float64).T  # strided
    s, h = kernels.linear_add_norm(x, y, weight, backend="reference")
    torch.testing.assert_close(s, x + y @ weight.T)
    with pytest.raises(ValueError, match="x's last dimension must be in \\[1, 256\\]"):
        kernels.linear_add_norm(x.float().to(DEVICE), y.float().to(DEVICE), weight.float().contiguous().to(DEVICE),
                                backend="triton")


@pytest.mark.parametrize("temperature", [1.0, 0.0])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_drafts_outside_the_vocabulary_are_rejected_on_both_backends(backend, temperature):
    logits = _t(1, 1, 4, 10)
    drafts = torch.tensor([[[3, -1, 10, 2]]], device=DEVICE)
    logp, u = torch.full((1, 1, 4), -5.0, device=DEVICE), torch.full((1, 1, 4), 0.5, device=DEVICE)
    res = kernels.acceptance(logits, drafts, logp, u, torch.tensor([4], device=DEVICE), temperature, rule="lossless",
                             backend=backend)
    assert not res.accept[0, 0, 1:3].any()
    if temperature:
        assert torch.isinf(res.logq[0, 0, 1:3]).all() and (res.logq[0, 0, 1:3] < 0).all()


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_numpy_scalars_are_taken_as_python_numbers(backend):
    """A NumPy integer ``top_k`` and NumPy float ``temperature`` give what the Python numbers give; a NumPy bool
    is still refused."""
    np = pytest.importorskip("numpy")
    logits, q = _t(3, 40, seed=3), _t(3, 40, seed=4)
    u = _t(3, seed=5).abs().clamp(max=0.99)
    want = kernels.sample(logits, u, 0.8, 5, backend=backend)
    got = kernels.sample(logits, u, np.float32(0.8), np.int64(5), backend=backend)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(kernels.residual_sample(q, logits, u, np.float64(0.8), np.int32(5), backend=backend),
                               kernels.residual_sample(q, logits, u, 0.8, 5, backend=backend))
    drafts = logits.argmax(-1).view(1, 1, 3)
    args = (logits.view(1, 1, 3, 40), drafts, torch.full((1, 1, 3), -2.0, device=DEVICE), u.view(1, 1, 3),
            torch.tensor([3], device=DEVICE))
    want = kernels.acceptance(*args, 0.8, 5, "lossless", backend=backend)
    got = kernels.acceptance(*args, np.float32(0.8), np.int16(5), "lossless", backend=backend)
    torch.testing.assert_close(got.accept, want.accept)
    with pytest.raises(TypeError, match="top_k must be None or an int"):
        kernels.sample(logits, u, 1.0, np.bool_(True), backend=backend)
