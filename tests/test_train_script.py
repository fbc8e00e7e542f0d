"""scripts/train.py: bad flags as one error line, NaN losses and non-finite weights, signals, help and the flags
that mirror TrainConfig."""

import math
import signal

import pytest
import torch

import sigmafast.train as train_mod
from sigmafast.checkpoint import read_checkpoint
from sigmafast.train import TrainConfig, train
from sigmafast import train_config
from helpers import BASE_ARGV, signals_at_step, small_cfg, train_script as load_script

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(
    "extra,match",
    [
        (["--task", "nope"], "argument --task: invalid choice: 'nope'"),
        (["--order", "zigzag"], "argument --order: invalid choice: 'zigzag'"),
        (["--preset", "huge"], "argument --preset: invalid choice: 'huge'"),
        (["--block-size", "8"], "--block-size (8) must be >= the task's seq_len (12)"),
        (["--n-embd", "60", "--n-head", "4"], "--n-embd (60) must be divisible by 2*n_head (8)"),
        (["--max-iters", "many"], "argument --max-iters: invalid int value: 'many'"),
        (["--lr", "-1"], "--lr must be > 0"),
        (["--seq-len", "1"], "--seq-len must be"),
        (["--resume", "--out-dir", "{empty}"], "no checkpoint at"),
        (["--resume", "--out-dir", "{trained}", "--n-layer", "3"], "n_layer: checkpoint 1, now 3"),
        (["--resume", "--out-dir", "{trained}", "--seq-len", "10"], "task seq_len: checkpoint 12, now 10"),
        (["--resume", "--out-dir", "{trained}", "--task", "step"], "written for task 'permutation'; leave --task out"),
        (["--resume", "--out-dir", "{trained}", "--objective", "diffusion"],
         "--objective: the checkpoint's run has objective 'sigma', and a resumed run keeps it"),
        (["--resume", "--out-dir", "{trained}", "--n-head", "3"],  # the checkpoint's width, not the recipe's 256
         "--n-embd (64) must be divisible by 2*n_head (6)"),
        (["--weight-decay", "nan"], "--weight-decay must be a finite number, got nan"),
        (["--lr", "inf"], "--lr must be a finite number, got inf"),
        (["--seq-len", "100000000"], "GiB available: reduce --batch-size"),
        (["--n-embd", "100000", "--n-layer", "100"], "GiB available: reduce --batch-size"),
        (["--order", "random", "--curriculum-start", "0.3"],
         "--curriculum-start applies to order 'curriculum' only; this run's order is 'random'"),
        (["--curriculum-start", "0.3", "--objective", "diffusion"], "--curriculum-start applies to order 'curriculum'"),
        (["--curriculum-iters", "5"], "--curriculum-iters applies to order 'curriculum' only"),
        (["--diffusion-noise", "absorbing"],
         "--diffusion-noise applies to objective 'diffusion' only; this run's objective is 'sigma'"),
        (["--lr-decay-iters", "10"], "--lr-decay-iters (10) must be >= warmup_iters (200)"),  # recipe's
        (["--seed", "-1"], "--seed must be in [0, 2**63), got -1"),
        (["--num-eval-samples", str(10**9)], "GiB available: reduce --num-eval-samples"),
        (["--seed", str(2**63)], f"--seed must be in [0, 2**63), got {2**63}"),
        pytest.param(["--device", "cuda"], "device 'cuda' requested but CUDA is not available",
                     marks=pytest.mark.skipif(torch.cuda.is_available(), reason="the error raised without CUDA")),
    ],
    ids=["task", "order", "preset", "block-size", "n-embd", "int", "lr", "seq-len", "missing-ckpt",
         "other-arch", "other-seq-len", "other-task", "other-objective", "other-heads", "nan-weight-decay", "inf-lr",
         "huge-seq-len", "huge-model", "curriculum-start-random", "curriculum-start-diffusion",
         "curriculum-iters-random", "diffusion-noise-sigma", "lr-decay-below-warmup", "negative-seed",
         "huge-eval-samples", "huge-seed",
         "cuda-without-cuda"],
)
def test_script_bad_input(extra, match, tmp_path, trained_dir, capsys):
    script = load_script()
    run_dir = ["--out-dir", str(tmp_path / "run")]  # a later --out-dir in extra wins
    argv = [a.format(empty=tmp_path / "empty", trained=trained_dir) for a in BASE_ARGV + run_dir + extra]
    try:
        code = script.main(argv)
    except SystemExit as e:  # argparse
        code = e.code
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert match in err
    assert "Traceback" not in err


def nan_loss_from_step(monkeypatch, first: int) -> None:
    """Training losses turn NaN from optimiser step ``first`` on (one micro-step per step)."""
    real_loss, calls = train_mod._Trainer._loss, []

    def loss(self, batch):
        calls.append(None)
        value = real_loss(self, batch)
        return value * math.nan if len(calls) > first else value

    monkeypatch.setattr(train_mod._Trainer, "_loss", loss)


def test_script_stops_at_a_nan_training_loss_and_keeps_the_checkpoint(tmp_path, monkeypatch, capsys):
    nan_loss_from_step(monkeypatch, 3)
    argv = BASE_ARGV + ["--max-iters", "6", "--eval-interval", "2", "--log-interval", "1", "--out-dir", str(tmp_path)]
    assert load_script().main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: training loss nan at iter 3: the run diverged; ") and err.count("\n") == 1, err
    assert f"{tmp_path / 'ckpt.pt'} is left as it was" in err
    ckpt = read_checkpoint(tmp_path / "ckpt.pt")
    assert ckpt["iter"] == 2 and all(torch.isfinite(w).all() for w in ckpt["model"].values())


