"""The engine's static-shape steps: buckets, lookahead, warmup, CUDA graphs and bad input (the steps under
torch.compile: test_engine_compile.py)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from helpers import tiny_model

import sigmafast
from sigmafast import kernels, naive, steps
from sigmafast.engine import NeuralSession
from sigmafast.request import BurstDraws, draw_burst

T = 8
VOCAB = 5


@pytest.fixture(scope="module")
def model():
    return tiny_model(VOCAB, T, seed=3, std=0.5, dtype=torch.float32)


@pytest.mark.parametrize("n,cap,want", [(1, 100, 16), (16, 100, 16), (17, 100, 32), (65, 100, 100), (5, 8, 8),
                                        (100, 100, 100)])
def test_bucket(n, cap, want):
    assert steps.bucket(n, cap) == want


@pytest.mark.parametrize("n,want", [(1, 1), (2, 2), (3, 4), (8, 8), (9, 16)])
def test_batch_bucket(n, want):
    from sigmafast.runner import batch_bucket

    assert batch_bucket(n) == want


@pytest.mark.parametrize("B,size,O", [(1, 1, 1), (3, 4, 5), (2, 2, 3), (0, 2, 2)])
def test_draws_into_static_buffers_equal_fresh_draws(B, size, O):
    """Captured steps read their draws from static buffers: drawing into their first B rows gives the
    fresh draws' values, leaves the padding rows alone and advances the generator alike."""
    g_fresh, g = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    fresh = draw_burst(g_fresh, B, O, T, "cpu")
    buffers = BurstDraws(*(torch.full((size, *t.shape[1:]), float("nan"), dtype=t.dtype) for t in fresh))
    got = draw_burst(g, B, O, T, "cpu", out=buffers)
    assert got is buffers
    for want, buf in zip(fresh, got):
        assert torch.equal(buf[:B], want)
        assert buf[B:].isnan().all()
    assert torch.equal(torch.rand(4, generator=g), torch.rand(4, generator=g_fresh))
    g_plain = torch.Generator().manual_seed(7)  # the protocol: four float64 draws in BurstDraws' field order
    plain = [torch.rand(shape, generator=g_plain, dtype=torch.float64) for shape in ((B, T), (B, O, T), (B, T), (B, T))]
    assert all(torch.equal(a, b) for a, b in zip(plain, (fresh.u_draft, fresh.keys, fresh.u_accept, fresh.u_residual)))


class _Status:
    """A step's status tensor that logs when the loop reads it."""

    def __init__(self, status, events, k):
        self.status, self.events, self.k = status, events, k

    def tolist(self):
        self.events.append(("read", self.k))
        return self.status.tolist()


@pytest.mark.parametrize("hook,lookahead", [(False, True), (True, True), (False, False)],
                         ids=["pipelined", "with-on_iteration", "lookahead-off"])
def test_bucketed_burst_queues_the_next_iteration_before_reading_a_status(hook, lookahead):
    """With static shapes the status of iteration i is read only once iteration i + 1 is queued (the device
    never waits for the host); an ``on_iteration`` callback, which sees each iteration's canvas, or
    ``lookahead=False`` reads every status before the next launch. Same tokens and statistics either way."""
    length = 40
    model = tiny_model(VOCAB, length, seed=4, std=0.5, n_embd=16)
    engine = sigmafast.Engine(model, buckets=True, lookahead=lookahead)
    sync = hook or not lookahead
    events, real = [], engine.burst

    def burst(*args):
        k = sum(e == "launch" for e, _ in events)
        events.append(("launch", k))
        n_commit, n, status = real(*args)
        return n_commit, n, _Status(status, events, k)

    engine.burst = burst
    idx = torch.randint(0, VOCAB, (3, 4), generator=torch.Generator().manual_seed(0))
    kwargs = dict(strategy="burst", acceptance="paper", num_orders=3, return_stats=True)
    out, stats = sigmafast.generate(engine, idx, length - 4, generator=torch.Generator().manual_seed(1),
                                    on_iteration=(lambda canvas, known: None) if hook else None, **kwargs)
    want, s_want = sigmafast.generate(model, idx, length - 4, generator=torch.Generator().manual_seed(1), **kwargs)
    assert torch.equal(out, want) and torch.equal(stats.accepted, s_want.accepted)
    reads = [k for e, k in events if e == "read"]
    launches = [k for e, k in events if e == "launch"]
    assert reads == list(range(int(stats.iterations.max()))) and len(reads) >= 3
    queued_next = [k + 1 in launches and events.index(("launch", k + 1)) < events.index(("read", k)) for k in reads]
    if sync:
        assert not any(queued_next), events
    else:  # the last iteration may have bounded the next one to nothing left
        assert all(queued_next[:-1]), events


