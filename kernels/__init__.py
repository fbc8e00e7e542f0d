"""sigmafast.kernels: the sampler's attention, acceptance and sampling ops.

This folder is the top-level ``kernels/`` of the repository, installed as the
subpackage ``sigmafast.kernels`` through setuptools ``package-dir``
(``"sigmafast.kernels" = "kernels"``); there is deliberately no top-level
``kernels`` module, which would collide with an unrelated PyPI package.

Every op has one plain PyTorch reference, in :mod:`sigmafast.kernels.reference` (the sampler's ops) or
:mod:`sigmafast.kernels.reference_layers` (the model layers' ops),
run by blocks of rows on the reference path where they span the vocabulary (``row_blocks``),
and one Triton implementation (``attention``, ``accept`` with ``decide``,
``sampling``, ``layer_norm``, ``fc_gelu``, ``linear_norm``, ``commit_step``, ``embed``, ``rotary``, ``slots``,
``along``, ``lossless``, ``flags``, ``plan``; the module names differ from the
functions' so that importing a module never rebinds a public name of this
package), registered as PyTorch custom ops ``torch.ops.sigmafast.*`` by ``ops``
so that ``torch.compile`` traces through them. ``acceptance_from_hidden`` and
``sample_from_hidden`` are extras: acceptance and sampling straight from hidden
states and the LM-head weight;
``add_layer_norm``, ``linear_gelu``, ``linear_add_norm``, ``mlp_add_norm``, ``feed_embedding``,
``rotary_``, ``draft_slots``, ``gather_drafts`` and ``commit``
fuse a step's small ops (a residual add and its LayerNorm; a narrow model's
output projection or MLP with them; the input embedding and the first LayerNorm; a
layer's RoPE; the slots a burst drafts and its visiting orders; the drafts read
along the orders; the cache and canvas writes of a commit, with the lossless
rule's residual token spliced in), as does ``residual_pick`` (the rest of the
lossless rule's bookkeeping);
``flag_nonfinite`` fuses a step's check of a non-finite output (and ``commit``
writes a burst's status), and ``plan_step`` an autoregressive token's read of
its plan. The functions below pick one per call:

* ``backend="triton"`` or ``"reference"`` (keyword) is used as is; pass it in
  compiled code, where the environment and context reads below are not
  traceable;
* else an explicit choice wins: ``use_backend(name)`` (innermost), else the
  ``SIGMAFAST_BACKEND`` environment variable, each one of ``auto``, ``triton``,
  ``reference``;
* ``auto``: Triton for CUDA tensors, and for float32 and float16 CPU tensors
  when ``TRITON_INTERPRET=1`` (the CPU tests then run the real kernel code);
  otherwise the reference, which is the fast CPU path. float64 (which the
  kernels do not take) always goes to the reference under ``auto``, and so
  does bfloat16 on the CPU: the interpreter has no bfloat16 arithmetic (its
  ``tl.dot`` returns garbage in it).

These rules, ``use_backend`` and ``use_pdl`` live in ``backends``. Triton and the kernel modules are imported
only when the Triton path is taken, so importing this package needs no triton (e.g. on macOS). The kernels
need triton >= 3.4 (``MIN_TRITON``, ``support``; PDL 3.5): without it, ``auto`` takes the reference (with a
warning for CUDA tensors), and an explicit ``triton`` raises ``TritonUnavailable``; ``triton_problem()`` says
why. Every function
checks its arguments the same way on both paths (``checks``, ``step_checks``:
the reference also takes float64, and any width or stride). Like any Triton kernel, a Triton op launches on
the current CUDA device: call it for tensors on another GPU under ``torch.cuda.device(t.device)``, as
``sigmafast.generate`` does for its model.
"""

from __future__ import annotations

from types import ModuleType
from typing import NamedTuple, Optional

import torch

from . import checks, reference, reference_layers, row_blocks, step_checks
from .backends import (BACKENDS, backend_for, check_triton_device, pdl_enabled, pdl_supported, use_backend,
                       use_pdl)
from .support import MIN_TRITON, TritonUnavailable, triton_problem
from .reference import Acceptance

_REF = checks.REFERENCE_DTYPES


