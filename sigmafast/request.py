"""What the cached sampler and the naive reference share: argument checking, the
randomness protocol and the statistics record.

Both samplers must consume exactly the same random tensors in the same order,
so the draws live here (see :mod:`sigmafast.sampler` for the protocol).
"""

from __future__ import annotations

import contextlib
import numbers
from dataclasses import dataclass
from typing import NamedTuple, Optional, Union

import torch
import torch.nn as nn

from .kernels.checks import check_temperature
from .memory import check_canvas_memory, check_decoding_memory, check_sampling_memory

STRATEGIES = ("burst", "autoregressive")
ACCEPTANCE_RULES = ("paper", "lossless")
AR_ORDERS = ("random", "left-to-right", "fractal")
DRAW_DTYPE = torch.float64  # every uniform and order key is drawn in float64


class Request(NamedTuple):
    """Normalised sampling arguments."""

    canvas: torch.Tensor  # (B, T) int64, unknown entries set to 0
    known: torch.Tensor  # (B, T) bool
    temperature: float
    top_k: Optional[int]
    strategy: str
    order: Union[str, torch.Tensor]  # a name of AR_ORDERS or a (B, T) permutation tensor
    num_orders: int
    acceptance: str
    generator: Optional[torch.Generator]


@dataclass
class SampleStats:
    """Statistics of one ``generate`` call.

    ``accepted[b, i]`` is the number of tokens row b committed at global
    iteration i (0 once the row is finished); ``burst_lengths[b, i]`` is the
    chosen order's accepted draft prefix (before a lossless residual token;
    ``None`` for the autoregressive strategy). ``forward_calls`` counts the
    algorithm's batched model calls: one prefill when any position is known,
    then one per autoregressive step or two (draft + verify) per burst
    iteration. The naive reference reports the same algorithmic count.
    """

    iterations: torch.Tensor  # (B,) int64
    forward_calls: int
    accepted: torch.Tensor  # (B, n_iter) int64
    burst_lengths: Optional[torch.Tensor]  # (B, n_iter) int64 or None
    wall_time: float  # seconds

    @property
    def mean_iterations(self) -> float:
        return float(self.iterations.double().mean()) if self.iterations.numel() else 0.0


def build_stats(accepted, lengths, batch_size: int, device, forward_calls: int, wall_time: float) -> SampleStats:
    """A :class:`SampleStats` from per-iteration counts: ``accepted`` and ``lengths`` (None: not a burst) each a
    list of (B,) tensors, one per iteration, or already a (B, iterations) tensor."""
    acc = _by_iteration(accepted, batch_size, device)
    lens = None if lengths is None else _by_iteration(lengths, batch_size, device)
    return SampleStats((acc > 0).sum(1), forward_calls, acc, lens, wall_time)


def _by_iteration(counts, batch_size: int, device) -> torch.Tensor:
    """(B, iterations) int64 from a list of (B,) tensors (one stack) or such a tensor."""
    if isinstance(counts, torch.Tensor):
        return counts
    return torch.stack(counts, 1) if counts else torch.zeros(batch_size, 0, dtype=torch.long, device=device)


def nonfinite_error(what: str) -> ValueError:
    """The error raised when the model's outputs are not finite (rather than returning garbage)."""
    return ValueError(f"model gave non-finite {what} (NaN or inf): its weights are probably not finite "
                      "(a diverged training run?) or its dtype overflows")


@contextlib.contextmanager
def eval_mode(model):
    """Run with dropout off, restoring every submodule's training flag afterwards: a model in training whose
    frozen parts are in eval mode gets them back so, and an eval model's stray training submodule drops out
    nothing meanwhile."""
    training = [m for m in model.modules() if m.training] if isinstance(model, nn.Module) else []  # oracles: none
    if training:
        model.eval()
    try:
        yield
    finally:
        for m in training:
            m.training = True


