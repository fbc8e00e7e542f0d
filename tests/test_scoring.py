"""``Engine(scoring="auto")`` (sigmafast/scoring.py): each burst shape's scoring chosen once by timing both.

On the CPU the timer is a stand-in that runs both candidates and reports given times; the GPU's own timer
(``gpu_times``) is checked on CUDA only.
"""

from __future__ import annotations

import pytest
import torch

import sigmafast
from helpers import count_variants, tiny_model, triton_device
from sigmafast import kernels, scoring

DEVICE = triton_device()
SCORED_BY = {"fused": "_lm_head_stream_kernel", "matmul": "_logq_finish_kernel"}  # a kernel of each scoring alone


class FakeTimer:
    """Runs every candidate once, as the GPU timer does, and reports ``times`` (ms) for them (None: cannot time)."""

    def __init__(self, times):
        self.times = times
        self.asked = 0

    def __call__(self, calls, device):
        self.asked += 1
        assert set(calls) == set(kernels.checks.SCORINGS) and device.type == torch.device(DEVICE).type
        if self.times is None:  # as gpu_times off CUDA: nothing runs
            return None
        for call in calls.values():
            call()
        return dict(self.times)


def _generate(engine, seed=5):
    idx = torch.randint(0, 7, (2, 3), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    return sigmafast.generate(engine, idx, 8, num_orders=3, acceptance="paper",
                              generator=torch.Generator(DEVICE).manual_seed(seed))


@pytest.fixture
def model():
    return tiny_model(vocab_size=7, block_size=12, seed=1, std=0.5, dtype=torch.float32).to(DEVICE)


@pytest.mark.parametrize("times,want", [
    ({"matmul": 1.0, "fused": 0.5}, "fused"),
    ({"matmul": 1.0, "fused": 0.95}, "matmul"),  # faster, but within the margin: the default stays
    ({"matmul": 0.5, "fused": 1.0}, "matmul"),
], ids=["fused-faster", "within-margin", "matmul-faster"])
def test_auto_scoring_times_each_burst_shape_once_and_keeps_the_faster(model, monkeypatch, times, want):
    """Every burst shape is timed once (the same shapes again ask nothing); the chosen scoring's kernels run and
    the tokens are those of an engine fixed to it (the timing runs leave no trace). Replaced weights are timed
    again."""
    timer = FakeTimer(times)
    monkeypatch.setattr(scoring, "gpu_times", timer)
    with kernels.use_backend("triton"):
        want_tokens = _generate(sigmafast.Engine(model, scoring=want))
        engine = sigmafast.Engine(model, scoring="auto")
        with count_variants() as v:
            got = _generate(engine)
        assert torch.equal(got, want_tokens)
        chosen = engine.scoring_choices
        assert chosen and set(chosen.values()) == {want} and timer.asked == len(chosen)
        assert set(SCORED_BY.values()) <= set(v.counts())  # the timing ran both
        with count_variants() as v:
            assert torch.equal(_generate(engine), want_tokens)
        assert timer.asked == len(chosen) and engine.scoring_choices == chosen
        assert {name for name, kernel in SCORED_BY.items() if kernel in v.counts()} == {want}
        model.lm_head.weight.data = model.lm_head.weight.data.clone()  # new weights: new timings
        _generate(engine)
    assert timer.asked == 2 * len(chosen)


def test_auto_scoring_takes_the_default_where_nothing_can_be_timed(model, monkeypatch):
    """Where the timer cannot time (``gpu_times`` off CUDA) the default scoring runs and nothing is stored,
    so a later run asks again; the reference backend never asks. A bad ``scoring`` is refused."""
    ran = []
    assert scoring.gpu_times({"a": lambda: ran.append(1)}, torch.device("cpu")) is None and not ran
    timer = FakeTimer(None)
    monkeypatch.setattr(scoring, "gpu_times", timer)
    with kernels.use_backend("triton"):
        want = _generate(sigmafast.Engine(model))
        engine = sigmafast.Engine(model, scoring="auto")
        with count_variants() as v:
            assert torch.equal(_generate(engine), want)
        assert SCORED_BY["fused"] not in v.counts() and engine.scoring_choices == {}
        asked = timer.asked
        assert asked >= 1
        _generate(engine)
        assert timer.asked == 2 * asked
    with kernels.use_backend("reference"):
        _generate(sigmafast.Engine(model, scoring="auto"))
    assert timer.asked == 2 * asked
    assert sigmafast.Engine(model, scoring="matmul").scoring_choices == {}
    with pytest.raises(ValueError, match="scoring must be None or one of .*'auto'"):
        sigmafast.Engine(model, scoring="fastest")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_times_orders_calls_by_their_work_and_auto_keeps_the_tokens():
    """On CUDA, ``gpu_times`` times a call doing 16x the work of another as slower; an auto engine samples the
    tokens of an engine fixed to the scoring it chose, in eager runs and replayed graphs."""
    a = torch.randn(2048, 2048, device="cuda")
    times = scoring.gpu_times({"small": lambda: a[:512] @ a[:512].T, "large": lambda: a @ a.T}, torch.device("cuda"))
    assert 0 < times["small"] < times["large"]
    model = tiny_model(vocab_size=7, block_size=12, seed=1, std=0.5, dtype=torch.float32).cuda()
    with kernels.use_backend("triton"):
        engine = sigmafast.Engine(model, scoring="auto")
        got = [_generate(engine, seed) for seed in range(3)]  # eager, captured, replayed
        chosen = set(engine.scoring_choices.values())
        assert len(chosen) == 1
        fixed = sigmafast.Engine(model, scoring=chosen.pop())
        for seed, tokens in enumerate(got):
            assert torch.equal(tokens, _generate(fixed, seed))
