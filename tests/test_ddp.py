"""DDP on CPU: 2 gloo processes through torch.multiprocessing, against one process with the same global batch."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sigmafast.checkpoint import read_checkpoint
from sigmafast.train import TrainConfig, train

WORLD = 2


def config(out_dir) -> TrainConfig:
    # grad_accum is global: 2 micro-steps, one per rank under DDP, both on the single process
    return TrainConfig(task="permutation", seq_len=12, preset="tiny", batch_size=8, grad_accum=2, max_iters=6,
                       warmup_iters=1, lr=3e-3, eval_interval=3, eval_iters=2, log_interval=1,
                       num_eval_samples=0, out_dir=str(out_dir))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, port: int, out_dir: str, result_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD))
    result = train(config(out_dir))
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

    assert sorted(os.listdir(ddp_out)) == ["ckpt.pt"]
    ckpt = read_checkpoint(ddp_out / "ckpt.pt")
    assert ckpt["iter"] == 6 and len(ckpt["rng"]) == WORLD
