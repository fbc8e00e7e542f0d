"""Compile every Triton kernel for an H100/H200 (sm_90) on a machine without a GPU.

    python benchmarks/compile_sm90.py [--json FILE] [--dtypes bf16,fp32] [--cases REGEX] [--pdl]

The Triton interpreter runs the kernels' arithmetic on the CPU but not the
GPU compiler, so a kernel can pass every CPU test and still fail to compile,
or spill registers, on the GPU. This script calls the real launchers (the
same tiles, specialisations and launch options as on CUDA) on CPU tensors,
with Triton's driver replaced by an offline one whose target is sm_90 and whose
launches only compile: Triton's own compiler and the bundled ptxas build each
kernel variant, and nothing runs. Per variant it prints the registers per
thread, the local memory (spills), the shared memory and the number of SASS
instructions (``nvdisasm``), and it exits 1 if a kernel fails to compile.
``--pdl`` builds the variants that ``kernels.use_pdl(True)`` launches on sm_90
(programmatic dependent launch: ``USE_GDC`` and Triton's ``launch_pdl``); the
``gdc`` column says whether a variant's PTX waits for the kernel before it.

It needs triton's NVIDIA backend (bundled with the Linux wheels), and
``TRITON_INTERPRET`` unset, which it enforces before importing triton.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
NV_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


class OfflineDriver:
    """The parts of Triton's active driver that compiling needs: an sm_90 target, device 0, stream 0."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return TARGET

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


