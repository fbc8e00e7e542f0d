"""sigmafast.generate: exactness in law, properties and calling conventions (bad input: test_sampler_errors.py)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from helpers import P_FAIL, chi2_pvalue, chi2_sf, tiny_model

import sigmafast
import sigmafast.naive as naive
from sigmafast.orders import make_orders

T = 8
VOCAB = 5


@pytest.fixture(scope="module")
def model():
    return tiny_model(VOCAB, T, seed=2, std=0.5)


def test_chi2_sf_known_values():
    assert chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, abs=1e-9)
    assert chi2_sf(2.0, 2) == pytest.approx(math.exp(-1.0), abs=1e-12)


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.6], ids=["T0.7", "T1", "T1.6"])
def test_lossless_burst_has_the_random_order_autoregressive_law(temperature):
    """Vocab 3 (tokens 0, 1 and BOS = 2, all three may be sampled), T = 4: 81 outcomes.

    The exact law is the average over all 24 orders of exp(log_likelihood), at a temperature tau from a copy
    of the model whose final LayerNorm's weight and bias are divided by tau: the LM head has no bias, so its
    logits are divided by tau. A flattening tau exercises the tempered draft, acceptance and residual
    together. At tau = 1 the paper's rule (5 orders), which is not exact, must be told apart. The bursts must
    commit several tokens per iteration: a rule that rejects every draft (the residual then being q) has the
    right law, one token at a time.
    """
    T4, V3, N = 4, 3, 60000  # 60000: the bugs the mutation review tried fail at T0.7 too (p < 1e-9), not only 1e-4
    lossy = tiny_model(V3, T4, seed=3, std=0.8, dtype=torch.float32, n_embd=8)  # float32 sampling is faster
    exact = tiny_model(V3, T4, seed=3, std=0.8, dtype=torch.float64, n_embd=8)  # the same weights
    with torch.no_grad():
        exact.ln_f.weight /= temperature
        exact.ln_f.bias /= temperature
    seqs = torch.tensor(list(itertools.product(range(V3), repeat=T4)))  # (81, 4)
    law = torch.zeros(len(seqs), dtype=torch.float64)
    for perm in itertools.permutations(range(T4)):
        order = torch.tensor(perm).expand(len(seqs), T4)
        law += sigmafast.log_likelihood(exact, seqs, order).exp()
    law /= 24
    assert law.sum().item() == pytest.approx(1.0, abs=1e-9)

    def p_value(acceptance, num_orders):
        g = torch.Generator().manual_seed(7)
        x, stats = sigmafast.generate(lossy, torch.zeros(N, 0, dtype=torch.long), T4, acceptance=acceptance,
                                      num_orders=num_orders, generator=g, temperature=temperature, return_stats=True)
        assert stats.mean_iterations < 2  # about 1.2 to 1.3 here; T4 = 4 with no draft ever accepted
        code = (x * V3 ** torch.arange(T4 - 1, -1, -1)).sum(1)  # row index in seqs
        return chi2_pvalue(torch.bincount(code, minlength=len(seqs)), law)

    assert p_value("lossless", 1) > P_FAIL
    if temperature == 1.0:
        assert p_value("paper", 5) < P_FAIL  # the test tells an inexact law apart


@pytest.mark.parametrize("L", [T, T - 3], ids=["full", "shorter-than-the-block"])
def test_log_likelihood_is_the_sum_of_autoregressive_log_probs(model, L):
    """Step by step, each from a fresh forward of the visited prefix; a sequence shorter than the block keeps BOS at
    the model's start position (block_size), not at the sequence's length."""
    g = torch.Generator().manual_seed(0 if L == T else 4)
    x = torch.randint(0, VOCAB, (3, L), generator=g)
    order = torch.rand(3, L, generator=g).argsort(1)
    ll = sigmafast.log_likelihood(model, x, order)
    for b in range(3):
        queries = [(order[b, :t].tolist(), x[b, order[b, :t]].tolist(), int(order[b, t])) for t in range(L)]
        logp = torch.log_softmax(naive.naive_logits(model, queries, L), -1)
        expected = logp[torch.arange(L), x[b, order[b]]].sum()
        assert ll[b].item() == pytest.approx(expected.item(), abs=1e-10)
    l2r = sigmafast.log_likelihood(model, x, "left-to-right")
    assert torch.allclose(l2r, sigmafast.log_likelihood(model, x, torch.arange(L).expand(3, L)))


def test_log_likelihood_named_orders_are_their_order_tensors(model):
    """The names visit the positions of ``make_orders``: "fractal" is not scored left-to-right."""
    x = torch.randint(0, VOCAB, (3, T), generator=torch.Generator().manual_seed(5))
    got = {name: sigmafast.log_likelihood(model, x, name) for name in ("left-to-right", "fractal")}
    for name, ll in got.items():
        assert torch.allclose(ll, sigmafast.log_likelihood(model, x, make_orders(name, 3, T)), rtol=0, atol=1e-12)
    assert not torch.allclose(got["fractal"], got["left-to-right"], rtol=0, atol=1e-6)  # the orders differ


@pytest.mark.parametrize("dtype,atol", [(torch.float16, 5e-3), (torch.bfloat16, 5e-2)], ids=["fp16", "bf16"])
def test_conditional_density_of_a_16_bit_model_is_float32(dtype, atol):
    """The softmax runs in float32 at least: 16-bit probabilities would not sum to 1."""
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (2, T), generator=g)
    known = torch.rand(2, T, generator=g) < 0.5
    half = tiny_model(VOCAB, T, seed=2, std=0.5, dtype=dtype)
    dens = sigmafast.conditional_density(half, x, known)
    assert dens.dtype == torch.float32
    assert torch.allclose(dens.sum(-1), torch.ones(2, T), atol=1e-6)
    exact = sigmafast.conditional_density(tiny_model(VOCAB, T, seed=2, std=0.5), x, known)
    assert torch.allclose(dens.double(), exact, atol=atol)


def test_log_likelihood_of_the_empty_sequence_is_zero(model):
    empty = torch.zeros(2, 0, dtype=torch.long)
    assert torch.equal(sigmafast.log_likelihood(model, empty, "left-to-right"), torch.zeros(2))
    assert torch.equal(sigmafast.log_likelihood(model, empty, torch.zeros(2, 0, dtype=torch.long)), torch.zeros(2))


def test_density_and_likelihood_name_their_bad_arguments(model):
    x = torch.zeros(1, T, dtype=torch.long)
    with pytest.raises(TypeError, match="known must be a"):
        sigmafast.conditional_density(model, x, None)
    with pytest.raises(ValueError, match=rf"idx must hold token ids in \[0, vocab_size={VOCAB}\) where it is known "
                                         rf".*got {VOCAB}$"):
        sigmafast.log_likelihood(model, x + VOCAB, "left-to-right")
    with pytest.raises(TypeError, match="order must be an integer tensor"):
        sigmafast.log_likelihood(model, x, torch.zeros(1, T))
    assert sigmafast.log_likelihood(model, x, torch.arange(T, dtype=torch.int8)[None]).shape == (1,)


def test_conditional_density_is_one_burst_of_the_model(model):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (2, T), generator=g)
    known = torch.rand(2, T, generator=g) < 0.5
    known[1] = False
    dens = sigmafast.conditional_density(model, x, known)
    assert dens.shape == (2, T, VOCAB)
    assert torch.allclose(dens.sum(-1), torch.ones(2, T, dtype=dens.dtype))
    for b in range(2):
        hist = [j for j in range(T) if known[b, j]]  # fed in ascending position order
        probs = torch.softmax(naive.naive_logits(model, [(hist, x[b, hist].tolist(), j) for j in range(T)], T), -1)
        for j in range(T):
            if known[b, j]:
                assert dens[b, j].tolist() == torch.nn.functional.one_hot(x[b, j], VOCAB).double().tolist()
            else:
                assert torch.allclose(dens[b, j], probs[j], atol=1e-12)


@pytest.mark.parametrize("strategy,acceptance,num_orders", [
    ("autoregressive", "lossless", 1), ("burst", "paper", 5), ("burst", "lossless", 1)])
def test_infilling_keeps_known_tokens_and_fills_the_rest(model, strategy, acceptance, num_orders):
    g = torch.Generator().manual_seed(2)
    idx = torch.randint(0, VOCAB, (4, T), generator=g)
    known = torch.rand(4, T, generator=g) < torch.tensor([[0.0], [0.3], [0.7], [1.0]])
    idx_in = torch.where(known, idx, -1)  # unknown entries may hold anything
    float_model = tiny_model(VOCAB, T, seed=2, std=0.5, dtype=torch.float32)
    out, stats = sigmafast.generate(float_model, idx_in, known=known, strategy=strategy, acceptance=acceptance,
                                    num_orders=num_orders, generator=g, return_stats=True)
    assert out.shape == (4, T) and out.dtype == torch.long
    assert torch.equal(out[known], idx[known])
    assert ((out >= 0) & (out < VOCAB)).all()
    assert stats.iterations[3] == 0 and (stats.iterations[:3] > 0).all()
    assert (stats.accepted.sum(1) == (~known).sum(1)).all()


def test_prompt_and_unconditional_shapes(model):
    prompt = torch.randint(0, VOCAB, (2, 3), generator=torch.Generator().manual_seed(3))
    out = sigmafast.generate(model, prompt, 4, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 7) and torch.equal(out[:, :3], prompt)
    out = sigmafast.generate(model, torch.zeros(2, 0, dtype=torch.long), T, strategy="autoregressive")
    assert out.shape == (2, T)


def test_greedy_autoregressive_in_a_fixed_order_ignores_the_generator(model):
    outs = [
        sigmafast.generate(model, torch.zeros(3, 0, dtype=torch.long), T, temperature=0, strategy="autoregressive",
                           order=order, generator=torch.Generator().manual_seed(s))
        for order in ("left-to-right", "fractal") for s in (0, 1)
    ]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[2], outs[3])


@pytest.mark.parametrize("acceptance,num_orders", [("paper", 3), ("lossless", 1)])
def test_greedy_burst_is_reproducible(model, acceptance, num_orders):
    """Greedy token choices use no uniform; the random orders come from the generator, so a seed fixes the result
    (without a generator, from the global RNG state)."""
    outs = []
    for _ in range(2):
        torch.manual_seed(5)
        outs.append(sigmafast.generate(model, torch.zeros(3, 0, dtype=torch.long), T, temperature=0,
                                       acceptance=acceptance, num_orders=num_orders))
    assert torch.equal(outs[0], outs[1])


def test_on_iteration_sees_every_iteration(model):
    seen = []
    _, stats = sigmafast.generate(model, torch.zeros(2, 0, dtype=torch.long), T, return_stats=True,
                                  on_iteration=lambda canvas, known: seen.append(int(known.sum())),
                                  generator=torch.Generator().manual_seed(0))
    assert len(seen) == stats.accepted.shape[1] == int(stats.iterations.max())
    assert seen == sorted(seen) and seen[-1] == 2 * T


@pytest.mark.parametrize("sampler", [sigmafast.generate, naive.generate])
@pytest.mark.parametrize("strategy", ["burst", "autoregressive"])
def test_on_iteration_gets_snapshots_that_change_nothing(model, sampler, strategy):
    """The callback sees copies: frames kept without a clone stay distinct, and writing into them (masking a display
    in place) changes neither the samples nor the known tokens; rows finished early included (the exact-shape loop
    drops them from its working batch)."""
    canvas = torch.randint(0, VOCAB, (4, T), generator=torch.Generator().manual_seed(1))
    known = torch.zeros(4, T, dtype=torch.bool)
    known[:3, 1:] = True  # rows 0..2 finish at the first iteration, row 3 (all unknown) later
    kwargs = dict(known=known, strategy=strategy, temperature=3.0, generator=torch.Generator().manual_seed(0))
    expected, stats = sampler(model, canvas, return_stats=True, **kwargs)
    assert stats.accepted.shape[1] > 1  # row 3 outlives the others
    frames = []

    def scribble(c, k):
        frames.append((c, k))
        c.fill_(VOCAB - 1)
        k.fill_(False)

    kwargs["generator"] = torch.Generator().manual_seed(0)
    out = sampler(model, canvas, on_iteration=scribble, **kwargs)
    assert torch.equal(out, expected) and torch.equal(out[known], canvas[known])
    assert all(f[0] is not out and f[0] is not g[0] and f[1] is not g[1] for f, g in zip(frames, frames[1:]))


def test_model_training_flag_is_restored(model):
    model.train()
    sigmafast.generate(model, torch.zeros(1, 0, dtype=torch.long), T)
    assert model.training
    model.eval()


def test_numpy_integers_count_as_ints(model):
    """Sizes read from a NumPy array (``np.int64``) are ints to ``generate``, as to nanoGPT's."""
    idx = torch.tensor([[1, 2]])
    for kw in (dict(acceptance="paper", num_orders=3), dict(top_k=2), dict(strategy="autoregressive", top_k=3)):
        want = sigmafast.generate(model, idx, T - 2, generator=torch.Generator().manual_seed(3), **kw)
        as_numpy = {k: np.int64(v) if isinstance(v, int) else v for k, v in kw.items()}
        got = sigmafast.generate(model, idx, np.int64(T - 2), generator=torch.Generator().manual_seed(3), **as_numpy)
        assert torch.equal(got, want)
    with pytest.raises(TypeError, match="top_k must be an int, got bool"):
        sigmafast.generate(model, idx, T - 2, top_k=True)


