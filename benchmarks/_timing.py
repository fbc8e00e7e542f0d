"""GPU timers for the kernel benchmarks: copy bandwidth, and CUDA-graph replays with L2 flushed."""

from __future__ import annotations

import statistics

import torch


def copy_bandwidth_gbps() -> float:
    """Measured device-to-device copy bandwidth (read + write bytes per second), in GB/s."""
    from triton.testing import do_bench

    src = torch.empty(2**28, dtype=torch.float32, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=10, rep=50)
    return 2 * src.numel() * 4 / ms / 1e6


def read_flushed_ms(replay, reps: int = 100) -> float:
    """Median ms of ``replay`` with L2 flushed by reading a 256 MB buffer before each call. ``do_bench``
    flushes by writing zeros to one, which leaves L2 full of dirty lines (about 50 MB on an H100 or H200)
    that the timed call must write back while it reads: half again the bytes of the L = 4096 attention
    case. This timing leaves L2 cold and clean, so it is the kernel's own bandwidth."""
    flush = torch.zeros(2**26, dtype=torch.float32, device="cuda")  # 256 MB, as do_bench's buffer
    sink = torch.empty((), dtype=torch.float32, device="cuda")
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for _ in range(3):
        replay()
    for start, end in zip(starts, ends):
        torch.sum(flush, dim=0, out=sink)
        start.record()
        replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in zip(starts, ends))


def graph_timings(fn):
    """Ms of ``fn`` replayed as a CUDA graph: the device time without Python's launch cost, which the
    engine's captured steps never pay. Returns (``do_bench``'s figure, L2 flushed between replays by
    writing; the median with L2 flushed by reading, see ``read_flushed_ms``; None), or (None, None, the
    error) when ``fn`` cannot be captured."""
    from triton.testing import do_bench

    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture stream (cuBLAS workspaces, allocator)
            fn()
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as e:
        torch.cuda.synchronize()
        return None, None, f"{type(e).__name__}: {str(e)[:200]}"
    return do_bench(graph.replay, warmup=10, rep=100), read_flushed_ms(graph.replay), None
