"""What a resumed run keeps and what a new run refuses: the optimiser settings and the task state given or
stored, the explicit fields, absolute data paths, the final evaluation, checkpoint temporary files and an out
dir that already holds a run."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sigmafast.checkpoint import atomic_save, load_checkpoint, read_checkpoint
from sigmafast.train import TrainConfig, train
from helpers import signal_in_val_loss, small_cfg, train_script

pytestmark = pytest.mark.usefixtures("one_thread")


def test_run_without_resume_refuses_an_out_dir_with_a_checkpoint(tmp_path, capsys):
    """A second run into the same --out-dir would replace the first one's checkpoint: an error naming --resume
    and --out-dir, unless --overwrite asks for a new run (which --resume excludes)."""
    train(small_cfg(tmp_path, max_iters=2))
    before = (tmp_path / "ckpt.pt").read_bytes()
    with pytest.raises(ValueError, match="already holds a checkpoint .*: pass --resume to continue its run, "
                                         "--overwrite to start a new run over it, or another --out-dir$"):
        train(small_cfg(tmp_path, max_iters=3))
    argv = ["--task", "permutation", "--seq-len", "12", "--max-iters", "3", "--out-dir", str(tmp_path)]
    assert train_script().main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --out-dir '{tmp_path}' already holds a checkpoint") and err.count("\n") == 1
    assert (tmp_path / "ckpt.pt").read_bytes() == before
    with pytest.raises(ValueError, match="TrainConfig.resume and TrainConfig.overwrite exclude each other"):
        small_cfg(tmp_path, resume=True, overwrite=True)
    train(small_cfg(tmp_path, max_iters=3, seed=7, overwrite=True))
    assert read_checkpoint(tmp_path / "ckpt.pt")["train_config"]["seed"] == 7
    train(small_cfg(tmp_path, max_iters=4, resume=True))  # overwrite is not taken from the checkpoint
    assert read_checkpoint(tmp_path / "ckpt.pt")["iter"] == 4


def test_optimizer_settings_given_on_resume_take_effect_and_keep_the_moments(tmp_path):
    """--weight-decay, --beta1/--beta2 and the lr scales given on resume reach the restored param groups, even
    when the scales regroup the parameters (the permutation recipe's 4 groups into 2); every parameter keeps its
    Adam state."""
    train(small_cfg(tmp_path, max_iters=2))
    assert len(read_checkpoint(tmp_path / "ckpt.pt")["optimizer"]["param_groups"]) == 4
    result = train(small_cfg(tmp_path, max_iters=3, resume=True, weight_decay=0.05, beta1=0.8, beta2=0.9,
                             embedding_lr_scale=1.0, final_norm_lr_scale=1.0))
    optimizer = read_checkpoint(tmp_path / "ckpt.pt")["optimizer"]
    groups = [(g["weight_decay"], g["betas"], g["lr_scale"]) for g in optimizer["param_groups"]]
    assert groups == [(0.05, (0.8, 0.9), 1.0), (0.0, (0.8, 0.9), 1.0)]
    assert len(optimizer["state"]) == len(list(result.model.parameters()))
    assert all(s["step"].item() == 3 for s in optimizer["state"].values())  # 2 steps restored, 1 taken


def write_char_text(path: Path, letter: str) -> Path:
    path.write_text(f"the {letter}at sat on the mat. " * 40)
    return path


def test_resume_builds_the_task_from_the_checkpoints_vocabulary_and_bins(tmp_path):
    """The char vocabulary and the series value range are the checkpoint's, not recomputed from a data file
    changed since: a character outside the vocabulary is an error (here 'c' -> 'z', the same vocabulary size,
    so token ids would otherwise shift), and a rescaled CSV keeps the stored bins."""
    text = write_char_text(tmp_path / "text.txt", "c")
    char = dict(task="char", text=str(text), seq_len=8, max_iters=1, batch_size=4, eval_iters=1,
                num_eval_samples=0, out_dir=str(tmp_path / "char"))
    train(TrainConfig(**char))
    write_char_text(text, "z")
    with pytest.raises(ValueError, match="holds characters outside the vocabulary of the checkpoint \\(e.g. 'z'\\)"):
        train(TrainConfig(**{**char, "max_iters": 2, "resume": True}))
    assert read_checkpoint(tmp_path / "char" / "ckpt.pt")["iter"] == 1

    csv = tmp_path / "series.csv"
    csv.write_text("value\n" + "".join(f"{v}\n" for v in range(200)))
    series = dict(task="series", csv=str(csv), column="value", seq_len=8, max_iters=1, batch_size=4, eval_iters=1,
                  num_eval_samples=0, out_dir=str(tmp_path / "series"))
    first = train(TrainConfig(**series))
    stored = read_checkpoint(first.checkpoint_path)["task"]["kwargs"]["value_range"]
    csv.write_text("value\n" + "".join(f"{1000 * v}\n" for v in range(200)))
    resumed = train(TrainConfig(**{**series, "max_iters": 2, "resume": True}))
    assert resumed.task.bins == first.task.bins
    assert read_checkpoint(first.checkpoint_path)["task"]["kwargs"]["value_range"] == stored


def test_resume_keeps_the_fields_the_run_was_given_over_derived_defaults(tmp_path):
    """--grad-accum and --lr-decay-iters given at the start stay when --batch-size and --max-iters, their
    sources, are given on resume; given again, they win."""
    train(small_cfg(tmp_path, max_iters=2, grad_accum=2, lr_decay_iters=6))
    train(small_cfg(tmp_path, max_iters=3, batch_size=4, resume=True))
    stored = read_checkpoint(tmp_path / "ckpt.pt")["train_config"]
    assert (stored["batch_size"], stored["grad_accum"], stored["lr_decay_iters"]) == (4, 2, 6)
    script = train_script()  # the record survives a resume that does not repeat them
    assert script.main(["--resume", "--out-dir", str(tmp_path), "--max-iters", "4", "--batch-size", "8"]) == 0
    stored = read_checkpoint(tmp_path / "ckpt.pt")["train_config"]
    assert (stored["batch_size"], stored["grad_accum"], stored["lr_decay_iters"]) == (8, 2, 6)
    train(small_cfg(tmp_path, max_iters=5, resume=True, grad_accum=1, lr_decay_iters=9))
    stored = read_checkpoint(tmp_path / "ckpt.pt")["train_config"]
    assert (stored["grad_accum"], stored["lr_decay_iters"]) == (1, 9)


def test_final_evaluation_stopped_at_the_last_step_runs_on_resume(tmp_path, monkeypatch):
    """A SIGINT in the iter-4 evaluation of a 4-step run: the iter-4 state is saved without it, and --resume
    runs it (not "nothing to train") and saves it."""
    kw = dict(max_iters=4, eval_interval=4, eval_iters=4)
    straight = train(small_cfg(tmp_path / "a", **kw))
    signal_in_val_loss(monkeypatch, call=3)  # the first batch of the iter-4 evaluation's random-order loss
    first = train(small_cfg(tmp_path / "b", **kw))
    monkeypatch.undo()
    assert first.interrupted and [h["iter"] for h in first.history] == [0]
    assert read_checkpoint(first.checkpoint_path)["iter"] == 4
    second = train(small_cfg(tmp_path / "b", resume=True, **kw))
    assert not second.interrupted and second.history == straight.history
    ckpt = read_checkpoint(first.checkpoint_path)
    assert ckpt["iter"] == 4 and ckpt["history"] == straight.history


def test_data_paths_are_stored_absolute_so_resume_works_from_another_folder(tmp_path, monkeypatch):
    """--text given relative is stored absolute: a resume from another folder reads the same file, not one of
    the same name there."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    write_char_text(tmp_path / "a" / "text.txt", "c")
    write_char_text(tmp_path / "b" / "text.txt", "b")  # same name, same vocabulary size, another text
    monkeypatch.chdir(tmp_path / "a")
    assert TrainConfig(text="text.txt").text == str(tmp_path / "a" / "text.txt")
    char = dict(task="char", text="text.txt", seq_len=8, max_iters=1, batch_size=4, eval_iters=1,
                num_eval_samples=0, out_dir=str(tmp_path / "run"))
    train(TrainConfig(**char))
    monkeypatch.chdir(tmp_path / "b")
    resumed = train(TrainConfig(out_dir=str(tmp_path / "run"), max_iters=2, resume=True))
    assert resumed.task.path == tmp_path / "a" / "text.txt"
    assert read_checkpoint(tmp_path / "run" / "ckpt.pt")["train_config"]["text"] == str(tmp_path / "a" / "text.txt")


def test_a_save_removes_the_temporary_files_of_killed_saves_only(tmp_path):
    """Temporary files of this checkpoint left by a process that is gone are removed by the next save; those of
    a live process, of another checkpoint name, or of another pattern are kept."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = tmp_path / f".ckpt.pt.{gone.pid}.0123abcd.tmp"
    kept = [tmp_path / f".ckpt.pt.{os.getppid()}.0123abcd.tmp", tmp_path / f".other.pt.{gone.pid}.0123abcd.tmp",
            tmp_path / f".ckpt.pt.{gone.pid}.notes.tmp", tmp_path / "ckpt.pt.tmp"]
    for path in [stale, *kept]:
        path.write_bytes(b"partial")
    atomic_save({"v": 1}, tmp_path / "ckpt.pt")
    assert not stale.exists() and all(path.exists() for path in kept)


def test_a_source_given_again_at_its_value_keeps_its_derived_field(tmp_path):
    """The permutation recipe's min_lr is lr / 100: --lr given again at the run's value on resume leaves it;
    another --lr derives it again (lr / 10)."""
    train(small_cfg(tmp_path, max_iters=2))
    stored = read_checkpoint(tmp_path / "ckpt.pt")["train_config"]
    assert stored["min_lr"] != stored["lr"] / 10  # the recipe's, not the default derivation
    train(small_cfg(tmp_path, max_iters=3, lr=stored["lr"], resume=True))
    now = read_checkpoint(tmp_path / "ckpt.pt")["train_config"]
    assert (now["lr"], now["min_lr"]) == (stored["lr"], stored["min_lr"])
    train(small_cfg(tmp_path, max_iters=4, lr=2 * stored["lr"], resume=True))
    now = read_checkpoint(tmp_path / "ckpt.pt")["train_config"]
    assert now["min_lr"] == 2 * stored["lr"] / 10


def test_a_checkpoint_of_a_run_shorter_than_its_warmup_from_older_versions_loads_and_resumes(tmp_path):
    """Before the check lr_decay_iters >= warmup_iters, a run shorter than its warm-up stored lr_decay_iters =
    max_iters: the same schedule as lr_decay_iters = warmup_iters, which loading and resuming read it as."""
    train(small_cfg(tmp_path, max_iters=2))
    path = tmp_path / "ckpt.pt"
    ckpt = read_checkpoint(path)
    ckpt["train_config"].update(max_iters=3, lr_decay_iters=3, warmup_iters=5)
    atomic_save(ckpt, path)
    _, _, cfg = load_checkpoint(path)
    assert (cfg.lr_decay_iters, cfg.warmup_iters) == (5, 5)
    train(TrainConfig(out_dir=str(tmp_path), resume=True))  # a bare resume: the stored run's last step
    assert read_checkpoint(path)["iter"] == 3