@pytest.mark.parametrize("acceptance,num_orders", [("paper", 3), ("lossless", 1)], ids=["paper-O3", "lossless"])
@pytest.mark.parametrize("lookahead", [True, False], ids=["pipelined", "lookahead-off"])
def test_non_finite_outputs_leave_the_generator_as_the_naive_reference(acceptance, num_orders, lookahead):
    """A non-finite model raises at the first status read, with the draws of the queued next iteration given
    back: the generator stands where the naive reference's does (the draws of one iteration)."""
    broken = tiny_model(VOCAB, T, seed=2, std=0.5)
    with torch.no_grad():
        broken.h[0].mlp.c_fc.weight.fill_(float("nan"))
    after = []
    for fn, target in ((sigmafast.generate, sigmafast.Engine(broken, buckets=True, lookahead=lookahead)),
                       (naive.generate, broken)):
        g = torch.Generator().manual_seed(0)
        with pytest.raises(ValueError, match="model gave non-finite"):
            fn(target, torch.zeros(2, 0, dtype=torch.long), T, acceptance=acceptance, num_orders=num_orders,
               generator=g)
        after.append(torch.rand(4, generator=g))
    assert torch.equal(after[0], after[1])


def test_bucketed_prefill_pads_the_known_count_to_a_bucket():
    """The prompt's prefill runs over the bucket of the largest known count (one static shape per bucket, so a
    CUDA graph replays it), commits only each row's known tokens, and leaves the tokens the naive reference's."""
    length = 40
    model = tiny_model(VOCAB, length, seed=4, std=0.5, n_embd=16)
    engine = sigmafast.Engine(model, buckets=True)
    fed, real = [], NeuralSession.feed_known
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(NeuralSession, "feed_known", lambda self, M: fed.append(M) or real(self, M))
        for prompt, want_m in ((3, 16), (17, 32), (33, 40)):
            idx = torch.randint(0, VOCAB, (3, prompt), generator=torch.Generator().manual_seed(prompt))
            kwargs = dict(strategy="burst", acceptance="paper", num_orders=2)
            got = sigmafast.generate(engine, idx, length - prompt, generator=torch.Generator().manual_seed(1),
                                     **kwargs)
            want = naive.generate(model, idx, length - prompt, generator=torch.Generator().manual_seed(1), **kwargs)
            assert fed[-1] == want_m and torch.equal(got, want), prompt


def test_engine_defaults_and_bad_input(model):
    engine = sigmafast.Engine(model)
    assert not engine.buckets and not engine.cuda_graphs  # CPU: exact shapes, no graphs
    assert sigmafast.Engine(model, buckets=True).buckets
    with pytest.raises(ValueError, match="cuda_graphs=True needs a model on a CUDA device"):
        sigmafast.Engine(model, cuda_graphs=True)
    with pytest.raises(TypeError, match="model must be a SigmaGPT"):
        sigmafast.Engine(object())
    from sigmafast.diffusion import DiffusionConfig, DiffusionGPT

    with pytest.raises(TypeError, match="model must be a SigmaGPT, got DiffusionGPT"):
        sigmafast.Engine(DiffusionGPT(model.config, DiffusionConfig(noise="absorbing")))
    with pytest.raises(TypeError, match="compile_steps must be None or a torch.compile backend name"):
        sigmafast.Engine(model, compile_steps=True)
    with pytest.raises(ValueError, match=r"compile_steps must be None or a torch.compile backend name, one of "
                                         r"\[.*'inductor'.*\], got 'bogus'"):
        sigmafast.Engine(model, compile_steps="bogus")
    with pytest.raises(TypeError, match="model must be a SigmaGPT, got str"):  # before the engine cache's lookup
        sigmafast.warmup("x", 2, T)
    with pytest.raises(ValueError, match="max_sessions must be >= 1, got 0"):
        sigmafast.Engine(model, max_sessions=0)
    with pytest.raises(TypeError, match="max_sessions must be an int, got bool"):
        sigmafast.Engine(model, max_sessions=True)
    assert sigmafast.Engine(model, max_sessions=np.int64(3)).max_sessions == 3  # as generate's integers
    with pytest.raises(TypeError, match="lookahead must be a bool"):
        sigmafast.Engine(model, lookahead=1)
    with pytest.raises(ValueError, match="lookahead=True needs buckets=True"):
        sigmafast.Engine(model, lookahead=True, buckets=False)
    with pytest.raises(TypeError, match="buckets must be None or a bool, got str"):
        sigmafast.Engine(model, buckets="false")
    with pytest.raises(TypeError, match="cuda_graphs must be None or a bool, got int"):
        sigmafast.Engine(model, cuda_graphs=0)
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        sigmafast.warmup(model, 0, T)
    with pytest.raises(TypeError, match="batch_size must be an int, got float"):
        sigmafast.warmup(model, 1.0, T)
    with pytest.raises(ValueError, match="seq_len must be >= 0, got -1"):
        sigmafast.warmup(model, 1, -1)
    with pytest.raises(ValueError, match="exceeds the model's block_size"):
        sigmafast.warmup(model, 2, T + 1)
    for huge in (2**40, 2**62):  # refused before a canvas of that length is allocated
        with pytest.raises(ValueError, match=f"canvas length {huge + 1} .* exceeds the model's block_size"):
            sigmafast.generate(model, torch.zeros(1, 1, dtype=torch.long), huge)
        with pytest.raises(ValueError, match="exceeds the model's block_size"):
            sigmafast.warmup(model, 2, huge)


