"""Input checks of the public kernel functions, shared by both backends (no triton import).

The Triton launchers call them with their limits (float32/float16/bfloat16,
the kernels' largest head dim); the dispatching functions of
``sigmafast.kernels`` call them before the reference too, which also takes
float64. So a bad argument gets the same clear error whichever backend runs.
They read shapes, dtypes and devices only, never values: no host sync, and
``torch.compile`` traces them.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional

import torch

from .reference import RULES

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
REFERENCE_DTYPES = FLOAT_DTYPES + (torch.float64,)
FUSED_END_WIDTH = 256  # the widest model whose sublayer ends linear_norm fuses (whole rows per program)
SCORINGS = ("matmul", "fused")  # how acceptance_from_hidden scores the drafts (accept.acceptance_from_hidden)
MIN_TEMPERATURE = 1e-6  # below it, logits / T can overflow float32 to inf and the softmax to NaN


def check_float(name: str, t, ndim: int, dtypes: tuple = FLOAT_DTYPES) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        names = [str(d).removeprefix("torch.") for d in dtypes]
        raise ValueError(f"{name} must be {', '.join(names[:-1])} or {names[-1]}, got {t.dtype}")


def check_same(name: str, t, ref_name: str, ref: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.shape != ref.shape:
        raise ValueError(f"{name} must have the shape of {ref_name} {tuple(ref.shape)}, got {tuple(t.shape)}")
    if t.dtype != ref.dtype:
        raise ValueError(f"{name} must have the dtype of {ref_name} ({ref.dtype}), got {t.dtype}")
    if t.device != ref.device:
        raise ValueError(f"{name} must be on {ref.device} like {ref_name}, got {t.device}")


def check_int(name: str, t, shape: tuple, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in (torch.int32, torch.int64) or tuple(t.shape) != tuple(shape):
        raise ValueError(
            f"{name} must be an int32/int64 tensor of shape {tuple(shape)}, got {t.dtype} {tuple(t.shape)}"
        )
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")


def check_tensor(name: str, t, shape: tuple, dtypes: tuple, device, unit_stride: bool = True) -> None:
    """A ``shape`` tensor of one of ``dtypes`` on ``device`` (and, when ``unit_stride``, a 2-D one with unit
    stride along its last dimension)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape or t.dtype not in dtypes or t.device != device:
        raise ValueError(f"{name} must be a {shape} tensor of {' or '.join(map(str, dtypes))} on {device}, got "
                         f"{t.dtype} {tuple(t.shape)} on {t.device}")
    if unit_stride and t.ndim == 2 and t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name} must have unit stride along its last dimension, got strides {t.stride()}")


def check_block_v(block_v: Optional[int]) -> None:
    if block_v is not None and (isinstance(block_v, bool) or not isinstance(block_v, int) or block_v < 1
                                or block_v & (block_v - 1)):
        raise ValueError(f"block_v must be None or a power of two, got {block_v!r}")


def check_temperature(temperature) -> None:
    """0 (greedy) or a finite number >= MIN_TEMPERATURE."""
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise TypeError(f"temperature must be a number, got {type(temperature).__name__}")
    if not (temperature == 0 or MIN_TEMPERATURE <= temperature < math.inf):
        raise ValueError(f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, "
                         f"got {temperature!r}")


def check_scoring_name(scoring) -> None:
    """How ``acceptance_from_hidden`` scores the drafts: one of :data:`SCORINGS`."""
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")


def plain_scalars(temperature, top_k) -> tuple:
    """``temperature`` and ``top_k`` as a Python float and int when they are real and integral numbers (NumPy
    scalars included, which the Triton launchers cannot take); anything else unchanged, for the checks to name."""
    if isinstance(temperature, numbers.Real) and not isinstance(temperature, bool):
        temperature = float(temperature)
    if isinstance(top_k, numbers.Integral) and not isinstance(top_k, bool):
        top_k = int(top_k)
    return temperature, top_k


def check_top_k(top_k) -> None:
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)):
        raise TypeError(f"top_k must be None or an int >= 1, got {type(top_k).__name__}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")


