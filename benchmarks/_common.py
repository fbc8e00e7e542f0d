"""Device labels, NVML readings, environment switches and sampling-statistics summaries."""

from __future__ import annotations

import os
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DIR = REPO_ROOT.parent / "shared"


def bench_full() -> bool:
    """``SIGMAFAST_BENCH_FULL=1``: paper-scale sizes instead of the 2-core-CPU defaults."""
    return os.environ.get("SIGMAFAST_BENCH_FULL", "") not in ("", "0")


def sample_count(default: int) -> int:
    """``SIGMAFAST_BENCH_SAMPLES=N``: sequences per quality figure, overriding ``default`` (the models stay
    the budget's own, so a CPU run can reach >= 1000 samples without paper-scale training)."""
    value = os.environ.get("SIGMAFAST_BENCH_SAMPLES", "")
    if not value:
        return default
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"SIGMAFAST_BENCH_SAMPLES must be an integer >= 1, got {value!r}")
    return int(value)


def cache_root() -> Path:
    env = os.environ.get("SIGMAFAST_CACHE")
    path = Path(env).expanduser() if env else Path.home() / ".cache" / "sigmafast" / "bench"
    path.mkdir(parents=True, exist_ok=True)
    return path


def cpu_label() -> str:
    name = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"CPU: {name}, {cores} cores"


def nvml_readings(index: int = 0) -> dict:
    """GPU name, memory used and power from nvidia-ml-py; {} when unavailable."""
    try:
        import pynvml
    except ImportError:
        return {}
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver / not an NVIDIA machine
        return {}
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        name = pynvml.nvmlDeviceGetName(handle)
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        out = {
            "nvml_gpu_name": name.decode() if isinstance(name, bytes) else name,
            "nvml_memory_used_mib": mem.used / 2**20,
            "nvml_memory_total_mib": mem.total / 2**20,
        }
        try:
            out["nvml_power_w"] = pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0
        except Exception:  # noqa: BLE001 - some boards do not report power
            pass
        return out
    finally:
        pynvml.nvmlShutdown()


def bench_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def device_label(device: torch.device) -> str:
    if device.type == "cuda":
        return f"GPU: {torch.cuda.get_device_name(device)}"
    return cpu_label()


def device_info(device: torch.device) -> dict:
    """Device fields for ``benchmark.extra_info`` (NVML readings taken now on CUDA)."""
    info = {"device": device_label(device)}
    if device.type == "cuda":
        info.update(nvml_readings(device.index or 0))
    return info


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def summarize(stats, n_generated: torch.Tensor) -> dict:
    """Per-call figures of a ``SampleStats``: iterations (mean/std over rows), model forward
    calls, generated tokens per iteration, and the chosen orders' mean accepted prefix."""
    iters = stats.iterations.double().cpu()
    gen = n_generated.double().cpu()
    out = {
        "iterations_mean": float(iters.mean()),
        "iterations_std": float(iters.std()) if iters.numel() > 1 else 0.0,
        "iterations_max": int(iters.max()),
        "forward_calls": int(stats.forward_calls),
        "accepted_per_iter": float((gen / iters.clamp_min(1)).mean()),
        "sampler_wall_s": float(stats.wall_time),
    }
    if stats.burst_lengths is not None:
        lens = stats.burst_lengths.double().cpu()
        active = stats.accepted.cpu() > 0
        out["burst_prefix_mean"] = float(lens[active].mean()) if bool(active.any()) else 0.0
    return out


def primary_metric(task, metrics: dict) -> tuple:
    """(name, value) of the task's headline validity figure, (None, None) when it has none."""
    for name in ("valid", "correct", "ones_rate"):
        if name in metrics:
            return name, float(metrics[name])
    return None, None
