"""Where one engine step spends its work: GPU kernels by torch.profiler, or dispatched ops without a GPU.

    python benchmarks/profile_steps.py [--shape gpt2] [--batch 1] [--remaining 256] [--rule paper]
    python benchmarks/profile_steps.py --count-ops [--shape gpt2] [--by-line]

Runs the eager (uncaptured) burst iteration and autoregressive step of a
random-weight model with bucketed shapes, after a warm-up, as a CUDA-graph
capture would run them:

* default (CUDA, bf16): per step the number of kernel launches, the summed
  kernel time and the ten costliest kernels (torch.profiler), and the eager
  wall-clock time per step (synchronized, without the profiler). A CUDA-graph
  replay runs the same kernels without the launch gaps. The prefill of a call
  (``Engine.start``: the known tokens' keys and values) is profiled too.
* ``--count-ops`` (any device; float32 on the CPU, the Triton kernels in the
  interpreter): every ATen and ``sigmafast::`` op the step dispatches
  (``TorchDispatchMode``), leaving out views and allocations, which launch no
  kernel. On CUDA each counted ATen op is at least one kernel and each custom
  op one to three; for small models these launches, not the arithmetic, set a
  replayed step's time. The Triton launches inside the custom ops are counted
  too, and so are the kernels their launchers run around them (casts,
  copies, fills: the innermost ATen ops under each custom op, by the CPU
  profiler), for an estimate of the kernels; it follows the interpreter's stand-ins
  (KV splits from 32 cache keys, the top-k threshold by ``torch.topk``). It
  defaults to a 512-token vocabulary, a 64-position canvas and 40 remaining
  positions (the interpreter is slow); ``--by-line`` groups the ops by the
  source line that issued them, and lists the launches per kernel.
  ``--pos-encoding``, ``--temperature`` and ``--top-k`` change the model and
  the sampling.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import time
import traceback
from typing import Iterator

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

NO_KERNEL = {"view", "_unsafe_view", "expand", "slice", "select", "as_strided", "unsqueeze", "squeeze", "permute",
             "t", "transpose", "alias", "detach", "empty", "empty_strided", "empty_like", "new_empty",
             "new_empty_strided", "lift_fresh", "unbind", "split", "split_with_sizes", "_reshape_alias", "unflatten",
             "narrow", "promote_types", "scalar_tensor"}


class OpLog(TorchDispatchMode):
    """Records (op, issuing source line in sigmafast) of every dispatched op that launches work."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        no_op_cast = name == "_to_copy" and set(kwargs) <= {"dtype"} and kwargs.get("dtype") in (None, args[0].dtype)
        if name not in NO_KERNEL and not no_op_cast:
            frames = [f for f in traceback.extract_stack()
                      if f"{os.sep}sigmafast{os.sep}" in f.filename or f"{os.sep}kernels{os.sep}" in f.filename]
            site = f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else "?"
            self.ops.append((str(func.overloadpacket).removeprefix("aten."), site))
        return func(*args, **kwargs)


TRITON_MARK = "triton launch"
NO_OP_WRAPPERS = {"to", "contiguous", "reshape", "flatten", "view_as", "expand_as", "type_as"}  # kernels: children's


@contextlib.contextmanager
def triton_launches() -> Iterator[collections.Counter]:
    """Count the Triton kernels launched inside the block, per kernel name (the interpreter's launcher; on
    the CPU the custom ops' kernels run there). Each launch is a ``TRITON_MARK`` range for the profiler."""
    from triton.runtime import interpreter

    launches: collections.Counter = collections.Counter()
    original = interpreter.InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        if not warmup:
            launches[self.fn.__name__] += 1
        with torch.profiler.record_function(TRITON_MARK):
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.run = run
    try:
        yield launches
    finally:
        interpreter.InterpretedFunction.run = original


