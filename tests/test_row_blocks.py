"""The reference path's vocabulary-wide ops by blocks of rows (``kernels.row_blocks``) against the references
in one call: the same values, whatever the block size, and through the dispatching functions."""

from __future__ import annotations

import pytest
import torch

from sigmafast import kernels
from sigmafast.kernels import reference as ref
from sigmafast.kernels import row_blocks

V = 37
SAMPLING = [(1.0, None), (0.7, 5), (0.0, None)]  # (temperature, top_k)


@pytest.fixture(params=[1, 3, 64], ids=lambda n: f"block{n}")
def block(request, monkeypatch):
    """Blocks of ``n`` rows of V float32 (or 16-bit) logits (n // 2 in float64)."""
    monkeypatch.setattr(row_blocks, "CPU_BLOCK_ELEMENTS", request.param * V)
    return request.param


def _logits(N, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, V, generator=g) * 3
    x[:, 5] = float("-inf")  # a token of probability 0
    return x.to(dtype), torch.rand(N, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("N", [0, 1, 7])
@pytest.mark.parametrize("temperature, top_k", SAMPLING)
def test_samples_by_blocks_are_the_reference_samples(block, N, dtype, temperature, top_k):
    x, u = _logits(N, dtype, seed=N)
    p, _ = _logits(N, dtype, seed=N + 100)
    assert row_blocks.block_rows(V, dtype, x.device) == max(1, block * 4 // max(dtype.itemsize, 4))
    assert row_blocks.block_rows(V, dtype, torch.device("cuda")) > 64  # larger blocks off the CPU
    tokens, logp = row_blocks.sample(x, u, temperature, top_k)
    want_tokens, want_logp = ref.sample(x, u, temperature, top_k)
    assert torch.equal(tokens, want_tokens) and torch.equal(logp, want_logp)
    assert torch.equal(row_blocks.residual_sample(x, p, u, temperature, top_k),
                       ref.residual_sample(x, p, u, temperature, top_k))


@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 3, 5), (3, 1, 4), (2, 2, 0)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("temperature, top_k", SAMPLING)
def test_draft_scores_by_blocks_are_the_reference_scores(block, shape, temperature, top_k):
    g = torch.Generator().manual_seed(sum(shape))
    logits = torch.randn(*shape, V, generator=g)
    drafts = torch.randint(-1, V + 1, shape, generator=g)  # out-of-vocabulary drafts score -inf
    want = ref.draft_scores(logits, drafts, temperature, top_k)
    assert torch.equal(row_blocks.draft_scores(logits, drafts, temperature, top_k), want)


@pytest.mark.parametrize("temperature, top_k", SAMPLING)
def test_scores_from_hidden_by_blocks_match_the_whole_logits(block, temperature, top_k):
    """The logits come from a block's matmul, which may round otherwise than the whole one: float64, and the
    scores compared to 1e-12 (greedy: the same argmax)."""
    g = torch.Generator().manual_seed(1)
    B, O, R, C, padded = 2, 3, 5, 8, V + 3  # rows past V are the head's alignment padding
    hidden = torch.randn(B, O, R, C, generator=g, dtype=torch.float64)
    weight = torch.randn(padded, C, generator=g, dtype=torch.float64)
    drafts = torch.randint(0, V, (B, O, R), generator=g)
    got = row_blocks.scores_from_hidden(hidden, weight, drafts, V, temperature, top_k)
    want = ref.draft_scores((hidden @ weight.T)[..., :V], drafts, temperature, top_k)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("N", [0, 1, 7])
@pytest.mark.parametrize("temperature, top_k", SAMPLING)
def test_samples_from_hidden_by_blocks_are_the_reference_samples(block, N, temperature, top_k):
    """float64: the same tokens as the whole logits' (a block's matmul may round otherwise than the whole one),
    log-probs to 1e-12; the head's padding rows past V are never drawn."""
    g = torch.Generator().manual_seed(N)
    C, padded = 8, V + 3
    hidden = torch.randn(N, C, generator=g, dtype=torch.float64)
    weight = torch.randn(padded, C, generator=g, dtype=torch.float64) * 2
    weight[V:] = 50.0  # padding rows: they would win every draw if they were read
    u = torch.rand(N, generator=g, dtype=torch.float64)
    tokens, logp = row_blocks.sample_from_hidden(hidden, weight, u, V, temperature, top_k)
    want_tokens, want_logp = ref.sample((hidden @ weight.T)[:, :V], u, temperature, top_k)
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logp, want_logp, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bad_row, used_row, flagged", [(None, None, False), (4, None, True), (4, True, True),
                                                        (4, False, False), (0, True, True)],
                         ids=["finite", "nan-every-row-used", "nan-used", "nan-unused", "nan-first-row"])
