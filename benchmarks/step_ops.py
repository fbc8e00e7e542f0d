"""Ops per engine step, without a GPU: every op one burst iteration or one autoregressive token dispatches.

    python benchmarks/step_ops.py [--shape gpt2] [--rule paper] [--by-line]

Runs one eager step of a random-weight model (float32, vocabulary 512 unless
``--vocab``, canvas 64) through the engine with bucketed shapes, as a CUDA-graph capture would,
and counts the ATen ops and ``sigmafast::`` custom ops it dispatches
(``TorchDispatchMode``), leaving out views and allocations, which launch no
kernel. On CUDA each counted ATen op is at least one kernel and each custom op
one to three (split-KV attention adds a combine, the vocabulary ops a pass per
split); in a CUDA-graph replay of small models these launches, not the
arithmetic, set the step time (benchmarks/RESULTS.md). The Triton path runs
in the interpreter (``TRITON_INTERPRET=1`` is set when there is no GPU);
``--by-line`` lists the ops by the source line that issued them.
"""

from __future__ import annotations

import argparse
import collections
import os
import traceback

import torch
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


def _report(title: str, ops: list, by_line: bool) -> None:
    custom = sum(1 for op, _ in ops if op.startswith("sigmafast."))
    print(f"== {title}: {len(ops)} ops ({custom} sigmafast custom ops)")
    groups = collections.Counter(ops if by_line else [(op, "") for op, _ in ops])
    for (op, site), n in sorted(groups.items(), key=lambda kv: (kv[0][1], -kv[1])):
        print(f"  {n:4d}  {op:28s} {site}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="gpt2", help="model preset (sigmafast.PRESETS)")
    parser.add_argument("--rule", default="paper", choices=["paper", "lossless"])
    parser.add_argument("--orders", type=int, default=5, help="burst: orders (1 for lossless)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=512,
                        help="vocabulary size (GPT-2's 50257 is slow in the interpreter)")
    parser.add_argument("--by-line", action="store_true", help="group the ops by the source line that issued them")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")

    import sigmafast
    from sigmafast import steps
    from sigmafast.request import draw, draw_burst

    if args.shape not in sigmafast.PRESETS:
        parser.error(f"--shape must be one of {sorted(sigmafast.PRESETS)}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    config = sigmafast.SigmaGPTConfig.from_preset(args.shape, vocab_size=args.vocab, block_size=64)
    model = sigmafast.SigmaGPT(config).to(device).eval()
    engine = sigmafast.Engine(model, buckets=True, cuda_graphs=False)
    B, T, left = args.batch, config.block_size, 40
    R = steps.bucket(left, T)
    orders = 1 if args.rule == "lossless" else args.orders
    g = torch.Generator().manual_seed(0)
    canvas = torch.randint(0, config.vocab_size, (B, T), generator=g).to(device)
    known = torch.ones(B, T, dtype=torch.bool, device=device)
    known[:, T - left:] = False
    with torch.no_grad():
        session = engine.start(canvas, known)
        d = draw_burst(g, session.batch_size, orders, T, device)
        engine.burst(session, d, R, 1.0, None, args.rule)  # warm: kernels compiled, nothing counted
        session = engine.start(canvas, known)
        with OpLog() as log:
            engine.burst(session, d, R, 1.0, None, args.rule)
        _report(f"burst iteration, {args.shape}, {args.rule}, B={B}, O={orders}, R={R}", log.ops, args.by_line)

        n_known = known.sum(1)
        visit = (~known).to(torch.int8).argsort(dim=1, stable=True)
        plan = steps.ar_plan(visit, draw(g, (B, T), device), n_known)
        session = engine.start(canvas, known)
        engine.ar(session, plan, 1.0, None)
        with OpLog() as log:
            engine.ar(session, plan, 1.0, None)
        _report(f"autoregressive token, {args.shape}, B={B}", log.ops, args.by_line)


if __name__ == "__main__":
    main()
