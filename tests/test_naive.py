"""The cached sampler returns the naive reference's tokens and statistics (float64)."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_model

import sigmafast
import sigmafast.naive as naive

T = 8
VOCAB = 5


@pytest.fixture(scope="module")
def model():
    return tiny_model(VOCAB, T, seed=1, std=0.5)


def _inputs(kind: str, batch: int):
    """(idx, kwargs) of one calling convention."""
    g = torch.Generator().manual_seed(11 + batch)
    if kind == "unconditional":
        return torch.zeros(batch, 0, dtype=torch.long), dict(max_new_tokens=T)
    if kind == "prompt":
        return torch.randint(0, VOCAB, (batch, 3), generator=g), dict(max_new_tokens=T - 3)
    known = torch.rand(batch, T, generator=g) < 0.4  # ragged: a different mask per row
    known[0, :] = False
    if batch > 1:
        known[1, :] = True  # a finished row from the start
    if batch > 2:
        known[2, :] = True
        known[2, 2] = False  # one unknown: finished after one step
    canvas = torch.randint(0, VOCAB, (batch, T), generator=g)
    return canvas, dict(known=known)


def _assert_same(model, idx, engine=None, **kwargs):
    """The cached sampler (through ``engine`` when given) and the naive one agree on everything."""
    outs, after = [], []
    for fn, target in ((sigmafast.generate, engine or model), (naive.generate, model)):
        g = torch.Generator().manual_seed(1234)
        outs.append(fn(target, idx, generator=g, return_stats=True, **kwargs))
        after.append(torch.rand(1, generator=g))
    (fast, s_fast), (slow, s_slow) = outs
    assert torch.equal(after[0], after[1])  # both consumed the same random stream
    assert torch.equal(fast, slow)
    assert torch.equal(s_fast.iterations, s_slow.iterations)
    assert torch.equal(s_fast.accepted, s_slow.accepted)
    assert s_fast.forward_calls == s_slow.forward_calls
    if s_slow.burst_lengths is None:
        assert s_fast.burst_lengths is None
    else:
        assert torch.equal(s_fast.burst_lengths, s_slow.burst_lengths)
    return fast, s_fast


ORDERS = ["random", "left-to-right", "fractal", "tensor"]
KINDS = ["unconditional", "prompt", "infill"]


@pytest.fixture(params=["exact", "bucketed"])
def engine(request, model):
    """The CPU default (exact shapes, finished rows dropped) and the GPU default (batch padded to a
    power of two, R to a bucket, finished rows masked)."""
    return sigmafast.Engine(model, buckets=request.param == "bucketed")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("order", ORDERS)
def test_autoregressive_matches_naive(model, engine, order, kind, batch=3):
    idx, kwargs = _inputs(kind, batch)
    if order == "tensor":
        order = torch.rand(batch, T, generator=torch.Generator().manual_seed(5)).argsort(1)
    _, stats = _assert_same(model, idx, engine, strategy="autoregressive", order=order, **kwargs)
    assert stats.burst_lengths is None


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("temperature,top_k", [(1.3, 3), (0.6, None), (1.0, 1), (0.0, None)],
                         ids=["t1.3-top3", "t0.6", "top1", "greedy"])
def test_tempered_top_k_autoregressive_matches_naive(model, engine, temperature, top_k, kind, batch=3):
    """The autoregressive step applies the temperature and top-k as the naive sampler does, token for token."""
    idx, kwargs = _inputs(kind, batch)
    _assert_same(model, idx, engine, strategy="autoregressive", temperature=temperature, top_k=top_k, **kwargs)


SETTINGS = [
    pytest.param("paper", 1, 1.0, None, id="paper-O1"),
    pytest.param("paper", 3, 1.0, None, id="paper-O3"),
    pytest.param("paper", 3, 0.0, None, id="paper-O3-greedy"),
    pytest.param("paper", 3, 0.8, 2, id="paper-O3-t0.8-top2"),
    pytest.param("lossless", 1, 1.0, None, id="lossless"),
    pytest.param("lossless", 1, 0.0, None, id="lossless-greedy"),
    pytest.param("lossless", 1, 1.3, 3, id="lossless-t1.3-top3"),
    pytest.param("lossless", 1, 0.7, 2, id="lossless-t0.7-top2"),  # top-2 of 5: the residual's truncation shows
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("acceptance,num_orders,temperature,top_k", SETTINGS)
def test_burst_matches_naive(model, engine, acceptance, num_orders, temperature, top_k, kind, batch=3):
    idx, kwargs = _inputs(kind, batch)
    _assert_same(model, idx, engine, acceptance=acceptance, num_orders=num_orders, temperature=temperature,
                 top_k=top_k, **kwargs)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("strategy,acceptance,num_orders", [
    pytest.param("autoregressive", "lossless", 1, id="autoregressive"),
    pytest.param("burst", "paper", 3, id="paper-O3"),
    pytest.param("burst", "lossless", 1, id="lossless"),
])
def test_batch_of_one_matches_naive(model, engine, strategy, acceptance, num_orders, kind):
    idx, kwargs = _inputs(kind, 1)
    _assert_same(model, idx, engine, strategy=strategy, acceptance=acceptance, num_orders=num_orders, **kwargs)


def test_burst_takes_several_iterations_with_ragged_counts(model):
    """The equality tests above are not trivial: this model needs several bursts, of varying sizes."""
    _, stats = _assert_same(model, torch.zeros(6, 0, dtype=torch.long), max_new_tokens=T,
                             acceptance="paper", num_orders=3)
    assert int(stats.iterations.max()) > 1
    assert len(set(stats.accepted[:, 0].tolist())) > 1


def test_all_known_canvas_matches_naive(model):
    idx = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(0))
    known = torch.ones(2, T, dtype=torch.bool)
    for strategy in ("burst", "autoregressive"):
        out, stats = _assert_same(model, idx, known=known, strategy=strategy)
        assert torch.equal(out, idx)
        assert stats.iterations.tolist() == [0, 0] and stats.forward_calls == 0


@pytest.mark.parametrize("strategy,acceptance,num_orders", [
    pytest.param("autoregressive", "lossless", 1, id="autoregressive"),
    pytest.param("burst", "paper", 3, id="paper-O3"),
    pytest.param("burst", "lossless", 1, id="lossless"),
])
def test_oracle_sampling_matches_naive(strategy, acceptance, num_orders):
    from sigmafast.tasks import get_task

    task = get_task("step", seq_len=12, run_length=4)
    data = task.sample_batch(3, generator=torch.Generator().manual_seed(0))
    known = (torch.arange(12) < 3).expand(3, 12)  # an expanded mask, as the trainer passes it
    out, _ = _assert_same(task.oracle(), data, known=known, strategy=strategy, acceptance=acceptance,
                          num_orders=num_orders)
    assert task.evaluate(out)["valid"] == 1.0


@pytest.mark.parametrize("length", [1, 2], ids=["T1", "T2"])
@pytest.mark.parametrize("strategy,acceptance,num_orders,top_k", [
    pytest.param("autoregressive", "lossless", 1, None, id="autoregressive"),
    pytest.param("burst", "paper", 3, 1, id="paper-O3-top1"),
    pytest.param("burst", "lossless", 1, None, id="lossless"),
])
def test_tiny_canvases_match_naive(model, strategy, acceptance, num_orders, top_k, length):
    out, stats = _assert_same(model, torch.zeros(2, 0, dtype=torch.long), max_new_tokens=length, strategy=strategy,
                              acceptance=acceptance, num_orders=num_orders, top_k=top_k)
    assert out.shape == (2, length)
    assert (stats.accepted.sum(1) == length).all()


@pytest.mark.parametrize("acceptance,num_orders", [("paper", 3), ("lossless", 1)])
def test_dropping_finished_rows_matches_naive(model, monkeypatch, acceptance, num_orders):
    """Rows with one unknown finish at the first iteration; the cached sampler then drops them."""
    from sigmafast.engine import NeuralSession

    selected = []
    original = NeuralSession.select
    monkeypatch.setattr(NeuralSession, "select", lambda self, rows: (selected.append(rows.tolist()),
                                                                     original(self, rows)))
    known = torch.ones(6, T, dtype=torch.bool)
    known[:, 0] = False
    known[[1, 4]] = False
    idx = torch.randint(0, VOCAB, (6, T), generator=torch.Generator().manual_seed(3))
    _, stats = _assert_same(model, idx, known=known, acceptance=acceptance, num_orders=num_orders)
    assert selected and selected[0] == [1, 4]
    assert stats.iterations.tolist()[0] == 1 and stats.iterations[1] > 1


@pytest.mark.parametrize("strategy,acceptance,num_orders", [
    pytest.param("autoregressive", "lossless", 1, id="autoregressive"),
    pytest.param("burst", "paper", 2, id="paper-O2"),
    pytest.param("burst", "lossless", 1, id="lossless"),
])
def test_every_bucket_matches_naive(strategy, acceptance, num_orders):
    """T = 40: remaining counts run through the buckets 40 (the cap), 32 and 16, and a batch of 5 is
    padded to 8 rows; the tokens and statistics stay the naive reference's."""
    from sigmafast import steps

    length = 40
    model = tiny_model(VOCAB, length, seed=4, std=0.5, n_embd=16)
    used = []
    real = steps.burst_step
    known = torch.rand(5, length, generator=torch.Generator().manual_seed(8)) < 0.2
    known[0] = False
    idx = torch.randint(0, VOCAB, (5, length), generator=torch.Generator().manual_seed(9))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(steps, "burst_step", lambda session, d, R, *a: used.append((session.batch_size, R))
                   or real(session, d, R, *a))
        engine = sigmafast.Engine(model, buckets=True)  # takes the step functions when built
        _assert_same(model, idx, engine, known=known, strategy=strategy, acceptance=acceptance,
                     num_orders=num_orders)
    if strategy == "burst":
        assert {b for b, _ in used} == {8}
        assert {R for _, R in used} >= {40, 16}, used


