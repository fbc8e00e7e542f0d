"""Sweep the split-V streaming tiles of the vocabulary kernels on a GPU.

    python benchmarks/sweep_vocab.py [--rows 1280] [--layouts] [--chunks 2048] [--tiles 4096,8192]
        [--warps 2,4] [--stages 1,3] [--json FILE]

``kernels/vocab.py`` fixes the tiling of the streaming kernels (chunk statistics, residual masses) with
module constants: ``CHUNK`` (columns per tile), ``TILE`` (elements per tile), ``STREAM_WARPS``,
``STREAM_STAGES`` (the chunk statistics' and top-k chunk maxima's loops: 1, a register prefetch of the next
tile; more, Triton's pipelining through shared memory) and ``PERSISTENT`` (one wave of looping programs, or
one program per tile). This script times the ops that stream GPT-2's 50257-wide bf16 rows (log q of
drafts for the acceptance, without and with top-k 50, the sample, the residual sample, and the residual with
its two passes over each row in one program, ``kernels/residual_rows.py``, at two L2 shares) under each
combination, replayed as CUDA graphs with L2 flushed by reading (as ``bench_kernels.py``), and prints the
share of copy bandwidth per op, best first. Each combination's kernels compile once, outside the timings.
The defaults are the constants' values when the script starts; a combination that fails to compile or run, or
whose output differs from the defaults' (:func:`mismatch`), is reported and not ranked.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from pathlib import Path
from typing import Optional

os.environ.setdefault("TRITON_INTERPRET", "0")

import torch  # noqa: E402
from _timing import copy_bandwidth_gbps, graph_timings  # noqa: E402

VOCAB = 50257


def _ops(rows: int, dtype: torch.dtype):
    """(name, thunk, bytes read) of the streaming ops on fresh random logits; each thunk returns one tensor
    (log q or tokens) for :func:`mismatch`."""
    from sigmafast.kernels import accept, sampling

    g = torch.Generator(device="cuda").manual_seed(0)
    q = (torch.randn(rows, VOCAB, device="cuda", generator=g) * 3).to(dtype)
    p = (q.float() + torch.randn(rows, VOCAB, device="cuda", generator=g)).to(dtype)
    u = torch.rand(rows, device="cuda", generator=g)
    drafts = torch.randint(0, VOCAB, (rows,), device="cuda", generator=g)
    nbytes = q.numel() * q.element_size()
    return [
        ("draft_logq", lambda: accept.draft_logq(q, drafts, 1.0), nbytes),
        ("draft_logq_top50", lambda: accept.draft_logq(q, drafts, 1.0, 50), nbytes),
        ("sample", lambda: sampling.sample(q, u, 1.0, None)[0], nbytes),  # the tokens (and their log p)
        ("residual_sample", lambda: sampling.residual_sample(q, p, u, 1.0, None), 2 * nbytes),
        *((f"residual_rows_l2_{share}", lambda share=share: _by_rows(q, p, u, share), 2 * nbytes)
          for share in (0.5, 1.0)),
    ]


def _by_rows(q, p, u, l2_share: float):
    """The residual sample with its two passes over each row in one program, as many programs as the SMs or
    as ``l2_share`` of the L2 holds rows of (``residual_rows.by_rows``)."""
    from sigmafast.kernels import residual_rows, sampling

    with residual_rows.by_rows(l2_share):
        return sampling.residual_sample(q, p, u, 1.0, None)


def _outputs(fn) -> Optional[torch.Tensor]:
    """``fn``'s output under the default tiling, or None when it fails there (each tiling then reports its own
    error or its timing unchecked)."""
    try:
        return fn().clone()
    except Exception:  # reported per tiling by the sweep
        return None


def mismatch(expected: torch.Tensor, got: torch.Tensor) -> Optional[str]:
    """None when a tiling's output agrees with the defaults': log q within 1e-3 relative and 2e-3 absolute
    (float32 sums in another order; equal infinities agree), tokens equal in at least 99% of rows (a draw at
    a knife edge may flip with the rounding); else what differs."""
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return f"got {got.dtype} {tuple(got.shape)}, the defaults give {expected.dtype} {tuple(expected.shape)}"
    if expected.is_floating_point():
        if torch.allclose(got, expected, rtol=1e-3, atol=2e-3):
            return None
        inf = float("inf")
        gap = torch.where(got == expected, 0.0, (got - expected).abs()).nan_to_num(nan=inf, posinf=inf)
        return f"log q differs by up to {float(gap.max()):.3g}"
    agree = float((got == expected).float().mean()) if expected.numel() else 1.0
    return None if agree >= 0.99 else f"tokens agree with the defaults' in {agree:.1%} of rows"


def _ints(parser: argparse.ArgumentParser, flag: str, text: str) -> list:
    """Comma-separated powers of two, or a parser error naming ``flag``."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 or v & (v - 1) for v in values):
        parser.error(f"{flag} takes comma-separated powers of two, got {text!r}")
    return values


