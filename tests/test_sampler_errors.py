"""sigmafast.generate on bad input, on models that give non-finite outputs, and on requests too large for memory:
a clear error, from the cached sampler and the naive reference alike."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from helpers import tiny_model

import sigmafast
import sigmafast.naive as naive

T = 8
VOCAB = 5


@pytest.fixture(scope="module")
def model():
    return tiny_model(VOCAB, T, seed=2, std=0.5)


BAD = [
    pytest.param(dict(idx=torch.full((1, 2), VOCAB)), ValueError, "vocab", id="token-out-of-vocab"),
    pytest.param(dict(idx=torch.full((1, 2), -1)), ValueError, "vocab", id="negative-token"),
    pytest.param(dict(max_new_tokens=T), ValueError, "block_size", id="too-long"),
    pytest.param(dict(idx=torch.zeros(1, T, dtype=torch.long), max_new_tokens=None,
                      known=torch.ones(1, T - 1, dtype=torch.bool)), ValueError, "shape", id="mask-shape"),
    pytest.param(dict(idx=torch.zeros(1, T, dtype=torch.long), max_new_tokens=None,
                      known=torch.ones(1, T, dtype=torch.long)), TypeError, "bool", id="mask-dtype"),
    pytest.param(dict(known=torch.ones(1, 2, dtype=torch.bool)), ValueError, "max_new_tokens", id="both-modes"),
    pytest.param(dict(max_new_tokens=None), ValueError, "max_new_tokens", id="no-length"),
    pytest.param(dict(max_new_tokens=-1), ValueError, "max_new_tokens", id="negative-length"),
    pytest.param(dict(idx=torch.zeros(1, 2)), TypeError, "integer", id="float-idx"),
    pytest.param(dict(idx=torch.zeros(2, dtype=torch.long)), ValueError, "shape", id="1d-idx"),
    pytest.param(dict(temperature=-0.5), ValueError, "temperature", id="negative-temperature"),
    pytest.param(dict(temperature=float("nan")), ValueError, "temperature", id="nan-temperature"),
    pytest.param(dict(temperature=1e-40), ValueError, "temperature", id="tiny-temperature"),
    pytest.param(dict(top_k=0), ValueError, "top_k", id="top-k-zero"),
    pytest.param(dict(num_orders=0), ValueError, "num_orders", id="no-orders"),
    pytest.param(dict(strategy="beam"), ValueError, "strategy", id="unknown-strategy"),
    pytest.param(dict(acceptance="greedy"), ValueError, "acceptance", id="unknown-acceptance"),
    pytest.param(dict(acceptance="lossless", num_orders=5), ValueError, "num_orders=1", id="lossless-many-orders"),
    pytest.param(dict(strategy="autoregressive", num_orders=5, acceptance="paper"), ValueError,
                 "apply to strategy='burst' only", id="autoregressive-with-orders"),
    pytest.param(dict(strategy="autoregressive", num_orders=3), ValueError, "apply to strategy='burst' only",
                 id="autoregressive-lossless-orders"),
    pytest.param(dict(strategy="autoregressive", order="spiral"), ValueError, "order", id="unknown-order"),
    pytest.param(dict(strategy="autoregressive", order=torch.zeros(1, 4, dtype=torch.long)), ValueError,
                 "permutation", id="order-not-a-permutation"),
    pytest.param(dict(strategy="autoregressive", order=np.arange(4)), TypeError,
                 r"order must be one of .* or a \(B, T\) integer torch.Tensor of permutations, got ndarray",
                 id="numpy-order"),
    pytest.param(dict(order="left-to-right"), ValueError, "autoregressive", id="burst-with-order"),
    pytest.param(dict(generator=0), TypeError, "generator", id="bad-generator"),
    pytest.param(dict(on_iteration="print"), TypeError, "on_iteration", id="on-iteration-not-callable"),
    pytest.param(dict(idx=torch.zeros(1, T, dtype=torch.long), max_new_tokens=None, known=np.ones((1, T), bool)),
                 TypeError, "known must be a bool torch.Tensor, got ndarray", id="numpy-mask"),
]


@pytest.mark.parametrize("kwargs,error,match", BAD)
@pytest.mark.parametrize("impl", ["cached", "naive"])
def test_bad_input_is_rejected(model, kwargs, error, match, impl):
    args = {"idx": torch.zeros(1, 2, dtype=torch.long), "max_new_tokens": 2, **kwargs}
    fn = sigmafast.generate if impl == "cached" else naive.generate
    with pytest.raises(error, match=match):
        fn(model, args.pop("idx"), **args)


@pytest.mark.parametrize("impl", ["cached", "naive"])
def test_a_model_of_mixed_dtypes_is_rejected(model, impl):
    """Half a cast (one block float32, the rest float64) is named, not a dtype error from a kernel or a matmul."""
    mixed = copy.deepcopy(model)
    mixed.h[0].float()
    fn = sigmafast.generate if impl == "cached" else naive.generate
    with pytest.raises(ValueError, match=r"model's floating-point parameters must share one dtype and device"):
        fn(mixed, torch.zeros(1, 0, dtype=torch.long), T)
    with pytest.raises(ValueError, match=r"model's floating-point parameters must share one dtype and device"):
        sigmafast.log_likelihood(mixed, torch.zeros(1, T, dtype=torch.long), "left-to-right")


@pytest.mark.parametrize("value", ["no", 1, None])
@pytest.mark.parametrize("impl", ["cached", "naive"])
def test_return_stats_must_be_a_bool(model, value, impl):
    fn = sigmafast.generate if impl == "cached" else naive.generate
    with pytest.raises(TypeError, match="return_stats must be a bool"):
        fn(model, torch.zeros(1, 0, dtype=torch.long), 2, return_stats=value)


def test_warmup_names_seq_len_when_it_exceeds_the_block_size(model):
    with pytest.raises(ValueError, match=rf"^seq_len {T + 1} exceeds the model's block_size {T}$"):
        sigmafast.warmup(model, 1, T + 1)


def test_bad_model_is_rejected():
    with pytest.raises(TypeError, match="model"):
        sigmafast.generate(torch.nn.Linear(2, 2), torch.zeros(1, 0, dtype=torch.long), 2)


@pytest.fixture(scope="module")
def nan_model():
    """A model whose first MLP weights are NaN: every output is NaN."""
    broken = tiny_model(VOCAB, T, seed=2, std=0.5)
    with torch.no_grad():
        broken.h[0].mlp.c_fc.weight.fill_(float("nan"))
    return broken


@pytest.mark.parametrize("strategy,acceptance,num_orders", [
    ("autoregressive", "lossless", 1), ("burst", "paper", 3), ("burst", "lossless", 1)])
@pytest.mark.parametrize("impl", ["cached", "naive"])
def test_non_finite_logits_raise(nan_model, strategy, acceptance, num_orders, impl):
    fn = sigmafast.generate if impl == "cached" else naive.generate
    with pytest.raises(ValueError, match="model gave non-finite"):
        fn(nan_model, torch.zeros(2, 0, dtype=torch.long), T, strategy=strategy, acceptance=acceptance,
           num_orders=num_orders, generator=torch.Generator().manual_seed(0))


def test_non_finite_density_and_likelihood_raise(nan_model):
    x = torch.zeros(2, T, dtype=torch.long)
    with pytest.raises(ValueError, match="model gave non-finite logits"):
        sigmafast.conditional_density(nan_model, x, torch.zeros(2, T, dtype=torch.bool))
    with pytest.raises(ValueError, match="model gave non-finite logits"):
        sigmafast.log_likelihood(nan_model, x, "left-to-right")


def test_burst_step_flags_non_finite_outputs(model, nan_model):
    """The flag rides on the status the loop reads anyway: 0 for a finite model, 1 otherwise."""
    from sigmafast import steps
    from sigmafast.engine import NeuralSession
    from sigmafast.request import draw_burst

    flags = []
    for m in (model, nan_model):
        session = NeuralSession(m, 2, T, "reference")
        session.prefill(torch.zeros(2, T, dtype=torch.long), torch.zeros(2, T, dtype=torch.bool))
        with torch.no_grad():
            _, _, status = steps.burst_step(session, draw_burst(torch.Generator().manual_seed(0), 2, 1, T, "cpu"),
                                            T, 1.0, None, "lossless")
        flags.append(int(status[2]))
    assert flags == [0, 1]


def test_the_non_finite_flag_is_sticky_within_a_call_and_cleared_by_the_next(model):
    """A burst step never zeroes the session's flag (the loop stops at the first status that reports it);
    loading the session for a call clears it, so a finite call after a broken one reports 0."""
    from sigmafast import steps
    from sigmafast.engine import NeuralSession
    from sigmafast.request import draw_burst

    session = NeuralSession(model, 2, T, "reference")
    empty = (torch.zeros(2, T, dtype=torch.long), torch.zeros(2, T, dtype=torch.bool))
    statuses = []
    for stale in (True, False):
        session.prefill(*empty)
        session.nonfinite.fill_(stale)  # as a broken step of this call would have left it
        with torch.no_grad():
            _, _, status = steps.burst_step(session, draw_burst(torch.Generator().manual_seed(0), 2, 1, T, "cpu"),
                                            T, 1.0, None, "lossless")
        statuses.append(int(status[2]))
    session.nonfinite.fill_(True)
    session.prefill(*empty)
    assert statuses == [1, 0] and not session.nonfinite


def test_too_many_orders_fail_before_allocating(model):
    """10**9 orders x 8 positions would need terabytes (float64 keys alone: 64 GB)."""
    with pytest.raises(ValueError, match=r"num_orders=1000000000 .* GiB .* reduce num_orders"):
        sigmafast.generate(model, torch.zeros(1, 0, dtype=torch.long), T, acceptance="paper", num_orders=10**9)


def test_orders_estimate_scales_with_num_orders_and_checks_the_available_memory(model):
    from sigmafast.memory import check_sampling_memory, sampling_peak_bytes

    cfg = model.config
    one, many = (sampling_peak_bytes(cfg, 4, o, T, 8) for o in (1, 10))
    per_order = 16 * 4 * T + 8 * 4 * T * cfg.n_embd * (2 * cfg.n_layer + 6)  # no logits per order on either path
    assert many - one == 9 * per_order
    blocks = 1000  # the reference path: four float32 blocks of logits in place of the whole draft's, and the scores
    scores = 2 * 8 * 4 * 10 * cfg.n_head * T * (2 * T + 1)
    reference = many - 4 * 4 * T * VOCAB + 16 * blocks + scores
    assert sampling_peak_bytes(cfg, 4, 10, T, 8, block_elements=blocks) == reference
    assert check_sampling_memory(cfg, 4, 10, T, torch.device("cpu"), 8, available=many) == many
    with pytest.raises(ValueError, match="num_orders=10 with 4 rows of 8 tokens"):
        check_sampling_memory(cfg, 4, 10, T, torch.device("cpu"), 8, available=many - 1)


def test_one_order_burst_memory_error_names_only_the_batch(model):
    """With one order (the lossless rule's only value) there is no num_orders to reduce: the error names the batch."""
    from sigmafast.memory import check_sampling_memory, sampling_peak_bytes

    need = sampling_peak_bytes(model.config, 4, 1, T, 8)
    with pytest.raises(ValueError, match=r"available: reduce the batch$"):
        check_sampling_memory(model.config, 4, 1, T, torch.device("cpu"), 8, available=need - 1)


def test_a_burst_whose_reference_attention_scores_do_not_fit_is_refused(monkeypatch):
    """On the reference path (the CPU's) the verifier attention's (B, O, H, R, L + R) scores and their softmax are
    the largest tensors of a long canvas (here 64 x 2 x 512 x 1025 float32, 0.5 GiB, where the rest is 80 MiB): a
    burst that cannot hold them is refused before it starts, not left to the allocator or the OOM killer."""
    from sigmafast.model_config import SigmaGPTConfig

    length, rows = 512, 64
    model = sigmafast.SigmaGPT(SigmaGPTConfig(vocab_size=VOCAB, block_size=length, n_layer=1, n_head=2, n_embd=16))
    scores = 2 * 4 * rows * 2 * length * (2 * length + 1)
    monkeypatch.setattr(sigmafast.memory, "available_bytes", lambda device: scores)
    with pytest.raises(ValueError, match=f"with {rows} rows of {length} tokens needs about .* reduce the batch$"):
        sigmafast.generate(model.eval(), torch.zeros(rows, 0, dtype=torch.long), length)
