"""The CPU path with GPT-2's vocabulary: ``generate`` on the ``small`` preset with random weights.

With a large vocabulary the CPU (reference) path spends its time in the vocabulary-wide ops: the LM head's
matmuls, the drafts' sampling, the verifier's scores and the residual, run a block of rows at a time
(``kernels/row_blocks.py``). The trained models of ``bench_throughput.py`` have vocabularies of 65 and fewer,
and ``bench_engine.py`` takes 512 on the CPU, so this file times the case that ``benchmarks/RESULTS.md``
reports for it: 240 new tokens after a 16-token prompt of zeros, batch 1, the same seed every call, with

* ``autoregressive``; ``autoregressive-topk200``: top-k 200 at temperature 0.8;
* ``burst-paper-o5``: the paper rule with 5 orders; ``burst-lossless``: the lossless rule (generate's default);
* ``burst-lossless-topk50``: the lossless rule with top-k 50 at temperature 0.8 (about 108 iterations).

CPU only: on a GPU, ``bench_engine.py`` takes GPT-2's vocabulary. ``benchmark.extra_info`` holds the median
seconds per call, the burst iterations and the tokens per second; nothing is asserted about them.
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch

import sigmafast
from _common import bench_device, device_info
from sigmafast import SigmaGPT, SigmaGPTConfig

VOCAB, BLOCK, PROMPT, NEW, ROUNDS = 50257, 256, 16, 240, 2
STRATEGIES = {
    "autoregressive": dict(strategy="autoregressive"),
    "autoregressive-topk200": dict(strategy="autoregressive", temperature=0.8, top_k=200),
    "burst-paper-o5": dict(strategy="burst", acceptance="paper", num_orders=5),
    "burst-lossless": dict(strategy="burst", acceptance="lossless", num_orders=1),
    "burst-lossless-topk50": dict(strategy="burst", acceptance="lossless", num_orders=1, temperature=0.8, top_k=50),
}


@pytest.fixture(scope="module")
def model():
    if bench_device().type != "cpu":
        pytest.skip("the CPU path's benchmark; on a GPU, bench_engine.py takes GPT-2's vocabulary")
    torch.manual_seed(0)
    return SigmaGPT(SigmaGPTConfig.from_preset("small", vocab_size=VOCAB, block_size=BLOCK)).eval()


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_cpu_vocab(benchmark, model, name):
    spec = STRATEGIES[name]
    prompt = torch.zeros(1, PROMPT, dtype=torch.long)

    def generate():
        return sigmafast.generate(model, prompt, NEW, generator=torch.Generator().manual_seed(0), return_stats=True,
                                  **spec)

    out, _ = generate()  # warm-up, and the output's check
    if out.shape != (1, PROMPT + NEW) or bool(((out < 0) | (out >= VOCAB)).any()):
        raise AssertionError(f"{name}: bad output shape {tuple(out.shape)} or ids outside the vocabulary")
    seconds = []

    def run():
        t0 = time.perf_counter()
        result = generate()
        seconds.append(time.perf_counter() - t0)
        return result

    _, stats = benchmark.pedantic(run, rounds=ROUNDS, iterations=1, warmup_rounds=0)
    wall = statistics.median(seconds)
    benchmark.extra_info.update(
        kind="cpu_vocab", shape="small", vocab_size=VOCAB, strategy=name, new_tokens=NEW, prompt_tokens=PROMPT,
        batch_size=1, seconds_median=wall, tokens_per_s=NEW / wall, iterations=int(stats.iterations.max()),
        threads=torch.get_num_threads(), **device_info(torch.device("cpu")),
    )
