"""Throughput: generated tokens per second, and FLOPs per sequence, per sampling strategy.

Trained models from ``_models.py`` (the tiny-shakespeare char model, and the
step model, whose sequences have real long-range structure even at CPU
training budgets) generate ``new_tokens`` after a prompt taken from a
validation sequence (the whole ``seq_len`` window unconditionally when
``new_tokens == seq_len``), with:

* ``autoregressive``: one token per model call with the KV cache (random order);
* ``burst-paper-o5``: burst sampling, paper rule, 5 verification orders;
* ``burst-lossless``: burst sampling, lossless rule (1 order);
* ``reference-autoregressive``: the naive uncached reference
  (``sigmafast.naive.generate``), which recomputes the whole prefix for
  every token (O(T²) work); only at batch 1. Its burst mode
  (``reference-burst-paper-o5``), which recomputes every draft and every
  verification step from scratch, runs only on the step model (T=100).

Defaults fit a 2-core CPU: char, 64 new tokens (after a 192-character
prompt) at batch 1 and 16 and 256 tokens (unconditional) at batch 1; step,
100 tokens at batch 1 and 16.
``SIGMAFAST_BENCH_FULL=1``: a ``gpt2``-size char model with 1024-token
windows, 256 and 1024 new tokens, batch 1 and 16.

FLOPs per generated sequence (forward only; layer norms, biases, softmax and
embeddings ignored), with L layers, width C, vocabulary V:

* every token-position processed (a "row") costs ``dense = 2·(12·L·C² + C·V)``
  (q/k/v 3C², projection C², MLP 8C² per layer; the tied LM head C·V), plus
  ``4·L·C·ctx`` for attention (QKᵀ and PV) over its ``ctx`` visible keys;
* autoregressive with a KV cache: T rows in total (prompt prefill included),
  row t sees t keys: ``T·dense + 4·L·C·T(T+1)/2``;
* burst, iteration k with R_k remaining positions and c_k = T − R_k cached
  entries: R_k draft rows seeing c_k + 1 keys, and O·R_k verification rows,
  row r of an order seeing c_k + r keys (r = 1..R_k), O = number of orders;
  plus the prompt prefill as above. R_k comes from the measured per-iteration
  accepted counts (``stats.accepted``);
* naive reference: each query is a full forward of its whole visited prefix
  (m rows cost ``m·dense + 4·L·C·m(m+1)/2``).

``flops_per_seq`` is this algorithmic count per row (what a sequence alone
would need); ``flops_per_seq_executed`` charges every row of the batch with
the batch's largest R_k, as the sampler pads ragged rows. On a CPU, which is
compute-bound, burst's extra FLOPs (drafting every remaining position and
verifying O orders) usually outweigh its fewer sequential steps; on a GPU the
sequential steps dominate at small batch.
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch

import sigmafast
import sigmafast.naive
from _common import bench_full, device_info, summarize, synchronize

FULL = bench_full()
SIZES = {  # model -> (new_tokens, batch)
    "char": [(256, 1), (256, 16), (1024, 1), (1024, 16)] if FULL else [(64, 1), (64, 16), (256, 1)],
    "step": [(100, 1), (100, 16)],
}
ROUNDS = 5 if FULL else 2
STRATEGIES = {
    "autoregressive": dict(strategy="autoregressive"),
    "burst-paper-o5": dict(strategy="burst", acceptance="paper", num_orders=5),
    "burst-lossless": dict(strategy="burst", acceptance="lossless", num_orders=1),
    "reference-autoregressive": dict(strategy="autoregressive", reference=True),
    "reference-burst-paper-o5": dict(strategy="burst", acceptance="paper", num_orders=5, reference=True),
}


def _runs(model: str, name: str, new_tokens: int, batch: int) -> bool:
    if not name.startswith("reference"):
        return True
    if batch != 1:
        return False
    if name == "reference-burst-paper-o5":
        return model == "step"  # 100 positions of a tiny model: affordable even uncached
    return True


CASES = [
    pytest.param(model, name, n, b, id=f"{model}-{name}-{n}tok-b{b}")
    for model, sizes in SIZES.items() for n, b in sizes for name in STRATEGIES if _runs(model, name, n, b)
]


def _forward(dense: float, attn: float, rows: torch.Tensor, ctx_sum: torch.Tensor) -> torch.Tensor:
    return rows * dense + attn * ctx_sum


def flops_per_seq(config, name: str, T: int, n_known: int, stats) -> tuple[float, float]:
    """(algorithmic, executed) forward FLOPs per sequence; see the module docstring."""
    L, C, V = config.n_layer, config.n_embd, config.vocab_size
    dense, attn = 2.0 * (12 * L * C * C + C * V), 4.0 * L * C
    spec = STRATEGIES[name]
    acc = stats.accepted.double().cpu()  # (B, n_iter)
    B = acc.shape[0]
    if spec["strategy"] == "autoregressive":
        if spec.get("reference"):
            m = torch.arange(n_known + 1, T + 1, dtype=torch.float64)  # forward lengths 1 + visited
            total = float(_forward(dense, attn, m, m * (m + 1) / 2).sum())
        else:
            total = T * dense + attn * T * (T + 1) / 2
        return total, total
    prefill = n_known * dense + attn * n_known * (n_known + 1) / 2
    O = spec["num_orders"]
    R = (T - n_known) - torch.cat([torch.zeros(B, 1, dtype=torch.float64), acc.cumsum(1)[:, :-1]], 1)  # (B, n_iter)
    c = T - R
    R_exec = R.amax(0, keepdim=True).expand_as(R)
    if spec.get("reference"):
        # R draft forwards of c+1 rows; O orders x R forwards of c+r rows, r = 1..R.
        draft = R * _forward(dense, attn, c + 1, (c + 1) * (c + 2) / 2)
        r_sum = R * (R + 1) / 2
        m_sum, m2_sum = R * c + r_sum, R * c * c + 2 * c * r_sum + R * (R + 1) * (2 * R + 1) / 6
        verify = O * (m_sum * dense + attn * (m2_sum + m_sum) / 2)
        total = float((draft + verify).sum(1).mean()) + prefill
        return total, total

    def burst(Rk: torch.Tensor) -> torch.Tensor:
        draft = _forward(dense, attn, Rk, Rk * (c + 1))
        verify = O * _forward(dense, attn, Rk, Rk * c + Rk * (Rk + 1) / 2)
        return draft + verify

    algorithmic = float(burst(R).sum(1).mean()) + prefill
    executed = float(burst(R_exec).sum(1).mean()) + prefill
    return algorithmic, executed


@pytest.mark.parametrize("model_name,name,new_tokens,batch", CASES)
def test_throughput(benchmark, request, model_name, name, new_tokens, batch, models, device):
    text = request.getfixturevalue("shakespeare") if model_name == "char" else None
    bm = models.get(model_name, device, text)
    model, task = bm.model, bm.task
    T = task.seq_len
    if new_tokens > T:
        pytest.skip(f"the {model_name} model has seq_len {T} < {new_tokens} new tokens")
    spec = dict(STRATEGIES[name])
    reference = spec.pop("reference", False)
    sampler = sigmafast.naive.generate if reference else sigmafast.generate
    window = task.sample_batch(batch, "val", torch.Generator().manual_seed(0)).to(device)  # (B, T)
    prompt = window[:, : T - new_tokens]  # (B, P)

    def generate(rows: int, seed: int):
        g = torch.Generator(device).manual_seed(seed)
        out = sampler(model, prompt[:rows], new_tokens, generator=g, return_stats=True, **spec)
        synchronize(device)
        return out

    check, _ = generate(min(batch, 2), 1)  # correctness (and warm-up) before timing
    if check.shape != (min(batch, 2), T) or not torch.equal(check[:, : prompt.shape[1]], prompt[: check.shape[0]]):
        raise AssertionError(f"{name}: bad output shape {tuple(check.shape)} or a changed prompt")

    seconds = []

    def run():
        t0 = time.perf_counter()
        out = generate(batch, 1234)
        seconds.append(time.perf_counter() - t0)
        return out

    tokens, stats = benchmark.pedantic(run, rounds=ROUNDS, iterations=1, warmup_rounds=0)
    if bool(((tokens < 0) | (tokens >= task.vocab_size)).any()):
        raise AssertionError(f"{name}: ids outside the vocabulary")
    wall = statistics.median(seconds)
    n_known = prompt.shape[1]
    algorithmic, executed = flops_per_seq(model.config, name, T, n_known, stats)
    benchmark.extra_info.update(
        kind="throughput", model=model_name, acceptance=spec.get("acceptance"), num_orders=spec.get("num_orders", 1),
        strategy=f"reference-{spec['strategy']}" if reference else spec["strategy"],
        new_tokens=new_tokens, prompt_tokens=n_known, batch_size=batch, seq_len=T, rounds=ROUNDS,
        seconds_median=wall, tokens_per_s=batch * new_tokens / wall, flops_per_seq=algorithmic,
        flops_per_seq_executed=executed, achieved_gflops_per_s=executed * batch / wall / 1e9,
        n_params=bm.info["n_params"], n_layer=model.config.n_layer, n_embd=model.config.n_embd,
        **summarize(stats, torch.full((batch,), new_tokens)), **device_info(device),
    )
