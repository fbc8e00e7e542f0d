"""Resuming a run: SIGINT / SIGTERM checkpoints, bitwise continuation, and the stored run's config."""

import logging
import os
import signal

import pytest
import torch

import sigmafast.train as train_mod
from sigmafast import train_config
from sigmafast.checkpoint import read_checkpoint
from sigmafast.signals import StopRequest
from sigmafast.train import TrainConfig, train
from helpers import small_cfg

pytestmark = pytest.mark.usefixtures("one_thread")


def losses(result) -> dict[int, float]:
    return {e["iter"]: e["loss"] for e in result.train_log}


def test_resume_after_sigterm_matches_uninterrupted_run(tmp_path, monkeypatch):
    kw = dict(order="curriculum", dropout=0.1, grad_accum=2, max_iters=10)
    straight = train(small_cfg(tmp_path / "a", **kw))

    real_get_batch = train_mod.get_batch

    def get_batch_then_sigterm(task, cfg, step, index, start_pos, device):
        if step == 4 and index == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_get_batch(task, cfg, step, index, start_pos, device)

    handler_before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(train_mod, "get_batch", get_batch_then_sigterm)
    first = train(small_cfg(tmp_path / "b", **kw))
    monkeypatch.setattr(train_mod, "get_batch", real_get_batch)
    assert first.interrupted and signal.getsignal(signal.SIGTERM) is handler_before
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
    real_get_batch = train_mod.get_batch

    def get_batch_then_two_sigterms(task, cfg, step, index, start_pos, device):
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
        return real_get_batch(task, cfg, step, index, start_pos, device)

    monkeypatch.setattr(train_mod, "get_batch", get_batch_then_two_sigterms)
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
    skip = {"max_iters", "resume", "lr_decay_iters", *train_config.ARCH_FIELDS}  # the model is compared above
    assert {k: v for k, v in now["train_config"].items() if k not in skip} \
        == {k: v for k, v in stored.items() if k not in skip}
    assert now["train_config"]["lr_decay_iters"] == 3  # derived from the new max_iters
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
