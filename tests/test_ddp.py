"""DDP on CPU: 2 gloo processes through torch.multiprocessing, against one process with the same global batch."""

import os
import signal
import socket
import time
from typing import Optional

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sigmafast.checkpoint import read_checkpoint
from sigmafast.train import TrainConfig, train

WORLD = 2


def config(out_dir, **kw) -> TrainConfig:
    # grad_accum is global: 4 micro-steps, two per rank under DDP (gradients synchronised on the last only), all
    # four on the single process
    return TrainConfig(**{**dict(task="permutation", seq_len=12, preset="tiny", batch_size=8, grad_accum=4,
                                 max_iters=6, warmup_iters=1, lr=3e-3, eval_interval=3, eval_iters=2, log_interval=1,
                                 num_eval_samples=0, out_dir=str(out_dir)), **kw})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, port: int, out_dir: str, result_dir: str, kw: Optional[dict] = None) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD))
    result = train(config(out_dir, **(kw or {})))
    assert not dist.is_initialized(), "train() destroys the process group it created"
    torch.save(
        {"params": [p.detach() for p in result.model.parameters()],
         "losses": [e["loss"] for e in result.train_log], "history": result.history},
        os.path.join(result_dir, f"rank{rank}.pt"),
    )


@pytest.mark.slow
def test_ddp_two_cpu_ranks_match_single_process(tmp_path, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    ddp_out, results = tmp_path / "ddp", tmp_path / "results"
    results.mkdir()
    mp.spawn(worker, args=(free_port(), str(ddp_out), str(results)), nprocs=WORLD, join=True)
    ranks = [torch.load(results / f"rank{r}.pt") for r in range(WORLD)]

    for p0, p1 in zip(ranks[0]["params"], ranks[1]["params"]):
        assert torch.equal(p0, p1)
    assert ranks[0]["losses"] == ranks[1]["losses"]  # the logged loss is the mean over ranks
    assert len(ranks[0]["history"]) == 3 and ranks[1]["history"] == []  # only rank 0 evaluates

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = train(config(tmp_path / "single"))
    finally:
        torch.set_num_threads(before)
    assert ranks[0]["losses"] == pytest.approx([e["loss"] for e in single.train_log], abs=1e-5)
    assert ranks[0]["losses"][-1] < ranks[0]["losses"][0]
    for p_ddp, p_single in zip(ranks[0]["params"], single.model.parameters()):
        torch.testing.assert_close(p_ddp, p_single.detach(), rtol=1e-4, atol=1e-5)

    assert sorted(os.listdir(ddp_out)) == [".lock", "ckpt.pt"]  # rank 0 holds the lock
    ckpt = read_checkpoint(ddp_out / "ckpt.pt")
    assert ckpt["iter"] == 6 and len(ckpt["rng"]) == WORLD
    assert not torch.equal(ckpt["rng"][0]["torch"], ckpt["rng"][1]["torch"])  # each rank its own dropout masks


class _SigintAfterFirst(list):
    """Validation batches that send this process a SIGINT when the second one is taken."""

    def __iter__(self):
        for i, batch in enumerate(super().__iter__()):
            if i == 1:
                os.kill(os.getpid(), signal.SIGINT)
            yield batch


DROPOUT = 0.1  # the stopped and resumed run's: the ranks' own RNG states matter on resume


def stopping_worker(rank: int, port: int, out_dir: str, result_dir: str) -> None:
    """A rank of the run of :func:`config` with dropout; rank 0 gets a SIGINT inside its iter-3 evaluation, after
    its first validation batch, and the other rank gets none."""
    import sigmafast.train as train_mod

    real, calls = train_mod.estimate_val_loss, []

    def estimate(model, batches, *args, **kwargs):
        calls.append(None)
        return real(model, _SigintAfterFirst(batches) if len(calls) == 3 else batches, *args, **kwargs)

    train_mod.estimate_val_loss = estimate  # a spawned process: nothing to restore
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD))
    result = train(config(out_dir, dropout=DROPOUT))
    torch.save({"interrupted": result.interrupted, "history": result.history,
                "steps": [e["iter"] for e in result.train_log]}, os.path.join(result_dir, f"rank{rank}.pt"))


@pytest.mark.slow
def test_ddp_stop_request_during_rank0_evaluation_stops_every_rank_and_resume_matches(tmp_path, monkeypatch):
    """Only rank 0 evaluates: a stop request there abandons its evaluation, and the collective stop decision
    takes every rank to the same checkpoint, with no deadlock. Resumed under DDP, each rank with its own stored
    RNG state (dropout masks), the run ends as the uninterrupted DDP run does, bit for bit."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    out, results = tmp_path / "ddp", tmp_path / "results"
    results.mkdir()
    ctx = mp.spawn(stopping_worker, args=(free_port(), str(out), str(results)), nprocs=WORLD, join=False)
    deadline = time.monotonic() + 300
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("the ranks did not finish within 300 s (a deadlock?)")
    ranks = [torch.load(results / f"rank{r}.pt") for r in range(WORLD)]
    assert [r["interrupted"] for r in ranks] == [True, True]
    assert ranks[0]["steps"] == ranks[1]["steps"] == [0, 1, 2]
    assert [h["iter"] for h in ranks[0]["history"]] == [0] and ranks[1]["history"] == []
    ckpt = read_checkpoint(out / "ckpt.pt")
    assert ckpt["iter"] == 3 and len(ckpt["rng"]) == WORLD and [h["iter"] for h in ckpt["history"]] == [0]

    kw = dict(dropout=DROPOUT)
    mp.spawn(worker, args=(free_port(), str(out), str(results), {**kw, "resume": True}), nprocs=WORLD, join=True)
    mp.spawn(worker, args=(free_port(), str(tmp_path / "straight"), str(results), kw), nprocs=WORLD, join=True)
    a, b = read_checkpoint(tmp_path / "straight" / "ckpt.pt"), read_checkpoint(out / "ckpt.pt")
    assert b["iter"] == a["iter"] == 6 and b["history"] == a["history"]
    for name, weight in a["model"].items():
        assert torch.equal(weight, b["model"][name]), name
