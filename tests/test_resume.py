"""Resuming a run: SIGINT / SIGTERM checkpoints, bitwise continuation, and the stored run's config."""

import logging
import signal

import pytest
import torch

from sigmafast import train_config
from sigmafast.checkpoint import read_checkpoint
from sigmafast.signals import StopRequest
from sigmafast.train import TrainConfig, train
from helpers import signal_in_val_loss, signals_at_step, small_cfg, train_script

pytestmark = pytest.mark.usefixtures("one_thread")


def losses(result) -> dict[int, float]:
    return {e["iter"]: e["loss"] for e in result.train_log}


def test_resume_after_sigterm_matches_uninterrupted_run(tmp_path):
    kw = dict(order="curriculum", dropout=0.1, grad_accum=2, max_iters=10)
    straight = train(small_cfg(tmp_path / "a", **kw))

    handler_before = signal.getsignal(signal.SIGTERM)
    with pytest.MonkeyPatch.context() as mp:
        signals_at_step(mp, 4, signal.SIGTERM)
        first = train(small_cfg(tmp_path / "b", **kw))
    assert first.interrupted and first.stop_signal == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is handler_before
    assert read_checkpoint(first.checkpoint_path)["iter"] == 5
    assert sorted(losses(first)) == list(range(5))

    second = train(small_cfg(tmp_path / "b", resume=True, **kw))
    assert not second.interrupted
    assert sorted(losses(second)) == list(range(5, 10))
    combined = {**losses(first), **losses(second)}
    assert combined == losses(straight)  # bitwise
    assert [h["iter"] for h in second.history] == [0, 4, 8, 10]
    assert second.history == straight.history
    for p, q in zip(straight.model.parameters(), second.model.parameters()):
        assert torch.equal(p, q)


def test_resume_keeps_the_best_validation_losses_of_the_stored_run(tmp_path):
    """The best validation losses are the whole run's, not the resumed part's: a best stored in the checkpoint
    (here lower than any evaluation of the resumed part reaches) is kept, and a resumed run's evaluations
    lower it only where they do better."""
    train(small_cfg(tmp_path, max_iters=4))
    path = tmp_path / "ckpt.pt"
    ckpt = read_checkpoint(path)
    ckpt["best_val_loss"] = {"random": 0.25, "l2r": 1e9}  # l2r: any evaluation does better
    torch.save(ckpt, path)
    resumed = train(small_cfg(tmp_path, max_iters=8, resume=True))
    assert [h["iter"] for h in resumed.history] == [0, 4, 8]
    best = read_checkpoint(path)["best_val_loss"]
    assert best == {"random": 0.25, "l2r": min(h["val_loss_l2r"] for h in resumed.history[2:])}