def _resolve(backend: Optional[str], t: torch.Tensor) -> str:
    """An explicit ``backend`` as is (the environment is read outside traced code only), else
    :func:`backend_for`. Not a tensor: the reference, whose argument checks name it."""
    if backend is not None and backend not in ("triton", "reference"):
        raise ValueError(f"backend must be None, 'triton' or 'reference', got {backend!r}")
    if not isinstance(t, torch.Tensor):
        return "reference"
    if backend is None:
        return backend_for(t)
    if backend == "triton" and not torch.compiler.is_compiling():
        check_triton_device(t, "backend='triton'")
    return backend


def _no_triton(e: ImportError) -> ImportError:
    return TritonUnavailable(f"the triton backend of sigmafast.kernels needs the triton package: {e}")


class _Triton(NamedTuple):
    accept: ModuleType
    along: ModuleType
    attention: ModuleType
    commit_step: ModuleType
    embed: ModuleType
    fc_gelu: ModuleType
    flags: ModuleType
    layer_norm: ModuleType
    linear_norm: ModuleType
    lossless: ModuleType
    plan: ModuleType
    rotary: ModuleType
    sampling: ModuleType
    slots: ModuleType


def _triton() -> _Triton:
    """The Triton modules, imported on first use (each imports triton, and ``ops`` imports them all). A
    plain import statement, not importlib, so that torch.compile traces the Triton path."""
    try:
        from . import (accept, along, attention, commit_step, embed, fc_gelu, flags, layer_norm, linear_norm,
                       lossless, plan, rotary, sampling, slots)
    except ImportError as e:
        raise _no_triton(e) from e
    return _Triton(accept, along, attention, commit_step, embed, fc_gelu, flags, layer_norm, linear_norm, lossless,
                   plan, rotary, sampling, slots)


def burst_attention(q, k, v, k_cache, v_cache, cache_lens, scale=None, *, backend: Optional[str] = None):
    """(B, H, R, D) queries over ``cache[:cache_lens]`` plus their own key; see the reference."""
    if _resolve(backend, q) == "triton":
        return _triton().attention.burst_attention(q, k, v, k_cache, v_cache, cache_lens, scale)
    checks.check_attention(q, k, v, k_cache, v_cache, cache_lens, 4, _REF, scale=scale)
    return reference.burst_attention(q, k, v, k_cache, v_cache, cache_lens, scale)


def verify_attention(q, k, v, k_cache, v_cache, cache_lens, scale=None, *, backend: Optional[str] = None):
    """(B, O, H, R, D) orders, causal, over a shared cache prefix; see the reference."""
    if _resolve(backend, q) == "triton":
        return _triton().attention.verify_attention(q, k, v, k_cache, v_cache, cache_lens, scale)
    checks.check_attention(q, k, v, k_cache, v_cache, cache_lens, 5, _REF, scale=scale)
    return reference.verify_attention(q, k, v, k_cache, v_cache, cache_lens, scale)


def acceptance(
    logits, drafts, draft_logp, uniforms, lengths, temperature=1.0, top_k=None, rule="paper", *,
    flag=None, backend: Optional[str] = None,
) -> Acceptance:
    """Accept/reject drafts from (B, O, R, V) verifier logits; see the reference. With a () bool ``flag``
    (temperature > 0), also ``reference.flag_nan_ratios``, fused on the Triton path."""
    temperature, top_k = checks.plain_scalars(temperature, top_k)
    if _resolve(backend, logits) == "triton":
        return _triton().accept.acceptance(logits, drafts, draft_logp, uniforms, lengths, temperature, top_k, rule,
                                           flag=flag)
    checks.check_acceptance(logits, drafts, draft_logp, uniforms, lengths, temperature, top_k, rule, _REF)
    checks.check_ratio_flag(flag, temperature, logits.device)
    scores = row_blocks.draft_scores(logits, drafts, temperature, top_k)
    res = reference.decide(scores, drafts, draft_logp, uniforms, lengths, temperature, rule)
    return reference.flagged(res, draft_logp, lengths, flag)


