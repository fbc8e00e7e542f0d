"""An engine's life across calls: the engine kept per model, and the sessions and buffers it keeps.

On CUDA an engine keeps its sessions, static buffers and captured graphs between calls, and ``generate`` keeps
one engine per model (``Engine.for_model``). The ``graph_engines`` fixture gives the CPU such engines: every
engine is built with buckets and ``cuda_graphs`` set, and a step the engine would capture or replay runs eagerly
instead, so everything the engine keeps between calls is kept as on CUDA.
"""

from __future__ import annotations

import copy
import gc
import pickle
import weakref

import pytest
import torch
from helpers import tiny_model

import sigmafast
from sigmafast import naive, runner

T = 8
VOCAB = 5


def _keep_graphs(monkeypatch, on=lambda device: True) -> None:
    """Engines built with buckets and, on the devices ``on`` names, ``cuda_graphs`` set: as on CUDA, sessions,
    static buffers and graphs are kept between calls; "replays" run eagerly."""
    real_init = runner.Engine.__init__

    def init(self, model, **kwargs):
        real_init(self, model, **{"buckets": True, **kwargs})
        self.cuda_graphs = on(self.device)

    monkeypatch.setattr(runner.Engine, "__init__", init)
    monkeypatch.setattr(runner.Graphs, "run", lambda self, key, fn: fn())


@pytest.fixture
def graph_engines(monkeypatch):
    _keep_graphs(monkeypatch)


def _model(seed: int = 3):
    return tiny_model(VOCAB, T, seed=seed, std=0.5, dtype=torch.float32)


def _prompt(B: int = 2, P: int = 3) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, P), generator=torch.Generator().manual_seed(B + P))


def test_the_engine_kept_for_a_model_does_not_keep_it_alive(graph_engines):
    """``generate(model, ...)`` keeps the model's engine (sessions, graphs) for its later calls, but not the model:
    once the caller drops the model, model and engine are freed (GPU memory of checkpoints sampled in a loop)."""
    model = _model()
    got = sigmafast.generate(model, _prompt(), T - 3, generator=torch.Generator().manual_seed(0))
    assert torch.equal(got, naive.generate(model, _prompt(), T - 3, generator=torch.Generator().manual_seed(0)))
    engine = sigmafast.Engine.for_model(model)
    assert engine.model is model and engine._sessions  # kept, with the session of the call
    assert sigmafast.Engine.for_model(model) is engine
    for other in (copy.deepcopy(model), copy.copy(model), pickle.loads(pickle.dumps(model))):
        assert sigmafast.Engine.for_model(other).model is other  # a copy gets an engine of its own
    assert sigmafast.Engine.for_model(model) is engine
    dead = weakref.ref(model), weakref.ref(engine)
    del model, engine, other
    gc.collect()
    assert dead[0]() is None and dead[1]() is None


@pytest.mark.parametrize("strategy", ["burst", "autoregressive"])
def test_calls_in_inference_mode_leave_the_engine_usable_outside_it(graph_engines, strategy):
    """What an engine keeps between calls is made of normal tensors: a warmup or a call inside
    ``torch.inference_mode()`` (a server's) does not make later calls outside it fail to update them in place."""
    model = _model()
    kwargs = dict(strategy=strategy, generator=torch.Generator().manual_seed(0))
    want = naive.generate(model, _prompt(), T - 3, **kwargs)
    with torch.inference_mode():
        engine = sigmafast.warmup(model, 2, T, strategy=strategy)
        kwargs["generator"].manual_seed(0)
        assert torch.equal(sigmafast.generate(engine, _prompt(), T - 3, **kwargs), want)
    for context in (torch.no_grad, torch.enable_grad, torch.inference_mode):
        with context():
            kwargs["generator"].manual_seed(0)
            assert torch.equal(sigmafast.generate(model, _prompt(), T - 3, **kwargs), want), context
    assert sigmafast.Engine.for_model(model) is engine and len(engine._sessions) == 1


@pytest.mark.parametrize("strategy", ["burst", "autoregressive"])
def test_memory_a_kept_session_holds_is_not_asked_for_again(graph_engines, monkeypatch, strategy):
    """On CUDA the free memory read before a call (``torch.cuda.mem_get_info``) no longer holds what the engine's
    kept session took (its KV cache, its graphs' pool): a call that fitted once is not refused the second time for
    needing that memory again; a call of another batch bucket, on a new session, is still checked."""
    import sigmafast.memory

    monkeypatch.setattr(sigmafast.memory, "SAMPLING_CHECK_FLOOR", 0)
    free = [1 << 40]
    monkeypatch.setattr(sigmafast.memory, "available_bytes", lambda device: free[0])
    engine = sigmafast.Engine(_model())
    kwargs = dict(strategy=strategy, generator=torch.Generator().manual_seed(0))
    sigmafast.generate(engine, _prompt(), T - 3, **kwargs)
    free[0] = sigmafast.memory.CANVAS_BYTES * 2 * T  # a new canvas fits; the first call's session holds the rest
    sigmafast.generate(engine, _prompt(), T - 3, **kwargs)
    sigmafast.warmup(engine, 2, T, strategy=strategy)
    with pytest.raises(ValueError, match="reduce .*the batch"):
        sigmafast.generate(engine, _prompt(B=3), T - 3, **kwargs)  # batch bucket 4: a new session


