"""Sampling quality: validity with a 95% confidence interval, and iterations, per sampling method.

Regenerates the quality table of issue 11 on the trained benchmark models
(``step`` and ``permutation``, trained once and cached, see ``_models.py``):

* ``AR``: autoregressive sampling in a random order, one model call per token;
* ``lossless``: burst sampling with the exact rule (``generate``'s default);
* ``paper, N orders``: the σ-GPT paper's rule (opt-in, not exact) with 1, 5, 10 orders;
* the same at temperature 0.7 for AR, lossless and the paper rule with 5 orders.

Validity is the task's own metric (``task.evaluate``) over ``n`` sequences, with a
Wilson score interval; iterations are per sequence (mean over rows): one model call
each for AR, two (draft + verify) for burst. AR and lossless sample the same law (the
model's random-order autoregressive law), so their validities must agree; this is
tested on the validity (two-proportion z-test) and on the mean number of distinct tokens per sequence
(two-sample z-test), which still tells the laws apart where a budget model's validity is 0%; the paper rule
is only reported.

Sizes: 1000 sequences per figure on a CPU (about 3 minutes on 2 cores); ``SIGMAFAST_BENCH_FULL=1``: 2000,
with the full-size models;
``SIGMAFAST_BENCH_SAMPLES=N``: N, with the budget's own models. The table is printed (markdown) and stored in
``benchmark.extra_info["rows"]``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import pytest
import torch

import sigmafast
from sigmafast.intervals import Z95, wilson_interval
from _common import bench_full, device_info, primary_metric, sample_count, synchronize

SAMPLES = sample_count(2000 if bench_full() else 1000)
CHUNK = 256  # sequences per generate call
METHODS = {
    "AR": dict(strategy="autoregressive"),
    "lossless": dict(strategy="burst", acceptance="lossless", num_orders=1),
    "paper, 1 order": dict(strategy="burst", acceptance="paper", num_orders=1),
    "paper, 5 orders": dict(strategy="burst", acceptance="paper", num_orders=5),
    "paper, 10 orders": dict(strategy="burst", acceptance="paper", num_orders=10),
    "AR, T=0.7": dict(strategy="autoregressive", temperature=0.7),
    "lossless, T=0.7": dict(strategy="burst", acceptance="lossless", num_orders=1, temperature=0.7),
    "paper, 5 orders, T=0.7": dict(strategy="burst", acceptance="paper", num_orders=5, temperature=0.7),
}
SAME_LAW = [("AR", "lossless"), ("AR, T=0.7", "lossless, T=0.7")]


def sampling_seed(method: str, start: int) -> int:
    """The seed of the generator that samples rows ``start..`` with ``method``: one stream per method, so that the
    samples the two-sample tests compare are independent. With one seed for all, AR's order keys would be the
    lossless drafts' uniforms and its token uniforms the lossless orders' keys (``sigmafast.sampler``'s
    protocol), coupling the two samples the tests take as independent."""
    return 1234 + 1_000_003 * list(METHODS).index(method) + start


def two_proportion_p_value(k1: int, n1: int, k2: int, n2: int) -> float:
    """Two-sided p-value of the pooled two-proportion z-test (1.0 when both are 0% or 100%)."""
    pooled = (k1 + k2) / (n1 + n2)
    se = math.sqrt(pooled * (1 - pooled) * (1 / n1 + 1 / n2))
    if se == 0:
        return 1.0
    z = abs(k1 / n1 - k2 / n2) / se
    return math.erfc(z / math.sqrt(2))


def two_mean_p_value(m1: float, sd1: float, n1: int, m2: float, sd2: float, n2: int) -> float:
    """Two-sided p-value of the two-sample z-test of equal means (unpooled variances; 1.0 when both samples are
    constant and equal, 0.0 when constant and different)."""
    se = math.sqrt(sd1 ** 2 / n1 + sd2 ** 2 / n2)
    if se == 0:
        return 1.0 if m1 == m2 else 0.0
    return math.erfc(abs(m1 - m2) / se / math.sqrt(2))


def distinct_tokens(tokens: torch.Tensor) -> torch.Tensor:
    """(B,) float64 number of distinct tokens in each row of ``tokens`` (B, T)."""
    s = tokens.sort(dim=1).values
    return 1.0 + (s[:, 1:] != s[:, :-1]).sum(dim=1).double()


@dataclass
class QualityRow:
    method: str
    valid: int  # valid sequences
    n: int  # sequences
    iterations: float  # mean per sequence
    low: float
    high: float
    distinct: float  # mean number of distinct tokens per sequence
    distinct_sd: float  # its standard deviation over sequences

    @property
    def rate(self) -> float:
        return self.valid / self.n

    def markdown(self) -> str:
        ci = f"{100 * self.rate:.1f}% [{100 * self.low:.1f}, {100 * self.high:.1f}]"
        half = Z95 * self.distinct_sd / math.sqrt(self.n)
        return f"| {self.method} | {ci} | {self.distinct:.2f} ± {half:.2f} | {self.iterations:.2f} | {self.n} |"


def measure(model, task, method: str, n: int, device: torch.device) -> QualityRow:
    """Sample ``n`` sequences around the task's prompt with ``METHODS[method]``, in chunks of ``CHUNK``."""
    valid, iterations, distinct = 0, 0.0, []
    for start in range(0, n, CHUNK):
        rows = min(CHUNK, n - start)
        canvas = task.sample_batch(rows, "val", torch.Generator().manual_seed(start)).to(device)
        known = task.prompt_mask.to(device).expand(rows, task.seq_len)
        g = torch.Generator(device).manual_seed(sampling_seed(method, start))
        tokens, stats = sigmafast.generate(model, canvas, known=known, generator=g, return_stats=True,
                                           **METHODS[method])
        synchronize(device)
        if not torch.equal(tokens[known], canvas[known]):
            raise AssertionError(f"{method}: generate changed known tokens")
        name, value = primary_metric(task, task.evaluate(tokens.cpu()))
        if name is None:
            raise AssertionError(f"task {task.name} has no validity metric")
        valid += round(value * rows)  # the metric is a mean over rows
        iterations += float(stats.iterations.double().sum())
        distinct.append(distinct_tokens(tokens.cpu()))
    d = torch.cat(distinct)
    sd = float(d.std()) if n > 1 else 0.0
    return QualityRow(method, valid, n, iterations / n, *wilson_interval(valid, n), float(d.mean()), sd)


