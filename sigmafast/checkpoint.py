"""Checkpoints: atomic writes, compatibility checks, RNG states and :func:`load_checkpoint`."""

from __future__ import annotations

import os
import re
import zipfile
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.nn as nn

from .diffusion.model import DiffusionConfig, make_model, objective_of
from .files import publish, temp_path
from .model import SigmaGPTConfig
from .train_config import TrainConfig

CKPT_NAME = "ckpt.pt"
LOCK_NAME = ".lock"
REQUIRED_KEYS = frozenset(
    {"model", "optimizer", "model_config", "train_config", "task", "iter", "rng", "best_val_loss", "history"}
)


def checkpoint_path(out_dir) -> Path:
    return Path(out_dir) / CKPT_NAME


def atomic_save(obj, path) -> Path:
    """``torch.save`` to a temporary file in the same folder, then rename it over ``path``
    (:mod:`sigmafast.files`: after a successful save, the temporary files of killed saves to ``path`` are
    removed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        with open(tmp, "xb") as f:  # unlike mkstemp, honours the umask
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        publish(tmp, path)
    except BaseException:
        with suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


def check_writable(folder) -> None:
    """Create and remove a temporary file in ``folder``; the ``OSError`` when that fails (a read-only or
    special folder), so that a run fails at start rather than at its first checkpoint."""
    probe = temp_path(Path(folder) / "write-test")
    with open(probe, "xb"):
        pass
    os.unlink(probe)


@contextmanager
def out_dir_lock(out_dir) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``out_dir/.lock`` for one training run (the kernel drops it when the
    process ends, however it ends, so it never goes stale); a ``ValueError`` naming the holder's process id
    when another run holds it. A no-op where ``fcntl`` is missing (Windows)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    try:
        f = open(Path(out_dir) / LOCK_NAME, "a+")
    except OSError as e:
        raise ValueError(f"TrainConfig.out_dir {str(out_dir)!r} is not writable: {e}") from None
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            raise ValueError(f"TrainConfig.out_dir {str(out_dir)!r} is in use by another training run (process "
                             f"{holder}): wait for it to end, or pick another TrainConfig.out_dir") from None
        f.truncate(0)
        f.write(f"{os.getpid()}\n")
        f.flush()
        yield


def load_error_reason(error: Exception) -> str:
    """The first sentence of the cause of a ``torch.load`` failure, without PyTorch's advice (which,
    for weights-only loading, is to retry unsafely)."""
    text = str(error)
    marker = "WeightsUnpickler error:"
    if marker in text:
        text = text.split(marker, 1)[1]
    text = re.sub(r"^\[enforce fail at [^\]]*\][ .]*", "", text.strip())  # c10's source location
    text = text.split("\n", 1)[0].split(". ", 1)[0].strip().rstrip(".")
    return text or type(error).__name__


def check_device(device) -> torch.device:
    """``device`` as a ``torch.device``; a ``ValueError`` naming it when it is malformed or not present."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be a torch device such as 'cpu', 'cuda' or 'cuda:1', got {device!r}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {str(dev)!r} requested but CUDA is not available: use device 'cpu'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {str(dev)!r}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError("device 'mps' requested but MPS is not available")
    if dev.type == "meta":
        raise ValueError("device 'meta' holds no data, so the model could not run: use device 'cpu' or 'cuda'")
    return dev