@contextlib.contextmanager
def inference(model):
    """No autograd, dropout off (the training flag restored afterwards) and autocast off: the model runs in
    its parameters' dtype, which is its KV cache's (an autocast around the call, as in nanoGPT's sample.py,
    would hand the cache 16-bit keys). Cast the model itself to sample in 16 bits. On CUDA the model's GPU is
    the current device meanwhile: Triton launches its kernels, and CUDA graphs capture, on the current one."""
    param = next(model.parameters(), None) if isinstance(model, nn.Module) else None
    no_autocast = torch.autocast(param.device.type, enabled=False) if param is not None else contextlib.nullcontext()
    on_gpu = torch.cuda.device(param.device) if param is not None and param.is_cuda else contextlib.nullcontext()
    with torch.no_grad(), no_autocast, eval_mode(model), on_gpu:
        yield


def is_sigma_gpt(model) -> bool:
    """True for the neural model (a module with a ``config``), False for an oracle."""
    return isinstance(model, nn.Module) and hasattr(model, "config")


def model_limits(model) -> tuple[int, int, torch.device]:
    """(vocab_size, block_size, device) of a SigmaGPT or of an oracle."""
    if getattr(model, "objective", "sigma") != "sigma":
        raise TypeError(
            f"model is a {model.objective!r} model ({type(model).__name__}), not a σ-GPT: sample it with "
            "sigmafast.diffusion.generate"
        )
    if is_sigma_gpt(model):
        cfg = model.config
        kinds = {(p.dtype, p.device) for p in model.parameters() if p.is_floating_point()}
        if len(kinds) > 1:  # half a cast: the KV cache and kernels take the first parameter's dtype
            found = ", ".join(sorted(f"{str(d).removeprefix('torch.')} on {dev}" for d, dev in kinds))
            raise ValueError(f"model's floating-point parameters must share one dtype and device, got {found}: "
                             "cast or move the whole model (model.to(dtype or device))")
        return cfg.vocab_size, cfg.block_size, next(model.parameters()).device
    if all(hasattr(model, a) for a in ("vocab_size", "block_size", "prefill")):
        return model.vocab_size, model.block_size, getattr(model, "device", torch.device("cpu"))
    raise TypeError(
        "model must be a SigmaGPT or an oracle with vocab_size, block_size and prefill(), "
        f"got {type(model).__name__}"
    )