@pytest.mark.parametrize("strategy", ["burst", "autoregressive"])
def test_autocast_around_the_call_changes_nothing(strategy):
    """nanoGPT's sample.py calls ``generate`` inside ``torch.autocast``: the model still runs in its own
    dtype (a float32 model here, the reference backend), so tokens and densities are those of the plain call."""
    model = tiny_model(dtype=torch.float32)
    idx, known = torch.tensor([[1, 2], [3, 0]]), torch.tensor([[True, False] * 4, [False, True] * 4])

    def calls():
        tokens = sigmafast.generate(model, idx, T - 2, temperature=0.8, top_k=3, strategy=strategy,
                                    generator=torch.Generator().manual_seed(7))
        canvas = torch.arange(2 * T).remainder(VOCAB - 1).view(2, T)
        return (tokens, sigmafast.conditional_density(model, canvas, known),
                sigmafast.log_likelihood(model, canvas, order="left-to-right"))

    with sigmafast.kernels.use_backend("reference"):
        want = calls()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = calls()
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)


def test_kv_cache_appends_ragged_rows_after_their_lengths():
    from sigmafast.cache import KVCache

    cache = KVCache(n_layer=2, batch_size=3, n_head=1, max_len=4, head_dim=2, dtype=torch.float64)
    new = torch.arange(2 * 3 * 1 * 3 * 2, dtype=torch.float64).view(2, 3, 1, 3, 2)  # (n_layer, B, H, R, D)
    cache.append(new, -new, torch.tensor([2, 0, 3]))
    cache.append(new + 100, -new, torch.tensor([1, 3, 1]))
    assert cache.lens.tolist() == [3, 3, 4]
    k, v = cache.layer(1)
    assert torch.equal(k[0, :, :3], torch.cat([new[1, 0, :, :2], new[1, 0, :, :1] + 100], 1))
    assert torch.equal(k[1, :, :3], new[1, 1] + 100)
    assert torch.equal(k[2, :, :4], torch.cat([new[1, 2], new[1, 2, :, :1] + 100], 1))
    assert torch.equal(v[2, :, :3], -new[1, 2])


