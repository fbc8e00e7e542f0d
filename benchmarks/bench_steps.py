"""Steps: how many model evaluations burst sampling needs, against the paper and theory.

Two families, both device-independent in what they count:

* ``test_oracle_steps``: the exact task oracles (``get_task(name).oracle()``)
  sampled by ``sigmafast.generate`` with the paper rule for 1, 2, 5, 10
  verification orders and with the lossless rule, on product, step and
  permutation (T=100). The iteration counts depend only on the algorithm.
* ``test_model_steps``: small σ-GPTs trained on the fly (cached, see
  ``_models.py``) on permutation, step, maze and tiny-shakespeare characters:
  burst (both rules) against autoregressive generation of the same positions.

Iterations are per sequence (mean ± std over rows); one burst iteration is two
batched model calls (draft + verify), one autoregressive step is one.
``forward_calls`` counts the batched calls of the whole ``generate`` call (its
slowest row decides). Validity is the task's own metric (``task.evaluate``).
Sequences: 128 per oracle case and the models' own few (``_models.py``) by default, so the validity figures are
indicative only; ``SIGMAFAST_BENCH_SAMPLES=N`` sets N for every case.
"""

from __future__ import annotations

import pytest
import torch

import sigmafast
from _common import bench_full, device_info, primary_metric, sample_count, summarize, synchronize
from sigmafast.tasks import get_task

# Reference step counts for T=100 (the paper, its appendix, and perfect-model
# simulations of this exact algorithm: paper rule with 5 orders, lossless).
REFERENCE = {
    "product": dict(paper_iterations=1.0, theory_iterations=1.0, paper_note="1 (paper); 1 (theory)"),
    "step": dict(paper_iterations=4.0, theory_iterations=3.0, paper_note="≈ 4 (paper); ≤ 3 (theory)",
                 sim_note="paper/5 orders ≲ 3.5; lossless ≲ 3.6"),
    "permutation": dict(paper_iterations=5.2, paper_iterations_std=0.6, sim_iterations=9.6,
                        sim_lossless_iterations=12.3,
                        paper_note="lower bound 5.2 ± 0.6 (paper)",
                        sim_note="paper/5 orders ≈ 9.6; lossless ≈ 12.3"),
}
RULES = [("paper", 1), ("paper", 2), ("paper", 5), ("paper", 10), ("lossless", 1)]
RULE_IDS = [f"{rule}-o{n}" for rule, n in RULES]
ORACLE_SEQUENCES = sample_count(1024 if bench_full() else 128)

MODEL_NAMES = ["permutation", "step", "maze", "char"]
STRATEGIES = [("autoregressive", "lossless", 1, "autoregressive")] + [
    ("burst", rule, n, f"burst-{i}") for (rule, n), i in zip(RULES, RULE_IDS)
]
# The char model (256 positions, 0.8M parameters) is the costly one on a CPU:
# there, 2 and 10 orders run only under SIGMAFAST_BENCH_FULL=1.
MODEL_CASES = [
    pytest.param(m, strategy, rule, n, id=f"{m}-{sid}")
    for m in MODEL_NAMES for strategy, rule, n, sid in STRATEGIES
    if bench_full() or m != "char" or n not in (2, 10)
]


def _check_sample(tokens: torch.Tensor, canvas: torch.Tensor, known: torch.Tensor, vocab_size: int) -> None:
    if tokens.shape != canvas.shape:
        raise AssertionError(f"generate returned shape {tuple(tokens.shape)}, expected {tuple(canvas.shape)}")
    if not torch.equal(tokens[known], canvas[known]):
        raise AssertionError("generate changed known tokens")
    if bool(((tokens < 0) | (tokens >= vocab_size)).any()):
        raise AssertionError("generate returned ids outside the vocabulary")


def timed_sample(benchmark, sample, task, canvas: torch.Tensor, known: torch.Tensor, device: torch.device):
    """Warm ``sample(canvas, known, generator) -> (tokens, stats)`` on two rows, then time one call on the
    whole batch. Both outputs are checked; returns ``(tokens, stats, metrics, metric name, metric value)``."""
    warm, _ = sample(canvas[:2], known[:2], torch.Generator(device).manual_seed(1))
    _check_sample(warm, canvas[:2], known[:2], task.vocab_size)

    def run():
        out = sample(canvas, known, torch.Generator(device).manual_seed(1234))
        synchronize(device)
        return out

    tokens, stats = benchmark.pedantic(run, rounds=1, iterations=1, warmup_rounds=0)
    _check_sample(tokens, canvas, known, task.vocab_size)
    metrics = {k: float(v) for k, v in task.evaluate(tokens.cpu()).items()}
    return (tokens, stats, metrics, *primary_metric(task, metrics))