def test_samples_from_hidden_flag_used_rows_that_are_not_finite(block, bad_row, used_row, flagged):
    """The () flag is set when a used row's logits hold a NaN, whichever block that row falls in, and never
    cleared; the other rows' draws are unchanged."""
    g = torch.Generator().manual_seed(2)
    N, C = 7, 5
    hidden = torch.randn(N, C, generator=g, dtype=torch.float64)
    weight = torch.randn(V, C, generator=g, dtype=torch.float64)
    u = torch.rand(N, generator=g, dtype=torch.float64)
    want = ref.sample(hidden @ weight.T, u)
    if bad_row is not None:
        hidden[bad_row, 1] = float("nan")
    used = None
    if used_row is not None:
        used = torch.ones(N, dtype=torch.bool)
        used[bad_row] = used_row
    flag = torch.zeros((), dtype=torch.bool)
    tokens, _ = row_blocks.sample_from_hidden(hidden, weight, u, V, used=used, flag=flag)
    assert bool(flag) == flagged
    finite = torch.arange(N) != (-1 if bad_row is None else bad_row)
    assert torch.equal(tokens[finite], want[0][finite])
    flag.fill_(True)
    row_blocks.sample_from_hidden(hidden[finite], weight, u[finite], V, flag=flag)
    assert bool(flag)  # sticky


def test_the_reference_backend_runs_by_blocks(monkeypatch):
    """kernels.sample, residual_sample, acceptance, acceptance_from_hidden and sample_from_hidden on the
    reference backend go through row_blocks (one row per block here) and give the one-call references' results."""
    monkeypatch.setattr(row_blocks, "CPU_BLOCK_ELEMENTS", 1)
    calls = []
    for name in ("sample", "residual_sample", "draft_scores", "scores_from_hidden", "sample_from_hidden"):
        fn = getattr(row_blocks, name)
        monkeypatch.setattr(row_blocks, name, lambda *a, _fn=fn, _name=name, **k: calls.append(_name) or _fn(*a, **k))
    x, u = _logits(6, torch.float64, seed=3)
    p, _ = _logits(6, torch.float64, seed=4)
    assert all(torch.equal(a, b) for a, b in zip(kernels.sample(x, u, 0.8, backend="reference"), ref.sample(x, u, 0.8)))
    assert torch.equal(kernels.residual_sample(x, p, u, backend="reference"), ref.residual_sample(x, p, u))
    g = torch.Generator().manual_seed(5)
    B, O, R, C = 2, 3, 4, 6
    hidden = torch.randn(B, O, R, C, generator=g, dtype=torch.float64)
    weight = torch.randn(V, C, generator=g, dtype=torch.float64)
    drafts = torch.randint(0, V, (B, O, R), generator=g)
    logp, ua = torch.rand(B, O, R, generator=g, dtype=torch.float64).log(), torch.rand(B, O, R, generator=g)
    lens = torch.tensor([4, 2])
    want = ref.acceptance(hidden @ weight.T, drafts, logp, ua, lens, 0.9, None, "paper")
    for got in (kernels.acceptance(hidden @ weight.T, drafts, logp, ua, lens, 0.9, backend="reference"),
                kernels.acceptance_from_hidden(hidden, weight, drafts, logp, ua, lens, 0.9, backend="reference")):
        torch.testing.assert_close(got.logq, want.logq, rtol=1e-12, atol=1e-12)
        assert all(torch.equal(a, b) for a, b in zip(got[1:], want[1:]))
    flat = hidden.flatten(0, 2)
    tokens, logp = kernels.sample_from_hidden(flat, weight, ua.flatten().double(), 0.9, backend="reference")
    want_tokens, want_logp = ref.sample(flat @ weight.T, ua.flatten().double(), 0.9)
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logp, want_logp, rtol=1e-12, atol=1e-12)
    assert calls == ["sample", "residual_sample", "draft_scores", "scores_from_hidden", "sample_from_hidden"]


def test_a_burst_on_the_reference_path_never_writes_whole_logits(monkeypatch):
    """A network's burst iteration on the reference path (lossless: the residual too) creates no tensor of a
    whole (B, R, V) draft's or (B, O, R, V) verifier's logits: float64 blocks of 3 rows, and more rows per
    call. Counted: the rows of the tensors (not views) as wide as the vocabulary."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from helpers import tiny_model
    from sigmafast import steps
    from sigmafast.engine import NeuralSession
    from sigmafast.request import draw_burst

    B, T, vocab = 4, 16, 96  # widths of the model's other tensors: 16, 48 (QKV), 64 (MLP)
    monkeypatch.setattr(row_blocks, "CPU_BLOCK_ELEMENTS", 6 * vocab)  # float32 values: 3 float64 rows

    class Largest(TorchDispatchMode):
        rows = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and not func.is_view and t.ndim and t.shape[-1] == vocab:
                    Largest.rows = max(Largest.rows, t.numel() // vocab)
            return out

    model = tiny_model(vocab, T, seed=1, n_embd=16)
    for rule, orders in (("lossless", 1), ("paper", 3)):
        session = NeuralSession(model, B, T, "reference")
        session.prefill(torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T, dtype=torch.bool))
        Largest.rows = 0
        with torch.no_grad(), Largest():
            steps.burst_step(session, draw_burst(torch.Generator().manual_seed(0), B, orders, T, "cpu"), T, 1.0,
                             None, rule)
        assert Largest.rows == (3 if rule == "paper" else B)  # a block's logits, or the residual's B rows
