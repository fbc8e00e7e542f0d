"""Backend dispatch of sigmafast.kernels, and the sampler end to end on the Triton kernels."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import sigmafast
from sigmafast import SigmaGPT, SigmaGPTConfig, kernels
from sigmafast.kernels import reference as ref


def test_import_does_not_load_triton():
    code = "import sys, sigmafast.kernels; assert 'triton' not in sys.modules, 'triton imported eagerly'"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_backend_choice(monkeypatch):
    x = torch.zeros(2)
    assert kernels.backend_for(x) == "reference"  # conftest: SIGMAFAST_BACKEND=reference
    monkeypatch.setenv("SIGMAFAST_BACKEND", "auto")
    assert kernels.backend_for(x) == "triton"  # TRITON_INTERPRET=1
    assert kernels.backend_for(x.double()) == "reference"  # the kernels take no float64
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


def test_public_functions_dispatch_to_triton(monkeypatch):
    from sigmafast.kernels import sampling

    calls = []
    real = sampling.sample
    monkeypatch.setattr(sampling, "sample", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(0)
    logits, u = torch.randn(6, 11, generator=g), torch.rand(6, generator=g)
    with kernels.use_backend("triton"):
        tokens, logp = kernels.sample(logits, u, 0.9, 4)
    assert calls == [1]
    want, want_logp = ref.sample(logits, u, 0.9, 4)
    assert torch.equal(tokens, want)
    torch.testing.assert_close(logp, want_logp, rtol=0, atol=1e-5)
    q = torch.randn(1, 2, 3, 8, generator=g)  # (B, H, R, D), also used as a 3-long cache
    with kernels.use_backend("triton"):
        out = kernels.burst_attention(q, q, q, q, q, torch.tensor([2]))
    torch.testing.assert_close(out, ref.burst_attention(q, q, q, q, q, torch.tensor([2])))
    hidden, weight = torch.randn(1, 2, 3, 16, generator=g), torch.randn(9, 16, generator=g)
    args = (torch.zeros(1, 2, 3, dtype=torch.long), torch.full((1, 2, 3), -2.0), torch.rand(1, 2, 3, generator=g),
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
def test_generate_triton_matches_reference_backend(kwargs, monkeypatch):
    used = set()
    real = kernels._triton
    monkeypatch.setattr(kernels, "_triton", lambda module, fn: used.add(module) or real(module, fn))
    model = _tiny_fp32_model()
    idx = torch.tensor([[1, 2], [3, 0]])
    runs = {}
    for backend in ("reference", "triton"):
        with kernels.use_backend(backend):
            g = torch.Generator().manual_seed(123)
            runs[backend] = sigmafast.generate(model, idx, 6, generator=g, return_stats=True, **kwargs)
    (tok_r, stats_r), (tok_t, stats_t) = runs["reference"], runs["triton"]
    assert torch.equal(tok_t, tok_r)
    assert torch.equal(stats_t.iterations, stats_r.iterations)
    want = {"burst_attn", "verify_attn", "sampling", "accept"} if kwargs["strategy"] == "burst" else {"sampling"}
    assert want <= used, f"the Triton run used only {sorted(used)}"
