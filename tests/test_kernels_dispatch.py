"""Backend dispatch of sigmafast.kernels, the custom ops, and the sampler end to end on the Triton kernels.

The tensors are built on the CPU and moved to ``DEVICE``: the CPU in the interpreter, else the GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import sigmafast
from helpers import count_variants, tiny_model, triton_device
from sigmafast import SigmaGPT, SigmaGPTConfig, kernels
from sigmafast.kernels import reference as ref

DEVICE = triton_device()


def _dev(*tensors):
    return [t.to(DEVICE) for t in tensors]


def test_import_does_not_load_triton():
    code = "import sys, sigmafast.kernels; assert 'triton' not in sys.modules, 'triton imported eagerly'"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


@pytest.mark.skipif(kernels.triton_problem() is not None, reason="this triton is below the kernels' floor")
def test_backend_choice(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # as conftest sets it without a GPU (read per call)
    x = torch.zeros(2)
    assert kernels.backend_for(x) == "reference"  # conftest: SIGMAFAST_BACKEND=reference
    monkeypatch.setenv("SIGMAFAST_BACKEND", "auto")
    assert kernels.backend_for(x) == "triton"  # TRITON_INTERPRET=1
    assert kernels.backend_for(x.double()) == "reference"  # the kernels take no float64
    assert kernels.backend_for(x.half()) == "triton"
    assert kernels.backend_for(x.bfloat16()) == "reference"  # the interpreter has no bfloat16
    with kernels.use_backend("reference"):
        assert kernels.backend_for(x) == "reference"
        with kernels.use_backend("triton"):
            assert kernels.backend_for(x) == "triton"
        assert kernels.backend_for(x) == "reference"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert kernels.backend_for(x) == "reference"
    monkeypatch.setenv("SIGMAFAST_BACKEND", "triton")
    with pytest.raises(ValueError, match="needs CUDA tensors, or TRITON_INTERPRET=1"):
        kernels.backend_for(x)
    monkeypatch.setenv("SIGMAFAST_BACKEND", "fast")
    with pytest.raises(ValueError, match="SIGMAFAST_BACKEND must be one of"):
        kernels.backend_for(x)
    with pytest.raises(ValueError, match="use_backend"):
        with kernels.use_backend("cuda"):
            pass


def test_auto_gives_a_cpu_bfloat16_model_the_reference_under_the_interpreter(monkeypatch):
    """The interpreter computes bfloat16 dots wrongly, so ``auto`` must not send CPU bfloat16 to Triton:
    a bf16 model's conditionals under ``auto`` are the reference's, bit for bit."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("SIGMAFAST_BACKEND", "auto")
    model = tiny_model(5, 8, seed=0, std=0.5, dtype=torch.bfloat16)
    idx = torch.zeros(2, 8, dtype=torch.long)
    known = torch.zeros(2, 8, dtype=torch.bool)
    known[1, :3] = True
    got = sigmafast.conditional_density(model, idx, known)
    with kernels.use_backend("reference"):
        want = sigmafast.conditional_density(model, idx, known)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_public_functions_dispatch_to_triton(monkeypatch):
    from sigmafast.kernels import sampling

    calls = []
    real = sampling.sample
    monkeypatch.setattr(sampling, "sample", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    g = torch.Generator().manual_seed(0)
    logits, u = _dev(torch.randn(6, 11, generator=g), torch.rand(6, generator=g))
    with kernels.use_backend("triton"):
        tokens, logp = kernels.sample(logits, u, 0.9, 4)
    assert calls == [1]
    want, want_logp = ref.sample(logits, u, 0.9, 4)
    assert torch.equal(tokens, want)
    torch.testing.assert_close(logp, want_logp, rtol=0, atol=1e-5)
    q, lens = _dev(torch.randn(1, 2, 3, 8, generator=g), torch.tensor([2]))  # (B, H, R, D), also a 3-long cache
    with kernels.use_backend("triton"):
        out = kernels.burst_attention(q, q, q, q, q, lens)
    torch.testing.assert_close(out, ref.burst_attention(q, q, q, q, q, lens))
    hidden, weight = _dev(torch.randn(1, 2, 3, 16, generator=g), torch.randn(9, 16, generator=g))
    args = _dev(torch.zeros(1, 2, 3, dtype=torch.long), torch.full((1, 2, 3), -2.0), torch.rand(1, 2, 3, generator=g),
                torch.tensor([3]))
    with kernels.use_backend("triton"):
        got = kernels.acceptance_from_hidden(hidden, weight, *args)
    want = kernels.acceptance_from_hidden(hidden, weight, *args)  # reference backend
    torch.testing.assert_close(got.logq, want.logq, rtol=0, atol=1e-5)
    assert torch.equal(got.n_accept, want.n_accept)


def _tiny_fp32_model(seed: int = 0) -> SigmaGPT:
    torch.manual_seed(seed)
    model = SigmaGPT(SigmaGPTConfig(vocab_size=7, block_size=8, n_layer=2, n_head=2, n_embd=32))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
    return model.eval()


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(strategy="burst", acceptance="paper", num_orders=3),
        dict(strategy="burst", acceptance="lossless", num_orders=1, top_k=4),
        dict(strategy="autoregressive", temperature=0.8),
    ],
    ids=["burst-paper", "burst-lossless-topk", "autoregressive"],
)
def test_generate_triton_matches_reference_backend(kwargs):
    model = _tiny_fp32_model().to(DEVICE)
    idx = torch.tensor([[1, 2], [3, 0]], device=DEVICE)
    runs = {}
    for backend in ("reference", "triton"):
        with count_variants() as launched, kernels.use_backend(backend):
            g = torch.Generator(device=DEVICE).manual_seed(123)
            runs[backend] = sigmafast.generate(model, idx, 6, generator=g, return_stats=True, **kwargs)
        if backend == "reference":
            assert launched.launches == {}
    (tok_r, stats_r), (tok_t, stats_t) = runs["reference"], runs["triton"]
    assert torch.equal(tok_t, tok_r)
    assert torch.equal(stats_t.iterations, stats_r.iterations)
    used = set(launched.launches)
    want = {"_cascade_attn_kernel", "_sample_kernel"}
    if kwargs["strategy"] == "burst":
        assert used & {"_lm_head_finish_kernel", "_logq_finish_kernel"}, f"no draft was scored: {sorted(used)}"
    if kwargs.get("acceptance") == "lossless":
        want.add("_residual_kernel")
    assert want <= used, f"the Triton run used only {sorted(used)}"