@pytest.mark.parametrize("pos_encoding", ["rope", "rope+sinusoidal", "rope-v", "rope-v+learned"])
@pytest.mark.parametrize("kind", ["prompt", "infill"])
@pytest.mark.parametrize("strategy,acceptance,num_orders", [
    pytest.param("autoregressive", "lossless", 1, id="autoregressive"),
    pytest.param("burst", "paper", 3, id="paper-O3"),
    pytest.param("burst", "lossless", 1, id="lossless"),
])
@pytest.mark.parametrize("buckets", [False, True], ids=["exact", "bucketed"])
def test_rotary_models_match_naive(pos_encoding, kind, strategy, acceptance, num_orders, buckets):
    """Rotated keys (and values) in the cache, the draft's per-position query rotation (and output
    rotation back) and the multi-order verification reproduce the full forward of the naive sampler."""
    rope_model = tiny_model(VOCAB, T, seed=5, std=0.5, pos_encoding=pos_encoding)
    idx, kwargs = _inputs(kind, 3)
    engine = sigmafast.Engine(rope_model, buckets=buckets)
    _assert_same(rope_model, idx, engine, strategy=strategy, acceptance=acceptance, num_orders=num_orders, **kwargs)


@pytest.mark.parametrize("pos_encoding", ["rope", "sinusoidal"])
@pytest.mark.parametrize("strategy,acceptance,num_orders", [
    pytest.param("autoregressive", "lossless", 1, id="autoregressive"),
    pytest.param("burst", "paper", 3, id="paper-O3"),
    pytest.param("burst", "lossless", 1, id="lossless"),
])
def test_attention_only_models_match_naive(pos_encoding, strategy, acceptance, num_orders):
    """Blocks without an MLP (``mlp_ratio=0``) and a scalar final-norm gain, the permutation recipe's
    architecture: the cached sampler still reproduces the naive one token for token."""
    model = tiny_model(VOCAB, T, seed=6, std=0.5, pos_encoding=pos_encoding, mlp_ratio=0, final_norm="scalar")
    idx, kwargs = _inputs("infill", 3)
    engine = sigmafast.Engine(model, buckets=True)
    _assert_same(model, idx, engine, strategy=strategy, acceptance=acceptance, num_orders=num_orders, **kwargs)
