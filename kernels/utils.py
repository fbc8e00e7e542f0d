"""Shared pieces of the Triton kernels: launch helpers, vocabulary helpers (the input checks are in checks).

Compile-once rules every kernel follows: ``tl.constexpr`` values depend only on
the dtype, the head dim and the vocabulary tiling; every size, count and
non-unit stride argument is in ``do_not_specialize`` (so Triton never
re-specialises on a value becoming 1 or a multiple of 16). The divisibility
by 16 that Triton would have inferred from the strides, which keeps the loads
vectorised, is restored by the ``STRIDE_UNIT`` constexprs: 16 when the layout
allows it (a function of the head dim, or of V or C), else 1; the launcher
passes each stride divided by it (exactly, copying the rare input whose
strides are not multiples of 16) and the kernel multiplies it back, so the
compiler sees a multiple of 16. Innermost strides are 1 and not passed.
Small per-row vectors (uniforms, drafts, thresholds, cache lengths), often
views at any offset, are in ``do_not_specialize_on_alignment``; the large
operands keep Triton's 16-byte pointer-alignment specialisation. Every kernel
also takes ``USE_GDC`` (``pdl_meta``): off except in ``Engine(pdl=True)``'s steps on sm_90 or later, so a
process that samples without programmatic dependent launch compiles no variant for it.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Callable, Iterable, Optional

import torch
import triton
import triton.language as tl

from .backends import pdl_enabled, pdl_supported
from .support import require_triton


_ALIGNMENT_KEYWORD = "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters


def jit(*, do_not_specialize: Iterable[str] = (), do_not_specialize_on_alignment: Iterable[str] = ()):
    """``triton.jit`` with both compile-once lists, on every Triton the kernels support. A Triton without
    ``do_not_specialize_on_alignment`` (before 3.2; torch 2.4 pins 3.0) specialises a pointer's 16-byte
    alignment unless the pointer is in ``do_not_specialize``, so there the alignment names join that list."""
    if _ALIGNMENT_KEYWORD:
        return triton.jit(do_not_specialize=list(do_not_specialize),
                          do_not_specialize_on_alignment=list(do_not_specialize_on_alignment))
    return triton.jit(do_not_specialize=[*do_not_specialize, *do_not_specialize_on_alignment])


def rows_per_program(block_v: int, budget: int = 4096) -> int:
    """Rows per program so that a (rows, BLOCK_V) chunk holds about ``budget`` elements."""
    return max(1, min(budget // block_v, 256))


def vocab_config(V: int, block_v: Optional[int] = None) -> tuple[int, int, int, bool]:
    """(BLOCK_V, BLOCK_N, num_warps, STRIDE_UNIT) of the vocabulary kernels: functions of V (and of an
    explicit ``block_v``) only, never of the row count."""
    block_v = block_v or min(triton.next_power_of_2(V), 4096)
    block_n = rows_per_program(block_v)
    return block_v, block_n, 4 if block_n * block_v <= 2048 else 8, 16 if V % 16 == 0 else 1


def row_stride(t: torch.Tensor) -> int:
    """Stride between the rows of an (N, X) tensor; 0 for one row (only row 0 is read)."""
    return t.stride(0) if t.shape[0] > 1 else 0


def rows_ready(t: torch.Tensor, unit: int) -> torch.Tensor:
    """(N, X) rows with a unit inner stride and a row stride that is a multiple of ``unit``."""
    if (t.stride(-1) == 1 or t.shape[-1] <= 1) and row_stride(t) % unit == 0:
        return t
    return t.contiguous()


@functools.lru_cache(maxsize=None)
def cuda_props(device: torch.device):
    """``torch.cuda.get_device_properties`` of a CUDA device (its index, or the current one), cached."""
    return _cuda_props(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_props(index: int):
    return torch.cuda.get_device_properties(index)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors to fill; a small stand-in in the CPU interpreter."""
    if device.type == "cuda":
        return cuda_props(device).multi_processor_count
    return 4


def pdl_meta(device: torch.device) -> dict:
    """The launch meta-parameters of every kernel: ``USE_GDC`` (``gdc_enter``) and, with it, Triton's
    ``launch_pdl`` option, on inside ``kernels.use_pdl(True)`` (``Engine(pdl=True)``'s steps) when ``device``
    is a CUDA GPU of compute capability 9 or more (Hopper's programmatic dependent launch: in a stream or a
    replayed CUDA graph, a kernel's launch and its programs' start overlap the end of the kernel before it,
    which otherwise costs a launch gap at each of the 40 to 230 kernels of a captured step). Off in the CPU
    interpreter, so its variants are those of a plain launch. Every launcher asks for them, so this is also
    where a launch on a Triton older than ``support.MIN_TRITON`` stops, with ``TritonUnavailable``."""
    require_triton("a sigmafast Triton kernel")
    if pdl_enabled() and pdl_supported(device):
        return dict(USE_GDC=True, launch_pdl=True)
    return dict(USE_GDC=False)