def acceptance_from_hidden(
    hidden, weight, drafts, draft_logp, uniforms, lengths, temperature=1.0, top_k=None, rule="paper", *,
    flag=None, backend: Optional[str] = None, scoring: Optional[str] = None, vocab_size: Optional[int] = None,
) -> Acceptance:
    """:func:`acceptance` of the logits ``(hidden @ weight.T)[..., :vocab_size]`` ((B, O, R, C) and
    (V', C), rows past ``vocab_size`` being alignment padding); neither path writes all the logits at
    once (``scoring``: see :func:`accept.acceptance_from_hidden`; the reference's: ``row_blocks``).
    ``flag``: as in :func:`acceptance`."""
    temperature, top_k = checks.plain_scalars(temperature, top_k)
    if _resolve(backend, hidden) == "triton":
        fn = _triton().accept.acceptance_from_hidden
        extra = {} if scoring is None else {"scoring": scoring}
        return fn(hidden, weight, drafts, draft_logp, uniforms, lengths, temperature, top_k, rule,
                  vocab_size=vocab_size, flag=flag, **extra)
    if scoring is not None:  # the Triton path's choice, checked alike
        checks.check_scoring_name(scoring)
    V = checks.check_hidden(hidden, weight, vocab_size, _REF)
    checks.check_scoring(hidden.shape[:3], hidden.device, drafts, draft_logp, uniforms, lengths, temperature, top_k,
                         rule)
    checks.check_ratio_flag(flag, temperature, hidden.device)
    scores = row_blocks.scores_from_hidden(hidden, weight, drafts, V, temperature, top_k)
    res = reference.decide(scores, drafts, draft_logp, uniforms, lengths, temperature, rule)
    return reference.flagged(res, draft_logp, lengths, flag)