def hidden_ops(step, steps_run: int) -> list:
    """(op, the custom op it ran in) of the kernels that the custom ops' launchers run around their Triton
    kernels (casts, copies, fills), which the dispatch mode sees as part of one op: the innermost ATen ops
    under a ``sigmafast::`` op (CPU profiler), leaving out allocations, views, no-op casts and the
    interpreter's own copies inside a Triton launch."""
    with triton_launches(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps_run):
            step()

    def launches_kernel(e) -> bool:
        name = e.name.removeprefix("aten::")
        return e.name.startswith("aten::") and name not in NO_KERNEL and name not in NO_OP_WRAPPERS

    found = []

    def walk(e, op: str) -> bool:  # whether e or a descendant launches a kernel; records the innermost ones
        if e.name == TRITON_MARK:
            return False
        inner = [walk(c, op) for c in e.cpu_children]
        if launches_kernel(e) and not any(inner):
            found.append((e.name.removeprefix("aten::"), f"in {op}"))
            return True
        return launches_kernel(e) or any(inner)

    for e in prof.events():
        if e.name.startswith("sigmafast::") and (e.cpu_parent is None or not e.cpu_parent.name.startswith("sigmafast")):
            for c in e.cpu_children:
                walk(c, e.name.replace("::", "."))
    return found


def _kernel_table(prof, title: str, steps_run: int, wall_ms: float) -> None:
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    launches = sum(e.count for e in events) / steps_run
    total_ms = sum(e.self_device_time_total for e in events) / 1e3 / steps_run
    print(f"\n== {title}: {launches:.0f} kernels, {total_ms:.3f} ms of kernel time per step, "
          f"{wall_ms:.3f} ms eager wall clock")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:10]:
        print(f"  {e.self_device_time_total / 1e3 / steps_run:8.4f} ms  x{e.count / steps_run:5.1f}  {e.key[:90]}")