@triton.jit
def gdc_enter(USE_GDC: tl.constexpr):
    """The first statement of every kernel. With ``USE_GDC`` (a programmatic dependent launch, ``pdl_meta``),
    wait until the previous kernel in the stream has finished and its writes are visible (a kernel may start
    before: every program waits, before any load or store, so none of them reads stale data or overwrites
    what the previous kernel still reads, and the kernel completes only after its predecessor), then let the
    next kernel launch (its programs take the SMs' free slots and wait in turn)."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


REGISTERS_PER_SM = 65536  # every NVIDIA GPU from sm_50 to sm_120


def occupancy(n_regs: int, shared: int, num_warps: int, max_threads: int, shared_per_sm: int) -> int:
    """Programs of ``num_warps`` warps, ``n_regs`` registers per thread and ``shared`` bytes of shared memory
    that one SM of ``max_threads`` threads and ``shared_per_sm`` bytes holds at once (registers are allocated
    per warp in units of 256), at most 32."""
    warp_regs = -(-n_regs * 32 // 256) * 256
    by_regs = REGISTERS_PER_SM // warp_regs // num_warps if n_regs else 32
    by_shared = shared_per_sm // shared if shared else 32
    return max(1, min(by_regs, max_threads // (32 * num_warps), by_shared, 32))


_RESIDENT: dict = {}  # (kernel, device index, tensor dtypes, meta) -> programs per SM; like Triton's kernel cache
FALLBACK_RESIDENT = 2  # programs per SM assumed when Triton does not expose a compiled kernel's registers


def measured_or_fallback(measure: Callable[[], int], name: str) -> int:
    """``measure()``, or :data:`FALLBACK_RESIDENT` with a warning when it fails on Triton internals that moved
    (an AttributeError or TypeError: ``_init_handles`` and ``n_regs`` are not public API). The grids built
    from it stay correct for any count; only the occupancy is then a guess. Compile errors still raise."""
    try:
        return measure()
    except (AttributeError, TypeError) as e:
        warnings.warn(f"sigmafast: could not read the registers of Triton kernel {name} ({type(e).__name__}: {e}); "
                      f"assuming {FALLBACK_RESIDENT} programs per SM", RuntimeWarning, stacklevel=2)
        return FALLBACK_RESIDENT


def _compiled_occupancy(kernel, args: tuple, meta: dict, index: int) -> int:
    compiled = kernel.warmup(*args, grid=(1,), **meta)  # compiles (or finds) the launch's variant, no launch
    compiled._init_handles()  # loads the binary and sets n_regs, as the tutorial does
    props = _cuda_props(index)  # older torch lacks the fields: sm_90's values
    return occupancy(compiled.n_regs, compiled.metadata.shared, compiled.metadata.num_warps,
                     getattr(props, "max_threads_per_multi_processor", 2048),
                     getattr(props, "shared_memory_per_multiprocessor", 233_472))


def resident_programs(kernel, args: tuple, meta: dict, device: torch.device) -> int:
    """Programs of ``kernel`` (a ``triton.jit`` function launched with ``args`` and ``meta``) that one SM holds
    at once, from the compiled kernel's registers, shared memory and warps, as Triton's fused-softmax tutorial
    computes it; 4 in the CPU interpreter. For persistent kernels, whose grid must fit the GPU in one wave.
    Cached per kernel, device, tensor dtypes and meta-parameters: the launchers that call it pass 16-byte
    aligned tensors and keep every size out of Triton's specialisation, so those pick the variant."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (kernel, index, tuple(a.dtype for a in args if isinstance(a, torch.Tensor)), tuple(sorted(meta.items())))
    if key not in _RESIDENT:
        _RESIDENT[key] = measured_or_fallback(lambda: _compiled_occupancy(kernel, args, meta, index),
                                              getattr(kernel, "__name__", repr(kernel)))
    return _RESIDENT[key]


def min_split_keys(device: torch.device) -> int:
    """Fewest cache keys per automatic KV split. On CUDA 512: a GPT-2 decode step (B = 1, cache 768) with
    13 one-tile splits spent 8 µs per layer in the combine against 6 µs in the attention itself (H200
    profile, benchmarks/RESULTS.md). In the CPU interpreter 32, so that small tests still split."""
    return 512 if device.type == "cuda" else 32


def strides(t: torch.Tensor) -> tuple:
    """``t.stride()`` with 0 for the size-1 dimensions (whose stride is never used, and may be anything)."""
    return tuple(0 if n == 1 else s for n, s in zip(t.shape, t.stride()))


def in_units(unit: int, *stride_values: int) -> tuple:
    """Strides divided by the kernels' ``STRIDE_UNIT`` (exact: the launcher chose ``unit`` so)."""
    return tuple(s // unit for s in stride_values)


LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def exp_ftz(b_d):
    """exp(b_d) as ``tl.exp2(b_d * log2 e)``: on sm_90 one multiply and one ``ex2.approx.ftz``, against six
    instructions for ``tl.exp`` (the same multiply and ex2, inside a guard that keeps denormal results).
    Results under 2^-126 (b_d < -87.3) are 0 on the GPU. The vocabulary kernels use it for every
    probability, so a chunk mass is 0 exactly when all of its probabilities are."""
    return tl.exp2(b_d * LOG2E)


@triton.jit
def online_lse(b_m, b_s, b_x, scale):
    """Fold a (BLOCK_N, BLOCK_V) chunk b_x into per-row running max b_m and sum b_s of ``exp2((x - max) *
    scale)``: ``scale = LOG2E`` sums exp(x - max) (as ``exp_ftz``); ``LOG2E / T`` sums exp((x - max) / T)
    with one multiply-add per element, the max staying that of the raw x."""
    m_new = tl.maximum(b_m, tl.max(b_x, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    b_s = b_s * tl.exp2((b_m - m_use) * scale) + tl.sum(tl.exp2((b_x - m_use[:, None]) * scale), 1)
    return m_new, b_s