def test_non_finite_weights_stop_the_run_before_a_checkpoint(tmp_path, monkeypatch):
    """No log line between the NaN step and the next evaluation: the weights' check stops the run there."""
    nan_loss_from_step(monkeypatch, 3)
    with pytest.raises(FloatingPointError, match="non-finite weights at iter 4: the run diverged; .* is left as it"):
        train(small_cfg(tmp_path, max_iters=6, eval_interval=2, log_interval=100))
    ckpt = read_checkpoint(tmp_path / "ckpt.pt")
    assert ckpt["iter"] == 2 and all(torch.isfinite(w).all() for w in ckpt["model"].values())
    nan_loss_from_step(monkeypatch, 0)
    with pytest.raises(FloatingPointError, match="loss nan at iter 0: the run diverged; no checkpoint was written"):
        train(small_cfg(tmp_path / "new", max_iters=6, eval_interval=2, log_interval=100))
    assert not (tmp_path / "new" / "ckpt.pt").exists()


def test_script_flags_mirror_config(tmp_path):
    parser = load_script().build_parser()
    args = parser.parse_args(["--max-iters", "7", "--no-bias", "--compile", "--order", "fractal",
                              "--curriculum-start", "0.25", "--out-dir", str(tmp_path)])
    cfg = TrainConfig(**vars(args))
    assert (cfg.max_iters, cfg.bias, cfg.compile, cfg.order, cfg.curriculum_start) == (7, False, True, "fractal", 0.25)
    assert TrainConfig(**vars(parser.parse_args([]))) == TrainConfig()


def test_script_help_names_the_task_recipe_defaults():
    """A flag whose default a task recipe may set says so, as --order does (--task step trains rope-v)."""
    helps = {action.dest: action.help for action in load_script().build_parser()._actions}
    recipe_fields = {name for recipe in train_config.TASK_RECIPES.values() for name in recipe}
    assert "pos_encoding" in recipe_fields
    for name in sorted(recipe_fields):
        assert "(default: the task recipe's, else " in helps[name], (name, helps[name])


def test_script_sigint_saves_checkpoint_and_exits(tmp_path, monkeypatch, capsys):
    signals_at_step(monkeypatch, 1, signal.SIGINT)
    handler_before = signal.getsignal(signal.SIGINT)
    code = load_script().main(BASE_ARGV + ["--max-iters", "50", "--out-dir", str(tmp_path)])
    assert code == 130 and signal.getsignal(signal.SIGINT) is handler_before
    assert read_checkpoint(tmp_path / "ckpt.pt")["iter"] == 2
    assert "Traceback" not in capsys.readouterr().err


def test_script_sigterm_saves_checkpoint_and_exits_with_143(tmp_path, monkeypatch):
    signals_at_step(monkeypatch, 1, signal.SIGTERM)
    code = load_script().main(BASE_ARGV + ["--max-iters", "50", "--out-dir", str(tmp_path)])
    assert code == 128 + signal.SIGTERM  # the shell's status for a process ended by SIGTERM
    assert read_checkpoint(tmp_path / "ckpt.pt")["iter"] == 2


def test_script_second_sigint_exits_at_once_without_a_traceback(tmp_path, monkeypatch, capsys):
    signals_at_step(monkeypatch, 1, signal.SIGINT, signal.SIGINT)
    handler_before = signal.getsignal(signal.SIGINT)
    try:
        code = load_script().main(BASE_ARGV + ["--max-iters", "50", "--out-dir", str(tmp_path)])
    except KeyboardInterrupt:
        pytest.fail("the second SIGINT escaped main() as a KeyboardInterrupt")
    assert code == 130 and signal.getsignal(signal.SIGINT) is handler_before
    assert not (tmp_path / "ckpt.pt").exists()
    assert "Traceback" not in capsys.readouterr().err


def test_script_trains_and_resumes(tmp_path, capsys):
    script = load_script()
    argv = BASE_ARGV + ["--out-dir", str(tmp_path)]
    assert script.main(argv) == 0
    assert script.main(argv + ["--max-iters", "3", "--resume"]) == 0
    assert read_checkpoint(tmp_path / "ckpt.pt")["iter"] == 3


def test_script_resume_after_the_text_moved_names_the_flag_that_finds_it(tmp_path, capsys):
    """The char task re-reads its text on resume: a moved file is named with --text, which resumes from the new
    path."""
    script = load_script()
    text = tmp_path / "a.txt"
    text.write_text("the cat sat on the mat. " * 40)
    out = ["--out-dir", str(tmp_path / "run")]
    base = ["--task", "char", "--text", str(text), "--seq-len", "8", "--batch-size", "4", "--max-iters", "1",
            "--eval-iters", "1", "--num-eval-samples", "0", "--preset", "tiny"]
    assert script.main(base + out) == 0
    moved = text.rename(tmp_path / "b.txt")
    capsys.readouterr()
    assert script.main(out + ["--resume", "--max-iters", "2"]) == 2
    assert capsys.readouterr().err == f"error: char task text file (--text FILE): {text} does not exist\n"
    assert script.main(out + ["--resume", "--max-iters", "2", "--text", str(moved)]) == 0
    assert read_checkpoint(tmp_path / "run" / "ckpt.pt")["iter"] == 2