def sample(logits, uniforms, temperature=1.0, top_k=None, *, used=None, flag=None, backend: Optional[str] = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF sampling from (N, V) logits with (N,) uniforms; see the reference. With a () bool ``flag``,
    also ``flag_nonfinite(logits, used, flag)`` (``used``: None or (N,) bool), fused on the Triton path."""
    temperature, top_k = checks.plain_scalars(temperature, top_k)
    if _resolve(backend, logits) == "triton":
        return _triton().sampling.sample(logits, uniforms, temperature, top_k, used=used, flag=flag)
    checks.check_sampling(logits, uniforms, temperature, top_k, dtypes=_REF)
    checks.check_used_rows(used, flag, logits)
    out = row_blocks.sample(logits, uniforms, temperature, top_k)
    if flag is not None:
        reference.flag_nonfinite(logits, used, flag)
    return out


def sample_from_hidden(hidden, weight, uniforms, temperature=1.0, top_k=None, *, vocab_size=None, used=None,
                       flag=None, backend: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sample` of the logits ``(hidden @ weight.T)[:, :vocab_size]`` ((N, C) and (V', C), rows past
    ``vocab_size`` being alignment padding). The reference path computes them a block of rows at a time
    (``row_blocks``), never all at once; the Triton path writes them whole and runs the sampling kernel."""
    temperature, top_k = checks.plain_scalars(temperature, top_k)
    triton = _resolve(backend, hidden) == "triton"
    V = checks.check_hidden(hidden, weight, vocab_size, checks.FLOAT_DTYPES if triton else _REF, ndim=2)
    if triton:
        logits = torch.nn.functional.linear(hidden, weight)[:, :V]
        return sample(logits, uniforms, temperature, top_k, used=used, flag=flag, backend="triton")
    checks.check_sampling(hidden, uniforms, temperature, top_k, name="hidden", dtypes=_REF)
    checks.check_used_rows(used, flag, hidden)
    return row_blocks.sample_from_hidden(hidden, weight, uniforms, V, temperature, top_k, used, flag)


def residual_sample(q_logits, p_logits, uniforms, temperature=1.0, top_k=None, *, backend: Optional[str] = None
                    ) -> torch.Tensor:
    """Sample from normalize(max(0, q - p)); see the reference."""
    temperature, top_k = checks.plain_scalars(temperature, top_k)
    if _resolve(backend, q_logits) == "triton":
        return _triton().sampling.residual_sample(q_logits, p_logits, uniforms, temperature, top_k)
    checks.check_residual(q_logits, p_logits, uniforms, temperature, top_k, dtypes=_REF)
    return row_blocks.residual_sample(q_logits, p_logits, uniforms, temperature, top_k)


def add_layer_norm(x, y, weight=None, bias=None, eps=1e-5, *, backend: Optional[str] = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual sum ``x + y`` and its LayerNorm, (..., C) each; see the reference."""
    if _resolve(backend, x) == "triton":
        return _triton().layer_norm.add_layer_norm(x, y, weight, bias, eps)
    step_checks.check_add_layer_norm(x, y, weight, bias, eps)
    return reference_layers.add_layer_norm(x, y, weight, bias, eps)


def linear_gelu(x, weight, bias=None, *, backend: Optional[str] = None) -> torch.Tensor:
    """``F.gelu(F.linear(x, weight, bias))``, (..., K) -> (..., F): the MLP's first matmul with its GELU as the
    epilogue (one kernel); see the reference."""
    if _resolve(backend, x) == "triton":
        return _triton().fc_gelu.linear_gelu(x, weight, bias)
    step_checks.check_linear_gelu(x, weight, bias)
    return reference_layers.linear_gelu(x, weight, bias)


def linear_add_norm(x, y, weight, bias=None, norm_weight=None, norm_bias=None, eps=1e-5, *, next_weight=None,
                    next_bias=None, next_out=None, backend: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + F.linear(y, weight, bias)`` and its LayerNorm, (..., C) each (the Triton kernel takes
    C <= 256); with ``next_weight``, the next projection of the LayerNorm into ``next_out``; see the
    reference."""
    nxt = dict(next_weight=next_weight, next_bias=next_bias, next_out=next_out)
    if _resolve(backend, x) == "triton":
        return _triton().linear_norm.linear_add_norm(x, y, weight, bias, norm_weight, norm_bias, eps, **nxt)
    step_checks.check_linear_add_norm(x, y, weight, bias, norm_weight, norm_bias, eps, **nxt)
    return reference_layers.linear_add_norm(x, y, weight, bias, norm_weight, norm_bias, eps, **nxt)


def mlp_add_norm(x, h, fc_weight, fc_bias, proj_weight, proj_bias, norm_weight=None, norm_bias=None, eps=1e-5, *,
                 next_weight=None, next_bias=None, next_out=None, backend: Optional[str] = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + mlp(h)`` (GELU between the two linears) and its LayerNorm, (..., C) each (the Triton kernel
    takes C <= 256); the next projection as in :func:`linear_add_norm`; see the reference."""
    args = (x, h, fc_weight, fc_bias, proj_weight, proj_bias, norm_weight, norm_bias, eps)
    nxt = dict(next_weight=next_weight, next_bias=next_bias, next_out=next_out)
    if _resolve(backend, x) == "triton":
        return _triton().linear_norm.mlp_add_norm(*args, **nxt)
    step_checks.check_mlp_add_norm(*args, **nxt)
    return reference_layers.mlp_add_norm(*args, **nxt)


def rotary_(q, k, v, pos_q, pos_k, cos, sin, sign: float = 1.0, *, backend: Optional[str] = None) -> None:
    """RoPE in place: q (..., H, T, D) rotated by the angles of table rows ``pos_q`` (..., T), k and v (each
    optional) by ``pos_k``'s, times ``sign`` (-1 rotates back); see the reference."""
    if _resolve(backend, q) == "triton":
        return _triton().rotary.rotary_(q, k, v, pos_q, pos_k, cos, sin, sign)
    step_checks.check_rotary(q, k, v, pos_q, pos_k, cos, sin)
    return reference_layers.rotary_(q, k, v, pos_q, pos_k, cos, sin, sign)


def residual_pick(n, remaining, orders, slots, u_residual, drafts, verifier, *, backend: Optional[str] = None
                  ) -> tuple[torch.Tensor, ...]:
    """The lossless rule's residual draw per row: its (B,) uniform, the (B,) committed count (n + rejected),
    and the (B, V) draft row and (B, X) verifier row it is drawn from; see the reference."""
    if _resolve(backend, u_residual) == "triton":
        return _triton().lossless.residual_pick(n, remaining, orders, slots, u_residual, drafts, verifier)
    checks.check_residual_pick(n, remaining, orders, slots, u_residual, drafts, verifier, unit_stride=False)
    return reference.residual_pick(n, remaining, orders, slots, u_residual, drafts, verifier)


def draft_slots(known, uniforms, keys, R: int, *, backend: Optional[str] = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A burst iteration's R draft slots of a (B, T) known mask (positions, the (B, T) uniforms at them, the
    used mask (B, R), the unknown counts (B,)) and its (B, O, R) visiting orders of (B, O, T) keys; see the
    reference."""
    if _resolve(backend, uniforms) == "triton":
        return _triton().slots.draft_slots(known, uniforms, keys, R)
    checks.check_draft_slots(known, uniforms, keys, R, unit_stride=False)
    return reference.draft_slots(known, uniforms, keys, R)


def gather_drafts(positions, tokens, logp, canvas, known, uniforms, orders, *, backend: Optional[str] = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A burst's (B, R) drafts read along (B, O, S) visiting orders: tokens, log-probs, uniforms and
    slots; see the reference."""
    args = (positions, tokens, logp, canvas, known, uniforms, orders)
    if _resolve(backend, logp) == "triton":
        return _triton().along.gather_drafts(*args)
    checks.check_gather_drafts(*args, unit_stride=False)
    return reference.gather_drafts(*args)


def feed_embedding(last_tok, last_pos, tokens, orders, wte, pe_in, pe_out, weight=None, bias=None, eps=1e-5, *,
                   next_weight=None, next_bias=None, next_out=None, backend: Optional[str] = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """σ-GPT's embedding of the inputs fed along (B, G, S) visiting orders and its LayerNorm, (B, G, S, C)
    each; with ``next_weight``, the first block's projection of the LayerNorm into ``next_out`` (the Triton
    kernel takes C <= 256); see the reference."""
    args = (last_tok, last_pos, tokens, orders, wte, pe_in, pe_out, weight, bias, eps)
    nxt = dict(next_weight=next_weight, next_bias=next_bias, next_out=next_out)
    if _resolve(backend, wte) == "triton":
        return _triton().embed.feed_embedding(*args, **nxt)
    step_checks.check_feed_embedding(*args, **nxt)
    return reference_layers.feed_embedding(*args, **nxt)


def commit(orders, choice, n, tokens, keys, values, *, canvas, known, last_tok, last_pos, k_cache, v_cache, lens,
           flag=None, status=None, residual=None, residual_step=None, backend: Optional[str] = None) -> None:
    """Append the first ``n[b]`` steps of order ``choice[b]`` to a session's canvas and KV cache, in place;
    with a (3,) int64 ``status`` and the () bool ``flag``, also write the burst status after it there; with
    (B,) ``residual`` tokens and ``residual_step``, commit the residual token at that step. See the
    reference."""
    state = dict(canvas=canvas, known=known, last_tok=last_tok, last_pos=last_pos, k_cache=k_cache,
                 v_cache=v_cache, lens=lens, flag=flag, status=status, residual=residual,
                 residual_step=residual_step)
    if _resolve(backend, k_cache) == "triton":
        return _triton().commit_step.commit(orders, choice, n, tokens, keys, values, **state)
    step_checks.check_commit(orders, choice, n, tokens, keys, values, **state)
    return reference.commit(orders, choice, n, tokens, keys, values, **state)


def flag_nonfinite(values, used, flag, *, backend: Optional[str] = None) -> None:
    """Set the () bool ``flag`` in place when a used row of ``values`` (..., N) is not finite (``used``:
    None or a bool mask broadcastable to the leading dims); never clears it. See the reference."""
    if _resolve(backend, values) == "triton":
        return _triton().flags.flag_nonfinite(values, used, flag)
    step_checks.check_flag_nonfinite(values, used, flag)
    return reference.flag_nonfinite(values, used, flag)


def plan_step(steps, step, *, backend: Optional[str] = None) -> torch.Tensor:
    """The (W, B) column ``step`` of an autoregressive plan's (W, B, T) ``steps``, then ``step += 1`` in place
    (a () int64); see the reference."""
    if _resolve(backend, steps) == "triton":
        return _triton().plan.plan_step(steps, step)
    checks.check_plan_step(steps, step, unit_stride=False)
    return reference.plan_step(steps, step)


__all__ = [
    "Acceptance",
    "BACKENDS",
    "MIN_TRITON",
    "TritonUnavailable",
    "acceptance",
    "acceptance_from_hidden",
    "add_layer_norm",
    "backend_for",
    "burst_attention",
    "commit",
    "draft_slots",
    "feed_embedding",
    "flag_nonfinite",
    "gather_drafts",
    "linear_gelu",
    "linear_add_norm",
    "mlp_add_norm",
    "pdl_enabled",
    "pdl_supported",
    "plan_step",
    "residual_pick",
    "residual_sample",
    "rotary_",
    "sample",
    "triton_problem",
    "use_backend",
    "use_pdl",
    "verify_attention",
]