def _backend_calls():
    g = torch.Generator().manual_seed(3)
    q, lens = _dev(torch.randn(1, 2, 3, 16, generator=g), torch.tensor([2]))  # (B, H, R, D), also a 3-long cache
    qo = q[:, None].expand(1, 2, 2, 3, 16)  # (B, O, H, R, D)
    logits, u = _dev(torch.randn(4, 9, generator=g), torch.rand(4, generator=g))
    drafts, dl, ua = _dev(torch.zeros(1, 2, 2, dtype=torch.long), torch.full((1, 2, 2), -2.0), torch.rand(1, 2, 2))
    hidden, weight = _dev(torch.randn(1, 2, 2, 16, generator=g), torch.randn(9, 16, generator=g))
    return {
        "burst_attention": lambda **kw: kernels.burst_attention(q, q, q, q, q, lens, **kw),
        "verify_attention": lambda **kw: kernels.verify_attention(qo, qo, qo, q, q, lens, **kw),
        "acceptance": lambda **kw: kernels.acceptance(logits.view(1, 2, 2, 9), drafts, dl, ua, lens, **kw),
        "acceptance_from_hidden": lambda **kw: kernels.acceptance_from_hidden(hidden, weight, drafts, dl, ua, lens,
                                                                             **kw),
        "sample": lambda **kw: kernels.sample(logits, u, 0.9, **kw),
        "residual_sample": lambda **kw: kernels.residual_sample(logits, logits.flip(0), u, **kw),
        "flag_nonfinite": lambda **kw: kernels.flag_nonfinite(logits, u > 0.5, torch.zeros_like(u[0], dtype=torch.bool),
                                                              **kw),
        "gather_drafts": lambda **kw: kernels.gather_drafts(drafts[:, 0], drafts[:, 0], dl[:, 0], drafts[:, 0],
                                                            drafts[:, 0] > 0, ua[:, 0], drafts, **kw),
    }


