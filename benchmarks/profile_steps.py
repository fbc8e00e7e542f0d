"""Where one engine step spends its GPU time: kernel counts and the top kernels, by torch.profiler.

    python benchmarks/profile_steps.py [--shape gpt2] [--batch 1] [--remaining 256]

Profiles the eager (uncaptured) autoregressive step and burst iteration of a
random-weight bf16 model with bucketed shapes on CUDA (float32 on CPU), after a
warm-up, and prints per step the number of kernel launches, the summed kernel
time and the ten costliest kernels. A CUDA-graph replay runs the same kernels
without the launch gaps.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import sigmafast
from sigmafast import steps
from sigmafast.request import draw, draw_burst


def _table(prof, title: str, steps_run: int) -> None:
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    launches = sum(e.count for e in events) / steps_run
    total_ms = sum(e.self_device_time_total for e in events) / 1e3 / steps_run
    print(f"\n== {title}: {launches:.0f} kernels, {total_ms:.3f} ms of kernel time per step")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:10]:
        print(f"  {e.self_device_time_total / 1e3 / steps_run:8.4f} ms  x{e.count / steps_run:5.1f}  {e.key[:90]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="gpt2", choices=list(sigmafast.PRESETS))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--remaining", type=int, default=256, help="burst: remaining positions R")
    parser.add_argument("--orders", type=int, default=5)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    torch.manual_seed(0)
    config = sigmafast.SigmaGPTConfig.from_preset(args.shape, vocab_size=50257)
    model = sigmafast.SigmaGPT(config).to(device=device, dtype=dtype).eval()
    engine = sigmafast.Engine(model, buckets=True, cuda_graphs=False)
    B, T = args.batch, config.block_size
    R = steps.bucket(args.remaining, T)
    g = torch.Generator().manual_seed(0)
    canvas = torch.randint(0, config.vocab_size, (B, T), generator=g).to(device)
    known = torch.ones(B, T, dtype=torch.bool, device=device)
    known[:, T - args.remaining:] = False  # a long known prefix, R positions left
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch.no_grad():
        session = engine.start(canvas, known)
        d = draw_burst(g, session.batch_size, args.orders, T, device)
        for _ in range(2):
            engine.burst(session, d, R, 1.0, None, "paper")
        session = engine.start(canvas, known)
        with profile(activities=acts) as prof:
            engine.burst(session, d, R, 1.0, None, "paper")
            if cuda:
                torch.cuda.synchronize()
        _table(prof, f"burst iteration {args.shape} B={B} R={R} O={args.orders}", 1)

        n_known = known.sum(1)
        visit = (~known).to(torch.int8).argsort(dim=1, stable=True)
        plan = steps.ar_plan(visit, draw(g, (B, T), device), n_known)
        session = engine.start(canvas, known)
        for _ in range(2):
            engine.ar(session, plan, 1.0, None)
        with profile(activities=acts) as prof:
            for _ in range(4):
                engine.ar(session, plan, 1.0, None)
            if cuda:
                torch.cuda.synchronize()
        _table(prof, f"autoregressive step {args.shape} B={B}", 4)


if __name__ == "__main__":
    main()