@pytest.mark.parametrize("strategy", ["burst", "autoregressive"])
def test_warmup_returns_an_engine_that_generate_takes(model, strategy):
    rule = dict(acceptance="paper", num_orders=2) if strategy == "burst" else {}
    engine = sigmafast.warmup(sigmafast.Engine(model, buckets=True), 2, T, strategy=strategy, **rule,
                              temperature=0.7)
    assert isinstance(engine, sigmafast.Engine) and engine.model is model
    idx = torch.randint(0, VOCAB, (2, 3), generator=torch.Generator().manual_seed(0))
    kwargs = dict(strategy=strategy, **rule, temperature=0.7, return_stats=True)
    out, stats = sigmafast.generate(engine, idx, T - 3, generator=torch.Generator().manual_seed(1), **kwargs)
    want, want_stats = sigmafast.generate(model, idx, T - 3, generator=torch.Generator().manual_seed(1), **kwargs)
    assert torch.equal(out, want) and torch.equal(stats.accepted, want_stats.accepted)
    assert torch.equal(out[:, :3], idx)


def test_warmup_of_one_token_runs_its_one_autoregressive_step(model):
    """A plan of T = 1 has one step: the warm-up runs that one (the capture comes with generate's next)."""
    engine = sigmafast.warmup(sigmafast.Engine(model, buckets=True), 2, 1, strategy="autoregressive")
    out = sigmafast.generate(engine, torch.zeros(2, 0, dtype=torch.long), 1, strategy="autoregressive",
                             generator=torch.Generator().manual_seed(0))
    want = sigmafast.generate(model, torch.zeros(2, 0, dtype=torch.long), 1, strategy="autoregressive",
                              generator=torch.Generator().manual_seed(0))
    assert torch.equal(out, want)


@pytest.mark.parametrize("acceptance", ["lossless", "paper"])
def test_warmup_runs_every_burst_bucket_of_a_long_canvas(acceptance):
    """T = 40: the R buckets 16, 32 and 40, each warmed on a session with R positions left (with more, the
    lossless rule would commit R drafts and a residual token into R slots); generate then gives the model's
    tokens."""
    long_model = tiny_model(VOCAB, 40, seed=4, std=0.5, dtype=torch.float32)
    idx = torch.randint(0, VOCAB, (3, 2), generator=torch.Generator().manual_seed(0))
    seen, real = [], steps.burst_step
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(steps, "burst_step", lambda session, d, R, *a: seen.append(R) or real(session, d, R, *a))
        engine = sigmafast.warmup(sigmafast.Engine(long_model, buckets=True), 3, 40, acceptance=acceptance)
    assert set(seen) == {16, 32, 40}, seen
    out = sigmafast.generate(engine, idx, 38, acceptance=acceptance, generator=torch.Generator().manual_seed(1))
    want = sigmafast.generate(long_model, idx, 38, acceptance=acceptance, generator=torch.Generator().manual_seed(1))
    assert torch.equal(out, want)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