@pytest.mark.parametrize("name", sorted(_backend_calls()))
def test_explicit_backend_argument(name, monkeypatch):
    """``backend=`` is used as is: no environment or context read, and it beats ``use_backend``."""
    call = _backend_calls()[name]
    monkeypatch.setattr(kernels, "backend_for", lambda t: pytest.fail("backend_for was read"))
    with count_variants() as launched, kernels.use_backend("triton"):
        call(backend="reference")
    assert launched.launches == {}
    with count_variants() as launched, kernels.use_backend("reference"):
        call(backend="triton")
    assert launched.launches
    for bad in ("auto", "cuda", ""):
        with pytest.raises(ValueError, match="backend must be None, 'triton' or 'reference'"):
            call(backend=bad)


def test_explicit_triton_backend_on_cpu_tensors_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1"):
        kernels.sample(torch.randn(3, 37), torch.rand(3), backend="triton")


def _commit_sample(g: torch.Generator) -> tuple:
    """Arguments of ``sigmafast::commit``: 2 rows, 3 orders of 4 steps, a 2-layer cache of 10 + 1 slots, and a
    residual token at step 3 of row 0."""
    B, O, R, T, D = 2, 3, 4, 10, 16
    qkv = torch.randn(2, B, O, R, 3 * 2 * D, generator=g)  # (n_layer, B, O, R, 3C), H = 2
    kv = qkv[..., 2 * D:].unflatten(-1, (2, 2, D)).permute(4, 0, 1, 2, 5, 3, 6)
    return _dev(torch.rand(B, O, T, generator=g).argsort(-1)[..., :R], torch.tensor([2, 0]), torch.tensor([4, 1]),
                torch.randint(0, 9, (B, R), generator=g), kv[0], kv[1], torch.zeros(B, T, dtype=torch.long),
                torch.zeros(B, T, dtype=torch.bool), torch.zeros(B, dtype=torch.long), torch.zeros(B, dtype=torch.long),
                torch.zeros(2, B, 2, T + 1, D), torch.zeros(2, B, 2, T + 1, D), torch.tensor([0, 6]),
                torch.ones((), dtype=torch.bool), torch.zeros(3, dtype=torch.long), torch.tensor([40, 41]),
                torch.tensor([3, 0]))


