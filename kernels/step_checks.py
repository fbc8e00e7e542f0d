"""Input checks of the fused step ops, shared by both backends (no triton import).

``add_layer_norm``, ``linear_add_norm``, ``mlp_add_norm``, ``feed_embedding``,
``rotary_``, ``flag_nonfinite`` and ``commit`` check their arguments here on
either path. The Triton launchers pass their limits: float32/float16/bfloat16,
the widest row a program holds (``max_width``, ``max_inner``) and unit strides
where the kernels read rows as vectors (``unit_stride``); the dispatching
functions of ``sigmafast.kernels`` call them with the defaults before the
reference, which also takes float64 and any width or stride. Like
:mod:`.checks`, they read shapes, dtypes and devices only, never values.
"""

from __future__ import annotations

from typing import Optional

import torch

from .checks import REFERENCE_DTYPES, check_flag, check_float, check_int, check_same

_INT = (torch.int64, torch.int32)


def describe(t) -> str:
    return f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__


def check_norm(weight, bias, eps, C: int, device, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """A LayerNorm's (C,) weight and bias (each may be None) of the normalised tensor's ``dtype`` (or float32
    when that is a 16-bit dtype, as under autocast) and eps; returns the bias with a unit stride, as the
    kernels read it."""
    allowed = (dtype, torch.float32) if dtype in (torch.float16, torch.bfloat16) else (dtype,)
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (not isinstance(t, torch.Tensor) or t.shape != (C,) or t.dtype not in allowed
                              or t.device != device):
            kinds = " or ".join(str(d) for d in allowed)
            raise ValueError(f"{name} must be None or a ({C},) {kinds} tensor on {device}, got {describe(t)}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"eps must be a positive float, got {eps!r}")
    return bias if bias is None or bias.stride(0) == 1 else bias.contiguous()


def _check_width(name: str, C: int, max_width: Optional[int], why: str = "") -> None:
    top = max_width if max_width is not None else float("inf")
    if not 1 <= C <= top:
        bound = f"[1, {max_width}]" if max_width is not None else ">= 1"
        raise ValueError(f"{name} must be in {bound}{why}, got {C}")


def _check_rows(name: str, weight, C: int, letter: str, max_inner: Optional[int]) -> int:
    """A 2-D ``weight`` of 1 to ``max_inner`` (when given) rows; returns the row count. Its columns, dtype,
    device and strides are :func:`check_linear`'s."""
    top = max_inner if max_inner is not None else float("inf")
    if not isinstance(weight, torch.Tensor) or weight.ndim != 2 or not 1 <= weight.shape[0] <= top:
        bound = f" with {letter} in [1, {max_inner}]" if max_inner is not None else ""
        article = "an" if letter in "AEFHILMNORSX" else "a"  # as the letter is read: "an (F, C)", "a (Q, C)"
        raise ValueError(f"{name} must be {article} ({letter}, {C}) tensor{bound}, got {describe(weight)}")
    return weight.shape[0]


def check_stream(x, dtypes: tuple, max_width: Optional[int]) -> int:
    """The residual stream x (..., C) with C <= max_width; returns C."""
    if not isinstance(x, torch.Tensor) or x.ndim < 1:
        raise TypeError(f"x must be a (..., C) tensor, got {type(x).__name__}")
    check_float("x", x, x.ndim, dtypes)
    _check_width("x's last dimension", x.shape[-1], max_width, " (whole rows per program)")
    return x.shape[-1]


def check_linear(prefix: str, weight, bias, shape: tuple, ref: torch.Tensor, unit_stride: bool) -> None:
    """``{prefix}weight``: a ``shape`` tensor (contiguous when ``unit_stride``), and ``{prefix}bias``:
    (shape[0],) or None (unit stride when ``unit_stride``), of ref's dtype and device."""
    if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != shape or weight.dtype != ref.dtype \
            or weight.device != ref.device or (unit_stride and not weight.is_contiguous()):
        kind = "contiguous " if unit_stride else ""
        raise ValueError(f"{prefix}weight must be a {kind}{shape} {ref.dtype} tensor on {ref.device}, got "
                         f"{describe(weight)}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != shape[:1]
                             or bias.dtype != ref.dtype or bias.device != ref.device
                             or (unit_stride and bias.stride(0) != 1)):
        kind = " with unit stride" if unit_stride else ""
        raise ValueError(f"{prefix}bias must be None or a ({shape[0]},) {ref.dtype} tensor on {ref.device}{kind}, "
                         f"got {describe(bias)}")


def check_next(next_weight, next_bias, next_out, lead: tuple, ref: torch.Tensor, max_inner: Optional[int] = None,
               unit_stride: bool = False) -> None:
    """The optional next projection of rows as wide as ``ref``'s last dimension C, of its dtype and device:
    a (Q, C) weight, a (Q,) bias or None, and a (*lead, Q) output whose rows are one strided (N, Q) view
    (unit inner strides when ``unit_stride``); all three None without one."""
    if next_weight is None:
        if next_bias is not None or next_out is not None:
            raise ValueError("next_bias and next_out need a next_weight")
        return
    C = ref.shape[-1]
    Q = _check_rows("next_weight", next_weight, C, "Q", max_inner)
    check_linear("next_", next_weight, next_bias, (Q, C), ref, unit_stride)
    want = (*lead, Q)
    if not isinstance(next_out, torch.Tensor) or tuple(next_out.shape) != want or next_out.dtype != ref.dtype \
            or next_out.device != ref.device or (next_out.numel() and next_out.stride(-1) != 1):
        raise ValueError(f"next_out must be a {want} {ref.dtype} tensor on {ref.device} with unit inner stride, "
                         f"got {describe(next_out)}")
    try:
        next_out.view(-1, Q)
    except RuntimeError:
        raise ValueError(f"next_out's rows must be one strided (N, {Q}) view, got strides "
                         f"{next_out.stride()}") from None


def check_add_layer_norm(x, y, weight, bias, eps, dtypes: tuple = REFERENCE_DTYPES,
                         max_width: Optional[int] = None) -> Optional[torch.Tensor]:
    """x, y (..., C) of one shape and dtype, the norm's weight, bias and eps; returns the bias as
    :func:`check_norm`."""
    if not isinstance(x, torch.Tensor) or x.ndim < 1:
        raise TypeError(f"x must be a (..., C) tensor, got {type(x).__name__}")
    check_float("x", x, x.ndim, dtypes)
    check_same("y", y, "x", x)
    _check_width("x's last dimension", x.shape[-1], max_width)
    return check_norm(weight, bias, eps, x.shape[-1], x.device, x.dtype)


def check_linear_add_norm(x, y, weight, bias, norm_weight, norm_bias, eps, next_weight=None, next_bias=None,
                          next_out=None, dtypes: tuple = REFERENCE_DTYPES, max_width: Optional[int] = None,
                          max_inner: Optional[int] = None, unit_stride: bool = False) -> Optional[torch.Tensor]:
    """The arguments of ``linear_add_norm``; returns the norm's bias as :func:`check_norm`."""
    C = check_stream(x, dtypes, max_width)
    top = max_inner if max_inner is not None else float("inf")
    if not isinstance(y, torch.Tensor) or y.shape[:-1] != x.shape[:-1] or y.dtype != x.dtype \
            or y.device != x.device or not 1 <= y.shape[-1] <= top:
        bound = f"[1, {max_inner}]" if max_inner is not None else ">= 1"
        raise ValueError(f"y must be a {(*x.shape[:-1], 'K')} {x.dtype} tensor on {x.device} with K in {bound}, "
                         f"got {describe(y)}")
    check_linear("", weight, bias, (C, y.shape[-1]), x, unit_stride)
    norm_bias = check_norm(norm_weight, norm_bias, eps, C, x.device, x.dtype)
    check_next(next_weight, next_bias, next_out, x.shape[:-1], x, max_inner, unit_stride)
    return norm_bias


def check_linear_gelu(x, weight, bias, dtypes: tuple = REFERENCE_DTYPES, unit_stride: bool = False) -> None:
    """The arguments of ``linear_gelu``: x (..., K), weight (F, K) (contiguous when ``unit_stride``), bias (F,)
    or None, of x's dtype and device."""
    K = check_stream(x, dtypes, None)
    check_linear("", weight, bias, (_check_rows("weight", weight, K, "F", None), K), x, unit_stride)


def check_mlp_add_norm(x, h, fc_weight, fc_bias, proj_weight, proj_bias, norm_weight, norm_bias, eps,
                       next_weight=None, next_bias=None, next_out=None, dtypes: tuple = REFERENCE_DTYPES,
                       max_width: Optional[int] = None, max_inner: Optional[int] = None,
                       unit_stride: bool = False) -> Optional[torch.Tensor]:
    """The arguments of ``mlp_add_norm``; returns the norm's bias as :func:`check_norm`."""
    C = check_stream(x, dtypes, max_width)
    check_same("h", h, "x", x)
    F = _check_rows("fc_weight", fc_weight, C, "F", max_inner)
    check_linear("fc_", fc_weight, fc_bias, (F, C), x, unit_stride)
    check_linear("proj_", proj_weight, proj_bias, (C, F), x, unit_stride)
    if (fc_bias is None) != (proj_bias is None):
        raise ValueError("fc_bias and proj_bias must be both given or both None")
    norm_bias = check_norm(norm_weight, norm_bias, eps, C, x.device, x.dtype)
    check_next(next_weight, next_bias, next_out, x.shape[:-1], x, max_inner, unit_stride)
    return norm_bias


def _check_index(name: str, t, shape: tuple, device) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype not in _INT:
        raise TypeError(f"{name} must be an int64 or int32 tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    if tuple(t.shape) != shape or t.device != device:
        raise ValueError(f"{name} must have shape {shape} on {device}, got {tuple(t.shape)} on {t.device}")


def _check_table(name: str, t, width: int, dtype, device) -> None:
    if (not isinstance(t, torch.Tensor) or t.ndim != 2 or t.shape[1] != width or t.dtype != dtype
            or t.device != device or t.stride(1) != 1):
        raise ValueError(f"{name} must be a (rows, {width}) {dtype} tensor on {device} with unit column stride, "
                         f"got {describe(t)}")


def check_feed_embedding(last_tok, last_pos, tokens, orders, wte, pe_in, pe_out, weight, bias, eps,
                         next_weight=None, next_bias=None, next_out=None, dtypes: tuple = REFERENCE_DTYPES,
                         max_width: Optional[int] = None, next_max_width: Optional[int] = None,
                         max_inner: Optional[int] = None, unit_stride: bool = False) -> Optional[torch.Tensor]:
    """The arguments of ``feed_embedding``; returns the norm's bias as :func:`check_norm`."""
    if not isinstance(orders, torch.Tensor) or orders.ndim != 3:
        raise ValueError(f"orders must be a (B, G, S) tensor, got {getattr(orders, 'shape', type(orders).__name__)}")
    B, G, S = orders.shape
    if S == 0:
        raise ValueError(f"orders must have at least one step per group (B, G, S >= 1), got {tuple(orders.shape)}")
    device = orders.device
    _check_index("orders", orders, (B, G, S), device)
    if B * G * S >= 2**31:
        raise ValueError(f"orders must have fewer than 2**31 steps, got {B * G * S}")
    _check_index("last_tok", last_tok, (B,), device)
    _check_index("last_pos", last_pos, (B,), device)
    if tokens is None:
        if S > 1:
            raise ValueError(f"tokens may be None only when orders has one step per group, got S = {S}")
    else:
        _check_index("tokens", tokens, (B, G, S), device)
    check_float("wte", wte, 2, dtypes)
    C = wte.shape[1]
    top = max_width if max_width is not None else float("inf")
    if not 2 <= C <= top or C % 2:
        bound = f"in [2, {max_width}]" if max_width is not None else ">= 2"
        raise ValueError(f"wte's width must be even and {bound}, got {C}")
    _check_table("wte", wte, C, wte.dtype, device)
    if (pe_in is None) != (pe_out is None):
        raise ValueError("pe_in and pe_out must be both tensors or both None")
    if pe_in is not None:
        _check_table("pe_in", pe_in, C // 2, wte.dtype, device)
        _check_table("pe_out", pe_out, C // 2, wte.dtype, device)
    bias = check_norm(weight, bias, eps, C, device, wte.dtype)
    if next_weight is not None and next_max_width is not None and C > next_max_width:
        raise ValueError(f"next_weight needs wte's width at most {next_max_width} (whole rows per program), got {C}")
    check_next(next_weight, next_bias, next_out, (B, G, S), wte, max_inner, unit_stride)
    return bias


def check_rotary(q, k, v, pos_q, pos_k, cos, sin, dtypes: tuple = REFERENCE_DTYPES) -> None:
    """The arguments of ``rotary_``."""
    if not isinstance(q, torch.Tensor) or q.ndim < 3 or q.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"q must be a (..., H, T, D) tensor of {names}, got {describe(q)}")
    D = q.shape[-1]
    if D % 2:
        raise ValueError(f"q's head dim must be even, got {D}")
    for name, t in (("k", k), ("v", v)):
        if t is not None and (not isinstance(t, torch.Tensor) or t.shape != q.shape or t.dtype != q.dtype
                              or t.device != q.device):
            raise ValueError(f"{name} must be None or a tensor like q ({describe(q)}), got {describe(t)}")
    for name, t in (("q", q), ("k", k), ("v", v)):  # rotated in place: an expanded view's rows share memory
        if t is not None and any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
            raise ValueError(f"{name} must not be an expanded view (it is rotated in place), got strides {t.stride()}")
    lead = (*q.shape[:-3], q.shape[-2])
    for name, p in (("pos_q", pos_q), ("pos_k", pos_k)):
        if p is None and name == "pos_k" and k is None and v is None:
            continue
        if not isinstance(p, torch.Tensor) or p.dtype not in _INT or tuple(p.shape) != lead or p.device != q.device:
            raise ValueError(f"{name} must be an int32/int64 tensor of shape {lead} on {q.device}, got {describe(p)}")
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor) or t.ndim != 2 or t.shape[1] != D // 2 or t.stride(1) != 1 \
                or not t.is_floating_point() or t.device != q.device:
            raise ValueError(f"{name} must be a float (n_pos, D / 2 = {D // 2}) tensor with unit inner stride on "
                             f"{q.device}, got {describe(t)}")
    if sin.shape != cos.shape:
        raise ValueError(f"sin must have the shape of cos {tuple(cos.shape)}, got {tuple(sin.shape)}")


def check_flag_nonfinite(values, used, flag, dtypes: tuple = REFERENCE_DTYPES) -> None:
    """The arguments of ``flag_nonfinite``: (..., N) float values with N >= 1, a bool ``used`` broadcastable
    to their leading dims (or None), a () bool flag."""
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"values must be a (..., N) torch.Tensor, got {type(values).__name__}")
    if values.ndim < 1 or values.shape[-1] < 1 or values.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"values must be a (..., N) tensor of {names} with N >= 1, got {describe(values)}")
    lead = values.shape[:-1]
    if used is not None:
        if not isinstance(used, torch.Tensor):
            raise TypeError(f"used must be None or a torch.Tensor, got {type(used).__name__}")
        fits = used.ndim <= len(lead) and all(d in (1, n) for d, n in zip(reversed(used.shape), reversed(lead)))
        if used.dtype != torch.bool or not fits or used.device != values.device:
            raise ValueError(f"used must be None or a bool tensor on {values.device} broadcastable to values' "
                             f"leading dims {tuple(lead)}, got {describe(used)}")
    check_flag(flag, values.device)


def check_commit(orders, choice, n, tokens, keys, values, canvas, known, last_tok, last_pos, k_cache, v_cache, lens,
                 flag=None, status=None, residual=None, residual_step=None) -> None:
    """The arguments of ``commit`` (see :func:`commit_step.commit`): every size and stride, no value."""
    if not isinstance(orders, torch.Tensor) or orders.ndim != 3:
        raise ValueError(f"orders must be a (B, O, R) tensor, got {getattr(orders, 'shape', type(orders))}")
    B, O, R = orders.shape
    if R == 0:
        raise ValueError(f"orders must have at least one slot (B, O, R >= 1), got {tuple(orders.shape)}")
    device = orders.device
    tokens_shape = (B, O, R) if isinstance(tokens, torch.Tensor) and tokens.ndim == 3 else (B, R)
    for name, t, shape in (("orders", orders, (B, O, R)), ("choice", choice, (B,)), ("n", n, (B,)),
                           ("tokens", tokens, tokens_shape), ("last_tok", last_tok, (B,)),
                           ("last_pos", last_pos, (B,)), ("lens", lens, (B,))):
        check_int(name, t, shape, device)
    for name, t in (("orders", orders), ("tokens", tokens), ("last_tok", last_tok), ("last_pos", last_pos),
                    ("lens", lens)):
        if t.dtype != torch.int64:
            raise ValueError(f"{name} must be int64, got {t.dtype}")
    if not isinstance(canvas, torch.Tensor) or canvas.dtype != torch.int64 or canvas.ndim != 2 \
            or canvas.shape[0] != B or canvas.device != device:
        raise ValueError(f"canvas must be an int64 (B={B}, T) tensor on {device}, got {describe(canvas)}")
    if not isinstance(known, torch.Tensor) or known.dtype != torch.bool or known.shape != canvas.shape \
            or known.device != device:
        raise ValueError(f"known must be a bool tensor of the canvas's shape {tuple(canvas.shape)}, "
                         f"got {describe(known)}")
    for name, t in (("canvas", canvas), ("known", known)):  # written in place at canvas + b * stride(0) + pos
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"{name} must have unit stride along T (written in place), got strides {t.stride()}")
    for name, t in (("last_tok", last_tok), ("last_pos", last_pos), ("lens", lens)):  # read/written at row b
        if B > 1 and t.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous (written in place), got stride {t.stride()}")
    if not isinstance(k_cache, torch.Tensor) or k_cache.ndim != 5 or k_cache.shape[1] != B \
            or k_cache.device != device:
        raise ValueError(f"k_cache must be an (n_layer, B={B}, H, L + 1, D) tensor on {device}, "
                         f"got {describe(k_cache)}")
    n_layer, _, H, _, D = k_cache.shape
    if not isinstance(v_cache, torch.Tensor) or v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype \
            or v_cache.device != device:
        raise ValueError(f"v_cache must match k_cache ({tuple(k_cache.shape)}, {k_cache.dtype}), got "
                         f"{describe(v_cache)}")
    if k_cache.stride(-1) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError(f"k_cache and v_cache must share strides with a unit last one (written in place), got "
                         f"{k_cache.stride()} and {v_cache.stride()}")
    want = (n_layer, B, O, H, R, D)
    for name, t in (("keys", keys), ("values", values)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != want or not t.is_floating_point() \
                or t.device != device:
            raise ValueError(f"{name} must be a float tensor of shape {want} on {device}, got {describe(t)}")
    if (flag is None) != (status is None):
        raise ValueError("flag and status must be given together (the burst status reads the flag)")
    if status is not None:
        check_flag(flag, device)
        if not isinstance(status, torch.Tensor) or status.shape != (3,) or status.dtype != torch.int64 \
                or status.device != device or not status.is_contiguous():
            raise ValueError(f"status must be a contiguous (3,) int64 tensor on {device}, got {describe(status)}")
    if (residual is None) != (residual_step is None):
        raise ValueError("residual and residual_step must be given together (the token and the step it goes at)")
    if residual is not None:
        for name, t in (("residual", residual), ("residual_step", residual_step)):
            check_int(name, t, (B,), device)
        if residual.dtype != torch.int64:
            raise ValueError(f"residual must be int64 (the tokens' dtype), got {residual.dtype}")
