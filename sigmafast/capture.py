"""How an :class:`~sigmafast.runner.Engine` makes its steps cheap to launch: ``torch.compile`` with a bounded
number of recompilations (:func:`compile_step`), and CUDA graphs run eagerly once, captured the second time and
replayed from then on (:class:`Graphs`)."""

from __future__ import annotations

import warnings
from typing import Callable

import torch

__all__ = ["RECOMPILE_LIMIT", "Graphs", "compile_step"]


RECOMPILE_LIMIT = 64  # compiled shapes per step function: R buckets x batch buckets x sampling settings


def compile_step(fn: Callable, backend: str) -> Callable:
    """``fn`` through ``torch.compile(fullgraph=True, dynamic=False)``. Every static shape (R bucket, batch
    bucket, orders, sampling settings, model) is one recompilation of the same function, more than dynamo's
    default limit of 8 (a burst over T = 768 alone has 7 R buckets), so calls raise the limit to
    ``RECOMPILE_LIMIT``. Dynamo counts them per function, over every engine of the process: past the limit,
    a new shape runs ``fn`` eagerly (the same values), with a ``RuntimeWarning`` the first time."""
    compiled = torch.compile(fn, fullgraph=True, dynamic=False, backend=backend)
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    limit_hit = tuple(getattr(torch._dynamo.exc, n) for n in ("FailOnRecompileLimitHit", "FailOnCacheLimitHit")
                      if hasattr(torch._dynamo.exc, n))
    warned = False

    def call(*args):
        nonlocal warned
        try:
            with config.patch(**{name: max(getattr(config, name), RECOMPILE_LIMIT)}):
                return compiled(*args)
        except limit_hit:  # raised before the step runs: nothing was written
            if not warned:
                warned = True
                warnings.warn(f"compile_steps: {fn.__name__} was compiled for {RECOMPILE_LIMIT} shapes and "
                              f"settings in this process; new ones run eagerly", RuntimeWarning, stacklevel=2)
            return fn(*args)
    return call


class Graphs:
    """Run a step eagerly the first time its key is seen, capture it the second time, then replay."""

    def __init__(self) -> None:
        self.graphs: dict = {}
        self.seen: set = set()
        self.pool = None
        self.stream = None  # the capture stream, on the engine's GPU (torch.cuda.graph's default is process-wide)

    def drop(self, session_id: int) -> None:
        """Forget the graphs of one session (keys carry the session's id second)."""
        for key in [k for k in self.graphs if k[1] == session_id]:
            del self.graphs[key]
        self.seen = {k for k in self.seen if k[1] != session_id}

    def run(self, key, fn: Callable):
        entry = self.graphs.get(key)
        if entry is not None:
            entry[0].replay()
            return entry[1]
        if key not in self.seen:
            self.seen.add(key)
            return fn()
        graph = torch.cuda.CUDAGraph()
        if self.stream is None:
            self.stream = torch.cuda.Stream()  # the current device: the model's, under request.inference
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            out = fn()
        self.pool = graph.pool()  # one memory pool for every step: outputs are cloned after each replay
        self.graphs[key] = (graph, out)
        graph.replay()
        return out