def _dropout_model():
    torch.manual_seed(0)
    config = sigmafast.SigmaGPTConfig(vocab_size=VOCAB, block_size=T, n_layer=2, n_head=2, n_embd=16, dropout=0.5)
    model = sigmafast.SigmaGPT(config)
    with torch.no_grad():  # far from uniform conditionals, as tiny_model's: dropout changes the tokens
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.5)
    return model


@pytest.mark.parametrize("sample", [sigmafast.generate, naive.generate], ids=["generate", "naive"])
def test_sampling_turns_every_dropout_off_and_restores_each_modules_training_flag(sample):
    """Inside a training loop whose frozen parts are in eval mode, sampling leaves them in eval mode; an eval
    model with a submodule left in training samples without dropout (the tokens of the model all in eval)."""
    model = _dropout_model()
    kwargs = dict(generator=torch.Generator().manual_seed(0))
    want = naive.generate(copy.deepcopy(model).eval(), _prompt(), T - 3, **kwargs)
    for setup in (lambda: model.train().h[0].eval(),  # training, with a frozen block
                  lambda: model.eval().h[1].mlp.train()):  # an eval model with one submodule (its dropout) training
        setup()
        flags = [m.training for m in model.modules()]
        kwargs["generator"].manual_seed(0)
        assert torch.equal(sample(model, _prompt(), T - 3, **kwargs), want)
        assert [m.training for m in model.modules()] == flags


def test_a_model_moved_to_another_device_gets_an_engine_there(graph_engines):
    """An engine's sessions and graphs live on the device it was built for: ``generate(model)`` after
    ``model.to(device)`` takes a new engine, and an engine given explicitly refuses the moved model (on CUDA,
    a graph captured on another device than its work's holds none of it: its replays did nothing)."""
    model = _model()
    engine = sigmafast.Engine.for_model(model)
    assert sigmafast.Engine.for_model(model) is engine
    model.to("meta")
    moved = sigmafast.Engine.for_model(model)
    assert moved is not engine and moved.device == torch.device("meta") and sigmafast.Engine.for_model(model) is moved
    canvas = torch.zeros(2, T, dtype=torch.long, device="meta")
    with pytest.raises(ValueError, match="captures CUDA graphs on cpu, but its model is now on meta"):
        engine.start(canvas, torch.zeros_like(canvas, dtype=torch.bool))


def test_a_model_moved_off_the_gpu_drops_its_kept_engine(monkeypatch):
    """A model moved where graphs are not captured (the CPU, for a CUDA model) gets a fresh engine each call, and
    the engine kept from before goes at once, with its caches and graphs, not when the model does."""
    _keep_graphs(monkeypatch, on=lambda device: device.type == "cpu")  # "cpu" plays CUDA, "meta" the CPU
    model = _model()
    kept = weakref.ref(sigmafast.Engine.for_model(model))
    assert sigmafast.Engine.for_model(model) is kept()
    model.to("meta")
    assert not sigmafast.Engine.for_model(model).cuda_graphs
    gc.collect()
    assert kept() is None and runner.ENGINE_ATTR not in vars(model)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_model_on_another_gpu_than_the_current_one_samples_there():
    """Triton launches on the current device and a capture records on its stream: generate makes the model's
    GPU current, so a model on cuda:1 (cuda:0 current) samples what it samples on cuda:0, captured steps too."""
    torch.cuda.set_device(0)
    models = [tiny_model(VOCAB, T, seed=3, std=0.5, dtype=torch.float32).to(f"cuda:{i}") for i in (0, 1)]
    with sigmafast.kernels.use_backend("triton"):
        for seed in range(4):  # eager, captured, then replayed steps
            outs = [sigmafast.generate(m, torch.zeros(3, 0, dtype=torch.long, device=m.lm_head.weight.device), T,
                                       generator=torch.Generator().manual_seed(seed)).cpu() for m in models]
            assert torch.equal(outs[0], outs[1]), seed
    assert torch.cuda.current_device() == 0
