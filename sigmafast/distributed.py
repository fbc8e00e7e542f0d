"""Process layout for training: one process, or DDP ranks started by ``torchrun``.

Only torch.distributed collectives are used. Under NCCL a second, gloo group
carries the small CPU-side messages (stop flag, RNG states) so that they never
synchronise the GPU stream.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist


@dataclass
class Layout:
    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    control_group: Optional[object] = None  # gloo group for CPU objects; None = the default group
    owns_group: bool = False  # this process created the group, so it destroys it

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def mean(self, t: torch.Tensor) -> torch.Tensor:
        """Mean of ``t`` over ranks (``t`` itself in one process)."""
        if not self.distributed:
            return t
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t / self.world_size

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on some rank."""
        if not self.distributed:
            return flag
        t = torch.tensor([int(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.control_group)
        return bool(t[0])

    def gather(self, obj) -> list:
        """``[obj of rank 0, obj of rank 1, ...]`` on every rank."""
        if not self.distributed:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.control_group)
        return out

    def close(self) -> None:
        if self.owns_group:
            dist.destroy_process_group()


def select_device(name: str, local_rank: int = 0, distributed: bool = False) -> torch.device:
    """``auto`` -> CUDA when available, else CPU; plain ``cuda`` under DDP -> ``cuda:LOCAL_RANK``."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    if name == "cuda" and distributed:
        name = f"cuda:{local_rank}"
    dev = torch.device(name)
    if dev.type == "cuda" and dev.index is not None:
        if dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s) are visible")
        if distributed and dev.index != local_rank:
            raise ValueError(f"device {name!r} under torchrun: pass --device cuda (each rank takes cuda:LOCAL_RANK)")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError("device 'mps' requested but MPS is not available")
    return dev


def init_layout(device: str = "auto") -> Layout:
    """Join the ``torchrun`` process group when ``WORLD_SIZE`` > 1 (NCCL on CUDA, gloo on CPU)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return Layout(device=select_device(device))
    if "RANK" not in os.environ:
        raise ValueError("WORLD_SIZE > 1 but RANK is not set: launch with torchrun")
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    dev = select_device(device, local_rank, distributed=True)
    owns = not dist.is_initialized()
    if owns:
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo", timeout=timedelta(minutes=30))
    control = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
    return Layout(rank=rank, world_size=world_size, device=dev, control_group=control, owns_group=owns)
