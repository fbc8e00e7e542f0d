"""Benchmark-session setup for ``pytest benchmarks/ --benchmark-only``.

Environment:

* ``SIGMAFAST_CACHE``: where the small benchmark models are trained once and
  cached (default ``~/.cache/sigmafast/bench``; never inside the repository).
* ``SIGMAFAST_BENCH_FULL=1``: paper-scale sizes (bigger models, 1024 tokens,
  more sequences). The default is sized for a 2-core CPU, training included.
* ``SIGMAFAST_BENCH_THREADS=N``: ``torch.set_num_threads(N)`` for the session
  (on a shared CPU, 1 avoids the collapse of oversubscribed threads).
* ``SIGMAFAST_BENCH_LOG=FILE``: append one JSON line per finished benchmark
  (name, median seconds, ``extra_info``) as it ends. pytest-benchmark writes
  its own JSON only when the session ends, so a session cut off by a time
  limit keeps the cases it finished.

Every benchmark stores its figures in ``benchmark.extra_info``; the device
label ("CPU: <model>, N cores" or the GPU name) goes into the JSON's
``machine_info`` as ``sigmafast_device``, which ``scripts/plot_benchmarks.py``
uses to label the tables.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from _common import SHARED_DIR, bench_device, bench_full, cache_root, device_label
from _models import ModelCache


def pytest_configure(config):
    threads = os.environ.get("SIGMAFAST_BENCH_THREADS")
    if threads:
        if not threads.isdigit() or int(threads) < 1:
            raise pytest.UsageError(f"SIGMAFAST_BENCH_THREADS must be a positive int, got {threads!r}")
        torch.set_num_threads(int(threads))


@pytest.fixture(scope="session")
def device() -> torch.device:
    return bench_device()


@pytest.fixture(scope="session")
def models() -> ModelCache:
    """The small benchmark models, trained on first use and cached under SIGMAFAST_CACHE."""
    return ModelCache(cache_root())


@pytest.fixture(scope="session")
def shakespeare() -> Path:
    path = SHARED_DIR / "data" / "tinyshakespeare.txt"
    if not path.is_file():
        pytest.skip(f"char model needs {path} (the offline tiny-shakespeare copy); not present")
    return path


@pytest.fixture(autouse=True)
def _log_finished_case(request):
    yield
    log = os.environ.get("SIGMAFAST_BENCH_LOG")
    bench = request.node.funcargs.get("benchmark")
    stats = getattr(getattr(bench, "stats", None), "stats", None)
    if not log or stats is None:
        return
    line = {"name": request.node.name, "median_s": stats.median, "extra_info": bench.extra_info}
    with open(log, "a") as f:
        f.write(json.dumps(line, default=str) + "\n")


def pytest_benchmark_update_machine_info(config, machine_info):
    machine_info["sigmafast_device"] = device_label(bench_device())
    machine_info["sigmafast_full"] = bench_full()
    machine_info["torch_version"] = torch.__version__
    machine_info["torch_threads"] = torch.get_num_threads()