def _stages(parser: argparse.ArgumentParser, text: str) -> list:
    """Comma-separated ints >= 1 for ``--stages``, or a parser error."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        parser.error(f"--stages takes comma-separated ints >= 1, got {text!r}")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1280, help="logit rows (1280: B=4, 5 orders, R=64)")
    parser.add_argument("--layouts", action="store_true", help="also one program per tile (PERSISTENT False)")
    parser.add_argument("--chunks", default="2048", help="CHUNK values, comma-separated (at the fifth lend 4096 "
                        "sped up log q alone and made the residual's token search spill)")
    parser.add_argument("--tiles", default="4096,8192", help="TILE values, comma-separated")
    parser.add_argument("--warps", default="2,4", help="STREAM_WARPS values, comma-separated (the fifth lend "
                        "swept CHUNK 1024-4096, TILE 8192-16384 and 4 or 8 warps: 4 won, 8 lost everywhere; fewer "
                        "warps share a tile's row reductions among fewer warps; 1 warp takes 255 registers on sm_90)")
    parser.add_argument("--stages", default="1,3", help="STREAM_STAGES values, comma-separated (ints >= 1)")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    args = parser.parse_args()
    chunks, tiles, warps = (_ints(parser, f, t) for f, t in (("--chunks", args.chunks), ("--tiles", args.tiles),
                                                              ("--warps", args.warps)))
    stages = _stages(parser, args.stages)
    if not torch.cuda.is_available():
        raise SystemExit("sweep_vocab.py needs a CUDA device")
    from sigmafast.kernels import vocab

    default = dict(CHUNK=vocab.CHUNK, TILE=vocab.TILE, STREAM_WARPS=vocab.STREAM_WARPS,
                   STREAM_STAGES=vocab.STREAM_STAGES, PERSISTENT=vocab.PERSISTENT)
    copy_gbps = copy_bandwidth_gbps()
    print(f"{torch.cuda.get_device_name()}: copy {copy_gbps:.0f} GB/s; defaults {default}", flush=True)
    grid = dict(CHUNK=chunks, TILE=tiles, STREAM_WARPS=warps, STREAM_STAGES=stages,
                PERSISTENT=[True, False] if args.layouts else [default["PERSISTENT"]])
    ops = _ops(args.rows, torch.bfloat16)
    expected = {op: _outputs(fn) for op, fn, _ in ops}  # under the defaults
    rows = []
    try:
        for combo in itertools.product(*grid.values()):
            cfg = dict(zip(grid, combo))
            for name, value in cfg.items():
                setattr(vocab, name, value)
            for op, fn, nbytes in ops:
                try:
                    out = fn()
                    err = None if expected[op] is None else mismatch(expected[op], out)
                    torch.cuda.synchronize()
                    ms, flushed, err = (None, None, f"wrong: {err}") if err else graph_timings(fn)
                except Exception as e:  # a combination that does not compile or fit: report it, go on
                    torch.cuda.synchronize()
                    ms, flushed, err = None, None, f"{type(e).__name__}: {str(e)[:160]}"
                share = None if flushed is None else nbytes / flushed / 1e6 / copy_gbps
                rows.append(dict(cfg, op=op, ms=ms, read_flushed_ms=flushed, share=share, error=err))
                print(f"{op:20s} {cfg} " + (f"{flushed * 1e3:7.1f} us {share:6.1%}" if share else f"error {err}"),
                      flush=True)
    finally:  # a sweep cut short (SIGINT) still leaves the rows it timed
        for name, value in default.items():
            setattr(vocab, name, value)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
    print("\nbest per op (share of copy bandwidth, L2 flushed by reading):")
    for op, _, _ in ops:
        done = sorted((r for r in rows if r["op"] == op and r["share"]), key=lambda r: -r["share"])
        base = next((r for r in done if all(r[k] == v for k, v in default.items())), None)
        for r in done[:3]:
            print(f"  {op:20s} {r['share']:6.1%}  CHUNK={r['CHUNK']} TILE={r['TILE']} "
                  f"STREAM_WARPS={r['STREAM_WARPS']} STREAM_STAGES={r['STREAM_STAGES']} PERSISTENT={r['PERSISTENT']}")
        if base:
            print(f"  {op:20s} {base['share']:6.1%}  (defaults)")


if __name__ == "__main__":
    main()
