"""Orders and position encodings: does a σ-GPT learn in random order, and at what cost in l2r?

Each case trains one model with the same budget (``sigmafast.train``, cached
like the other benchmark models) for a (task, position encoding, training
order) triple and records its validation losses against steps, in random
order and left to right (``val_loss_random`` / ``val_loss_l2r`` of every
evaluation). ``scripts/plot_benchmarks.py`` draws the curves (``orders.png``)
and the final-loss table.

Budgets:

* default (2-core CPU, minutes): the ``tiny`` preset for 150 steps, char at
  64 positions;
* ``SIGMAFAST_BENCH_FULL=1``: the setup of the README's table, ``small`` at
  256 positions for 1500 steps on tiny-shakespeare (about 16 min per case on
  one idle core) and permutation at T=100;
* ``SIGMAFAST_ORDERS_STEPS=N`` overrides the number of steps of either.

Cases: every encoding in random order, plus left-to-right and curriculum
for sinusoidal (the paper's), rope and rope-v. Every case keeps its preset's
architecture, whatever the task recipe's width.
"""

from __future__ import annotations

import os

import pytest

from _common import bench_full, device_info
from _models import ModelSpec
from sigmafast.checkpoint import read_checkpoint
from sigmafast.model_config import POS_ENCODINGS, PRESETS

TASKS = ("char", "permutation")
BASELINE_ENCODINGS = ("sinusoidal", "rope", "rope-v")  # also trained left-to-right and with the curriculum


def budget() -> dict:
    """Training budget shared by every case: preset, steps, batch, char length and eval cadence."""
    full = bench_full()
    steps = int(os.environ.get("SIGMAFAST_ORDERS_STEPS", 1500 if full else 150))
    if steps < 1:
        raise ValueError(f"SIGMAFAST_ORDERS_STEPS must be >= 1, got {steps}")
    return dict(preset="small" if full else "tiny", steps=steps, batch_size=32,
                char_len=256 if full else 64, eval_interval=max(1, steps // (15 if full else 5)),
                eval_iters=10 if full else 4)


def cases() -> list:
    out = []
    for task in TASKS:
        for enc in POS_ENCODINGS:
            orders = ("random", "left-to-right", "curriculum") if enc in BASELINE_ENCODINGS else ("random",)
            out += [pytest.param(task, enc, order, id=f"{task}-{enc}-{order}") for order in orders]
    return out


def orders_spec(task: str, pos_encoding: str, order: str) -> ModelSpec:
    b = budget()
    return ModelSpec(
        name=f"orders-{task}-{pos_encoding}-{order}", task=task, preset=b["preset"], max_iters=b["steps"],
        batch_size=b["batch_size"], lr=3e-3, seq_len=b["char_len"] if task == "char" else None,
        overrides=dict(**{k: PRESETS[b["preset"]][k] for k in ("n_layer", "n_head", "n_embd")},
                       pos_encoding=pos_encoding, order=order, eval_interval=b["eval_interval"],
                       eval_iters=b["eval_iters"], warmup_iters=min(50, b["steps"] // 10)),
    )


@pytest.mark.parametrize("task_name,pos_encoding,order", cases())
def test_orders(benchmark, request, task_name, pos_encoding, order, models, device):
    text = request.getfixturevalue("shakespeare") if task_name == "char" else None
    spec = orders_spec(task_name, pos_encoding, order)
    bm = benchmark.pedantic(models.get_spec, args=(spec, device, text), rounds=1, iterations=1, warmup_rounds=0)
    history = read_checkpoint(bm.info["cache_dir"] + "/ckpt.pt")["history"]
    curve = [{k: h[k] for k in ("iter", "val_loss_random", "val_loss_l2r")} for h in history]
    benchmark.extra_info.update(
        kind="orders", task=task_name, seq_len=bm.task.seq_len, vocab_size=bm.task.vocab_size,
        pos_encoding=pos_encoding, order=order, preset=spec.preset, steps=spec.max_iters,
        batch_size=spec.batch_size, n_params=bm.info["n_params"], train_seconds=bm.info.get("train_seconds"),
        curve=curve, final=curve[-1], **device_info(device),
    )
    assert curve[-1]["iter"] == spec.max_iters, "the last evaluation is at the end of training"
    first = curve[0]
    if order != "left-to-right":  # every random-order run must improve on its initial loss
        assert curve[-1]["val_loss_random"] < first["val_loss_random"], curve
