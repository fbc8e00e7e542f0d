"""The engine's steps under torch.compile(fullgraph=True): no graph break, and the eager tokens."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_model

import sigmafast
from sigmafast import steps
from sigmafast.engine import NeuralSession
from sigmafast.request import draw, draw_burst

T = 8
VOCAB = 5


@pytest.fixture(scope="module")
def model():
    return tiny_model(VOCAB, T, seed=3, std=0.5, dtype=torch.float32)


def _recording(seen: set):
    """aot_eager, noting the ops of each graph dynamo hands it (the custom ops appear as ``sigmafast.*``)."""
    from torch._dynamo.backends.registry import lookup_backend

    def backend(gm, example_inputs):
        seen.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return lookup_backend("aot_eager")(gm, example_inputs)
    return backend


BURST_OPS = {"sigmafast.draft_slots", "sigmafast.sample", "sigmafast.gather_drafts", "sigmafast.burst_attention",
             "sigmafast.verify_attention", "sigmafast.decide"}


def _burst_run(model, step, backend, rule, num_orders, B=4, R=T, temperature=0.9, top_k=None):
    """Three burst iterations of ``step`` from the same state and draws; the final canvas and outputs."""
    canvas = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(0))
    known = torch.rand(B, T, generator=torch.Generator().manual_seed(1)) < 0.3
    session = NeuralSession(model, B, T, backend)
    session.prefill(canvas, known)
    g = torch.Generator().manual_seed(5)
    outs = [step(session, draw_burst(g, B, num_orders, T, "cpu"), R, temperature, top_k, rule) for _ in range(3)]
    return session.canvas.clone(), session.known.clone(), outs


def _ar_run(model, step, backend, B=3):
    canvas = torch.zeros(B, T, dtype=torch.long)
    known = torch.zeros(B, T, dtype=torch.bool)
    known[1, :3] = True
    session = NeuralSession(model, B, T, backend)
    session.prefill(canvas, known)
    n_known = known.sum(1)
    visit = torch.where(known, torch.arange(T) - T, torch.arange(T).flip(0)).argsort(dim=1, stable=True)
    plan = steps.ar_plan(visit, draw(torch.Generator().manual_seed(2), (B, T), "cpu"), n_known)
    for _ in range(T):
        step(session, plan, 0.8, 3)
    assert not plan.nonfinite
    return session.canvas.clone(), session.known.clone()


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("rule,num_orders,temperature,top_k", [("paper", 3, 0.9, None), ("lossless", 1, 0.9, None),
                                                             ("lossless", 1, 0.8, 3), ("paper", 3, 0.0, None)])
def test_burst_step_compiles_without_graph_breaks(model, backend, rule, num_orders, temperature, top_k):
    """fullgraph=True raises on any graph break: no host read, no data-dependent shape, the Triton
    kernels traced as custom ops. aot_eager traces and functionalises like inductor, without codegen."""
    torch._dynamo.reset()
    seen = set()
    compiled = torch.compile(steps.burst_step, fullgraph=True, backend=_recording(seen))
    with torch.no_grad():
        want = _burst_run(model, steps.burst_step, backend, rule, num_orders, temperature=temperature, top_k=top_k)
        got = _burst_run(model, compiled, backend, rule, num_orders, temperature=temperature, top_k=top_k)
    ops = {op for op in seen if op.startswith("sigmafast.")}
    want_ops = BURST_OPS | ({"sigmafast.residual_pick", "sigmafast.residual_sample"} if rule == "lossless" else set())
    assert ops >= want_ops if backend == "triton" else not ops, ops  # the Triton kernels traced, as custom ops
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for o_got, o_want in zip(got[2], want[2]):
        for a, b in zip(o_got, o_want):
            assert torch.equal(a, b)
    assert want[2][0][0].sum() > 0  # the steps did commit tokens


@pytest.mark.parametrize("pos_encoding", ["rope", "rope-v"])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_rotary_burst_step_compiles_without_graph_breaks(backend, pos_encoding):
    rope = tiny_model(VOCAB, T, seed=3, std=0.5, dtype=torch.float32, pos_encoding=pos_encoding)
    torch._dynamo.reset()
    compiled = torch.compile(steps.burst_step, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        want = _burst_run(rope, steps.burst_step, backend, "paper", 3)
        got = _burst_run(rope, compiled, backend, "paper", 3)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_ar_step_compiles_without_graph_breaks(model, backend):
    torch._dynamo.reset()
    seen = set()
    compiled = torch.compile(steps.ar_step, fullgraph=True, backend=_recording(seen))
    with torch.no_grad():
        want = _ar_run(model, steps.ar_step, backend)
        got = _ar_run(model, compiled, backend)
    want_ops = {"sigmafast.sample", "sigmafast.verify_attention"} if backend == "triton" else set()
    assert {op for op in seen if op.startswith("sigmafast.")} == want_ops
    assert want[1].all()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("strategy", ["burst", "autoregressive"])
def test_compiled_steps_give_the_eager_tokens(model, strategy):
    """Engine(compile_steps=...) runs the steps through torch.compile(fullgraph=True)."""
    idx = torch.randint(0, VOCAB, (2, 2), generator=torch.Generator().manual_seed(0))
    rule = dict(acceptance="paper", num_orders=2) if strategy == "burst" else {}
    kwargs = dict(strategy=strategy, **rule, temperature=0.9, return_stats=True)
    torch._dynamo.reset()
    compiled = sigmafast.Engine(model, buckets=True, compile_steps="aot_eager")
    got, s_got = sigmafast.generate(compiled, idx, T - 2, generator=torch.Generator().manual_seed(1), **kwargs)
    want, s_want = sigmafast.generate(model, idx, T - 2, generator=torch.Generator().manual_seed(1), **kwargs)
    assert torch.equal(got, want) and torch.equal(s_got.accepted, s_want.accepted)


def test_compiled_steps_take_more_shapes_than_dynamos_default_limit(model):
    """Each R bucket and sampling setting recompiles the step: ten settings exceed dynamo's default of 8
    (a fullgraph compile then raises), and a long burst alone has up to log2(T / 16) + 2 R buckets."""
    idx = torch.randint(0, VOCAB, (1, 2), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    compiled = sigmafast.Engine(model, buckets=True, compile_steps="eager")
    for i in range(10):
        kwargs = dict(strategy="burst", acceptance="paper", num_orders=2, temperature=0.5 + 0.05 * i)
        got = sigmafast.generate(compiled, idx, T - 2, generator=torch.Generator().manual_seed(i), **kwargs)
        want = sigmafast.generate(model, idx, T - 2, generator=torch.Generator().manual_seed(i), **kwargs)
        assert torch.equal(got, want), i


def test_compiled_steps_run_eagerly_past_the_recompile_limit(model, monkeypatch):
    """Past RECOMPILE_LIMIT shapes (here 2, and dynamo's own limit 2) a fullgraph compile would raise: new
    settings run the step eagerly, with one RuntimeWarning, and still give the eager tokens."""
    from sigmafast import capture

    config = torch._dynamo.config
    monkeypatch.setattr(capture, "RECOMPILE_LIMIT", 2)
    monkeypatch.setattr(config, "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit", 2)
    idx = torch.zeros(1, 2, dtype=torch.long)
    torch._dynamo.reset()
    compiled = sigmafast.Engine(model, buckets=True, compile_steps="eager")
    with pytest.warns(RuntimeWarning, match="compile_steps: burst_step was compiled for 2 shapes") as record:
        for i in range(5):
            kwargs = dict(strategy="burst", acceptance="lossless", temperature=0.5 + 0.1 * i)
            got = sigmafast.generate(compiled, idx, T - 2, generator=torch.Generator().manual_seed(i), **kwargs)
            want = sigmafast.generate(model, idx, T - 2, generator=torch.Generator().manual_seed(i), **kwargs)
            assert torch.equal(got, want), i
    assert len([w for w in record if "compile_steps" in str(w.message)]) == 1
    torch._dynamo.reset()