def test_engine_follows_replaced_weights(device):
    """Steps read the parameters in place; an engine whose model's tensors were replaced starts afresh. On
    CUDA the engine keeps sessions and captured graphs, which would replay the old weights; on the CPU it
    keeps none, and the test checks the contract only."""
    clone = tiny_model(VOCAB, T, seed=3, std=0.5, dtype=torch.float32).to(device)
    engine = sigmafast.Engine(clone, buckets=True)
    idx = torch.zeros(2, 0, dtype=torch.long, device=device)
    for _ in range(2):  # on CUDA the first call runs eagerly, the second captures its steps
        first = sigmafast.generate(engine, idx, T, generator=torch.Generator().manual_seed(0), temperature=0)
    with torch.no_grad():
        for p in clone.parameters():
            p.data = p.data * -1.0  # new storage
    second = sigmafast.generate(engine, idx, T, generator=torch.Generator().manual_seed(0), temperature=0)
    want = sigmafast.generate(clone, idx, T, generator=torch.Generator().manual_seed(0), temperature=0)
    assert torch.equal(second, want)
    assert not torch.equal(first, second)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("strategy,acceptance,num_orders,top_k", [
    ("burst", "paper", 3, None), ("burst", "paper", 3, 3), ("burst", "lossless", 1, None),
    ("burst", "lossless", 1, 2), ("autoregressive", "lossless", 1, None)])
def test_cuda_graphs_replay_the_eager_tokens(strategy, acceptance, num_orders, top_k):
    """On CUDA, generate replays captured steps; the tokens equal an eager run of the same shapes (top-k
    included: a vocabulary too small for the top-k prefilter takes the chunk statistics)."""
    model = tiny_model(VOCAB, 40, seed=3, std=0.5, dtype=torch.float32).cuda()
    eager = sigmafast.Engine(model, buckets=True, cuda_graphs=False)
    graphs = sigmafast.Engine(model)
    assert graphs.cuda_graphs
    kwargs = dict(strategy=strategy, acceptance=acceptance, num_orders=num_orders, top_k=top_k, return_stats=True)
    with kernels.use_backend("triton"):
        assert graphs.backend == "triton"
        for seed in range(6):  # the first call runs eagerly, later ones capture and replay
            idx = torch.randint(0, VOCAB, (3, 5), device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
            where = "cuda" if seed % 2 else "cpu"  # draws made on the GPU, or on the CPU and copied
            want, s_want = sigmafast.generate(eager, idx, 35, generator=torch.Generator(where).manual_seed(seed),
                                              **kwargs)
            got, s_got = sigmafast.generate(graphs, idx, 35, generator=torch.Generator(where).manual_seed(seed),
                                            **kwargs)
            assert torch.equal(got, want)
            assert torch.equal(s_got.accepted, s_want.accepted)
    assert graphs._graphs.graphs, "no step was captured"
    small = sigmafast.Engine(model, max_sessions=1)  # a new canvas length evicts the old session and graphs
    with kernels.use_backend("triton"):
        for length in (20, 20, 30, 30):
            sigmafast.generate(small, torch.zeros(2, 0, dtype=torch.long, device="cuda"), length, **kwargs)
    assert len(small._sessions) == 1 and all(key[1] == id(next(iter(small._sessions.values())))
                                             for key in small._graphs.graphs)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_padded_lm_head_gives_the_same_steps(model, backend):
    """Sessions on CUDA pad the LM head to a multiple of 64 rows (aligned logits for cuBLAS); drafts,
    scores and residuals read only the first V logits, so the steps are unchanged."""

    def run(head_align):
        canvas = torch.randint(0, VOCAB, (3, T), generator=torch.Generator().manual_seed(0))
        known = torch.rand(3, T, generator=torch.Generator().manual_seed(1)) < 0.3
        session = NeuralSession(model, 3, T, backend, head_align=head_align)
        session.prefill(canvas, known)
        g = torch.Generator().manual_seed(5)
        outs = [steps.burst_step(session, draw_burst(g, 3, 1, T, "cpu"), T, 0.9, 3, "lossless") for _ in range(2)]
        return session, outs

    with torch.no_grad():
        padded, got = run(16)
        plain, want = run(None)
    assert padded.head_weight.shape == (16, model.config.n_embd)
    assert padded.head_weight[VOCAB:].eq(0).all() and plain.head_weight is model.lm_head.weight
    assert torch.equal(padded.canvas, plain.canvas)
    for o_got, o_want in zip(got, want):
        for a, b in zip(o_got, o_want):
            assert torch.equal(a, b)


def test_verify_keys_from_the_shared_projection_buffer_match_the_per_layer_keys(model):
    """Eager verify (no autograd) writes every layer's QKV projection into one buffer and returns its keys
    and values as (n_layer, B, O, H, R, D) views of it; with autograd it stacks the per-layer tensors.
    Both must hold the same keys, values and hidden states, and commit must fill the same cache."""
    B, O, R = 3, 4, T
    canvas = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(5))
    known = torch.rand(B, T, generator=torch.Generator().manual_seed(6)) < 0.4
    orders = torch.rand(B, O, T, generator=torch.Generator().manual_seed(7)).argsort(-1)[..., :R]
    drafts = torch.randint(0, VOCAB, (B, O, R), generator=torch.Generator().manual_seed(8))
    choice, n = torch.tensor([2, 0, 3]), torch.tensor([3, 0, 1])
    got = []
    for grad in (False, True):
        session = NeuralSession(model, B, T, "reference")
        with torch.set_grad_enabled(grad):
            session.prefill(canvas, known)
            verified = session.verify(orders, drafts)
            session.commit(verified, choice, n, drafts[torch.arange(B), choice])
        got.append((verified, session.cache.k.detach(), session.cache.v.detach(), session.cache.lens))
    (fast, k_fast, v_fast, lens_fast), (slow, k_slow, v_slow, lens_slow) = got
    L, H, D = model.config.n_layer, model.config.n_head, model.config.head_dim
    assert fast.keys.shape == (L, B, O, H, R, D) and slow.keys.shape == fast.keys.shape
    assert fast.keys._base is not None and slow.keys._base is None  # a view of the buffer; a stack
    torch.testing.assert_close(fast.keys, slow.keys.detach(), rtol=0, atol=0)
    torch.testing.assert_close(fast.values, slow.values.detach(), rtol=0, atol=0)
    torch.testing.assert_close(fast.hidden, slow.hidden.detach(), rtol=0, atol=0)
    assert torch.equal(lens_fast, lens_slow) and lens_fast.sum() > known.sum()
    torch.testing.assert_close(k_fast, k_slow, rtol=0, atol=0)
    torch.testing.assert_close(v_fast, v_slow, rtol=0, atol=0)