def test_kernels_are_custom_ops():
    from sigmafast.kernels import ops

    for name in ops.OPS:
        assert isinstance(getattr(torch.ops.sigmafast, name), torch._ops.OpOverloadPacket), name
    g = torch.Generator().manual_seed(4)
    q, kc, lens = _dev(torch.randn(2, 3, 5, 16, generator=g), torch.randn(2, 5, 40, 16, generator=g),
                       torch.tensor([7, 40]))
    q = q.transpose(1, 2)  # (B, H=5, R=3, D) view
    logits, u, drafts, hidden, weight = _dev(torch.randn(6, 9, generator=g), torch.rand(6, generator=g),
                                             torch.randint(0, 9, (6,), generator=g), torch.randn(6, 16, generator=g),
                                             torch.randn(9, 16, generator=g))
    samples = {
        "burst_attention": (q, q, q, kc, kc, lens, None, 2),
        "verify_attention": (q[:, None].expand(2, 2, 5, 3, 16), q[:, None].expand(2, 2, 5, 3, 16),
                             q[:, None].expand(2, 2, 5, 3, 16), kc, kc, lens, 0.3, None),
        "draft_logq": (logits, drafts, 0.8, 3, None, None, None),
        "lm_head_logq": (hidden, weight, drafts, 0.0, None, None),
        "sample": (logits, u, 1.0, None, None, None, None),
        "residual_sample": (logits, logits.flip(0), u, 0.7, 2, 8),
        "commit": _commit_sample(g),
        "add_layer_norm": (*_dev(torch.randn(2, 3, 16, generator=g), torch.randn(2, 3, 16, generator=g),
                                 torch.rand(16, generator=g), torch.randn(16, generator=g)), 1e-5),
        "linear_gelu": (*_dev(torch.randn(2, 3, 24, generator=g)[..., :16], torch.randn(40, 16, generator=g),
                              torch.randn(40, generator=g)),),
        "linear_add_norm": (*_dev(torch.randn(2, 3, 16, generator=g), torch.randn(2, 3, 8, generator=g),
                                  torch.randn(16, 8, generator=g), torch.randn(16, generator=g),
                                  torch.rand(16, generator=g)), None, 1e-5,
                            *_dev(torch.randn(48, 16, generator=g), torch.randn(48, generator=g),
                                  torch.empty(2, 3, 48))),
        "mlp_add_norm": (*_dev(torch.randn(2, 3, 16, generator=g), torch.randn(2, 3, 16, generator=g),
                               torch.randn(40, 16, generator=g), torch.randn(40, generator=g),
                               torch.randn(16, 40, generator=g), torch.randn(16, generator=g)), None, None, 1e-5,
                         None, None, None),
        "feed_embedding": (*_dev(torch.tensor([1, 4]), torch.tensor([8, 0]), torch.randint(5, (2, 3, 4), generator=g),
                                 torch.randint(0, 9, (2, 3, 4), generator=g), torch.randn(5, 16, generator=g),
                                 torch.randn(9, 8, generator=g), torch.randn(9, 8, generator=g),
                                 torch.rand(16, generator=g)), None, 1e-5,
                           *_dev(torch.randn(48, 16, generator=g), torch.randn(48, generator=g),
                                 torch.empty(2, 3, 4, 48))),
        "decide": (*_dev(torch.rand(2, 3, 5, generator=g) * 2, torch.zeros(2, 3, 5, dtype=torch.long),
                         torch.rand(2, 3, 5, generator=g, dtype=torch.float64), torch.tensor([5, 2])), False, True,
                   None),
        "flag_nonfinite": (*_dev(torch.randn(2, 3, 4, 9, generator=g).index_fill_(-1, torch.tensor([3]), float("nan")),
                                 torch.tensor([[[True, False, False, True]]]).expand(2, 1, 4),
                                 torch.zeros((), dtype=torch.bool)),),
        "plan_step": tuple(_dev(torch.randint(0, 9, (4, 2, 5), generator=g), torch.tensor(3))),
        "gather_drafts": tuple(_dev(torch.tensor([[1, 3, 0], [2, 0, 1]]), torch.randint(9, (2, 3), generator=g),
                                    torch.rand(2, 3, generator=g), torch.randint(9, (2, 4), generator=g),
                                    torch.tensor([[True, False, True, False], [False, False, False, True]]),
                                    torch.rand(2, 4, generator=g, dtype=torch.float64),
                                    torch.rand(2, 2, 4, generator=g).argsort(-1)[..., :3])),
        "rotary_": (*_dev(torch.randn(2, 3, 5, 8, generator=g), torch.randn(2, 3, 5, 8, generator=g)), None,
                    *_dev(torch.randint(0, 7, (2, 5), generator=g), torch.randint(0, 7, (2, 5), generator=g),
                          torch.rand(7, 4, generator=g), torch.rand(7, 4, generator=g)), -1.0),
        "draft_slots": (*_dev(torch.rand(2, 6, generator=g) < 0.5, torch.rand(2, 6, generator=g),
                              torch.rand(2, 3, 6, generator=g)), 4),
        "residual_pick": tuple(_dev(torch.tensor([1, 3]), torch.tensor([2, 3]), torch.tensor([[4, 0, 2], [1, 3, 0]]),
                                    torch.tensor([[0, 2, 1], [2, 0, 1]]), torch.rand(2, 5, generator=g),
                                    torch.randn(2, 3, 16, generator=g)[..., :9], torch.randn(2, 3, 4, generator=g))),
    }
    assert set(samples) == set(ops.OPS)
    for name, args in samples.items():  # schema, fake (meta) function against the real one, no aliasing
        torch.library.opcheck(getattr(torch.ops.sigmafast, name).default, args,
                              test_utils=("test_schema", "test_faketensor"))


def test_ops_that_mutate_declare_no_defaults():
    """torch 2.11 drops the trailing arguments left at their schema defaults before an op's ADInplaceOrView
    kernel, which then indexes the mutated ones: ``sample(..., flag=None)`` raised IndexError on an H200
    (2.13 fills the defaults back in first). Mutating ops therefore take every argument explicitly."""
    from sigmafast.kernels import ops

    for name in ops.OPS:
        schema = getattr(torch.ops.sigmafast, name).default._schema
        if schema.is_mutable:
            defaults = [a.name for a in schema.arguments if a.has_default_value()]
            assert not defaults, f"{name} mutates an argument and declares defaults for {defaults}"