def check_attention(q, k, v, k_cache, v_cache, cache_lens, ndim: int, dtypes: tuple = FLOAT_DTYPES,
                    max_head_dim: Optional[int] = None, scale=None) -> None:
    """q, k, v (..., H, R, D) of rank ``ndim`` against caches (B, H, L, D) and lens (B,); the softmax scale
    None or a positive real."""
    check_float("q", q, ndim, dtypes)
    check_same("k", k, "q", q)
    check_same("v", v, "q", q)
    check_float("k_cache", k_cache, 4, dtypes)
    check_same("v_cache", v_cache, "k_cache", k_cache)
    B, H, D = q.shape[0], q.shape[-3], q.shape[-1]
    if k_cache.dtype != q.dtype or k_cache.device != q.device:
        raise ValueError(
            f"k_cache must match q's dtype/device ({q.dtype}, {q.device}), got {k_cache.dtype}, {k_cache.device}"
        )
    if (k_cache.shape[0], k_cache.shape[1], k_cache.shape[3]) != (B, H, D):
        raise ValueError(f"k_cache must have shape (B={B}, H={H}, L, D={D}), got {tuple(k_cache.shape)}")
    if D == 0:
        raise ValueError(f"q must have a nonempty head dim D, got shape {tuple(q.shape)}")
    if max_head_dim is not None and D > max_head_dim:
        raise ValueError(f"head dim D={D} is over the supported maximum {max_head_dim}")
    check_int("cache_lens", cache_lens, (B,), q.device)
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)
                              or not 0 < scale < math.inf):
        raise ValueError(f"scale must be None or a positive finite float, got {scale!r:.40}")


def check_sampling(logits, uniforms, temperature, top_k, block_v=None, name: str = "logits",
                   dtypes: tuple = FLOAT_DTYPES) -> None:
    """(N, V) logits and (N,) float uniforms."""
    check_float(name, logits, 2, dtypes)
    if not isinstance(uniforms, torch.Tensor) or not uniforms.is_floating_point():
        raise ValueError(f"uniforms must be a float tensor of shape ({logits.shape[0]},), got {uniforms!r:.60}")
    if tuple(uniforms.shape) != (logits.shape[0],) or uniforms.device != logits.device:
        raise ValueError(
            f"uniforms must have shape ({logits.shape[0]},) on {logits.device}, "
            f"got {tuple(uniforms.shape)} on {uniforms.device}"
        )
    check_temperature(temperature)
    check_top_k(top_k)
    if logits.shape[1] == 0:
        raise ValueError(f"{name} must have a nonempty vocabulary dimension")
    check_block_v(block_v)


def check_flag(flag, device: torch.device) -> None:
    """A () bool flag on ``device``."""
    if not isinstance(flag, torch.Tensor):
        raise TypeError(f"flag must be a torch.Tensor, got {type(flag).__name__}")
    if flag.dtype != torch.bool or flag.shape != () or flag.device != device:
        raise ValueError(f"flag must be a () bool tensor on {device}, got {flag.dtype} {tuple(flag.shape)} "
                         f"on {flag.device}")


def check_ratio_flag(flag, temperature, device: torch.device) -> None:
    """An acceptance's optional NaN-ratio flag: None, or a () bool tensor with temperature > 0 (greedy
    decisions compare tokens, and have no ratio)."""
    if flag is None:
        return
    check_flag(flag, device)
    if temperature == 0:
        raise ValueError("flag needs temperature > 0: greedy decisions have no ratio to check "
                         "(check the verifier's outputs with flag_nonfinite)")


def check_used_rows(used, flag, logits: torch.Tensor) -> None:
    """A sampler's optional non-finite check: ``flag`` None or a () bool tensor; ``used`` None or (N,) bool
    (only with a flag)."""
    if flag is None:
        if used is not None:
            raise ValueError("used is only read with a flag: pass flag=, or used=None")
        return
    check_flag(flag, logits.device)
    if used is None:
        return
    if not isinstance(used, torch.Tensor):
        raise TypeError(f"used must be None or a torch.Tensor, got {type(used).__name__}")
    if used.dtype != torch.bool or tuple(used.shape) != (logits.shape[0],) or used.device != logits.device:
        raise ValueError(f"used must be None or a ({logits.shape[0]},) bool tensor on {logits.device}, got "
                         f"{used.dtype} {tuple(used.shape)} on {used.device}")


def check_residual(q_logits, p_logits, uniforms, temperature, top_k, block_v=None,
                   dtypes: tuple = FLOAT_DTYPES) -> None:
    """(N, V) q and p logits of one dtype and (N,) uniforms."""
    check_sampling(q_logits, uniforms, temperature, top_k, block_v, "q_logits", dtypes)
    check_same("p_logits", p_logits, "q_logits", q_logits)