@pytest.mark.parametrize("num_orders", [1, 4])
def test_triton_commit_leaves_the_session_as_the_reference_commit(model, num_orders):
    """One verification committed twice from the same prefilled state, by the fused Triton op (eager, no
    autograd) and by the reference: canvas, mask, last token, lengths and cache must be identical."""
    B, R = 3, T
    canvas = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(5))
    known = torch.rand(B, T, generator=torch.Generator().manual_seed(6)) < 0.4
    orders = torch.rand(B, num_orders, T, generator=torch.Generator().manual_seed(7)).argsort(-1)[..., :R]
    drafts = torch.randint(0, VOCAB, (B, num_orders, R), generator=torch.Generator().manual_seed(8))
    choice = torch.tensor([num_orders - 1, 0, num_orders // 2])
    n = torch.tensor([3, 0, 1])
    sessions = []
    with torch.no_grad():
        for backend in ("reference", "triton"):
            session = NeuralSession(model, B, T, "reference")
            session.prefill(canvas, known)
            verified = session.verify(orders, drafts)
            session.backend = backend
            session.commit(verified, choice, n, drafts[torch.arange(B), choice])
            sessions.append(session)
    want, got = sessions
    for name in ("canvas", "known", "last_tok", "last_pos"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert torch.equal(got.cache.lens, want.cache.lens) and got.cache.lens.sum() > known.sum()
    for name in ("k", "v"):  # the scratch slot T excluded: the reference parks the rejected steps there
        assert torch.equal(getattr(got.cache, name)[..., :T, :], getattr(want.cache, name)[..., :T, :]), name


@pytest.mark.parametrize("flags", [[0, 1, 1, 0, 1], [1], [0, 0]], ids=["mixed", "one", "none"])
def test_bool_view_of_int64_flags_equals_the_cast(flags):
    """The autoregressive step's live flags as a bool view of their bytes: the cast's values, no copy."""
    x = torch.tensor(flags)
    got = steps.bool_view(x)
    assert got.dtype == torch.bool and torch.equal(got, x.bool())
    if sys.byteorder == "little":
        assert got.data_ptr() == x.data_ptr()  # a view