SYNCS = ("__int__", "__bool__", "__float__", "__index__", "item", "tolist", "nonzero")


@pytest.mark.parametrize("strategy,acceptance,num_orders", [
    ("autoregressive", "lossless", 1), ("burst", "paper", 3), ("burst", "lossless", 1)])
@pytest.mark.parametrize("buckets", [False, True], ids=["exact", "bucketed"])
def test_sampling_loop_reads_the_device_once_per_iteration(model, monkeypatch, strategy, acceptance, num_orders,
                                                           buckets):
    """Host reads of tensor values (syncs on a GPU) in the loop: one per burst iteration (the remaining
    count and the non-finite flag), plus, for exact shapes, one before the first (bucketed: the largest count
    ``generate`` read before the prefill bounds the first launch); for autoregressive sampling, one after the
    loop (the non-finite flag), none per token nor before the loop (the step count is the largest unknown
    count ``generate`` read before the prefill)."""
    from sigmafast import sampler
    from sigmafast.request import prepare

    idx = torch.randint(0, VOCAB, (3, T), generator=torch.Generator().manual_seed(0))
    known = torch.rand(3, T, generator=torch.Generator().manual_seed(1)) < 0.3
    req = prepare(model, idx, known=known, strategy=strategy, num_orders=num_orders, acceptance=acceptance,
                  generator=torch.Generator().manual_seed(2))
    canvas, known_now = req.canvas.clone(), req.known.clone()
    runner = sigmafast.Engine(model, buckets=buckets)
    session = runner.start(canvas, known_now)
    max_left = int((~known_now).sum(1).max())
    reads = count_reads(monkeypatch)
    with torch.no_grad():
        if strategy == "autoregressive":
            accepted, _, _ = sampler._autoregressive(runner, session, req, canvas, known_now, None, n_steps=max_left)
        else:
            accepted, _, _ = sampler._burst(runner, session, req, canvas, known_now, None, max_left=max_left)
    monkeypatch.undo()
    expected = 1 if strategy == "autoregressive" else len(accepted) + (0 if buckets else 1)
    assert len(reads) == expected, reads
    assert known_now.all()