def check_int(name: str, value, minimum: int) -> int:
    """``value`` as a Python int: an int or a NumPy integer, never a bool."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_seed(name: str, seed: int) -> int:
    """``seed`` when it is in ``torch.Generator.manual_seed``'s range [0, 2**63) (a larger one overflows, a
    negative one wraps silently), else a ``ValueError`` naming ``name``."""
    if not 0 <= seed < 2**63:
        raise ValueError(f"{name} must be in [0, 2**63), got {seed}")
    return seed


def check_request_memory(model, req: Request, rows: Optional[int] = None, most: Optional[int] = None) -> None:
    """A ``ValueError`` before a σ-GPT's sampling that cannot fit in memory: a burst naming ``num_orders`` and
    the batch, autoregressive sampling (its KV cache, and on the reference path its prompt's prefill) naming the
    batch; nothing for an oracle. ``rows``: the batch the session allocates (an engine's batch bucket), the
    request's by default; ``most``: the largest known count of a row when the caller has read it (else read here
    when needed). The samplers call it after :func:`prepare`; the other users of ``prepare`` (density, diffusion)
    sample no burst, keep no cache, and check their own estimates."""
    if not is_sigma_gpt(model):
        return
    from .kernels import backend_for, row_blocks

    param = next(model.parameters())
    B, T = req.canvas.shape if rows is None else (rows, req.canvas.shape[1])
    reference = backend_for(param) != "triton"
    if req.strategy != "burst":
        prefill = 0  # the Triton attention keeps no scores
        if reference:
            prefill = int(req.known.sum(1).max()) if most is None else most
        check_decoding_memory(model.config, B, T, param.device, param.element_size(), prefill=prefill)
        return
    blocks = None if not reference else row_blocks.block_elements(param.device)
    check_sampling_memory(model.config, B, req.num_orders, T, param.device, param.element_size(),
                          block_elements=blocks)


def check_callback(on_iteration) -> None:
    if on_iteration is not None and not callable(on_iteration):
        raise TypeError(f"on_iteration must be None or a callable (canvas, known), got {type(on_iteration).__name__}")


def check_return_stats(return_stats) -> None:
    """A bool, not any truthy value: ``generate``'s result is a tuple exactly when it is True."""
    if not isinstance(return_stats, bool):
        raise TypeError(f"return_stats must be a bool, got {type(return_stats).__name__}")


def check_order_tensor(order: torch.Tensor, shape: tuple, name: str = "order") -> torch.Tensor:
    """A (B, T) integer tensor whose rows are permutations of 0..T-1."""
    if order.is_floating_point() or order.is_complex() or order.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {order.dtype}")
    if tuple(order.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape (B, T) = {tuple(shape)}, got {tuple(order.shape)}")
    order = order.long()
    T = shape[1]
    if not torch.equal(order.sort(1).values, torch.arange(T, device=order.device).expand(shape)):
        raise ValueError(f"every row of {name} must be a permutation of 0..{T - 1}")
    return order


def prepare(model, idx, *, max_new_tokens: Optional[int] = None, temperature: float = 1.0,
            top_k: Optional[int] = None, known: Optional[torch.Tensor] = None, strategy: str = "burst",
            order="random", num_orders: int = 1, acceptance: str = "lossless",
            generator: Optional[torch.Generator] = None) -> Request:
    """Validate ``generate``'s arguments and build the (B, T) canvas and known mask."""
    vocab_size, block_size, device = model_limits(model)
    if not isinstance(idx, torch.Tensor):
        raise TypeError(f"idx must be a torch.Tensor, got {type(idx).__name__}")
    if idx.dtype == torch.bool or idx.is_floating_point() or idx.is_complex():
        raise TypeError(f"idx must be an integer tensor of token ids, got {idx.dtype}")
    if idx.dim() != 2 or idx.shape[0] < 1:
        raise ValueError(f"idx must have shape (B >= 1, T), got {tuple(idx.shape)}")
    if idx.device != device:
        raise ValueError(f"idx is on {idx.device} but the model is on {device}")
    B = idx.shape[0]
    if known is None:
        if max_new_tokens is None:
            raise ValueError("max_new_tokens is required when known is None (prompt mode)")
        max_new_tokens = check_int("max_new_tokens", max_new_tokens, 0)
        if idx.shape[1] + max_new_tokens > block_size:  # before the canvas is allocated
            raise ValueError(f"canvas length {idx.shape[1] + max_new_tokens} (prompt {idx.shape[1]} + max_new_tokens "
                             f"{max_new_tokens}) exceeds the model's block_size {block_size}")
        check_canvas_memory(B, idx.shape[1] + max_new_tokens, device)
        canvas = torch.cat([idx.long(), idx.new_zeros(B, max_new_tokens, dtype=torch.long)], 1)
        known = torch.zeros_like(canvas, dtype=torch.bool)
        known[:, : idx.shape[1]] = True
    else:
        if max_new_tokens is not None:
            raise ValueError(
                "max_new_tokens must be None when known is given: with infilling, idx is the whole (B, T) "
                "canvas and the unknown positions are known == False"
            )
        if not isinstance(known, torch.Tensor) or known.dtype != torch.bool:
            got = known.dtype if isinstance(known, torch.Tensor) else type(known).__name__
            raise TypeError(f"known must be a bool torch.Tensor, got {got}")
        if known.shape != idx.shape:
            raise ValueError(f"known must have the shape of idx {tuple(idx.shape)}, got {tuple(known.shape)}")
        check_canvas_memory(B, idx.shape[1], device)
        known = known.to(device)
        canvas = torch.where(known, idx.long(), torch.zeros_like(idx, dtype=torch.long))
    T = canvas.shape[1]
    if T > block_size:
        raise ValueError(f"canvas length {T} exceeds the model's block_size {block_size}")
    bad = known & ((canvas < 0) | (canvas >= vocab_size))
    if bool(bad.any()):
        raise ValueError(f"idx must hold token ids in [0, vocab_size={vocab_size}) where it is known (a prompt, "
                         f"or known == True), got {int(canvas[bad][0])}")
    check_temperature(temperature)
    if top_k is not None:
        top_k = check_int("top_k", top_k, 1)
    num_orders = check_int("num_orders", num_orders, 1)
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if acceptance not in ACCEPTANCE_RULES:
        raise ValueError(f"acceptance must be one of {ACCEPTANCE_RULES}, got {acceptance!r}")
    if strategy == "autoregressive" and (acceptance != "lossless" or num_orders != 1):
        raise ValueError(f"acceptance and num_orders apply to strategy='burst' only (autoregressive sampling "
                         f"verifies no drafts): got acceptance={acceptance!r}, num_orders={num_orders}")
    if acceptance == "lossless" and num_orders != 1:
        raise ValueError(
            f"acceptance='lossless' uses a single order chosen before drafting: pass num_orders=1 (got {num_orders})"
        )
    if isinstance(order, torch.Tensor):
        if strategy != "autoregressive":
            raise ValueError("an order tensor is only used with strategy='autoregressive'")
        order = check_order_tensor(order.to(device), canvas.shape)
    elif not isinstance(order, str):
        raise TypeError(f"order must be one of {AR_ORDERS} or a (B, T) integer torch.Tensor of permutations, "
                        f"got {type(order).__name__}")
    elif order not in AR_ORDERS:
        raise ValueError(f"order must be one of {AR_ORDERS} or a (B, T) tensor, got {order!r}")
    elif strategy == "burst" and order != "random":
        raise ValueError(f"strategy='burst' always verifies random orders; order={order!r} needs 'autoregressive'")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    return Request(canvas, known, float(temperature), top_k, strategy, order, num_orders, acceptance, generator)


def draw(generator: Optional[torch.Generator], shape: tuple, device, out: Optional[torch.Tensor] = None
         ) -> torch.Tensor:
    """Uniforms in [0, 1) of ``shape``, drawn on the generator's device in float64, moved to ``device``;
    written into ``out`` (a contiguous float64 tensor of ``shape`` on ``device``) when given, with the same
    values."""
    gen_device = generator.device if generator is not None else torch.device("cpu")
    if out is not None and out.device == gen_device:
        return torch.rand(shape, generator=generator, dtype=DRAW_DTYPE, out=out)
    u = torch.rand(shape, generator=generator, device=gen_device, dtype=DRAW_DTYPE)
    device = torch.device(device)
    pinned = device.type == "cuda" and u.device.type == "cpu"
    if pinned:
        u = u.pin_memory()  # then no host sync for a CPU generator
    if out is not None:
        return out.copy_(u, non_blocking=pinned)
    return u.to(device, non_blocking=pinned)


class BurstDraws(NamedTuple):
    u_draft: torch.Tensor  # (B, T)
    keys: torch.Tensor  # (B, O, T)
    u_accept: torch.Tensor  # (B, T)
    u_residual: torch.Tensor  # (B, T)


def burst_shapes(batch_size: int, num_orders: int, seq_len: int) -> tuple:
    """The shapes of :class:`BurstDraws`' four tensors, in their order."""
    B, O, T = batch_size, num_orders, seq_len
    return (B, T), (B, O, T), (B, T), (B, T)


def draw_burst(generator, batch_size: int, num_orders: int, seq_len: int, device,
               out: Optional[BurstDraws] = None) -> BurstDraws:
    """The four draws of one burst iteration, always all four, in this order; into the first
    ``batch_size`` rows of ``out``'s buffers (contiguous, float64, on ``device``) when given."""
    shapes = burst_shapes(batch_size, num_orders, seq_len)
    if out is None:
        return BurstDraws(*(draw(generator, shape, device) for shape in shapes))
    for buf, shape in zip(out, shapes):
        draw(generator, shape, device, out=buf[:batch_size])
    return out


def ar_rank(order: Union[str, torch.Tensor], keys: Optional[torch.Tensor], batch_size: int, seq_len: int,
            device) -> torch.Tensor:
    """(B, T) sort key of each position in the autoregressive base order (lower = earlier).

    ``"random"`` uses the drawn keys; a named or given order uses each position's
    step index in it.
    """
    from . import orders as orders_mod

    if isinstance(order, str) and order == "random":
        return keys
    if isinstance(order, str):
        order = orders_mod.make_orders(order, batch_size, seq_len, device=device)
    steps = torch.arange(seq_len, device=device).expand(batch_size, seq_len)
    return orders_mod.unshuffle(steps, order).to(DRAW_DTYPE)
