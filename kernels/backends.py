"""Which backend a kernel call takes (``backend_for``, ``use_backend``), and whether its launches ask for
programmatic dependent launch (``use_pdl``); the package ``sigmafast.kernels`` re-exports each public name and
documents the rules."""

from __future__ import annotations

import contextlib
import contextvars
import os
import warnings
from typing import Iterator, Optional

import torch

from . import checks, support
from .support import require_triton, triton_problem

BACKENDS = ("auto", "triton", "reference")
_override: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("sigmafast_backend", default=None)


def _check_backend(name: str, source: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"{source} must be one of {BACKENDS}, got {name!r}")
    return name


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Run the enclosed kernel calls on ``name`` ("auto", "triton" or "reference")."""
    token = _override.set(_check_backend(name, "use_backend(name)"))
    try:
        yield
    finally:
        _override.reset(token)


_pdl: contextvars.ContextVar[bool] = contextvars.ContextVar("sigmafast_pdl", default=False)


@contextlib.contextmanager
def use_pdl(on: bool = True) -> Iterator[None]:
    """Launch the enclosed Triton kernels with programmatic dependent launch (``on``) or plainly, on the GPUs
    that have it (:func:`pdl_supported`; ``utils.pdl_meta``): each kernel may then start while the one before
    it ends, and waits for it before touching memory. ``Engine(pdl=True)`` runs its steps inside it, so its
    captured graphs keep those launches."""
    if not isinstance(on, bool):
        raise TypeError(f"use_pdl(on) takes a bool, got {type(on).__name__}")
    token = _pdl.set(on)
    try:
        yield
    finally:
        _pdl.reset(token)


def pdl_enabled() -> bool:
    """Whether the kernels launched now ask for programmatic dependent launch (:func:`use_pdl`)."""
    return _pdl.get()


def pdl_supported(device: torch.device) -> bool:
    """Whether ``device`` has programmatic dependent launch: a CUDA GPU of compute capability 9 or more, with
    triton >= 3.5 (``support.PDL_TRITON``)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9 and support.triton_has_pdl()


def backend_for(t: torch.Tensor) -> str:
    """The backend ("triton" or "reference") a call on tensor ``t`` takes now."""
    name = _override.get()
    if name is None:
        env = os.environ.get("SIGMAFAST_BACKEND", "auto").strip().lower() or "auto"
        name = _check_backend(env, "SIGMAFAST_BACKEND")
    if name == "auto":
        if t.dtype not in checks.FLOAT_DTYPES:
            return "reference"
        interpreted = os.environ.get("TRITON_INTERPRET") == "1" and t.dtype != torch.bfloat16
        return "triton" if (t.is_cuda or interpreted) and _triton_runs(t) else "reference"
    if name == "triton":
        check_triton_device(t, "the triton backend")
    return name


def _triton_runs(t: torch.Tensor) -> bool:
    """Whether the kernels can run (``support``); if not, say once that CUDA tensors take the reference."""
    problem = triton_problem()
    if problem is not None and t.is_cuda:
        warnings.warn(f"sigmafast.kernels: the fused Triton kernels need triton >= {support.required_version()}; "
                      f"{problem}. CUDA tensors take the slower PyTorch reference path.", RuntimeWarning,
                      stacklevel=3)
    return problem is None


def check_triton_device(t: torch.Tensor, what: str) -> None:
    require_triton(what)
    if not t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"{what} needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is imported, for "
                         f"tensors on {t.device}")
