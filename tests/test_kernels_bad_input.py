"""Bad input to sigmafast.kernels: the same mistake gets the same ``ValueError`` or ``TypeError``, naming the
argument, on the reference and on the Triton path."""

from __future__ import annotations

import pytest
import torch

from sigmafast import kernels


def _attention_args(B=2, H=2, R=3, L=5, D=8, O=None):
    g = torch.Generator().manual_seed(0)
    q = torch.randn((B, H, R, D) if O is None else (B, O, H, R, D), generator=g)
    cache = torch.randn(B, H, L, D, generator=g)
    return [q, q.clone(), q.clone(), cache, cache.clone(), torch.tensor([L] * B)]


def _bad_calls():
    """(id, call(backend), error, match): the same mistake must get the same error on both paths."""
    x, u = torch.randn(4, 10), torch.rand(4)
    drafts = x.argmax(-1).view(1, 1, 4)
    scoring = (drafts, u.view(1, 1, 4), u.view(1, 1, 4))
    hidden, weight = torch.randn(1, 1, 4, 6), torch.randn(10, 6)
    known, u_pos, keys = torch.zeros(2, 6, dtype=torch.bool), torch.rand(2, 6), torch.rand(2, 1, 6)
    pos, tok = torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 6, dtype=torch.long)

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
        ("sample-rank", lambda b: kernels.sample(x[None], u, backend=b), ValueError, "logits must have 2 dim"),
        ("sample-uniforms", lambda b: kernels.sample(x, u[:3], backend=b), ValueError, "uniforms must have shape"),
        ("residual-p-rows", lambda b: kernels.residual_sample(x, x[:1], u, backend=b), ValueError, "p_logits must"),
        ("acceptance-lengths", lambda b: kernels.acceptance(x.view(1, 1, 4, 10), *scoring, torch.tensor([4, 4]),
                                                            backend=b), ValueError, "lengths must be an int tensor"),
        ("acceptance-rule", lambda b: kernels.acceptance(x.view(1, 1, 4, 10), *scoring, torch.tensor([4]),
                                                         rule="best", backend=b), ValueError, "acceptance rule"),
        ("hidden-weight", lambda b: kernels.acceptance_from_hidden(hidden, weight[:, :5], *scoring, torch.tensor([4]),
                                                                   backend=b), ValueError, "weight must be"),
        ("hidden-vocab", lambda b: kernels.acceptance_from_hidden(hidden, weight, *scoring, torch.tensor([4]),
                                                                  vocab_size=11, backend=b), ValueError, "vocab_size"),
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
        ("plan-step-int32", lambda b: kernels.plan_step(tok[None], torch.zeros((), dtype=torch.int32), backend=b),
         ValueError, "step must be"),
        ("plan-steps-2d", lambda b: kernels.plan_step(tok, torch.zeros((), dtype=torch.long), backend=b),
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


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("case", _bad_calls(), ids=lambda c: c[0])
def test_both_backends_reject_bad_input_alike(case, backend):
    _, call, error, match = case
    with pytest.raises(error, match=match):
        call(backend)


@pytest.mark.parametrize("temperature", [1.0, 0.0])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_drafts_outside_the_vocabulary_are_rejected_on_both_backends(backend, temperature):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 1, 4, 10, generator=g)
    drafts = torch.tensor([[[3, -1, 10, 2]]])
    logp, u = torch.full((1, 1, 4), -5.0), torch.full((1, 1, 4), 0.5)
    res = kernels.acceptance(logits, drafts, logp, u, torch.tensor([4]), temperature, rule="lossless",
                             backend=backend)
    assert not res.accept[0, 0, 1:3].any()
    if temperature:
        assert torch.isinf(res.logq[0, 0, 1:3]).all() and (res.logq[0, 0, 1:3] < 0).all()
