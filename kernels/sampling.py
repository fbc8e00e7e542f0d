"""Triton inverse-CDF sampling from logits, and the speculative-sampling residual.

Each program owns BLOCK_N rows (a function of BLOCK_V only, itself of V) and
streams the vocabulary in (BLOCK_N, BLOCK_V) chunks:

* pass 1: online max and sum of exponentials (log-sum-exp) of the processed
  logits (temperature, top-k threshold from ``torch.topk``);
* residual only, pass 2: the mass of ``max(0, q - p)`` (and of q, for rows whose
  residual is empty and fall back to q);
* last pass: a running cumulative sum of the (unnormalised) probabilities that
  stops loading once it passes ``u * total``; the token is the first index whose
  cumulative sum exceeds it, clamped to the last index of nonzero probability.

Nothing is materialised but the (N,) outputs. The uniforms come from the
caller; there is no RNG in the kernel. Against the reference the only possible
differences are float-rounding ties: a uniform within a few ulps of a CDF
boundary, or a logit that rounds onto the top-k threshold after the division
by the temperature (the kernel compares raw logits with the raw k-th value).

``_sample_kernel`` and ``_residual_kernel`` share one body; each compiles at
most twice per dtype and V (with and without top-k): the row count and strides
are not specialised.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .utils import (
    check_block_v, check_float, kth_largest, load_logits, online_lse, row_stride, rows_ready, vocab_config,
)


@triton.jit
def _sample_rows(
    QL, PL, U, KQ, KP, TOK, LOGP, s_q, s_p, N, V, temperature,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, HAS_TOPK: tl.constexpr, RESIDUAL: tl.constexpr,
    STRIDE_UNIT: tl.constexpr,
):
    """The rows' tokens (and, unless RESIDUAL, their log-probs) by inverse CDF over the streamed logits.
    Row strides come in units of STRIDE_UNIT elements (see utils)."""
    s_q = s_q * STRIDE_UNIT
    s_p = s_p * STRIDE_UNIT
    o_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    o_n64 = o_n.to(tl.int64)
    p_q = QL + o_n64[:, None] * s_q  # (BLOCK_N, 1)
    p_p = PL + o_n64[:, None] * s_p
    kq = tl.zeros([BLOCK_N, 1], tl.float32)
    kp = tl.zeros([BLOCK_N, 1], tl.float32)
    if HAS_TOPK:
        kq = tl.load(KQ + o_n64, mask=m_n, other=0.0).to(tl.float32)[:, None]
        if RESIDUAL:
            kp = tl.load(KP + o_n64, mask=m_n, other=0.0).to(tl.float32)[:, None]
    o_b = tl.arange(0, BLOCK_V)

    m_q = tl.full([BLOCK_N], float("-inf"), tl.float32)
    s_qs = tl.zeros([BLOCK_N], tl.float32)
    m_p = tl.full([BLOCK_N], float("-inf"), tl.float32)
    s_ps = tl.zeros([BLOCK_N], tl.float32)
    for start in range(0, V, BLOCK_V):
        o_v = start + o_b[None, :]
        m_v = m_n[:, None] & (o_v < V)
        m_q, s_qs = online_lse(m_q, s_qs, load_logits(p_q, o_v, m_v, kq, temperature, HAS_TOPK))
        if RESIDUAL:
            m_p, s_ps = online_lse(m_p, s_ps, load_logits(p_p, o_v, m_v, kp, temperature, HAS_TOPK))

    m_q = tl.where(m_n, m_q, 0.0)  # padding rows: keep them finite
    s_qs = tl.where(m_n, s_qs, 1.0)
    lse_q = m_q + tl.log(s_qs)
    total = s_qs
    if RESIDUAL:
        lse_p = tl.where(m_n, m_p, 0.0) + tl.log(tl.where(m_n, s_ps, 1.0))
        r_tot = tl.zeros([BLOCK_N], tl.float32)
        q_tot = tl.zeros([BLOCK_N], tl.float32)
        for start in range(0, V, BLOCK_V):
            o_v = start + o_b[None, :]
            m_v = m_n[:, None] & (o_v < V)
            b_q = tl.exp(load_logits(p_q, o_v, m_v, kq, temperature, HAS_TOPK) - lse_q[:, None])
            b_p = tl.exp(load_logits(p_p, o_v, m_v, kp, temperature, HAS_TOPK) - lse_p[:, None])
            r_tot += tl.sum(tl.maximum(b_q - b_p, 0.0), 1)
            q_tot += tl.sum(b_q, 1)
        empty = r_tot <= 0.0
        total = tl.where(empty, q_tot, r_tot)

    target = tl.load(U + o_n64, mask=m_n, other=0.0).to(tl.float32) * total
    carry = tl.zeros([BLOCK_N], tl.float32)
    first = tl.zeros([BLOCK_N], tl.int32) + V
    last_nz = tl.full([BLOCK_N], -1, tl.int32)
    for start in range(0, V, BLOCK_V):
        o_v = start + o_b[None, :]
        bound = tl.where(m_n & (first == V), V, 0)  # stop loading a row once its token is found
        m_v = o_v < bound[:, None]
        if RESIDUAL:
            b_q = tl.exp(load_logits(p_q, o_v, m_v, kq, temperature, HAS_TOPK) - lse_q[:, None])
            b_p = tl.exp(load_logits(p_p, o_v, m_v, kp, temperature, HAS_TOPK) - lse_p[:, None])
            b_w = tl.where(empty[:, None], b_q, tl.maximum(b_q - b_p, 0.0))
        else:
            b_w = tl.exp(load_logits(p_q, o_v, m_v, kq, temperature, HAS_TOPK) - m_q[:, None])
        b_c = carry[:, None] + tl.cumsum(b_w, 1)
        first = tl.minimum(first, tl.min(tl.where((b_c > target[:, None]) & m_v, o_v, V), 1))
        last_nz = tl.maximum(last_nz, tl.max(tl.where(b_w > 0.0, o_v, -1), 1))
        carry = tl.max(b_c, 1)
    token = tl.minimum(first, last_nz)
    tl.store(TOK + o_n64, token.to(tl.int64), mask=m_n)
    if not RESIDUAL:
        m_tok = m_n & (token >= 0)
        x_tok = load_logits(QL + o_n64 * s_q, token, m_tok, kq.reshape([BLOCK_N]), temperature, HAS_TOPK)
        tl.store(LOGP + o_n64, (x_tok - lse_q).to(LOGP.dtype.element_ty), mask=m_n)


@triton.jit(do_not_specialize=["s_q", "N"], do_not_specialize_on_alignment=["U", "KQ"])
def _sample_kernel(
    QL, U, KQ, TOK, LOGP, s_q, N, V, temperature,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, HAS_TOPK: tl.constexpr, STRIDE_UNIT: tl.constexpr,
):
    _sample_rows(QL, QL, U, KQ, KQ, TOK, LOGP, s_q, s_q, N, V, temperature, BLOCK_N, BLOCK_V, HAS_TOPK, False,
                 STRIDE_UNIT)


@triton.jit(do_not_specialize=["s_q", "s_p", "N"], do_not_specialize_on_alignment=["U", "KQ", "KP"])
def _residual_kernel(
    QL, PL, U, KQ, KP, TOK, s_q, s_p, N, V, temperature,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, HAS_TOPK: tl.constexpr, STRIDE_UNIT: tl.constexpr,
):
    _sample_rows(QL, PL, U, KQ, KP, TOK, TOK, s_q, s_p, N, V, temperature, BLOCK_N, BLOCK_V, HAS_TOPK, True,
                 STRIDE_UNIT)


def _check_args(logits, uniforms, temperature, top_k, block_v, name="logits") -> None:
    check_float(name, logits, 2)
    if not isinstance(uniforms, torch.Tensor) or not uniforms.is_floating_point():
        raise ValueError(f"uniforms must be a float tensor of shape ({logits.shape[0]},), got {uniforms!r:.60}")
    if tuple(uniforms.shape) != (logits.shape[0],) or uniforms.device != logits.device:
        raise ValueError(
            f"uniforms must have shape ({logits.shape[0]},) on {logits.device}, "
            f"got {tuple(uniforms.shape)} on {uniforms.device}"
        )
    if not float(temperature) >= 0.0:
        raise ValueError(f"temperature must be >= 0, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")
    if logits.shape[1] == 0:
        raise ValueError("logits must have a nonempty vocabulary dimension")
    check_block_v(block_v)


def launch(q_logits, p_logits, uniforms, temperature, top_k, block_v=None):
    """Launch the sample (``p_logits`` None) or residual kernel, no checks: (N,) tokens and (N,) log-probs
    (residual: None). Temperature 0 is the first argmax of q (log-prob 0), without a kernel."""
    N, V = q_logits.shape
    residual = p_logits is not None
    if temperature == 0:
        return q_logits.argmax(-1), None if residual else q_logits.new_zeros(N)
    block_v, block_n, num_warps, unit = vocab_config(V, block_v)
    q_logits = rows_ready(q_logits, unit)
    p_logits = rows_ready(p_logits, unit) if residual else None
    kq = kth_largest(q_logits, top_k)
    kp = kth_largest(p_logits, top_k) if residual else None
    tokens = torch.empty(N, dtype=torch.int64, device=q_logits.device)
    logp = None if residual else torch.empty(N, dtype=q_logits.dtype, device=q_logits.device)
    if N == 0:
        return tokens, logp
    u = uniforms.float().contiguous()
    grid = (triton.cdiv(N, block_n),)
    meta = dict(BLOCK_N=block_n, BLOCK_V=block_v, HAS_TOPK=kq is not None, STRIDE_UNIT=unit, num_warps=num_warps)
    if residual:
        _residual_kernel[grid](
            q_logits, p_logits, u, kq if kq is not None else u, kp if kp is not None else u, tokens,
            row_stride(q_logits) // unit, row_stride(p_logits) // unit, N, V, float(temperature), **meta,
        )
    else:
        _sample_kernel[grid](
            q_logits, u, kq if kq is not None else u, tokens, logp, row_stride(q_logits) // unit, N, V,
            float(temperature), **meta,
        )
    return tokens, logp


def sample(
    logits: torch.Tensor,
    uniforms: torch.Tensor,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    *,
    block_v: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row by inverse CDF.

    logits: (N, V) float32/float16/bfloat16; uniforms: (N,) in [0, 1).
    Returns tokens (N,) int64 and their log-probabilities (N,) (logits' dtype)
    under the processed distribution; temperature 0 is greedy (first argmax,
    log-prob 0). ``block_v`` (a power of two) overrides the vocabulary chunk.
    """
    _check_args(logits, uniforms, temperature, top_k, block_v)
    from . import ops  # noqa: F401  (registers torch.ops.sigmafast.*)

    return torch.ops.sigmafast.sample(logits, uniforms, float(temperature), top_k, block_v)


def residual_sample(
    q_logits: torch.Tensor,
    p_logits: torch.Tensor,
    uniforms: torch.Tensor,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    *,
    block_v: Optional[int] = None,
) -> torch.Tensor:
    """Sample from normalize(max(0, q - p)), the speculative-sampling residual.

    q_logits, p_logits: (N, V); uniforms: (N,). q and p are the processed
    (temperature, top-k) softmaxes. Rows whose residual is all zero sample
    from q; temperature 0 returns argmax q. Returns (N,) int64 tokens.
    """
    _check_args(q_logits, uniforms, temperature, top_k, block_v, name="q_logits")
    check_float("p_logits", p_logits, 2)
    if p_logits.shape != q_logits.shape or p_logits.device != q_logits.device:
        raise ValueError(f"p_logits must have q_logits' shape {tuple(q_logits.shape)}, got {tuple(p_logits.shape)}")
    from . import ops  # noqa: F401  (registers torch.ops.sigmafast.*)

    return torch.ops.sigmafast.residual_sample(q_logits, p_logits, uniforms, float(temperature), top_k, block_v)