def count_reads(monkeypatch) -> list:
    reads = []
    for name in SYNCS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return reads


@pytest.mark.parametrize("buckets", [False, True], ids=["exact", "bucketed"])
def test_autoregressive_generate_reads_the_device_three_times(model, monkeypatch, buckets):
    """A whole autoregressive ``generate`` with a prompt: the token-range check of ``idx``, the fewest and
    most known counts (one read, also handed to the prefill, which so reads nothing), and the non-finite
    flag after the loop."""
    idx = torch.randint(0, VOCAB, (3, 4), generator=torch.Generator().manual_seed(0))
    engine = sigmafast.Engine(model, buckets=buckets)
    reads = count_reads(monkeypatch)
    sigmafast.generate(engine, idx, T - 4, strategy="autoregressive", generator=torch.Generator().manual_seed(1))
    monkeypatch.undo()
    assert reads == ["__bool__", "tolist", "__bool__"]


def test_generate_defaults_to_exact_sampling():
    import inspect

    for fn in (sigmafast.generate, naive.generate, sigmafast.warmup):
        params = inspect.signature(fn).parameters
        assert (params["acceptance"].default, params["num_orders"].default) == ("lossless", 1), fn


@pytest.mark.parametrize("sampler", [sigmafast.generate, naive.generate], ids=["cached", "naive"])
@pytest.mark.parametrize("order", ["fractal", "tensor"])
def test_autoregressive_visits_the_unknown_positions_in_the_given_order(model, sampler, order):
    """``order[b, s]`` is the position visited at step s (as in ``log_likelihood``), not the step of position s:
    both samplers share ``ar_rank``, so their token-for-token agreement cannot tell an order from its inverse.
    Each step must make the next unknown position of ``order[b]`` known (known ones skipped)."""
    B = 3
    if order == "tensor":
        orders = torch.stack([torch.randperm(T, generator=torch.Generator().manual_seed(20 + b)) for b in range(B)])
    else:
        orders = make_orders("fractal", B, T)
    inverse = torch.empty_like(orders).scatter_(1, orders, torch.arange(T).expand(B, T))
    assert not torch.equal(orders, inverse)  # an involution could not tell them apart
    known = torch.zeros(B, T, dtype=torch.bool)
    known[1, [0, 5]] = True
    idx = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(4))
    seen, before = [], known.clone()

    def record(canvas, now):
        seen.append([(now[b] & ~before[b]).nonzero().flatten().tolist() for b in range(B)])
        before.copy_(now)

    sampler(model, idx, known=known, strategy="autoregressive", order=orders if order == "tensor" else order,
            generator=torch.Generator().manual_seed(0), on_iteration=record)
    for b in range(B):
        want = [j for j in orders[b].tolist() if not known[b, j]]
        got = [step[b] for step in seen if step[b]]
        assert all(len(g) == 1 for g in got) and [g[0] for g in got] == want, (b, got, want)