def read_checkpoint(path) -> dict:
    """The raw checkpoint dict at ``path`` (tensors on CPU); clear errors when missing or foreign."""
    path = Path(path)
    if path.is_dir():
        inside = path / CKPT_NAME
        hint = f": pass the checkpoint file, {inside}" if inside.is_file() else ", not a checkpoint file"
        raise FileNotFoundError(f"no checkpoint at {path}: it is a directory{hint}")
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    not_torch = not_torch_file(path)
    if not_torch:
        raise ValueError(f"{path} is not a readable sigmafast checkpoint: {not_torch}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several unrelated types for corrupt or foreign files
        raise ValueError(
            f"{path} is not a readable sigmafast checkpoint: torch.load failed (corrupt, or written by something "
            f"else): {load_error_reason(e)}"
        ) from None
    if not isinstance(ckpt, dict):
        raise ValueError(f"{path} is not a sigmafast checkpoint: it holds a {type(ckpt).__name__}, not a dict")
    missing = REQUIRED_KEYS - set(ckpt)
    if missing:
        raise ValueError(f"{path} is not a sigmafast checkpoint: missing keys {sorted(missing)}")
    return ckpt


def not_torch_file(path: Path) -> Optional[str]:
    """Why ``path`` cannot be a file of ``torch.save`` (a zip archive), or None when it may be one."""
    with open(path, "rb") as f:
        head = f.read(16)
    if not head:
        return "the file is empty"
    if not zipfile.is_zipfile(path):
        if head.startswith(b"PK"):
            return "not a complete torch.save file (its zip archive is truncated or damaged)"
        return f"not a torch.save file (not a zip archive; it starts with {head!r})"
    try:
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()  # every member's CRC: torch.load would read damaged tensors silently
    except (zipfile.BadZipFile, OSError, EOFError, RuntimeError) as e:  # RuntimeError: an encrypted member
        return f"its zip archive cannot be read ({e})"
    if damaged is not None:
        return f"the file is corrupt (member {damaged} fails its checksum)"
    return None


def read_resumed(cfg: TrainConfig) -> dict:
    """The checkpoint ``--resume`` continues; clear errors when there is none, or when ``cfg`` names another
    task or preset than the ones it was written for (the architecture comes from the checkpoint, so another
    preset would only be recorded, not built)."""
    path = checkpoint_path(cfg.out_dir)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}: train without --resume first, or fix --out-dir")
    ckpt = read_checkpoint(path)
    stored_task = ckpt["task"]["name"]
    if "task" in cfg.explicit_fields() and cfg.task != stored_task:
        raise ValueError(f"--task {cfg.task!r}: checkpoint {path} was written for task {stored_task!r}; leave "
                         "--task out to continue that run, or pass another --out-dir")
    stored_preset = ckpt["train_config"].get("preset")
    if "preset" in cfg.explicit_fields() and cfg.preset != stored_preset:
        raise ValueError(f"--preset {cfg.preset!r}: checkpoint {path} was trained with preset {stored_preset!r}, "
                         "and the architecture must match on resume; leave --preset out to continue that run, or "
                         "pass another --out-dir")
    return ckpt


def check_new_run(cfg: TrainConfig) -> None:
    """A ``ValueError`` when a run without ``--resume`` would replace the checkpoint in ``cfg.out_dir``
    (unless ``cfg.overwrite``)."""
    path = checkpoint_path(cfg.out_dir)
    if not cfg.resume and not cfg.overwrite and path.exists():
        raise ValueError(f"--out-dir {cfg.out_dir!r} already holds a checkpoint ({path}): pass --resume to continue "
                         "its run, --overwrite to start a new run over it, or another --out-dir")


def claim_out_dir(cfg: TrainConfig, held: ExitStack, locked: bool) -> None:
    """Make ``cfg.out_dir`` a writable folder, or raise a ``ValueError`` saying why it cannot be one. Unless
    ``locked`` (the caller already holds its lock), take the folder's lock into ``held`` and check again that no
    run saved a checkpoint there since :func:`check_new_run`."""
    folder = checkpoint_path(cfg.out_dir).parent
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"TrainConfig.out_dir {cfg.out_dir!r} is a file, not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"TrainConfig.out_dir {cfg.out_dir!r} cannot be created: {e}") from None
    try:  # mkdir accepts an existing folder this process cannot write to
        check_writable(folder)
    except OSError as e:
        raise ValueError(f"TrainConfig.out_dir {cfg.out_dir!r} is not writable: {e}") from None
    if not locked:
        held.enter_context(out_dir_lock(cfg.out_dir))
        check_new_run(cfg)


def task_record(task, kwargs: dict) -> dict:
    """What identifies a task in a checkpoint: its name, its arguments (file paths made absolute, so
    that :func:`load_checkpoint` works from any directory, plus what the task learned from its data,
    ``task.checkpoint_kwargs()``) and its shape."""
    paths = {k: str(Path(v).resolve()) for k, v in kwargs.items() if k in ("text", "data_dir", "csv")}
    learned = task.checkpoint_kwargs()
    return {"name": task.name, "kwargs": {**kwargs, **paths, **learned}, "seq_len": task.seq_len,
            "vocab_size": task.vocab_size}


def stored_objective(ckpt: dict) -> tuple[str, Optional[DiffusionConfig]]:
    """The checkpoint's objective and diffusion config; checkpoints older than the field hold "sigma"."""
    objective = ckpt.get("objective", "sigma")
    diffusion = ckpt.get("diffusion_config")
    return objective, None if diffusion is None else DiffusionConfig.from_dict(diffusion)


