"""Exact laws of the samplers with top-k and with known tokens: chi-square tests against enumerated laws.

With top-k (and a temperature), each conditional of the model is truncated to its k most likely tokens and
renormalised; the exact random-order autoregressive law is then the average over all T! orders of the product
of those truncated conditionals. Autoregressive sampling in random order follows it by construction, and the
lossless burst rule must too: its drafts, ratios and residuals all use the same truncated laws. The law is
enumerated from ``naive.naive_logits`` of a float64 copy of the model (one forward for every prefix of every
order), with the temperature and the truncation written out apart (``helpers.truncated_log_probs``), independently
of the samplers' code (``kernels.reference.process_logits``, which both samplers share). With known tokens
(infilling), the model reads them first, in ascending positions, and the law averages the visiting orders of the
unknown positions.
"""

from __future__ import annotations

import itertools
from typing import Optional

import pytest
import torch
from helpers import P_FAIL, chi2_pvalue, tiny_model, truncated_log_probs

import sigmafast
from sigmafast import naive

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
            logp = truncated_log_probs(naive.naive_logits(model, queries, T4), temperature, top_k)  # (Q, V)
        row = {key: i for i, key in enumerate(prefixes)}
        for s, seq in enumerate(seqs):
            value = dict(zip(unknown, seq))
            visited = tuple(value[j] for j in perm)
            law[s] += sum(logp[row[(t, visited[:t])], visited[t]] for t in range(len(perm))).exp()
    return law / len(orders)


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
    assert chi2_pvalue(counts, law) > P_FAIL


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
    assert chi2_pvalue(torch.bincount(code, minlength=V4 ** 2), law) > P_FAIL