def test_torch_compile_fullgraph_traces_the_triton_ops():
    """One function over every dispatch function on the Triton path compiles with fullgraph=True
    (a graph break raises) and gives the eager results."""
    g = torch.Generator().manual_seed(5)
    B, O, H, R, D, L, V = 2, 2, 2, 3, 16, 20, 9
    C = H * D
    kc, vc = _dev(*torch.randn(2, B, H, L, D, generator=g))
    q, k, v = _dev(*torch.randn(3, B, O, H, R, D, generator=g))
    lens, hidden, weight = _dev(torch.tensor([5, 20]), torch.randn(B, O, R, C, generator=g),
                                torch.randn(V, C, generator=g))
    u, ua, ur = _dev(torch.rand(B * R, generator=g), torch.rand(B, O, R, generator=g), torch.rand(B, generator=g))
    known, u_pos = _dev(torch.rand(B, L, generator=g) < 0.5, torch.rand(B, L, generator=g))
    w_proj, w_fc, b_fc = _dev(torch.randn(C, C, generator=g), torch.randn(2 * C, C, generator=g),
                              torch.randn(2 * C, generator=g))

    def step(q, k, v, hidden):
        x = kernels.burst_attention(q[:, 0], k[:, 0], v[:, 0], kc, vc, lens, backend="triton")
        y = kernels.verify_attention(q, k, v, kc, vc, lens, backend="triton")
        p_logits = (x + y[:, 1]).transpose(1, 2).reshape(B, R, H * D) @ weight.T  # (B, R, V)
        tok, logp = kernels.sample(p_logits.flatten(0, 1), u, 0.9, backend="triton")
        drafts = tok.view(B, 1, R).expand(B, O, R)
        draft_logp = logp.view(B, 1, R).expand(B, O, R)
        res = kernels.acceptance(hidden @ weight.T, drafts, draft_logp, ua, lens.clamp(max=R), 0.9, 4, "paper",
                                 backend="triton")
        res_h = kernels.acceptance_from_hidden(hidden, weight, drafts, draft_logp, ua, lens.clamp(max=R), 0.9,
                                               rule="lossless", backend="triton", scoring="fused")
        res_m = kernels.acceptance_from_hidden(hidden, weight, drafts, draft_logp, ua, lens.clamp(max=R), 0.9,
                                               rule="lossless", backend="triton", scoring="matmul")
        r_tok = kernels.residual_sample(hidden[:, 0, 0] @ weight.T, p_logits[:, 0], ur, 0.9, backend="triton")
        slots = kernels.draft_slots(known, u_pos, ua.new_ones(B, O, L) - u_pos[:, None], R, backend="triton")
        nxt = hidden.new_empty(B, O, R, 2 * C)  # written by the first end (a mutated argument)
        ends = (*kernels.linear_add_norm(hidden, hidden, w_proj, next_weight=w_fc, next_bias=b_fc, next_out=nxt,
                                         backend="triton"), nxt,
                *kernels.mlp_add_norm(hidden, hidden, w_fc, b_fc, w_fc.t().contiguous(), b_fc[:C], backend="triton"),
                kernels.linear_gelu(hidden, w_fc, b_fc, backend="triton"))
        return (x, y, tok, logp, res.logq, res.n_accept, res_h.logq, res_h.best, res_m.logq, r_tok, *slots, *ends)

    traced = set()

    def eager_recording(gm, example_inputs):  # the "eager" backend, noting the graph's ops
        traced.update(str(n.target).removesuffix(".default") for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    with kernels.use_backend("triton"):
        want = step(q, k, v, hidden)
        torch._dynamo.reset()
        got = torch.compile(step, fullgraph=True, backend=eager_recording)(q, k, v, hidden)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    ops = {f"sigmafast.{name}" for name in
           ("burst_attention", "verify_attention", "sample", "draft_logq", "lm_head_logq", "residual_sample",
            "draft_slots", "linear_add_norm", "mlp_add_norm", "linear_gelu")}
    assert ops <= traced, f"not in the graph: {ops - traced}"
