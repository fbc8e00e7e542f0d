"""Exact task oracles: their conditionals against enumeration, and the burst sampler against theory."""

from __future__ import annotations

import itertools

import pytest
import torch

import sigmafast
from sigmafast.tasks import get_task
from sigmafast.tasks.oracles import make_oracle


def _all_sequences(task) -> torch.Tensor:
    """(N, T) every sequence of a small task, each equally likely (product: weighted separately)."""
    T = task.seq_len
    if task.name == "step":
        return torch.stack([torch.tensor([int(s <= j < s + task.run_length) for j in range(T)])
                            for s in range(T - task.run_length + 1)])
    if task.name == "permutation":
        return torch.tensor(list(itertools.permutations(range(T))))
    return torch.tensor(list(itertools.product(range(2), repeat=T)))


def _enumerated(task, seqs, canvas_row, known_row, j) -> torch.Tensor:
    """(V,) exact p(x_j | revealed) by enumeration; None when no sequence is consistent."""
    weights = torch.ones(len(seqs), dtype=torch.float64)
    if task.name == "product":
        weights = torch.where(seqs == 1, task.p_one, 1 - task.p_one).double().prod(1)
    match = (seqs[:, known_row] == canvas_row[known_row]).all(1)
    p = torch.zeros(task.vocab_size, dtype=torch.float64)
    p.index_add_(0, seqs[match, j], weights[match])
    return p / p.sum() if p.sum() > 0 else None


SMALL = [("product", dict(seq_len=5)), ("step", dict(seq_len=7, run_length=3)), ("permutation", dict(seq_len=5))]


@pytest.mark.parametrize("name,kwargs", SMALL, ids=[s[0] for s in SMALL])
def test_oracle_conditionals_match_enumeration(name, kwargs):
    task = get_task(name, **kwargs)
    oracle = make_oracle(task)
    seqs = _all_sequences(task)
    T, B, O = task.seq_len, 6, 2
    g = torch.Generator().manual_seed(0)
    canvas = seqs[torch.randint(len(seqs), (B,), generator=g)]
    canvas[-1] = torch.randint(0, task.vocab_size - 1, (T,), generator=g)  # possibly inconsistent
    known = torch.rand(B, T, generator=g) < torch.linspace(0, 0.9, B)[:, None]
    positions = torch.arange(T).expand(B, T)
    session = oracle.prefill(canvas, known)
    draft = session.draft(positions).exp()
    orders = torch.rand(B, O, T, generator=g).argsort(-1)
    drafts = torch.randint(0, task.vocab_size - 1, (B, O, T), generator=g)
    verify = session.verify(orders, drafts).logits.exp()
    dens = sigmafast.conditional_density(oracle, canvas, known)
    checked = 0
    for b in range(B):
        for j in range(T):
            if not known[b, j]:  # the sampler only queries unknown positions
                expected = _enumerated(task, seqs, canvas[b], known[b], j)
                if expected is not None:
                    assert torch.allclose(draft[b, j], expected, atol=1e-12)
                    assert torch.allclose(dens[b, j], expected, atol=1e-12)
        for o in range(O):
            for k in range(T):
                c, kn = canvas[b].clone(), known[b].clone()
                c[orders[b, o, :k]] = drafts[b, o, :k]
                kn[orders[b, o, :k]] = True
                if known[b, orders[b, o, : k + 1]].any():
                    continue  # orders only visit unknown positions
                expected = _enumerated(task, seqs, c, kn, int(orders[b, o, k]))
                if expected is not None:
                    checked += 1
                    assert torch.allclose(verify[b, o, k], expected, atol=1e-12)
    assert checked >= B  # many verification steps are compared, not only trivial ones
    # Impossible revealed sets (duplicate classes, two runs, ...) still get proper distributions.
    for p in (draft, verify, dens):
        assert torch.allclose(p.sum(-1), torch.ones(p.shape[:-1], dtype=p.dtype))


def _mean_iterations(task, acceptance, num_orders, n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, stats = sigmafast.generate(task.oracle(), torch.zeros(n, 0, dtype=torch.long), task.seq_len,
                                  acceptance=acceptance, num_orders=num_orders, generator=g, return_stats=True)
    return x, stats.mean_iterations


THEORY = [
    pytest.param("product", {}, "paper", 5, 1.0, id="product-paper"),
    pytest.param("product", {}, "lossless", 1, 1.0, id="product-lossless"),
    pytest.param("step", {}, "paper", 5, 3.5, id="step-paper"),
    pytest.param("step", {}, "lossless", 1, 3.6, id="step-lossless"),
    pytest.param("permutation", dict(seq_len=100), "paper", 5, 10.5, id="permutation-paper"),
    pytest.param("permutation", dict(seq_len=100), "lossless", 1, 13.5, id="permutation-lossless"),
]


@pytest.mark.parametrize("name,kwargs,acceptance,num_orders,bound", THEORY)
def test_burst_iterations_match_theory(name, kwargs, acceptance, num_orders, bound):
    task = get_task(name, **kwargs)
    x, mean_iters = _mean_iterations(task, acceptance, num_orders)
    print(f"\n{name} T={task.seq_len} {acceptance} orders={num_orders}: mean iterations {mean_iters:.3f} "
          f"(bound {bound})")
    if name == "product":
        assert mean_iters == 1.0
        assert ((x == 0) | (x == 1)).all()
    else:
        assert mean_iters <= bound
        assert mean_iters > 1.0
        assert task.evaluate(x)["valid"] == 1.0


@pytest.mark.parametrize("name,kwargs", [("step", {}), ("permutation", dict(seq_len=30))])
def test_oracle_autoregressive_and_infilling_samples_are_valid(name, kwargs):
    task = get_task(name, **kwargs)
    g = torch.Generator().manual_seed(1)
    x = sigmafast.generate(task.oracle(), torch.zeros(16, 0, dtype=torch.long), task.seq_len,
                           strategy="autoregressive", generator=g)
    assert task.evaluate(x)["valid"] == 1.0
    data = task.sample_batch(16, generator=g)
    known = torch.rand(data.shape, generator=g) < 0.3
    for strategy in ("autoregressive", "burst"):
        y = sigmafast.generate(task.oracle(), data, known=known, strategy=strategy, generator=g)
        assert torch.equal(y[known], data[known])
        assert task.evaluate(y)["valid"] == 1.0


def test_make_oracle_rejects_other_tasks():
    with pytest.raises(ValueError, match="oracle"):
        make_oracle(get_task("random_walk"))


@pytest.mark.parametrize("name", ["step", "permutation"])
def test_oracle_rejects_canvases_shorter_than_its_sequences(name):
    oracle = make_oracle(get_task(name, seq_len=12))
    with pytest.raises(ValueError, match="exactly its task's seq_len = 12 tokens, got 3"):
        sigmafast.generate(oracle, torch.zeros(1, 0, dtype=torch.long), 3)


@pytest.mark.parametrize("name,kwargs,n_sequences", [
    ("permutation", dict(seq_len=5), 120), ("step", dict(seq_len=10, run_length=3), 8)])
def test_oracle_log_likelihood_is_uniform_in_every_order(name, kwargs, n_sequences):
    task = get_task(name, **kwargs)
    g = torch.Generator().manual_seed(0)
    x = task.sample_batch(4, generator=g)
    for order in (torch.rand(x.shape, generator=g).argsort(1), "left-to-right", "fractal"):
        ll = sigmafast.log_likelihood(task.oracle(), x, order)
        assert torch.allclose(ll, torch.full_like(ll, -torch.log(torch.tensor(float(n_sequences))).item()))
