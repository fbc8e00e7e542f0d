"""What a benchmark's calls compiled: the Triton kernel variants held in the JIT caches of ``sigmafast.kernels``,
and the entries created in a cache directory (``bench_engine.py``'s first-call case)."""

from __future__ import annotations

import importlib
import os
import pkgutil

import sigmafast

KERNEL_MODULES = ("attention", "utils", "accept", "sampling")  # then any other module of the package


def jit_functions() -> dict:
    """name -> triton JITFunction found among the kernel modules' attributes (autotuner wrappers unwrapped)."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return {}
    import sigmafast.kernels as package

    names = list(KERNEL_MODULES)
    names += [m.name for m in pkgutil.iter_modules(package.__path__) if m.name not in names]
    found = {}
    for mod_name in names:
        try:
            mod = importlib.import_module(f"sigmafast.kernels.{mod_name}")
        except ImportError:
            continue
        for attr, obj in vars(mod).items():
            for _ in range(3):  # Autotuner / Heuristics keep the kernel in .fn
                if isinstance(obj, JITFunction) or not hasattr(obj, "fn"):
                    break
                obj = obj.fn
            if isinstance(obj, JITFunction) and all(obj is not f for f in found.values()):
                inner = getattr(obj, "fn", None)
                found[f"{getattr(inner, '__module__', mod_name).rsplit('.', 1)[-1]}.{attr}"] = obj
    return found


def compiled_variants(fns: dict) -> dict:
    """name -> number of compiled variants held in the kernel's in-memory cache (all devices); None if unreadable."""
    out = {}
    for name, fn in fns.items():
        try:
            out[name] = sum(len(caches[0]) for caches in list(fn.device_caches.values()))
        except Exception:  # noqa: BLE001 - triton internals differ between versions
            out[name] = None
    return out


def cache_entries(path: str) -> int:
    """Files and folders under ``path``."""
    return sum(len(dirs) + len(files) for _, dirs, files in os.walk(path))


def uses_triton(model) -> bool:
    """Whether ``model``'s kernel calls take the Triton backend now."""
    return sigmafast.kernels.backend_for(next(model.parameters())) == "triton"
