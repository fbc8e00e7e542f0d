"""Compile for sm_90 every Triton launch that a set of CPU tests makes, without a GPU.

    python benchmarks/compile_tested.py [pytest arguments]     (default: the kernel and engine tests)

``compile_sm90.py`` compiles the variants the engine uses at a few realistic
shapes. The tests launch the kernels at many more (odd vocabularies, narrow
rows, one-row batches, forced tiles), and the Triton interpreter they run in
accepts code the GPU compiler refuses: a ``tl.dot`` narrower than 16, or, in
Triton 3.6, a scan over a tile with fewer elements than threads. This script
runs pytest in the interpreter with itself as a plugin (``-p compile_tested``),
which records each launch's kernel, argument dtypes, pointer alignments,
integer specialisation classes and keyword arguments, then replays every distinct
launch through Triton's compiler with ``compile_sm90``'s offline sm_90 driver
(nothing runs). It prints the variants that fail to compile, and those that
take a stack frame (spills), and exits 1 on a failure.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_TESTS = ["tests/test_engine.py", *sorted(str(p.relative_to(HERE.parent))
                                                 for p in (HERE.parent / "tests").glob("test_kernels_*.py")
                                                 if p.name != "test_kernels_sm90.py")]
RECORD_ENV = "SIGMAFAST_LAUNCH_RECORD"


def _describe(arg) -> dict:
    """What of a launch argument Triton specialises a compile on: a tensor's dtype and 16-byte alignment, an
    integer's class (1, a multiple of 16, other; 32 or 64 bits), any other value itself."""
    import torch

    if isinstance(arg, torch.Tensor):
        return {"dtype": str(arg.dtype).split(".")[1], "aligned": arg.data_ptr() % 16 == 0}
    if isinstance(arg, int) and not isinstance(arg, bool):
        wide = not -2**31 <= arg < 2**31
        return {"int": 1 if arg == 1 else (2**34 if wide else 32) + (0 if arg % 16 == 0 else 3)}
    return {"value": arg if arg is None or isinstance(arg, (bool, float, str)) else repr(arg)}


def _describe_meta(value) -> dict:
    """A keyword argument (constexprs, ``num_warps``): kept as it is, unless it is a tensor."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    return _describe(value)


def pytest_configure(config) -> None:
    """As a pytest plugin: wrap the interpreter's launches so that each distinct one is recorded."""
    out = os.environ.get(RECORD_ENV)
    if not out:
        return
    from triton.runtime.interpreter import GridExecutor, InterpretedFunction

    seen: set = set()

    def record(fn, args, kwargs) -> None:
        entry = json.dumps([fn.__module__, fn.__name__, [_describe(a) for a in args],
                            {k: _describe_meta(v) for k, v in kwargs.items()}], sort_keys=True)
        if entry not in seen:  # one JSON line per distinct launch, at once: a crash loses none recorded before
            seen.add(entry)
            with open(out, "a") as f:
                f.write(entry + "\n")

    if hasattr(InterpretedFunction, "run"):  # Triton 3.6 and later
        run = InterpretedFunction.run

        def recording_run(self, *args, grid, warmup, **kwargs):
            record(self.fn, args, kwargs)
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)

        InterpretedFunction.run = recording_run
    else:  # Triton 3.4 and 3.5: every launch calls a GridExecutor, with all its launch keywords
        call = GridExecutor.__call__

        def recording_call(self, *args, **kwargs):
            record(self.fn, args, {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")})
            return call(self, *args, **kwargs)

        GridExecutor.__call__ = recording_call


def _rebuild(desc: dict):
    import torch

    if "dtype" in desc:  # a few elements: nothing runs, only the dtype and the alignment matter
        base = torch.empty(80, dtype=getattr(torch, desc["dtype"]))
        return base[:64] if desc["aligned"] else base[1:65]
    return desc["int"] if "int" in desc else desc["value"]


def replay(launches: list) -> tuple[list, list]:
    """Compile each recorded launch for sm_90: (failures, variants with a stack frame)."""
    import compile_sm90
    from triton.runtime.driver import driver

    driver.set_active(compile_sm90.OfflineDriver())
    failures, stacks, seen = [], [], set()
    for module, name, args, kwargs in launches:
        kernel = getattr(importlib.import_module(module), name)
        meta = {k: _rebuild(v) for k, v in kwargs.items()}
        try:
            compiled = kernel.run(*[_rebuild(a) for a in args], grid=(1,), warmup=True, **meta)
        except Exception as e:  # report every failing launch, not only the first
            cause = e.__cause__ or e  # a CompilationError's message ends with the source line; its cause says why
            line = f"{name} {meta}: {type(cause).__name__}: {(str(cause).strip().splitlines() or [''])[-1][:200]}"
            if line not in failures:
                failures.append(line)
            continue
        if compiled.hash in seen:
            continue
        seen.add(compiled.hash)
        res = compile_sm90._resources(compiled)
        if res["stack"] or res["local"]:
            stacks.append(f"{name} {meta}: {res['stack']} bytes of stack, {res['local']} of local memory")
    return failures, stacks


def main() -> None:
    tests = sys.argv[1:] or DEFAULT_TESTS
    with tempfile.TemporaryDirectory() as tmp:
        record = Path(tmp) / "launches.jsonl"
        env = {**os.environ, "TRITON_INTERPRET": "1", RECORD_ENV: str(record),
               "PYTHONPATH": os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)}
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "compile_tested", "-p", "no:cacheprovider",
                               "-p", "no:xdist", *tests], cwd=HERE.parent, env=env)  # one process: one record
        if not record.exists():
            sys.exit(f"pytest recorded no launches (rc {done.returncode})")
        launches = [json.loads(line) for line in record.read_text().splitlines()]
    os.environ.pop("TRITON_INTERPRET", None)  # compile_sm90 imports triton for the GPU compiler
    failures, stacks = replay(launches)
    import triton

    print(f"triton {triton.__version__}, sm_90: {len(launches)} distinct launches recorded (pytest rc "
          f"{done.returncode}), {len(failures)} failed to compile, {len(stacks)} variants with a stack frame")
    for line in failures:
        print("FAILED", line)
    for line in stacks:
        print("STACK ", line)
    sys.exit(1 if failures or done.returncode not in (0, 5) else 0)


if __name__ == "__main__":
    main()