def stored_train_config(ckpt: dict) -> dict:
    """The checkpoint's TrainConfig fields. Older versions stored ``lr_decay_iters = max_iters < warmup_iters``
    for a run shorter than its warm-up, which the config now refuses; :func:`~sigmafast.optim.learning_rate`
    gives it the schedule of ``lr_decay_iters = warmup_iters`` (all warm-up, then ``min_lr``), so it is read
    as that."""
    d = dict(ckpt["train_config"])
    if None not in (d.get("lr_decay_iters"), d.get("warmup_iters")) and d["lr_decay_iters"] < d["warmup_iters"]:
        d["lr_decay_iters"] = d["warmup_iters"]
    return d


def stored_model_config(ckpt: dict) -> SigmaGPTConfig:
    """The checkpoint's model config; fields added since it was written read as their defaults (the model
    it was built with)."""
    return SigmaGPTConfig.from_dict(ckpt["model_config"])


# Model config fields that change no weight, only training: they may differ on resume.
RESUMABLE_MODEL_FIELDS = frozenset({"dropout"})


def check_compatible(ckpt: dict, model_config: SigmaGPTConfig, task: dict, path, objective: str = "sigma",
                     diffusion: Optional[DiffusionConfig] = None) -> None:
    """Raise ``ValueError`` listing every objective, architecture or task field that differs from the
    checkpoint (:data:`RESUMABLE_MODEL_FIELDS`, such as dropout, may change)."""
    diffs = []
    was = stored_objective(ckpt)
    if was != (objective, diffusion):
        diffs.append(f"objective: checkpoint {was[0]!r} {was[1]}, now {objective!r} {diffusion}")
    stored, now = stored_model_config(ckpt).to_dict(), model_config.to_dict()
    for k in sorted((set(stored) | set(now)) - RESUMABLE_MODEL_FIELDS):
        if stored.get(k) != now.get(k):
            diffs.append(f"{k}: checkpoint {stored.get(k)!r}, now {now.get(k)!r}")
    for k in ("name", "seq_len", "vocab_size"):
        if ckpt["task"].get(k) != task.get(k):
            diffs.append(f"task {k}: checkpoint {ckpt['task'].get(k)!r}, now {task.get(k)!r}")
    if diffs:
        raise ValueError(f"checkpoint {path} was written by another configuration: " + "; ".join(diffs) + ". A "
                         "resumed run keeps its checkpoint's objective, architecture and task: leave those flags "
                         "out, or start a new run (--overwrite, or another --out-dir)")


def rng_state(device: torch.device) -> dict:
    """This process's global torch RNG states (CPU, and the current CUDA device if any)."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return {"torch": torch.get_rng_state(), "cuda": cuda}


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state.get("cuda") is not None:
        torch.cuda.set_rng_state(state["cuda"], device)


def load_checkpoint(path, device="cpu") -> tuple[nn.Module, object, TrainConfig]:
    """``(model, task, train_cfg)`` from a checkpoint; the model is in eval mode on ``device``.

    The model is a :class:`~sigmafast.model.SigmaGPT` or, for a checkpoint of objective
    "diffusion", a :class:`~sigmafast.diffusion.DiffusionGPT`.

    The task is rebuilt through ``get_task`` with the arguments stored at training time.
    """
    from .tasks import get_task

    device = check_device(device)
    ckpt = read_checkpoint(path)
    train_cfg = TrainConfig.from_dict(stored_train_config(ckpt))
    task = get_task(ckpt["task"]["name"], **ckpt["task"]["kwargs"])
    model = make_model(stored_model_config(ckpt), *stored_objective(ckpt))
    model.load_state_dict(ckpt["model"])
    return model.to(device).eval(), task, train_cfg


def build_checkpoint(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    train_cfg: TrainConfig,
    task: dict,
    iteration: int,
    rng: list,
    best_val_loss: dict,
    history: list,
    explicit: frozenset = frozenset(),
) -> dict:
    """The checkpoint dict; ``rng`` holds one :func:`rng_state` per DDP rank, ``explicit`` the TrainConfig
    fields the run was given explicitly (kept on ``--resume``, see :func:`~sigmafast.train_config.resume_config`)."""
    diffusion = getattr(model, "diffusion_config", None)
    return {
        "objective": objective_of(model),
        "diffusion_config": None if diffusion is None else diffusion.to_dict(),
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "model_config": model.config.to_dict(),
        "train_config": train_cfg.to_dict(),
        "task": task,
        "iter": iteration,
        "rng": rng,
        "best_val_loss": dict(best_val_loss),
        "history": list(history),
        "explicit_fields": sorted(explicit),
    }