def _op_table(ops: list, launches: collections.Counter, hidden: list, title: str, steps_run: int,
              by_line: bool) -> None:
    custom = sum(1 for op, _ in ops if op.startswith("sigmafast."))
    kernels = len(ops) - custom + sum(launches.values()) + len(hidden)
    print(f"\n== {title}: {len(ops) / steps_run:.0f} ops ({custom / steps_run:.0f} sigmafast custom ops, "
          f"{sum(launches.values()) / steps_run:.0f} Triton launches and {len(hidden) / steps_run:.0f} other kernels "
          f"in them; about {kernels / steps_run:.0f} kernels) per step")
    groups = collections.Counter(ops if by_line else [(op, "") for op, _ in ops])
    for (op, site), n in sorted(groups.items(), key=lambda kv: (kv[0][1], -kv[1])):
        print(f"  {n / steps_run:6.1f}  {op:28s} {site}")
    if by_line:
        for name, n in sorted(launches.items()):
            print(f"  {n / steps_run:6.1f}  {name:28s} (Triton)")
        for (op, site), n in sorted(collections.Counter(hidden).items(), key=lambda kv: kv[0][1]):
            print(f"  {n / steps_run:6.1f}  {op:28s} {site}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="gpt2", help="model preset (sigmafast.PRESETS)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--remaining", type=int, help="burst: remaining positions (default 256; 40 counting ops)")
    parser.add_argument("--rule", default="paper", choices=["paper", "lossless"])
    parser.add_argument("--orders", type=int, default=5, help="burst orders of the paper rule (lossless: 1)")
    parser.add_argument("--vocab", type=int, help="vocabulary size (default 50257; 512 counting ops)")
    parser.add_argument("--block-size", type=int, help="canvas length (default the preset's; 64 counting ops)")
    parser.add_argument("--pos-encoding", help="the model's position encoding (default: the preset's)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, help="top-k sampling (default: none)")
    parser.add_argument("--count-ops", action="store_true", help="count dispatched ops instead of GPU kernels")
    parser.add_argument("--by-line", action="store_true", help="--count-ops: group the ops by source line")
    parser.add_argument("--fused-ends", action="store_true",
                        help="Engine(fused_ends=True): one-kernel sublayer ends in models at most 256 wide")
    parser.add_argument("--scoring", choices=["matmul", "fused", "auto"],
                        help="Engine(scoring=...): how a burst scores its drafts (default: the engine's; auto: "
                             "timed at the first run, the choice printed)")
    parser.add_argument("--fused-gelu", action="store_true",
                        help="Engine(fused_gelu=True): each MLP's first matmul and GELU as one Triton kernel")
    parser.add_argument("--pdl", action="store_true",
                        help="Engine(pdl=True): Triton kernels with programmatic dependent launch (sm_90 or later)")
    args = parser.parse_args()
    for name, low in (("batch", 1), ("remaining", 1), ("orders", 1), ("vocab", 2), ("block_size", 1), ("top_k", 1)):
        value = getattr(args, name)
        if value is not None and value < low:
            parser.error(f"--{name.replace('_', '-')} must be >= {low}, got {value}")
    cuda = torch.cuda.is_available()
    if not cuda and not args.count_ops:
        parser.error("kernel profiles need a CUDA device; without one, pass --count-ops")
    if not cuda:  # before the first kernel call imports triton
        os.environ.setdefault("TRITON_INTERPRET", "1")

    import sigmafast
    from sigmafast import steps
    from sigmafast.request import draw, draw_burst

    if args.shape not in sigmafast.PRESETS:
        parser.error(f"--shape must be one of {sorted(sigmafast.PRESETS)}")
    small = args.count_ops
    vocab = args.vocab or (512 if small else 50257)
    overrides = {"block_size": args.block_size or 64} if small or args.block_size else {}
    if args.pos_encoding:
        overrides["pos_encoding"] = args.pos_encoding
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda and not small else torch.float32  # counts: as on the CPU
    torch.manual_seed(0)
    config = sigmafast.SigmaGPTConfig.from_preset(args.shape, vocab_size=vocab, **overrides)
    model = sigmafast.SigmaGPT(config).to(device=device, dtype=dtype).eval()
    engine = sigmafast.Engine(model, buckets=True, cuda_graphs=False, fused_ends=args.fused_ends,
                              scoring=args.scoring, pdl=args.pdl, fused_gelu=args.fused_gelu)
    B, T = args.batch, config.block_size
    left = min(args.remaining or (40 if small else 256), T)
    R = steps.bucket(left, T)
    orders = 1 if args.rule == "lossless" else args.orders
    g = torch.Generator().manual_seed(0)
    canvas = torch.randint(0, config.vocab_size, (B, T), generator=g).to(device)
    known = torch.ones(B, T, dtype=torch.bool, device=device)
    known[:, T - left:] = False  # a long known prefix, ``left`` positions to sample

    def measured(title: str, step, steps_run: int) -> None:
        if small:
            with OpLog() as log, triton_launches() as launches:
                for _ in range(steps_run):
                    step()
            _op_table(log.ops, launches, hidden_ops(step, steps_run), title, steps_run, args.by_line)
            return
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps_run):
            step()
        torch.cuda.synchronize()
        wall_ms = 1e3 * (time.perf_counter() - t0) / steps_run
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps_run):
                step()
            torch.cuda.synchronize()
        _kernel_table(prof, title, steps_run, wall_ms)

    with torch.no_grad():
        session = engine.start(canvas, known)
        d = draw_burst(g, session.batch_size, orders, T, device)
        for _ in range(2):  # warm: kernels compiled
            engine.burst(session, d, R, args.temperature, args.top_k, args.rule)
        for key, choice in engine.scoring_choices.items():
            print(f"scoring=auto: {choice} for hidden states {key[0]}, ms {engine.scoring_times[key]}")
        session = engine.start(canvas, known)
        sampling = f"T={args.temperature}" + (f" top-k={args.top_k}" if args.top_k else "")
        measured(f"burst iteration {args.shape} {args.rule} B={B} R={R} O={orders} {sampling}",
                 lambda: engine.burst(session, d, R, args.temperature, args.top_k, args.rule), 1)

        visit = (~known).to(torch.int8).argsort(dim=1, stable=True)
        plan = steps.ar_plan(visit, draw(g, (B, T), device), known.sum(1))
        session = engine.start(canvas, known)
        for _ in range(2):
            engine.ar(session, plan, args.temperature, args.top_k)
        measured(f"autoregressive step {args.shape} B={B} {sampling}",
                 lambda: engine.ar(session, plan, args.temperature, args.top_k), 4)
        measured(f"prefill {args.shape} B={B}, {T - left} known tokens", lambda: engine.start(canvas, known), 2)


if __name__ == "__main__":
    main()
