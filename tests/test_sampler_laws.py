"""Exact laws of the samplers with top-k and with known tokens: chi-square tests against enumerated laws.

With top-k (and a temperature), each conditional of the model is truncated to its k most likely tokens and
renormalised; the exact random-order autoregressive law is then the average over all T! orders of the product
of those truncated conditionals. Autoregressive sampling in random order follows it by construction, and the
lossless burst rule must too: its drafts, ratios and residuals all use the same truncated laws. The law is
enumerated from ``naive.naive_logits`` of a float64 copy of the model (one forward for every prefix of every
order), independently of the samplers' code. With known tokens (infilling), the model reads them first, in
ascending positions, and the law averages the visiting orders of the unknown positions.
"""

from __future__ import annotations

import itertools
from typing import Optional

import pytest
import torch
from helpers import tiny_model
from test_sampler import chi2_sf

import sigmafast
from sigmafast import naive
from sigmafast.kernels.reference import log_probs

T4, V4, N = 4, 4, 20000  # ids 0..2 and BOS = 3 (a data token too): 256 outcomes


def truncated_law(model, temperature: float, top_k, known: Optional[dict] = None) -> torch.Tensor:
    """(V^U,) probabilities of the U unknown positions' tokens in ``itertools.product`` order (ascending
    positions), given ``known`` {position: token}, which the model reads first, in ascending positions."""
    known = known or {}
    given = sorted(known)
    unknown = [j for j in range(T4) if j not in known]
    seqs = list(itertools.product(range(V4), repeat=len(unknown)))
    law = torch.zeros(len(seqs), dtype=torch.float64)
    orders = list(itertools.permutations(unknown))
    for perm in orders:
        prefixes = [(t, p) for t in range(len(perm)) for p in itertools.product(range(V4), repeat=t)]
        queries = [(given + list(perm[:t]), [known[j] for j in given] + list(p), perm[t]) for t, p in prefixes]
        with torch.no_grad():
            logp = log_probs(naive.naive_logits(model, queries, T4), temperature, top_k)  # (Q, V)
        row = {key: i for i, key in enumerate(prefixes)}
        for s, seq in enumerate(seqs):
            value = dict(zip(unknown, seq))
            visited = tuple(value[j] for j in perm)
            law[s] += sum(logp[row[(t, visited[:t])], visited[t]] for t in range(len(perm))).exp()
    return law / len(orders)


def chi2_p(counts: torch.Tensor, law: torch.Tensor) -> float:
    """Chi-square p-value of ``counts`` against ``law``, cells expecting under 5 draws pooled into one."""
    expected = law * counts.sum()
    big = expected >= 5
    rare = ~big & (law > 0)
    obs = torch.cat([counts[big], counts[rare].sum()[None]] if rare.any() else [counts[big]])
    exp = torch.cat([expected[big], expected[rare].sum()[None]] if rare.any() else [expected[big]])
    return chi2_sf(float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1)


@pytest.mark.parametrize("strategy", ["burst", "autoregressive"])
@pytest.mark.parametrize("temperature, top_k", [(1.0, 2), (1.5, 3)], ids=["T1-k2", "T1.5-k3"])
def test_top_k_sampling_has_the_truncated_random_order_law(strategy, temperature, top_k):
    lossy = tiny_model(V4, T4, seed=5, std=0.8, dtype=torch.float32, n_embd=8)
    exact = tiny_model(V4, T4, seed=5, std=0.8, dtype=torch.float64, n_embd=8)  # the same weights
    law = truncated_law(exact, temperature, top_k)
    assert law.sum().item() == pytest.approx(1.0, abs=1e-9)
    assert (law == 0).sum() > 0  # top-k rules sequences out: the test sees the truncation
    x = sigmafast.generate(lossy, torch.zeros(N, 0, dtype=torch.long), T4, temperature, top_k, strategy=strategy,
                           generator=torch.Generator().manual_seed(11))
    code = (x * V4 ** torch.arange(T4 - 1, -1, -1)).sum(1)
    counts = torch.bincount(code, minlength=V4 ** T4).double()
    assert counts[law == 0].sum() == 0, "a sequence outside every order's top-k was sampled"
    assert chi2_p(counts, law) > 1e-3


@pytest.mark.parametrize("strategy", ["burst", "autoregressive"])
@pytest.mark.parametrize("top_k", [None, 3], ids=["all", "k3"])
def test_infilling_has_the_conditional_random_order_law(strategy, top_k):
    """Known tokens at positions 2 and 0 (read first, in ascending positions), the two others sampled: the law
    of the pair averages the two visiting orders of the unknown positions."""
    lossy = tiny_model(V4, T4, seed=6, std=0.8, dtype=torch.float32, n_embd=8)
    exact = tiny_model(V4, T4, seed=6, std=0.8, dtype=torch.float64, n_embd=8)
    known = {2: 1, 0: 3}
    law = truncated_law(exact, 1.0, top_k, known)
    canvas = torch.zeros(N, T4, dtype=torch.long)
    mask = torch.zeros(N, T4, dtype=torch.bool)
    for j, tok in known.items():
        canvas[:, j], mask[:, j] = tok, True
    x = sigmafast.generate(lossy, canvas, known=mask, top_k=top_k, strategy=strategy,
                           generator=torch.Generator().manual_seed(12))
    assert torch.equal(x[mask], canvas[mask])
    code = x[:, 1] * V4 + x[:, 3]
    assert chi2_p(torch.bincount(code, minlength=V4 ** 2).double(), law) > 1e-3
