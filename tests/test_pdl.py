"""Programmatic dependent launch (``Engine(pdl=True)``, ``kernels.use_pdl``): when the launches ask for it, and
that it keeps the tokens on a GPU that has it."""

from __future__ import annotations


import pytest
import torch
from helpers import tiny_model

import sigmafast
from sigmafast import kernels
from sigmafast.kernels import support
from sigmafast.kernels import utils as kernel_utils

T = 8
VOCAB = 5


@pytest.fixture(scope="module")
def model():
    return tiny_model(VOCAB, T, seed=3, std=0.5, dtype=torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a CUDA GPU of compute capability 9 or more")
@pytest.mark.parametrize("strategy,acceptance,num_orders,top_k", [
    ("burst", "paper", 3, None), ("burst", "lossless", 1, 2), ("autoregressive", "lossless", 1, None)])
def test_programmatic_dependent_launch_keeps_the_tokens(strategy, acceptance, num_orders, top_k):
    """With ``Engine(pdl=True)`` every Triton kernel may start before the one before it ends and waits for it in
    ``gdc_enter``: replayed graphs and eager runs give the tokens of plain launches."""
    model = tiny_model(VOCAB, 40, seed=3, std=0.5, dtype=torch.float32).cuda()
    kwargs = dict(strategy=strategy, acceptance=acceptance, num_orders=num_orders, top_k=top_k, return_stats=True)
    with kernels.use_backend("triton"):
        plain = [sigmafast.generate(sigmafast.Engine(model, buckets=True, cuda_graphs=False), idx, 35,
                                    generator=torch.Generator("cuda").manual_seed(seed), **kwargs)
                 for seed, idx in _prompts(4)]
        with kernels.use_pdl(True):
            assert kernel_utils.pdl_meta(torch.device("cuda")) == dict(USE_GDC=True, launch_pdl=True)
        for engine in (sigmafast.Engine(model, buckets=True, cuda_graphs=False, pdl=True),
                       sigmafast.Engine(model, pdl=True)):
            for (want, s_want), (seed, idx) in zip(plain, _prompts(4)):  # the graphs: captured, then replayed
                got, s_got = sigmafast.generate(engine, idx, 35, generator=torch.Generator("cuda").manual_seed(seed),
                                                **kwargs)
                assert torch.equal(got, want)
                assert torch.equal(s_got.accepted, s_want.accepted)


def _prompts(n: int):
    return [(seed, torch.randint(0, VOCAB, (3, 5), device="cuda", generator=torch.Generator("cuda").manual_seed(seed)))
            for seed in range(n)]


def test_pdl_is_off_in_the_interpreter_and_before_sm90(monkeypatch):
    """``utils.pdl_meta``: plain launches unless inside ``kernels.use_pdl(True)`` on a CUDA GPU of compute
    capability 9 or more (the PTX ``griddepcontrol`` instructions need sm_90), with triton >= 3.5."""
    pdl = support.triton_has_pdl()
    with kernels.use_pdl(True):
        assert kernel_utils.pdl_meta(torch.device("cpu")) == dict(USE_GDC=False)
        for major, on in ((8, False), (9, pdl), (10, pdl)):
            monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, major=major: (major, 0))
            want = dict(USE_GDC=True, launch_pdl=True) if on else dict(USE_GDC=False)
            assert kernel_utils.pdl_meta(torch.device("cuda", 0)) == want
        with kernels.use_pdl(False):
            assert kernel_utils.pdl_meta(torch.device("cuda", 0)) == dict(USE_GDC=False)
    assert kernel_utils.pdl_meta(torch.device("cuda", 0)) == dict(USE_GDC=False)
    with pytest.raises(TypeError, match=r"use_pdl\(on\) takes a bool, got int"):
        with kernels.use_pdl(1):
            pass


def test_engine_launches_its_steps_with_its_own_pdl_setting(model, monkeypatch):
    """``Engine(pdl=...)`` launches every kernel of its prefill, burst and autoregressive steps inside
    ``use_pdl`` of its own setting, whatever the caller's; ``pdl=True`` needs a GPU that has it."""
    with pytest.raises(ValueError, match="pdl=True needs a model on a CUDA GPU of compute capability 9"):
        sigmafast.Engine(model, pdl=True)
    with pytest.raises(TypeError, match="pdl must be a bool, got int"):
        sigmafast.Engine(model, pdl=1)
    asked = []  # pdl_enabled() at every launch's pdl_meta
    monkeypatch.setattr(kernel_utils, "pdl_enabled", lambda: asked.append(kernels.pdl_enabled()) or asked[-1])
    monkeypatch.setattr(kernels, "pdl_supported", lambda device: True)
    idx = torch.randint(0, VOCAB, (2, 2), generator=torch.Generator().manual_seed(0))
    with kernels.use_backend("triton"):
        for pdl in (True, False):
            asked.clear()
            engine = sigmafast.Engine(model, pdl=pdl)
            with kernels.use_pdl(not pdl):
                for strategy, rule in (("burst", dict(acceptance="paper", num_orders=2)), ("autoregressive", {})):
                    sigmafast.generate(engine, idx, 6, strategy=strategy, generator=torch.Generator().manual_seed(1),
                                       **rule)
            assert len(asked) > 20 and set(asked) == {pdl}
    assert not kernels.pdl_enabled()
