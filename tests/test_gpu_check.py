"""benchmarks/gpu_check.sh, dry: every command it would run on a lent GPU selects tests and benchmarks that exist
and passes flags its scripts accept. A GPU is lent rarely and briefly, so a wrong ``-k`` or flag there costs a
whole device call; here ``python`` and ``nvidia-smi`` are stubs that record their arguments."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from helpers import REPO

PARTS = "small sweep tests vocab fused topk engine kernels profile anchors inductor engine-ar engine-burst"
STUB = "#!/bin/sh\nfor a in \"$@\"; do printf '%s\\037' \"$a\"; done >> \"$STUB_LOG\"\necho >> \"$STUB_LOG\"\n"
# Parse a script's flags with its own parser, then stop: the GPU part of the script is not run.
PARSE_ONLY = ("import argparse, os, runpy, sys\n"
              "parse = argparse.ArgumentParser.parse_args\n"
              "def parse_only(self, *a, **k):\n"
              "    parse(self, *a, **k)\n"
              "    raise SystemExit(0)\n"
              "argparse.ArgumentParser.parse_args = parse_only\n"
              "sys.argv = sys.argv[1:]\n"
              "sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))\n"
              "runpy.run_path(sys.argv[0], run_name='__main__')\n")


@pytest.fixture(scope="module")
def gpu_calls(tmp_path_factory) -> list[list[str]]:
    """The argument lists of the ``python`` calls of every part, in order."""
    tmp = tmp_path_factory.mktemp("gpu_check")
    stubs = tmp / "bin"
    stubs.mkdir()
    for name in ("python", "nvidia-smi"):
        (stubs / name).write_text(STUB)
        (stubs / name).chmod(0o755)
    log = tmp / "calls.log"
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "STUB_LOG": str(log), "OUT": str(tmp),
           "GPU_PARTS": PARTS}
    done = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh")], env=env, cwd=tmp,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp / "gpu_check.tgz").is_file()
    calls = [line.split("\x1f")[:-1] for line in log.read_text().splitlines()]
    return [c for c in calls if c and not c[0].startswith("--query-gpu")]


def _selection(call: list[str]) -> tuple[list[str], list[str]]:
    """A pytest call's paths and its -k / -m selection."""
    paths, selection, args = [], [], iter(call[2:])
    for arg in args:
        if arg in ("-k", "-m"):
            selection += [arg, next(args)]
        elif arg.endswith(".py") or arg.endswith("/"):
            paths.append(arg)
    return paths, selection


def test_every_part_runs_something(gpu_calls):
    pytest_calls = [c for c in gpu_calls if c[:2] == ["-m", "pytest"]]
    scripts = {os.path.basename(c[0]) for c in gpu_calls if c[0].endswith(".py")}
    assert len(pytest_calls) == 12 and {"profile_steps.py", "sweep_vocab.py", "gpu_summary.py"} <= scripts


def test_pytest_selections_collect_tests(gpu_calls):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    for call in (c for c in gpu_calls if c[:2] == ["-m", "pytest"]):
        paths, selection = _selection(call)
        assert paths and all((REPO / p).exists() for p in paths), call
        done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                               "-p", "no:xdist", *paths, *selection], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=300)
        collected = re.search(r"(\d+)(?:/\d+)? tests? collected", done.stdout)
        assert done.returncode == 0 and collected and int(collected.group(1)) > 0, (call, done.stdout[-2000:])


def test_script_flags_parse(gpu_calls):
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    for call in (c for c in gpu_calls if c[0] in ("benchmarks/profile_steps.py", "benchmarks/sweep_vocab.py")):
        done = subprocess.run([sys.executable, "-c", PARSE_ONLY, *call], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, (call, done.stderr[-2000:])


def test_the_sweep_ranks_no_tiling_whose_output_differs_from_the_defaults(monkeypatch):
    """``sweep_vocab.mismatch``: rounding-level differences of log q and a rare flipped token pass; a wrong
    value, a token flipped in 2% of rows, another dtype or shape is named, so the sweep does not rank it."""
    import importlib

    import torch

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    mismatch = importlib.import_module("sweep_vocab").mismatch
    logq = torch.tensor([-1.5, -float("inf"), -20.0, 0.0])
    assert mismatch(logq, logq + 1e-4) is None
    assert "differs by up to 0.1" in mismatch(logq, logq + torch.tensor([0, 0, 0, 0.1]))
    assert "differs by up to inf" in mismatch(logq, torch.tensor([-1.5, 0.0, -20.0, 0.0]))
    tokens = torch.arange(100)
    flipped = tokens.clone()
    flipped[0] = 7
    assert mismatch(tokens, flipped) is None
    flipped[1] = 7
    assert mismatch(tokens, flipped) == "tokens agree with the defaults' in 98.0% of rows"
    assert "got torch.float32" in mismatch(tokens, tokens.float())
    assert "(99,)" in mismatch(tokens, tokens[1:])
