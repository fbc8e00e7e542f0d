"""``Engine(scoring="auto")``: how a burst scores its drafts, chosen per shape by timing both ways on the GPU.

A burst verifies B·O·R drafts from the verifier's hidden states, either by a matmul against the padded LM
head and the log q kernel, or by the fused LM-head stream (``kernels.acceptance_from_hidden``'s
``scoring``). Which is faster depends on the card, the model's width and the row count, so with
``"auto"`` the first eager run of each burst shape (the run before its capture) times both on the GPU and
the engine keeps the faster for that shape, like ``torch.backends.cudnn.benchmark``: the timing's host
syncs happen once per shape, never in a captured or replayed step, and another process may choose
otherwise where the two are within ``MARGIN`` (their log q differ in the last bits only, a different
summation order). Elsewhere (CPU, the reference backend, a traced step) ``"auto"`` is the default scoring,
``kernels.accept.SCORING``.
"""

from __future__ import annotations

import statistics
from typing import Callable, Optional

import torch

from . import kernels

__all__ = ["SCORING_CHOICES", "MeasuredScoring", "gpu_times"]

SCORING_CHOICES = (*kernels.checks.SCORINGS, "auto")  # Engine(scoring=...) besides None
MARGIN = 0.9  # the other scoring replaces the default only when it takes less than this share of its time
REPS = 5  # timed runs of each candidate, interleaved; the median counts
SLEEP_CYCLES = 2_000_000  # about 1 ms of GPU clock before each timed run: the host queues it meanwhile


def gpu_times(calls: dict[str, Callable[[], object]], device: torch.device,
              reps: int = REPS) -> Optional[dict[str, float]]:
    """Median GPU milliseconds of each call (compiled and warmed by one untimed run each), or None where the
    GPU cannot be timed now (not a CUDA device, or a stream capture in progress). Before each timed run the
    GPU sleeps while the host queues the run, so the time is the GPU's alone, without the host's launch
    overhead (which a replayed CUDA graph does not pay either)."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return None
    for call in calls.values():
        call()
    runs: dict[str, list] = {name: [] for name in calls}
    for _ in range(reps):
        for name, call in calls.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(SLEEP_CYCLES)
            start.record()
            call()
            end.record()
            runs[name].append((start, end))
    torch.cuda.synchronize(device)
    return {name: statistics.median(s.elapsed_time(e) for s, e in pairs) for name, pairs in runs.items()}


class MeasuredScoring:
    """The scoring of each burst shape, timed once (``Engine(scoring="auto")``).

    ``choose(run, key, device)``: the scoring stored for ``key`` (the shape and sampling settings), else,
    when :func:`gpu_times` can time ``run(scoring)`` for both scorings on ``device``,
    the faster one (the default ``kernels.accept.SCORING`` unless the other takes less than ``MARGIN`` of
    its time), stored; else None (the default, not stored: asked again on a later run)."""

    def __init__(self) -> None:
        self.choices: dict = {}  # key -> scoring
        self.times: dict = {}  # key -> {scoring: ms} as measured

    def choose(self, run: Callable[[str], object], key: tuple, device: torch.device) -> Optional[str]:
        choice = self.choices.get(key)
        if choice is not None:
            return choice
        times = gpu_times({s: (lambda s=s: run(s)) for s in kernels.checks.SCORINGS}, device)
        if times is None:
            return None
        from .kernels import accept  # the Triton path's module (imports triton)

        default = accept.SCORING
        best = min(times, key=times.get)
        choice = best if times[best] < MARGIN * times[default] else default
        self.choices[key], self.times[key] = choice, dict(times)
        return choice

    def clear(self) -> None:
        self.choices.clear()
        self.times.clear()
