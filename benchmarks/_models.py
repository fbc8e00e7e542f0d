"""Small σ-GPT models for the benchmarks: trained once with ``sigmafast.train``, cached on disk.

Each :class:`ModelSpec` is a ``TrainConfig`` recipe. Its checkpoint lives in
``<cache>/<name>-<hash>/ckpt.pt`` where the hash covers every training field
(and the text file's size for the char model), so a changed recipe trains a
new model instead of reusing a stale one. ``done.json`` is written (atomically)
once training finished; a checkpoint without it (an interrupted run) is
resumed. The default recipes fit a 2-core CPU (about 4 minutes for all four
models on an idle machine); ``SIGMAFAST_BENCH_FULL=1`` selects bigger ones.

At these budgets the models are weak, and the benchmarks report it: the step
model leaves its plateau (lr 3e-3 matters; at 1e-3 it stays at the Bernoulli
marginal), the permutation model barely leaves the uniform plateau (learned
positions help: with the unscaled sinusoidal encoding it sat at exactly log 100
for 1200 steps), and the char model stays near its unigram loss.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from _common import bench_full

CACHE_FORMAT = 2


@dataclass(frozen=True)
class ModelSpec:
    """A benchmark model: the task it learns and a CPU- or paper-sized training recipe."""

    name: str
    task: str
    preset: str
    max_iters: int
    batch_size: int
    lr: float = 1e-3
    seq_len: Optional[int] = None
    n_sequences: int = 32  # sequences generated per model benchmark
    overrides: dict = field(default_factory=dict)

    def train_kwargs(self, out_dir: Path, text: Optional[Path]) -> dict:
        kwargs = dict(
            task=self.task, preset=self.preset, max_iters=self.max_iters, batch_size=self.batch_size,
            grad_accum=1, lr=self.lr, warmup_iters=min(100, self.max_iters // 10),
            eval_interval=self.max_iters, eval_iters=4, num_eval_samples=0, log_interval=100,
            out_dir=str(out_dir), device="cuda" if torch.cuda.is_available() else "cpu",
        )
        if self.seq_len is not None:
            kwargs["seq_len"] = self.seq_len
        if text is not None:
            kwargs["text"] = str(text)
        kwargs.update(self.overrides)
        return kwargs


CPU_SPECS = {
    # the tiny preset's width, not the permutation recipe's 256: keeps this model's training to a minute
    "permutation": ModelSpec("permutation", "permutation", "tiny", max_iters=800, batch_size=32, lr=3e-3,
                             overrides=dict(pos_encoding="learned", n_embd=64, n_head=2)),
    "step": ModelSpec("step", "step", "tiny", max_iters=800, batch_size=32, lr=3e-3),
    "maze": ModelSpec("maze", "maze", "tiny", max_iters=500, batch_size=16, lr=3e-3, n_sequences=16),
    "char": ModelSpec("char", "char", "small", max_iters=400, batch_size=16, lr=2e-3, seq_len=256, n_sequences=4),
}
FULL_SPECS = {
    "permutation": ModelSpec("permutation", "permutation", "small", max_iters=20000, batch_size=64),
    "step": ModelSpec("step", "step", "small", max_iters=5000, batch_size=64),
    "maze": ModelSpec("maze", "maze", "small", max_iters=20000, batch_size=32, n_sequences=64),
    "char": ModelSpec("char", "char", "gpt2", max_iters=5000, batch_size=16, lr=6e-4, seq_len=1024,
                      n_sequences=16, overrides=dict(warmup_iters=200, dropout=0.1)),
}


def spec(name: str) -> ModelSpec:
    specs = FULL_SPECS if bench_full() else CPU_SPECS
    if name not in specs:
        raise ValueError(f"unknown benchmark model {name!r}; expected one of {sorted(specs)}")
    return specs[name]


@dataclass
class BenchModel:
    spec: ModelSpec
    model: torch.nn.Module
    task: object
    info: dict  # training summary: iterations, final validation losses, training seconds, cache path


def _key(kwargs: dict, text: Optional[Path]) -> str:
    from sigmafast.train_config import TASK_RECIPES

    record = {k: v for k, v in kwargs.items() if k not in ("out_dir", "device")}
    record["_format"] = CACHE_FORMAT
    record["_recipe"] = TASK_RECIPES.get(kwargs["task"], {})  # fills the fields the spec leaves unset
    if text is not None:
        record["_text_size"] = text.stat().st_size
    return hashlib.sha1(json.dumps(record, sort_keys=True).encode()).hexdigest()[:12]


def _write_json(obj: dict, path: Path) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


class ModelCache:
    """Trained benchmark models under ``root``, each loaded at most once per session."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._loaded: dict[tuple, BenchModel] = {}

    def get(self, name: str, device: torch.device, text: Optional[Path] = None) -> BenchModel:
        """The trained benchmark model ``name``: from the cache, or trained now (then cached)."""
        return self.get_spec(spec(name), device, text)

    def get_spec(self, s: ModelSpec, device: torch.device, text: Optional[Path] = None) -> BenchModel:
        """The model of recipe ``s``: from the cache, or trained now (then cached)."""
        name = s.name
        out_dir = self.root / f"{name}-{_key(s.train_kwargs(Path('.'), text), text)}"
        memo = (str(out_dir), str(device))
        if memo not in self._loaded:
            self._loaded[memo] = _load_or_train(s, out_dir, device, text)
        return self._loaded[memo]


def _load_or_train(s: ModelSpec, out_dir: Path, device: torch.device, text: Optional[Path]) -> BenchModel:
    from sigmafast.train import TrainConfig, load_checkpoint, train

    kwargs = s.train_kwargs(out_dir, text)
    done = out_dir / "done.json"
    if not done.is_file():
        kwargs["resume"] = (out_dir / "ckpt.pt").is_file()
        t0 = time.perf_counter()
        result = train(TrainConfig(**kwargs))
        if result.interrupted:
            raise RuntimeError(f"training of benchmark model {s.name!r} was interrupted; rerun to resume it")
        last = result.history[-1] if result.history else {}
        _write_json({
            "name": s.name, "train_seconds": time.perf_counter() - t0, "resumed": kwargs["resume"],
            "final_eval": last, "train_config": {k: v for k, v in kwargs.items() if k != "resume"},
        }, done)
    info = json.loads(done.read_text())
    model, task, _ = load_checkpoint(out_dir / "ckpt.pt", device=device)
    info["cache_dir"] = str(out_dir)
    info["n_params"] = sum(p.numel() for p in model.parameters())
    return BenchModel(s, model, task, info)
