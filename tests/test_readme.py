"""The README's Python snippets and its --infill example run as written, on a tiny quick-start checkpoint
(the `step` task, as `python scripts/train.py --task step` writes it, but trained for two steps)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from helpers import sample_script

from sigmafast.tasks import get_task
from sigmafast.train import TrainConfig, train

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
INFILL_FLAG = re.compile(r'--infill "([^"]*)"')


@pytest.fixture(scope="module")
def quick_start_dir(tmp_path_factory):
    """A folder holding out/ckpt.pt and out/diffusion/ckpt.pt, the paths the README's snippets read."""
    root = tmp_path_factory.mktemp("quick_start")
    common = dict(task="step", preset="tiny", max_iters=2, batch_size=4, warmup_iters=1, eval_interval=2,
                  eval_iters=1, num_eval_samples=0)
    train(TrainConfig(**common, out_dir=str(root / "out")))
    train(TrainConfig(**common, objective="diffusion", diffusion_noise="absorbing",
                      out_dir=str(root / "out" / "diffusion")))
    return root


def test_readme_python_snippets_run_in_order(quick_start_dir, monkeypatch):
    blocks = PYTHON_BLOCK.findall(README.read_text())
    assert len(blocks) >= 2, "the README's Python snippets were not found"
    monkeypatch.chdir(quick_start_dir)
    namespace: dict = {}
    for i, block in enumerate(blocks, 1):
        exec(compile(block, f"README.md python block {i}", "exec"), namespace)
    assert namespace["ll"].shape == (4,) and torch.isfinite(namespace["ll"]).all()


def test_readme_infill_examples_fit_the_quick_start_task(quick_start_dir, capsys):
    templates = INFILL_FLAG.findall(README.read_text())
    assert templates, "no --infill example in the README"
    script = sample_script()
    step = get_task("step")
    for template in templates:
        tokens, known = script.parse_template(template, step, step.seq_len)
        assert bool(known.any()) and int(tokens[known].max()) < step.vocab_size
        argv = ["--checkpoint", str(quick_start_dir / "out" / "ckpt.pt"), "--infill", template, "--num-samples", "2"]
        assert script.main(argv) == 0, capsys.readouterr().err