def test_extending_a_run_with_pinned_schedules_matches_the_longer_run(tmp_path):
    """A run stopped at its max_iters and resumed with a larger one is the longer run when the schedules that
    max_iters would set are pinned: the learning rate's decay and the curriculum's left-to-right share."""
    pinned = dict(order="curriculum", lr_decay_iters=8, curriculum_iters=8)
    straight = train(small_cfg(tmp_path / "a", max_iters=8, **pinned))
    train(small_cfg(tmp_path / "b", max_iters=4, **pinned))
    extended = train(TrainConfig(out_dir=str(tmp_path / "b"), resume=True, max_iters=8))
    assert read_checkpoint(tmp_path / "b" / "ckpt.pt")["train_config"]["curriculum_iters"] == 8
    assert [e["l2r_fraction"] for e in extended.train_log] == [e["l2r_fraction"] for e in straight.train_log[4:]]
    for p, q in zip(straight.model.parameters(), extended.model.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("first,second,error", [
    (signal.SIGTERM, signal.SIGTERM, SystemExit), (signal.SIGINT, signal.SIGTERM, SystemExit),
    (signal.SIGTERM, signal.SIGINT, KeyboardInterrupt), (signal.SIGINT, signal.SIGINT, KeyboardInterrupt),
], ids=["term-term", "int-term", "term-int", "int-int"])
def test_first_signal_asks_to_stop_once_and_a_second_exits_at_once(first, second, error, caplog):
    caplog.set_level(logging.WARNING, logger="sigmafast.train")
    handlers_before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with pytest.raises(error) as info:
        with StopRequest() as stop:
            signal.raise_signal(first)
            assert stop.requested
            signal.raise_signal(second)
            raise AssertionError("the second signal did not exit")
    if error is SystemExit:
        assert info.value.code == 128 + signal.SIGTERM
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers_before
    messages = [r.getMessage() for r in caplog.records]
    assert sum("saving a checkpoint and stopping" in m for m in messages) == 1, messages
    assert sum("exiting now, without a checkpoint" in m for m in messages) == 1, messages


def test_second_sigterm_stops_training_at_once(tmp_path, monkeypatch):
    """Two SIGTERMs inside a step: the run ends there, without finishing the step or saving."""
    signals_at_step(monkeypatch, 2, signal.SIGTERM, signal.SIGTERM)
    with pytest.raises(SystemExit):
        train(small_cfg(tmp_path, max_iters=50, eval_interval=50))
    assert not (tmp_path / "ckpt.pt").exists()


def test_resume_continues_the_stored_run_after_the_recipe_changes(tmp_path, monkeypatch):
    """Fields left unset on --resume come from the checkpoint, not from a recipe changed since (a newer
    version); a field an older checkpoint lacks takes its value from before the recipes; an explicit flag
    wins, and a derived field follows an explicit source."""
    first = train(small_cfg(tmp_path, task="product", loss_weighting="uniform", max_iters=2))
    stored = read_checkpoint(first.checkpoint_path)["train_config"]
    ckpt = read_checkpoint(first.checkpoint_path)
    del ckpt["train_config"]["loss_weighting"]  # a checkpoint from before the option
    torch.save(ckpt, first.checkpoint_path)
    monkeypatch.setitem(train_config.TASK_RECIPES, "product", dict(
        loss_weighting="visited", pos_encoding="rope", mlp_ratio=0, final_norm="scalar", lr=1e-2, batch_size=4))
    resumed = dict(task="product", seq_len=12, out_dir=str(tmp_path), resume=True, log_interval=1)
    train(TrainConfig(**resumed, max_iters=3))
    now = read_checkpoint(first.checkpoint_path)
    assert now["iter"] == 3 and now["model_config"] == ckpt["model_config"]
    skip = {"max_iters", "resume", "lr_decay_iters", "curriculum_iters", *train_config.ARCH_FIELDS}  # model: above
    assert {k: v for k, v in now["train_config"].items() if k not in skip} \
        == {k: v for k, v in stored.items() if k not in skip}
    assert now["train_config"]["lr_decay_iters"] == now["train_config"]["curriculum_iters"] == 3  # the new max_iters
    train(TrainConfig(**resumed, max_iters=4, loss_weighting="visited", lr=2e-3))  # explicit flags win
    now = read_checkpoint(first.checkpoint_path)["train_config"]
    assert (now["loss_weighting"], now["lr"], now["min_lr"]) == ("visited", 2e-3, 2e-4)
    assert now["batch_size"] == stored["batch_size"]


def test_resume_reads_missing_model_fields_as_their_defaults(tmp_path):
    """A checkpoint written before ``mlp_ratio``, ``embedding_init`` and ``final_norm`` existed resumes:
    its model was built with their defaults."""
    first = train(small_cfg(tmp_path, task="product", max_iters=2))  # a task without a recipe
    ckpt = read_checkpoint(first.checkpoint_path)
    for name in ("mlp_ratio", "embedding_init", "final_norm"):
        del ckpt["model_config"][name]
    torch.save(ckpt, first.checkpoint_path)
    train(small_cfg(tmp_path, task="product", max_iters=3, resume=True))
    assert read_checkpoint(first.checkpoint_path)["iter"] == 3
    with pytest.raises(ValueError, match="mlp_ratio: checkpoint 4, now 0"):
        train(small_cfg(tmp_path, task="product", max_iters=4, resume=True, mlp_ratio=0))


# A run started with values other than the defaults of task, seed, grad_clip, log_interval, dtype and more.
OWN_FLAGS = ["--task", "step", "--seq-len", "20", "--seed", "5", "--grad-clip", "0.01", "--log-interval", "2",
             "--dtype", "float32", "--batch-size", "4", "--warmup-iters", "1", "--eval-interval", "2",
             "--eval-iters", "1", "--num-eval-samples", "0", "--weight-decay", "0.05", "--beta1", "0.8"]


@pytest.mark.parametrize("flags", [
    OWN_FLAGS,
    OWN_FLAGS + ["--objective", "diffusion", "--diffusion-noise", "absorbing"],
], ids=["sigma", "diffusion"])
def test_script_resume_with_only_out_dir_continues_the_run(flags, tmp_path, capsys):
    """``--resume --out-dir D --max-iters N``, no other flag: every setting comes from the checkpoint, so
    the run ends where the uninterrupted one does, bit for bit."""
    script = train_script()
    flags = flags + ["--lr-decay-iters", "5"]  # the straight run's schedule in the first part of the split one
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert script.main(flags + ["--max-iters", "5", "--out-dir", str(straight)]) == 0
    assert script.main(flags + ["--max-iters", "4", "--out-dir", str(split)]) == 0  # at an evaluation
    assert script.main(["--resume", "--out-dir", str(split), "--max-iters", "5"]) == 0
    assert "error" not in capsys.readouterr().err
    a, b = read_checkpoint(straight / "ckpt.pt"), read_checkpoint(split / "ckpt.pt")
    assert b["iter"] == 5 and b["history"] == a["history"]
    assert (a["objective"], a["diffusion_config"]) == (b["objective"], b["diffusion_config"])
    assert a["model"].keys() == b["model"].keys()
    for name, weight in a["model"].items():
        assert torch.equal(weight, b["model"][name]), name
    differ = {k for k in a["train_config"] if a["train_config"][k] != b["train_config"][k]}
    assert differ - set(train_config.ARCH_FIELDS) == {"out_dir", "resume"}, differ


def test_script_flags_given_on_resume_win_even_at_their_defaults(tmp_path, caplog):
    script = train_script()
    assert script.main(OWN_FLAGS + ["--max-iters", "2", "--out-dir", str(tmp_path)]) == 0
    before = read_checkpoint(tmp_path / "ckpt.pt")["train_config"]
    caplog.set_level(logging.WARNING, logger="sigmafast.train")
    assert script.main(["--resume", "--out-dir", str(tmp_path), "--max-iters", "3", "--seed", "1337",
                        "--grad-clip", "1.0", "--lr", "1e-3", "--weight-decay", str(before["weight_decay"])]) == 0
    changed = (f"grad_clip: {before['grad_clip']!r} -> 1.0; lr: {before['lr']!r} -> 0.001; "
               f"seed: {before['seed']!r} -> 1337")
    assert [r.getMessage() for r in caplog.records] == [
        f"resuming with changed settings ({changed}): the run goes on with them"]  # not max_iters, nor an equal value
    stored = read_checkpoint(tmp_path / "ckpt.pt")["train_config"]
    assert (stored["seed"], stored["grad_clip"], stored["lr"], stored["min_lr"]) == (1337, 1.0, 1e-3, 1e-4)
    assert (stored["task"], stored["weight_decay"], stored["lr_decay_iters"]) == ("step", 0.05, 3)


def test_explicit_fields_are_the_ones_passed():
    assert TrainConfig(seed=1337, lr=None).explicit_fields() == {"seed", "lr"}  # even at their defaults
    assert TrainConfig("step").explicit_fields() == {"task"} and TrainConfig().explicit_fields() == set()
    assert train_config.resolve(TrainConfig(), 12).explicit_fields() == set(TrainConfig().to_dict())


def test_resume_config_takes_every_field_not_passed_from_the_checkpoint():
    stored = train_config.resolve(TrainConfig(task="step", seed=5, grad_clip=0.01, objective="diffusion",
                                              log_interval=3, dtype="float32", compile=True), 100).to_dict()
    model = {"n_layer": 2}
    resumed = train_config.resume_config(TrainConfig(out_dir="elsewhere", resume=True), stored, model)
    assert resumed == TrainConfig(**{**stored, "n_layer": 2, "out_dir": "elsewhere", "resume": True})
    given = train_config.resume_config(TrainConfig(seed=1337, objective="sigma", max_iters=7), stored, model)
    assert (given.seed, given.objective, given.grad_clip, given.max_iters, given.lr_decay_iters) \
        == (1337, "sigma", 0.01, 7, None)  # lr_decay_iters is derived again from the new max_iters
    warm = train_config.resume_config(TrainConfig(warmup_iters=stored["lr_decay_iters"] + 1), stored, model)
    assert warm.lr_decay_iters is None  # and from a new warm-up: the stored one would end before it
    explicit = train_config.resume_config(TrainConfig(warmup_iters=1), stored, model, frozenset({"lr_decay_iters"}))
    assert explicit.lr_decay_iters == stored["lr_decay_iters"]  # unless the stored run was given it


@pytest.mark.parametrize("max_iters", [2, 1])
def test_script_resume_with_nothing_to_train_says_so(max_iters, tmp_path, caplog):
    script = train_script()
    assert script.main(OWN_FLAGS + ["--max-iters", "2", "--out-dir", str(tmp_path)]) == 0
    before = (tmp_path / "ckpt.pt").read_bytes()
    caplog.clear()
    caplog.set_level(logging.WARNING, logger="sigmafast.train")
    assert script.main(["--resume", "--out-dir", str(tmp_path), "--max-iters", str(max_iters)]) == 0
    assert [r.getMessage() for r in caplog.records] == [
        f"nothing to train: the checkpoint is at iter 2 and max_iters is {max_iters}; pass a larger --max-iters "
        "to train on"]
    assert (tmp_path / "ckpt.pt").read_bytes() == before
    caplog.clear()
    assert script.main(["--resume", "--out-dir", str(tmp_path)]) == 0  # max_iters from the checkpoint: 2
    assert "max_iters is 2" in caplog.text


def test_resume_with_another_task_names_the_checkpoints(tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("the cat sat on the mat. " * 40)
    script = train_script()
    out = ["--out-dir", str(tmp_path / "char")]
    char = ["--task", "char", "--text", str(text), "--seq-len", "8", "--max-iters", "1", "--eval-iters", "1",
            "--num-eval-samples", "0", "--batch-size", "4"]
    assert script.main(char + out) == 0
    capsys.readouterr()
    assert script.main(["--task", "step", "--resume", "--max-iters", "2"] + out) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --task 'step': checkpoint ") and err.count("\n") == 1, err
    assert "was written for task 'char'; leave --task out" in err
    assert script.main(["--resume", "--max-iters", "2"] + out) == 0  # the task, text and seq_len are stored
    assert read_checkpoint(tmp_path / "char" / "ckpt.pt")["iter"] == 2


def test_stop_request_during_evaluation_abandons_it_and_resume_matches(tmp_path, monkeypatch, caplog):
    """A SIGINT in the middle of the iter-4 evaluation (l2r order, after 1 of 50 batches): the evaluation
    stops at the next batch and is not recorded, the iter-4 state is saved, and --resume gives the
    uninterrupted run bit for bit."""
    kw = dict(max_iters=6, eval_iters=50, dropout=0.1)
    straight = train(small_cfg(tmp_path / "a", **kw))
    wrapped = signal_in_val_loss(monkeypatch, call=4)
    caplog.set_level(logging.INFO, logger="sigmafast.train")
    first = train(small_cfg(tmp_path / "b", **kw))
    monkeypatch.undo()
    assert first.interrupted and wrapped[0].taken == 2  # the signal came with batch 1: it was not evaluated
    assert "evaluation at iter 4 abandoned: stopping" in caplog.text
    assert not any(r.getMessage().startswith("eval iter 4") for r in caplog.records)
    ckpt = read_checkpoint(first.checkpoint_path)
    assert ckpt["iter"] == 4 and [h["iter"] for h in ckpt["history"]] == [0]
    assert ckpt["best_val_loss"] == {name: ckpt["history"][0][f"val_loss_{name}"] for name in ("random", "l2r")}
    assert sorted(losses(first)) == list(range(4))

    second = train(small_cfg(tmp_path / "b", resume=True, **kw))
    assert not second.interrupted and second.history == straight.history
    assert {**losses(first), **losses(second)} == losses(straight)
    for p, q in zip(straight.model.parameters(), second.model.parameters()):
        assert torch.equal(p, q)


def test_script_sigint_in_the_first_evaluation_saves_the_initial_state(tmp_path, monkeypatch, capsys):
    """The first evaluation (iter 0, before any step) is stopped too: the run exits at once with the
    initial state saved, so that ``--resume`` continues it."""
    script = train_script()
    flags = OWN_FLAGS + ["--max-iters", "3", "--eval-iters", "500"]
    assert script.main(flags + ["--out-dir", str(tmp_path / "straight")]) == 0
    wrapped = signal_in_val_loss(monkeypatch, call=1)
    assert script.main(flags + ["--out-dir", str(tmp_path / "split")]) == 130
    monkeypatch.undo()
    assert wrapped[0].taken == 2
    ckpt = read_checkpoint(tmp_path / "split" / "ckpt.pt")
    assert ckpt["iter"] == 0 and ckpt["history"] == [] and not ckpt["optimizer"]["state"]
    assert script.main(["--resume", "--out-dir", str(tmp_path / "split")]) == 0
    assert "Traceback" not in capsys.readouterr().err
    a, b = read_checkpoint(tmp_path / "straight" / "ckpt.pt"), read_checkpoint(tmp_path / "split" / "ckpt.pt")
    assert b["iter"] == 3 and b["history"] == a["history"]
    for name, weight in a["model"].items():
        assert torch.equal(weight, b["model"][name]), name


def test_script_checkpoint_write_error_is_an_error_line_and_keeps_the_last_checkpoint(tmp_path, monkeypatch,
                                                                                        capsys):
    script = train_script()
    flags = ["--task", "permutation", "--seq-len", "12", "--preset", "tiny", "--batch-size", "8", "--eval-iters", "2",
             "--eval-interval", "4", "--num-eval-samples", "0", "--out-dir", str(tmp_path)]
    assert script.main(flags + ["--max-iters", "4"]) == 0
    before = read_checkpoint(tmp_path / "ckpt.pt")

    def disk_full(obj, f, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    assert script.main(flags + ["--resume", "--max-iters", "8"]) == 1
    err = capsys.readouterr().err
    assert "error: [Errno 28] No space left on device" in err and "Traceback" not in err
    after = read_checkpoint(tmp_path / "ckpt.pt")
    assert after["iter"] == before["iter"] == 4
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_resume_with_another_preset_is_an_error(tmp_path, capsys):
    """The architecture comes from the checkpoint, so another --preset would only be recorded: refused. The
    same preset, given again, is fine."""
    script = train_script()
    out = ["--out-dir", str(tmp_path)]
    assert script.main(OWN_FLAGS + ["--preset", "tiny", "--max-iters", "2"] + out) == 0
    capsys.readouterr()
    assert script.main(["--resume", "--preset", "small", "--max-iters", "3"] + out) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --preset 'small': checkpoint ") and err.count("\n") == 1, err
    assert "was trained with preset 'tiny', and the architecture must match on resume" in err
    assert read_checkpoint(tmp_path / "ckpt.pt")["iter"] == 2
    assert script.main(["--resume", "--preset", "tiny", "--max-iters", "3"] + out) == 0
    ckpt = read_checkpoint(tmp_path / "ckpt.pt")
    assert ckpt["iter"] == 3 and ckpt["train_config"]["preset"] == "tiny"


def test_resume_may_change_dropout(tmp_path, caplog):
    """Dropout changes no weight: --resume accepts another value and the model trains on with it. Another
    depth is refused, before any word that the run goes on with it."""
    train(small_cfg(tmp_path, max_iters=2, dropout=0.0))
    result = train(small_cfg(tmp_path, max_iters=3, dropout=0.2, resume=True))
    assert result.model.config.dropout == 0.2
    ckpt = read_checkpoint(tmp_path / "ckpt.pt")
    assert ckpt["iter"] == 3 and ckpt["model_config"]["dropout"] == 0.2 and ckpt["train_config"]["dropout"] == 0.2
    caplog.set_level(logging.INFO, logger="sigmafast.train")
    caplog.clear()
    with pytest.raises(ValueError, match=r"another configuration: n_layer: checkpoint 1, now 3\. A resumed run keeps "
                                         r"its checkpoint's objective, architecture and task: leave those flags out"):
        train(small_cfg(tmp_path, max_iters=4, dropout=0.1, n_layer=3, resume=True))  # the weights must match
    assert not any("changed settings" in r.getMessage() or "peak memory" in r.getMessage() for r in caplog.records)