@pytest.mark.parametrize("rule,num_orders", RULES, ids=RULE_IDS)
@pytest.mark.parametrize("task_name", list(REFERENCE))
def test_oracle_steps(benchmark, task_name, rule, num_orders):
    task = get_task(task_name)
    oracle = task.oracle()
    T = task.seq_len
    empty = torch.zeros(2, 0, dtype=torch.long)
    kwargs = dict(strategy="burst", num_orders=num_orders, acceptance=rule, return_stats=True)

    warm, _ = sigmafast.generate(oracle, empty, T, generator=torch.Generator().manual_seed(1), **kwargs)
    _check_sample(warm, torch.zeros(2, T, dtype=torch.long), torch.zeros(2, T, dtype=torch.bool), task.vocab_size)

    def run():
        g = torch.Generator().manual_seed(1234)
        return sigmafast.generate(oracle, torch.zeros(ORACLE_SEQUENCES, 0, dtype=torch.long), T, generator=g,
                                  **kwargs)

    tokens, stats = benchmark.pedantic(run, rounds=1, iterations=1, warmup_rounds=0)
    metrics = task.evaluate(tokens)
    name, value = primary_metric(task, metrics)
    ref = REFERENCE[task_name]
    benchmark.extra_info.update(
        kind="oracle_steps", task=task_name, seq_len=T, strategy="burst", acceptance=rule, num_orders=num_orders,
        n_sequences=ORACLE_SEQUENCES, ar_iterations=T, metric_name=name, metric_value=value, metrics=metrics,
        **summarize(stats, torch.full((ORACLE_SEQUENCES,), T)), **ref, **device_info(torch.device("cpu")),
    )
    if task_name == "product":
        assert stats.mean_iterations == 1.0, "the product oracle's drafts are exact: one iteration"
    else:  # an exact oracle gives q = 0 to any incoherent draft, so both rules only accept valid tokens
        assert value == 1.0, f"exact oracle produced invalid {task_name} samples ({metrics})"


def _canvas(task, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed validation batch and the task's prompt mask (maze: the maze half is given)."""
    canvas = task.sample_batch(n, "val", torch.Generator().manual_seed(0)).to(device)
    known = task.prompt_mask.to(device).expand(n, task.seq_len).clone()
    return canvas, known


@pytest.mark.parametrize("model_name,strategy,rule,num_orders", MODEL_CASES)
def test_model_steps(benchmark, request, model_name, strategy, rule, num_orders, models, device):
    text = request.getfixturevalue("shakespeare") if model_name == "char" else None
    bm = models.get(model_name, device, text)
    model, task = bm.model, bm.task
    n = sample_count(bm.spec.n_sequences)
    canvas, known = _canvas(task, n, device)

    def sample(c, k, g):
        return sigmafast.generate(model, c, known=k, strategy=strategy, num_orders=num_orders, acceptance=rule,
                                  generator=g, return_stats=True)

    tokens, stats, metrics, name, value = timed_sample(benchmark, sample, task, canvas, known, device)
    n_unknown = (~known).sum(1)
    if name is None:  # no validity metric (text): per-token left-to-right NLL under the model
        for key, seqs in (("sample_nll_l2r", tokens), ("data_nll_l2r", canvas)):
            nll = -sigmafast.log_likelihood(model, seqs, "left-to-right") / task.seq_len
            metrics[key] = float(nll.mean())
    benchmark.extra_info.update(
        kind="model_steps", model=model_name, task=task.name, seq_len=task.seq_len, strategy=strategy,
        acceptance=rule if strategy == "burst" else None, num_orders=num_orders, n_sequences=n,
        ar_iterations=float(n_unknown.double().mean()), metric_name=name, metric_value=value, metrics=metrics,
        n_params=bm.info["n_params"], preset=bm.spec.preset, train_iters=bm.spec.max_iters,
        train_seconds=bm.info.get("train_seconds"), final_eval=bm.info.get("final_eval"),
        **REFERENCE.get(task.name, {}), **summarize(stats, n_unknown), **device_info(device),
    )
    if strategy == "autoregressive":
        assert torch.equal(stats.iterations, n_unknown), "autoregressive takes one step per unknown position"