def _resources(kernel) -> dict:
    """Registers per thread, stack and local (spill) bytes, shared memory bytes and SASS instructions."""
    cubin = kernel.asm["cubin"]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([str(NV_BIN / "cuobjdump"), "--dump-resource-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([str(NV_BIN / "nvdisasm"), "-c", f.name],
                              capture_output=True, text=True, check=True).stdout
    field = {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", usage)}
    return dict(registers=field.get("REG", 0), stack=field.get("STACK", 0), local=field.get("LOCAL", 0),
                shared=kernel.metadata.shared, instructions=len(re.findall(r"/\*[0-9a-f]{4,}\*/\s+\S", sass)),
                gdc="griddepcontrol.wait" in kernel.asm["ptx"])


def _pdl_on(device) -> dict:
    return dict(USE_GDC=True, launch_pdl=True)  # utils.pdl_meta of an sm_90 GPU inside use_pdl(True)


def _cases(dtype: torch.dtype):
    """(name, thunk) pairs that launch every kernel variant the engine uses for one dtype."""
    from sigmafast.kernels import (accept, along, attention, commit_step, decide, embed, fc_gelu, flags, layer_norm,
                                   lm_head, linear_norm, lossless, plan, radix, rotary, sampling, slots, topk)

    g = torch.Generator().manual_seed(0)
    V, N, C = 50257, 64, 768

    def attn(ndim: int, D: int, splits):
        B, O, H, R, L = 2, 5, 12, 16, 2048
        shape = (B, H, R, D) if ndim == 4 else (B, O, H, R, D)
        q, k, v = (torch.randn(shape, generator=g).to(dtype) for _ in range(3))
        kc, vc = (torch.randn(B, H, L, D, generator=g).to(dtype) for _ in range(2))
        return lambda: attention.cascade_attention(q, k, v, kc, vc, torch.tensor([L, 100]), num_splits=splits)

    x = torch.randn(N, V, generator=g).to(dtype)
    p = torch.randn(N, V, generator=g).to(dtype)
    u = torch.rand(N, generator=g, dtype=torch.float64)  # the engine's draws
    d = torch.randint(0, V, (N,), generator=g)
    ratio = (torch.randn(N, generator=g) - 3, torch.empty(N))  # the engine's log q calls: draft log p, log ratio
    h = torch.randn(N, C, generator=g).to(dtype)
    w = torch.randn(V, C, generator=g).to(dtype)
    for D in (64, 128, 256):
        for ndim, kind in ((4, "burst"), (5, "verify")):
            yield f"{kind} attention D={D}, one split", attn(ndim, D, 1)
            yield f"{kind} attention D={D}, KV splits", attn(ndim, D, 4)
    for T, k in ((1.0, None), (0.8, 50)):
        yield f"sample T={T} top-k={k}", lambda T=T, k=k: sampling.launch(x, None, u, T, k)
        yield f"residual sample T={T} top-k={k}", lambda T=T, k=k: sampling.launch(x, p, u, T, k)
        yield f"draft log q T={T} top-k={k}", lambda T=T, k=k: accept.draft_logq(x, d, T, k, None, *ratio)
    for Vs in (300, 1000, 4097):  # 1 to 3 chunks a row: Triton 3.6 failed on their token search (vocab.MIN_NC_PAD)
        xs, ps, ds = x[:, :Vs], p[:, :Vs], d % Vs
        for k in (None, 3):
            yield f"sample V={Vs} top-k={k}", lambda a=(xs, None, u, 0.8, k): sampling.launch(*a)
            yield f"residual sample V={Vs} top-k={k}", lambda a=(xs, ps, u, 0.8, k): sampling.launch(*a)
            yield f"draft log q V={Vs} top-k={k}", lambda a=(xs, ds, 0.8, k, None, *ratio): accept.draft_logq(*a)
        yield f"fused LM head log q V={Vs}", lambda a=(h, w[:Vs], ds, 1.0, *ratio): lm_head.lm_head_logq(*a)
    yield "draft argmax (greedy acceptance)", lambda: accept.draft_logq(x, d, 0.0)
    yield "top-k threshold (chunk-max prefilter)", lambda: topk.kth_largest(x, 50)
    for T, k in ((1.0, None), (0.8, 50)):  # the streaming loops pipelined by Triton (vocab.STREAM_STAGES = 3)
        yield f"sample T={T} top-k={k}, pipelined", lambda T=T, k=k: _pipelined(
            lambda: sampling.launch(x, None, u, T, k))
        yield f"residual sample T={T} top-k={k}, pipelined", lambda T=T, k=k: _pipelined(
            lambda: sampling.launch(x, p, u, T, k))
    yield "top-k threshold (chunk-max prefilter), pipelined", lambda: _pipelined(lambda: topk.kth_largest(x, 50))
    for T, k, Vs in ((1.0, None, V), (0.8, 50, V), (0.8, None, 300), (0.8, 3, 4097)):  # residual_rows.ROWS
        yield f"residual sample V={Vs} T={T} top-k={k}, by rows", lambda a=(x[:, :Vs], p[:, :Vs], u, T, k): _by_rows(
            a)
    yield "top-k threshold (radix select)", lambda: radix.radix_kth_largest(x, 50)
    yield "top-k log q from the candidates", lambda: accept.topk_logq(x, d, 0.8, 50, draft_logp=ratio[0],
                                                                      log_ratio=ratio[1])
    for Cs in (C, 128, 64):  # GPT-2's width (64-column chunks), then the narrow models' (rows in registers)
        hs, ws = h[:, :Cs].contiguous(), w[:, :Cs].contiguous()
        yield f"fused LM head log q C={Cs}", lambda a=(hs, ws, d, 0.8, *ratio): lm_head.lm_head_logq(*a)
        yield f"fused LM head argmax C={Cs}", lambda a=(hs, ws, d, 0.0): lm_head.lm_head_logq(*a)
    for D in (64, 128):
        yield f"commit D={D}", lambda D=D: _commit(commit_step, dtype, D, g)
    ratio, lens = torch.rand(8, 5, 256, generator=g), torch.tensor([256, 3, 0, 100, 256, 17, 1, 255])
    u64, toks = torch.rand(8, 5, 256, generator=g, dtype=torch.float64), torch.randint(0, V, (8, 5, 256), generator=g)
    for greedy in (False, True):
        for paper in (True, False):
            yield (f"decide greedy={greedy} paper={paper}",
                   lambda gr=greedy, pa=paper: decide.launch(toks if gr else ratio, toks, u64, lens, gr, pa))
    flag, used = torch.zeros((), dtype=torch.bool), torch.rand(N, generator=g) < 0.5
    yield "non-finite flag, logits", lambda: flags.launch(x, used, flag)
    yield "non-finite flag, hidden states", lambda hs=h.view(2, 2, 16, C): flags.launch(hs, used.view(2, 2, 16)[:, :1],
                                                                                       flag)
    yield "autoregressive plan step", lambda: plan.launch(torch.randint(0, 1024, (4, 8, 1024), generator=g),
                                                          torch.zeros((), dtype=torch.long))
    known = torch.rand(2, 1024, generator=g) < 0.5
    drafts = (known.to(torch.int8).argsort(dim=1, stable=True)[:, :512], torch.randint(0, V, (2, 512), generator=g),
              torch.rand(2, 512, generator=g), torch.randint(0, V, (2, 1024), generator=g), known,
              torch.rand(2, 1024, generator=g, dtype=torch.float64),
              torch.rand(2, 5, 1024, generator=g).argsort(-1)[..., :512])
    yield "drafts along the orders", lambda: along.launch(*drafts)
    yield "draft slots and visiting orders", lambda: slots.launch(
        known, drafts[5], torch.rand(2, 5, 1024, generator=g, dtype=torch.float64), 512)
    n_acc, rem = torch.randint(0, 257, (8,), generator=g), torch.randint(0, 300, (8,), generator=g)
    ords = torch.rand(8, 1, 1024, generator=g).argsort(-1)[..., :256][:, 0]
    yield "lossless residual pick", lambda: lossless.pick_launch(
        n_acc, rem, ords, ords % 256, torch.rand(8, 1024, generator=g, dtype=torch.float64),
        torch.randn(8, 256, 50304, dtype=dtype)[..., :50257], torch.randn(8, 256, 768, dtype=dtype))
    for D in (64, 128):  # the QKV projection's views (B, O, H, R, D) rotated in place, and an output back
        proj = torch.randn(2, 5, 256, 3 * 12 * D, generator=g).to(dtype)
        qkv = [t.view(2, 5, 256, 12, D).transpose(-3, -2) for t in proj.split(12 * D, dim=-1)]
        pos = torch.randint(0, 1025, (2, 5, 256), generator=g)
        cos, sin = (torch.rand(1025, D // 2, generator=g).to(dtype) for _ in range(2))
        yield f"rotary q, k, v D={D}", lambda a=(*qkv, pos, pos, cos, sin): rotary.launch(*a, 1.0)
    for C in (64, 128, 256):  # the narrow models' sublayer ends (`tiny`, `small`, the widest fused)
        xs = [torch.randn(1280, C, generator=g).to(dtype) for _ in range(2)]
        w, b = torch.ones(C, dtype=dtype), torch.zeros(C, dtype=dtype)
        proj, fc = (torch.randn(C, 4 * C, generator=g).to(dtype), torch.randn(4 * C, C, generator=g).to(dtype))
        yield f"projection + add + LayerNorm C={C}", lambda xs=xs, a=(proj[:, :C].contiguous(), b, w, b): (
            linear_norm.linear_launch(*xs, *a, 1e-5))
        yield f"MLP + add + LayerNorm C={C}", lambda xs=xs, a=(fc, fc[:, 0].contiguous(), proj, b, w, b): (
            linear_norm.mlp_launch(*xs, *a, 1e-5))
        nxt = (fc[:3 * C], fc[:3 * C, 0].contiguous(), torch.empty(1280, 4 * C, dtype=dtype)[:, :3 * C])
        yield f"projection + add + LayerNorm + next QKV C={C}", lambda xs=xs, a=(proj[:, :C].contiguous(), b, w, b), \
            n=nxt: linear_norm.linear_launch(*xs, *a, 1e-5, *n)
        yield f"MLP + add + LayerNorm + next QKV C={C}", lambda xs=xs, a=(fc, fc[:, 0].contiguous(), proj, b, w, b), \
            n=nxt: linear_norm.mlp_launch(*xs, *a, 1e-5, *n)
        wte, pe = torch.randn(V, C, generator=g).to(dtype), torch.randn(1025, C // 2, generator=g).to(dtype)
        feed = (torch.tensor([3, 9]), torch.tensor([1024, 7]), torch.randint(0, V, (2, 5, 128), generator=g),
                torch.rand(2, 5, 1024, generator=g).argsort(-1)[..., :128])
        qkv = (fc[:3 * C], fc[:3 * C, 0].contiguous(), torch.empty(2, 5, 128, 4 * C, dtype=dtype)[..., :3 * C])
        yield f"feed embedding + LayerNorm + first QKV C={C}", lambda f=feed, t=(wte, pe, w, b), n=qkv: embed.launch(
            *f, t[0], t[1], t[1], t[2], t[3], 1e-5, *n)
    for C in (8, 64, 128, 768):  # the MLP's first matmul with its GELU (Engine(fused_gelu=True)), any width
        x, fc = torch.randn(1280, C, generator=g).to(dtype), torch.randn(4 * C, C, generator=g).to(dtype)
        yield f"linear + GELU C={C}", lambda x=x, fc=fc: fc_gelu.launch(x, fc, fc[:, 0].contiguous())
    for C in (768, 1024):  # GPT-2 small and medium widths: add + LayerNorm, and add + ScalarGainNorm
        xs = [torch.randn(1280, C, generator=g).to(dtype) for _ in range(2)]
        w, b = torch.ones(C, dtype=dtype), torch.zeros(C, dtype=dtype)
        yield f"add + LayerNorm C={C}", lambda xs=xs, w=w, b=b: layer_norm.launch(*xs, w, b, 1e-5)
        yield f"add + scalar-gain norm C={C}", lambda xs=xs, w=w: layer_norm.launch(*xs, w[:1].expand(C), None, 1e-5)
        wte, pe = torch.randn(V, C, generator=g).to(dtype), torch.randn(1025, C // 2, generator=g).to(dtype)
        orders = torch.rand(2, 5, 1024, generator=g).argsort(-1)[..., :256]
        feed = (torch.tensor([3, 9]), torch.tensor([1024, 7]), torch.randint(0, V, (2, 5, 256), generator=g), orders)
        yield f"feed embedding + LayerNorm C={C}", lambda f=feed, t=(wte, pe, w, b): embed.launch(
            *f, t[0], t[1], t[1], t[2], t[3], 1e-5)
    for C in (2, 8):  # rows narrower than a tl.dot's 16 columns: the kernel must not compile its projection
        wte, pe = torch.randn(V, C, generator=g).to(dtype), torch.randn(1025, C // 2, generator=g).to(dtype)
        w, b = torch.ones(C, dtype=dtype), torch.zeros(C, dtype=dtype)
        yield f"feed embedding + LayerNorm C={C}", lambda f=feed, t=(wte, pe, w, b): embed.launch(
            *f, t[0], t[1], t[1], t[2], t[3], 1e-5)


def _pipelined(launch, stages: int = 3) -> None:
    """``launch()`` with the streaming kernels' loops pipelined (``vocab.STREAM_STAGES``)."""
    from sigmafast.kernels import vocab

    default, vocab.STREAM_STAGES = vocab.STREAM_STAGES, stages
    try:
        launch()
    finally:
        vocab.STREAM_STAGES = default


def _by_rows(args: tuple) -> None:
    """``sampling.launch(*args)`` with the residual's masses by whole rows (``residual_rows.by_rows``)."""
    from sigmafast.kernels import residual_rows, sampling

    with residual_rows.by_rows():
        sampling.launch(*args)


def _commit(commit_step, dtype: torch.dtype, D: int, g: torch.Generator) -> None:
    """One commit of a verification over 5 orders (keys as views of the shared QKV projection buffer), with the
    burst status."""
    nl, B, O, H, R, T = 12, 2, 5, 12, 16, 1024
    qkv = torch.randn(nl, B, O, R, 3 * H * D, generator=g).to(dtype)
    kv = qkv[..., H * D:].unflatten(-1, (2, H, D)).permute(4, 0, 1, 2, 5, 3, 6)
    cache = torch.zeros(nl, B, H, T + 1, D, dtype=dtype)
    commit_step.launch(torch.rand(B, O, T, generator=g).argsort(-1)[..., :R], torch.tensor([1, 4]),
                       torch.tensor([3, 16]), torch.zeros(B, R, dtype=torch.long), kv[0], kv[1],
                       torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T, dtype=torch.bool),
                       torch.zeros(B, dtype=torch.long), torch.zeros(B, dtype=torch.long), cache, cache.clone(),
                       torch.tensor([5, 700]), torch.zeros((), dtype=torch.bool), torch.zeros(3, dtype=torch.long))


def compile_all(dtype_names, pattern: str = "", pdl: bool = False) -> tuple[list, list]:
    """Compile the kernels of every case whose name matches the regular expression ``pattern`` (with
    ``pdl``, their programmatic-dependent-launch variants): (rows of per-variant resources, errors). For a
    process without a GPU: the offline driver stays active (Triton cannot create its default driver there)."""
    from sigmafast import kernels

    compiled = []
    launch = JITFunction.run
    modules = [importlib.import_module(f"{kernels.__name__}.{m.name}") for m in pkgutil.iter_modules(kernels.__path__)]
    modules = [m for m in modules if getattr(m, "pdl_meta", None) is kernels.utils.pdl_meta]

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append((self.fn.__name__, kernel))
        return kernel

    driver.set_active(OfflineDriver())
    JITFunction.run = compile_only
    for m in modules if pdl else ():  # the launchers' CPU tensors would turn it off
        m.pdl_meta = _pdl_on
    rows, errors, seen = [], [], set()
    try:
        for dname in dtype_names:
            for case, thunk in _cases(DTYPES[dname]):
                if not re.search(pattern, case):
                    continue
                compiled.clear()
                try:
                    thunk()
                except Exception as e:  # report every failing case, not only the first
                    errors.append(dict(dtype=dname, case=case, error=f"{type(e).__name__}: {e}",
                                       trace=traceback.format_exc(limit=-3)))
                    continue
                for name, kernel in compiled:
                    key = (dname, name, kernel.hash)
                    if key not in seen:
                        seen.add(key)
                        rows.append(dict(dtype=dname, case=case, kernel=name, **_resources(kernel)))
    finally:
        JITFunction.run = launch
        for m in modules:
            m.pdl_meta = kernels.utils.pdl_meta
    return rows, errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the rows and errors here")
    parser.add_argument("--dtypes", default="bf16,fp16,fp32", help="comma-separated: bf16, fp16, fp32")
    parser.add_argument("--cases", default="", help="only the cases whose name matches this regular expression")
    parser.add_argument("--pdl", action="store_true", help="the variants launched inside kernels.use_pdl(True)")
    args = parser.parse_args()
    names = [n for n in args.dtypes.split(",") if n]
    bad = [n for n in names if n not in DTYPES]
    if bad or not names:
        parser.error(f"--dtypes takes names from {sorted(DTYPES)}, got {args.dtypes!r}")
    if args.json and not args.json.parent.is_dir():
        parser.error(f"--json {args.json}: the folder {args.json.parent} does not exist")
    if not (NV_BIN / "ptxas").exists():
        sys.exit(f"triton {triton.__version__} has no bundled ptxas under {NV_BIN}: cannot compile for sm_90")
    rows, errors = compile_all(names, args.cases, args.pdl)
    print(f"triton {triton.__version__}, sm_90 (code generation differs between versions: tl.histogram, for one)")
    print(f"{'dtype':5} {'kernel':24} {'regs':>4} {'local':>5} {'shared':>6} {'SASS':>5} {'gdc':>3}  first case")
    for r in rows:
        print(f"{r['dtype']:5} {r['kernel']:24} {r['registers']:4d} {r['local']:5d} {r['shared']:6d} "
              f"{r['instructions']:5d} {'yes' if r['gdc'] else 'no':>3}  {r['case']}")
    for e in errors:
        print(f"\nFAILED {e['dtype']} {e['case']}: {e['error']}\n{e['trace']}")
    if args.json:
        args.json.write_text(json.dumps(dict(triton=triton.__version__, target="sm_90", rows=rows, errors=errors),
                                        indent=1))
    sys.exit(1 if errors else 0)


if __name__ == "__main__":
    main()