def markdown_table(title: str, rows: list[QualityRow]) -> str:
    lines = [f"**{title}**", "", "| method | valid % [95% CI] | distinct tokens [95% CI] | iterations | n |",
             "|---|---|---|---|---|"]
    return "\n".join(lines + [r.markdown() for r in rows])


def test_two_proportion_p_value_known_values():
    assert abs(two_proportion_p_value(50, 100, 50, 100) - 1.0) < 1e-12
    assert abs(two_proportion_p_value(60, 100, 40, 100) - 0.004677734981047) < 1e-9


def test_each_method_samples_with_its_own_stream():
    seeds = {sampling_seed(m, start) for m in METHODS for start in range(0, 4000, CHUNK)}
    assert len(seeds) == len(METHODS) * len(range(0, 4000, CHUNK))


def test_two_mean_p_value_and_distinct_tokens():
    assert abs(two_mean_p_value(1.0, 2.0, 100, 1.0, 3.0, 50) - 1.0) < 1e-12
    assert abs(two_mean_p_value(0.0, 3.0, 100, 1.0, 4.0, 100) - 0.045500263896358) < 1e-9
    assert two_mean_p_value(2.0, 0.0, 10, 2.0, 0.0, 10) == 1.0 and two_mean_p_value(2.0, 0.0, 10, 3.0, 0.0, 10) == 0.0
    rows = torch.tensor([[3, 1, 3, 3], [0, 1, 2, 3], [5, 5, 5, 5]])
    assert distinct_tokens(rows).tolist() == [2.0, 4.0, 1.0]


@pytest.mark.parametrize("model_name", ["step", "permutation"])
def test_quality(benchmark, capsys, model_name, models, device):
    bm = models.get(model_name, device)
    model, task = bm.model, bm.task

    def run():
        return [measure(model, task, method, SAMPLES, device) for method in METHODS]

    rows = benchmark.pedantic(run, rounds=1, iterations=1, warmup_rounds=0)
    by_method = {r.method: r for r in rows}
    final = bm.info.get("final_eval", {})
    title = (f"{model_name}: {bm.spec.preset} model, {bm.spec.max_iters} training steps, random-order val loss "
             f"{final.get('val_loss_random', float('nan')):.3f}; {device_info(device)['device']}")
    table = markdown_table(title, rows)
    with capsys.disabled():
        print("\n\n" + table + "\n")
    benchmark.extra_info.update(
        kind="quality", model=model_name, task=task.name, seq_len=task.seq_len, n_samples=SAMPLES,
        rows=[{**asdict(r), "rate": r.rate} for r in rows], table=table, n_params=bm.info["n_params"],
        train_iters=bm.spec.max_iters, final_eval=final, **device_info(device),
    )
    n_unknown = int((~task.prompt_mask).sum())
    assert by_method["AR"].iterations == n_unknown, "autoregressive takes one step per unknown position"
    for a, b in SAME_LAW:
        ra, rb = by_method[a], by_method[b]
        p = two_proportion_p_value(ra.valid, ra.n, rb.valid, rb.n)
        assert p > 1e-3, f"{a} and {b} sample the same law, yet validity {ra.rate:.3f} vs {rb.rate:.3f} (p={p:.2g})"
        p = two_mean_p_value(ra.distinct, ra.distinct_sd, ra.n, rb.distinct, rb.distinct_sd, rb.n)
        assert p > 1e-3, (f"{a} and {b} sample the same law, yet {ra.distinct:.3f} vs {rb.distinct:.3f} distinct "
                          f"tokens per sequence (p={p:.2g})")