def check_scoring(shape, device, drafts, draft_logp, uniforms, lengths, temperature, top_k, rule) -> None:
    """The (B, O, R) = ``shape`` drafting inputs of an acceptance (O >= 1)."""
    if rule not in RULES:
        raise ValueError(f"acceptance rule must be one of {RULES}, got {rule!r}")
    B, O, R = shape
    if O < 1:
        raise ValueError(f"an acceptance needs at least one order: the scores' shape (B, O, R) is {tuple(shape)}")
    if not isinstance(drafts, torch.Tensor) or drafts.dtype not in (torch.int32, torch.int64):
        got = getattr(drafts, "dtype", type(drafts))
        raise ValueError(f"drafts must be an int64 tensor of shape {(B, O, R)}, got {got}")
    for name, t in (("drafts", drafts), ("draft_logp", draft_logp), ("uniforms", uniforms)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (B, O, R) or t.device != device:
            got = getattr(t, "shape", t)
            raise ValueError(f"{name} must be a tensor of shape {(B, O, R)} on {device}, got {got!r:.80}")
    if not draft_logp.is_floating_point() or not uniforms.is_floating_point():
        raise ValueError(f"draft_logp and uniforms must be float tensors, got {draft_logp.dtype} and {uniforms.dtype}")
    if not isinstance(lengths, torch.Tensor) or tuple(lengths.shape) != (B,) \
            or lengths.dtype not in (torch.int32, torch.int64):
        got = f"{lengths.dtype} {tuple(lengths.shape)}" if isinstance(lengths, torch.Tensor) else f"{lengths!r:.80}"
        raise ValueError(f"lengths must be an int32 or int64 tensor of shape ({B},), got {got}")
    if lengths.device != device:
        raise ValueError(f"lengths must be on {device}, got {lengths.device}")
    check_temperature(temperature)
    check_top_k(top_k)


def check_acceptance(logits, drafts, draft_logp, uniforms, lengths, temperature, top_k, rule,
                     dtypes: tuple = FLOAT_DTYPES) -> None:
    """(B, O, R, V) verifier logits (V >= 1) and the drafting inputs."""
    check_float("logits", logits, 4, dtypes)
    if logits.shape[3] < 1:
        raise ValueError(f"logits must have a nonempty vocabulary dimension, got shape {tuple(logits.shape)}")
    check_scoring(logits.shape[:3], logits.device, drafts, draft_logp, uniforms, lengths, temperature, top_k, rule)


def check_hidden(hidden, weight, vocab_size, dtypes: tuple = FLOAT_DTYPES, ndim: int = 4) -> int:
    """(B, O, R, C) hidden states (``ndim`` dimensions, C last) and a (V', C) LM-head weight; returns the
    vocabulary size V."""
    check_float("hidden", hidden, ndim, dtypes)
    check_float("weight", weight, 2, dtypes)
    if hidden.shape[-1] == 0:
        raise ValueError(f"hidden must have a nonempty last (channel) dimension, got shape {tuple(hidden.shape)}")
    if weight.dtype != hidden.dtype or weight.shape[1] != hidden.shape[-1] or weight.device != hidden.device:
        raise ValueError(
            f"weight must be (V, C={hidden.shape[-1]}) {hidden.dtype} on {hidden.device}, "
            f"got {tuple(weight.shape)} {weight.dtype} on {weight.device}"
        )
    V = weight.shape[0] if vocab_size is None else vocab_size
    if isinstance(V, bool) or not isinstance(V, int) or not 1 <= V <= weight.shape[0]:
        raise ValueError(f"vocab_size must be None or an int in [1, {weight.shape[0]}], got {vocab_size!r}")
    return V


def check_draft_slots(known, uniforms, keys, R, unit_stride: bool = True) -> None:
    """A burst iteration's (B, T) known mask and uniforms, (B, O, T) order keys and R in [1, T]."""
    if not isinstance(known, torch.Tensor) or known.ndim != 2:
        raise ValueError(f"known must be a (B, T) tensor, got {getattr(known, 'shape', type(known).__name__)}")
    B, T = known.shape
    if isinstance(R, bool) or not isinstance(R, int) or not 1 <= R <= T:
        raise ValueError(f"R must be an int in [1, T = {T}], got {R!r}")
    check_tensor("known", known, (B, T), (torch.bool,), known.device, unit_stride=unit_stride)
    check_tensor("uniforms", uniforms, (B, T), (torch.float32, torch.float64), known.device, unit_stride=unit_stride)
    if not isinstance(keys, torch.Tensor) or keys.ndim != 3 or keys.shape[1] < 1:
        raise ValueError(f"keys must be a (B, O, T) tensor with O >= 1, got "
                         f"{getattr(keys, 'shape', type(keys).__name__)}")
    check_tensor("keys", keys, (B, keys.shape[1], T), (torch.float32, torch.float64), known.device,
                 unit_stride=False)


def check_gather_drafts(positions, tokens, logp, canvas, known, uniforms, orders, unit_stride: bool = True) -> None:
    """The drafts (B, R), canvas, known mask and uniforms (B, T) and orders (B, O, S) of ``gather_drafts``."""
    if not isinstance(orders, torch.Tensor) or orders.ndim != 3:
        raise ValueError(f"orders must be a (B, O, S) tensor, got {getattr(orders, 'shape', type(orders).__name__)}")
    B = orders.shape[0]
    device = orders.device
    check_tensor("orders", orders, tuple(orders.shape), (torch.int64,), device, unit_stride=False)
    if not isinstance(positions, torch.Tensor) or positions.ndim != 2:
        raise ValueError(f"positions must be a (B, R) tensor, got "
                         f"{getattr(positions, 'shape', type(positions).__name__)}")
    R = positions.shape[1]
    if not isinstance(canvas, torch.Tensor) or canvas.ndim != 2:
        raise ValueError(f"canvas must be a (B, T) tensor, got {getattr(canvas, 'shape', type(canvas).__name__)}")
    T = canvas.shape[1]
    if not 1 <= R <= T:
        raise ValueError(f"positions must hold 1 to T = {T} positions per row, got {R}")
    check_tensor("positions", positions, (B, R), (torch.int64,), device, unit_stride=unit_stride)
    check_tensor("tokens", tokens, (B, R), (torch.int64,), device, unit_stride=unit_stride)
    check_tensor("logp", logp, (B, R), (torch.float32, torch.float64), device, unit_stride=unit_stride)
    check_tensor("canvas", canvas, (B, T), (torch.int64,), device, unit_stride=unit_stride)
    check_tensor("known", known, (B, T), (torch.bool,), device, unit_stride=unit_stride)
    check_tensor("uniforms", uniforms, (B, T), (torch.float32, torch.float64), device, unit_stride=unit_stride)


def check_plan_step(steps, step, unit_stride: bool = True) -> None:
    """An autoregressive plan's (W, B, T) int64 steps (T >= 1) and its () int64 step."""
    if not isinstance(steps, torch.Tensor) or steps.ndim != 3 or steps.shape[2] < 1:
        raise ValueError(f"steps must be a (W, B, T) tensor with T >= 1, got "
                         f"{getattr(steps, 'shape', type(steps).__name__)}")
    check_tensor("steps", steps, tuple(steps.shape), (torch.int64,), steps.device, unit_stride=unit_stride)
    check_tensor("step", step, (), (torch.int64,), steps.device, unit_stride=unit_stride)


def check_residual_pick(n, remaining, orders, slots, u_residual, drafts, verifier, unit_stride: bool = True) -> None:
    """The arguments of ``residual_pick``: counts (B,), orders and slots (B, R), uniforms (B, T), rows."""
    if not isinstance(orders, torch.Tensor) or orders.ndim != 2 or orders.shape[1] < 1:
        raise ValueError(f"orders must be a (B, R) tensor with R >= 1, got "
                         f"{getattr(orders, 'shape', type(orders).__name__)}")
    B, R = orders.shape
    device = orders.device
    for name, t in (("n", n), ("remaining", remaining)):
        check_int(name, t, (B,), device)
    check_tensor("orders", orders, (B, R), (torch.int64,), device, unit_stride=unit_stride)
    check_tensor("slots", slots, (B, R), (torch.int64,), device, unit_stride=unit_stride)
    if not isinstance(u_residual, torch.Tensor) or u_residual.ndim != 2:
        raise ValueError(f"u_residual must be a (B, T) tensor, got "
                         f"{getattr(u_residual, 'shape', type(u_residual).__name__)}")
    check_tensor("u_residual", u_residual, (B, u_residual.shape[1]), (torch.float32, torch.float64), device,
                 unit_stride=unit_stride)
    for name, t, rows in (("drafts", drafts, None), ("verifier", verifier, R)):
        if (not isinstance(t, torch.Tensor) or t.ndim != 3 or t.shape[0] != B or t.shape[2] < 1
                or (rows is not None and t.shape[1] != rows) or t.shape[1] < 1 or t.device != device):
            want = f"({B}, {'R' if rows is None else rows}, W)"
            raise ValueError(f"{name} must be a {want} tensor on {device} with W >= 1, got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
