"""Triton inverse-CDF sampling from logits, and the speculative-sampling residual.

Split-V design (see vocab.py for why): the logits are read once (residual:
twice) by thousands of (row block, chunk) programs, plus one chunk per row:

* ``_chunk_stats_kernel`` (vocab.py): per (row, chunk) the max and sum of
  ``exp(x - max)`` of the processed logits (temperature, top-k threshold from
  ``topk.threshold``, which takes q's and p's rows in the same launches);
  residual: for q's and p's rows in one launch;
* residual only, ``_residual_mass_kernel`` (residual.py): per (row, chunk) the
  masses of ``max(0, q - p)`` and of q (the row log-sum-exps come from the
  partials); with ``residual_rows.ROWS`` on (opt-in) and a row per SM,
  ``_residual_rows_kernel`` (residual_rows.py) writes the same from both
  passes over each row in one program (the second meant to hit L2) instead of these two;
* ``_sample_kernel`` / ``_residual_kernel`` (one program per row block): the
  chunk masses (``s_c * exp(m_c - row max)``, or the residual masses, or q's
  where the row's residual is empty) give the row total and, by a cumsum over
  the NC chunk masses, the chunk where the CDF crosses ``u * total``; the
  program then loads only that chunk of each row and finds the token there by a
  cumsum started at the chunks' prefix sum (and the token's log-prob).

There is no scan over every chunk of the row. The sampling law is unchanged:
the token is the first index whose cumulative sum of the (unnormalised)
processed probabilities exceeds ``u * total``, clamped to the last index of
nonzero probability. Clamp: the chunk is the first whose prefix sum exceeds the
target, or else the last chunk of nonzero mass; inside it the token is the first
crossing, or else the chunk's last nonzero index. A chunk mass is positive
exactly when one of its probabilities is (the same exponentials), so this is the
reference's global ``min(first crossing, last nonzero)`` (the reference clamps to
the last index where its running sum grows: the last nonzero one, unless the sum
absorbs later probabilities, which no draw below the total reaches). The sums are
associated differently from the reference's sequential cumsum (chunk sums,
then a prefix over chunks): as before, tokens can differ from the reference
only when ``u * total`` is within a few float ulps of a CDF boundary (a chunk
boundary included: if the in-chunk sums fall short of the target by rounding,
the chunk's last nonzero index is taken, the boundary's left side), or when a
logit rounds onto the top-k threshold after the division by the temperature
(the kernels compare raw logits with the raw k-th value). The residual's
chunk and in-chunk masses use bit-identical q and p (same partials, same
tiles), so the residual chosen chunk always holds a nonzero residual.

Chunks are 16-byte aligned windows of each row (vocab.row_window), so every
load is a 16-byte vector even for an odd V such as 50257.

Every kernel compiles at most twice per dtype and V (with and without top-k):
row counts and strides are not specialised, the tiles depend only on V.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import residual_rows
from .topk import threshold
from .checks import check_residual, check_sampling, check_used_rows
from .flags import launch as flag_launch
from .utils import exp_ftz, gdc_enter, jit, pdl_meta, row_stride
from .residual import residual_masses, residual_probs
from .vocab import aligned_rows, chunk_stats, row_masses, row_window, split_config, window_load, window_masks


@triton.jit
def _sample_rows(
    QL, PL, U, KQ, KP, MQ, SQ, RM, QM, LSE, TOK, LOGP, USED, FLAG, s_x, s_u, N, V, NC, check, temperature,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, NC_PAD: tl.constexpr, HAS_TOPK: tl.constexpr,
    RESIDUAL: tl.constexpr, STRIDE_UNIT: tl.constexpr, ALIGN: tl.constexpr,
):
    """The rows' tokens (and, unless RESIDUAL, their log-probs): the crossing chunk from the (N, NC)
    chunk masses, then the token inside that one chunk. q and p rows share the row stride s_x, in units
    of STRIDE_UNIT (see utils); chunks are aligned windows (see vocab.row_window). Unless RESIDUAL, with
    ``check`` 1 (every row) or 2 (the rows whose byte at USED + n * s_u is nonzero) a row whose total is
    not in (0, inf) stores 1 into FLAG (see ``flag_rows``)."""
    o_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    o_n64 = o_n.to(tl.int64)
    kq = tl.zeros([BLOCK_N, 1], tl.float32)
    kp = tl.zeros([BLOCK_N, 1], tl.float32)
    if HAS_TOPK:
        kq = tl.load(KQ + o_n64, mask=m_n, other=0.0).to(tl.float32)[:, None]
        if RESIDUAL:
            kp = tl.load(KP + o_n64, mask=m_n, other=0.0).to(tl.float32)[:, None]

    o_c = tl.arange(0, NC_PAD)[None, :]  # (1, NC_PAD)
    if RESIDUAL:  # MQ and SQ unread (the residual kernel passes RM)
        lse_q = tl.load(LSE + 2 * o_n64, mask=m_n, other=0.0)  # the mass kernel's, so q and p are its own
        lse_p = tl.load(LSE + 2 * o_n64 + 1, mask=m_n, other=0.0)
        m_c = m_n[:, None] & (o_c < NC)
        b_r = tl.load(RM + o_n64[:, None] * NC + o_c, mask=m_c, other=0.0)  # (BLOCK_N, NC_PAD)
        empty = tl.sum(b_r, 1) <= 0.0
        b_cw = tl.where(empty[:, None], tl.load(QM + o_n64[:, None] * NC + o_c, mask=m_c, other=0.0), b_r)
    else:
        q_max, b_cw, q_tot = row_masses(MQ, SQ, o_n64, m_n, NC, NC_PAD)  # (BLOCK_N,), (BLOCK_N, NC_PAD), (BLOCK_N,)
        lse_q = q_max + tl.log(q_tot)
    b_cc = tl.cumsum(b_cw, 1)  # (BLOCK_N, NC_PAD) inclusive prefix sums of the chunk masses
    total = tl.max(b_cc, 1)  # nondecreasing: the last prefix sum
    target = tl.load(U + o_n64, mask=m_n, other=0.0).to(tl.float32) * total
    c_first = tl.min(tl.where(b_cc > target[:, None], o_c, NC_PAD), 1)
    c_last = tl.max(tl.where(b_cw > 0.0, o_c, 0), 1)
    c_tok = tl.minimum(c_first, c_last)  # (BLOCK_N,) the chunk of the token
    carry = tl.max(tl.where(o_c < c_tok[:, None], b_cc, 0.0), 1)  # prefix sum before it

    o_base, shift, end = row_window(o_n64, s_x * STRIDE_UNIT, V, ALIGN)  # (BLOCK_N,) each
    o_b = c_tok[:, None] * BLOCK_V + tl.arange(0, BLOCK_V)[None, :]  # (BLOCK_N, BLOCK_V) window offsets
    o_v, m_w, m_v = window_masks(o_b, shift, end, m_n, V)  # (BLOCK_N, BLOCK_V) each
    if RESIDUAL:
        b_q, b_p = residual_probs(QL, PL, o_base, o_b, shift, end, m_n, V, False, kq, kp, lse_q, lse_p,
                                  temperature, HAS_TOPK)  # a chunk per row: never uniformly interior
        b_w = tl.where(empty[:, None], b_q, tl.maximum(b_q - b_p, 0.0))
        b_x = b_q
    else:
        b_x = window_load(QL + o_base[:, None], o_b, m_w, m_v, kq, temperature, HAS_TOPK)
        b_w = exp_ftz(b_x - q_max[:, None])
    b_c = carry[:, None] + tl.cumsum(b_w, 1)
    first = tl.min(tl.where((b_c > target[:, None]) & m_v, o_v, V), 1)
    last_nz = tl.max(tl.where((b_w > 0.0) & m_v, o_v, -1), 1)
    token = tl.maximum(tl.minimum(first, last_nz), 0)  # max: rows without any mass (NaN) only
    tl.store(TOK + o_n64, token.to(tl.int64), mask=m_n)
    if not RESIDUAL:
        x_tok = tl.max(tl.where(o_v == token[:, None], b_x, float("-inf")), 1)
        tl.store(LOGP + o_n64, (x_tok - lse_q).to(LOGP.dtype.element_ty), mask=m_n)
        flag_rows(USED, FLAG, o_n, o_n64, q_tot, s_u, N, check)


@triton.jit
def flag_rows(USED, FLAG, o_n, o_n64, total, s_u, N, check):
    """Store 1 into FLAG when a checked row's total ``sum exp(x - row max)`` is not in (0, inf): NaN exactly
    when the row holds a NaN or +inf (NaN - max, or inf - inf, reaches the sum even where ``tl.max`` drops
    NaNs), 0 exactly when it has no finite entry, so ``reference.nonfinite``'s rows. ``check``: 0 none, 1
    every row, 2 those with a nonzero byte at USED + n * s_u."""
    m_c = o_n < tl.where(check > 0, N, 0)
    b_used = tl.load(USED + o_n64 * s_u, mask=o_n < tl.where(check > 1, N, 0), other=1)
    bad = m_c & (b_used != 0) & ~((total > 0.0) & (total < float("inf")))
    tl.store(FLAG, tl.full((), 1, tl.uint8), mask=tl.max(bad.to(tl.int32), 0) > 0)


@jit(do_not_specialize=["s_x", "s_u", "N", "NC", "check"],
     do_not_specialize_on_alignment=["U", "KQ", "USED", "FLAG"])
def _sample_kernel(
    QL, U, KQ, MQ, SQ, TOK, LOGP, USED, FLAG, s_x, s_u, N, V, NC, check, temperature,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, NC_PAD: tl.constexpr, HAS_TOPK: tl.constexpr,
    STRIDE_UNIT: tl.constexpr, ALIGN: tl.constexpr, USE_GDC: tl.constexpr,
):
    gdc_enter(USE_GDC)
    _sample_rows(QL, QL, U, KQ, KQ, MQ, SQ, MQ, MQ, MQ, TOK, LOGP, USED, FLAG, s_x, s_u, N, V, NC, check,
                 temperature, BLOCK_N, BLOCK_V, NC_PAD, HAS_TOPK, False, STRIDE_UNIT, ALIGN)


@jit(do_not_specialize=["s_x", "N", "NC"], do_not_specialize_on_alignment=["U", "KQ", "KP"])
def _residual_kernel(
    QL, PL, U, KQ, KP, RM, QM, LSE, TOK, s_x, N, V, NC, temperature,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, NC_PAD: tl.constexpr, HAS_TOPK: tl.constexpr,
    STRIDE_UNIT: tl.constexpr, ALIGN: tl.constexpr, USE_GDC: tl.constexpr,
):
    gdc_enter(USE_GDC)
    _sample_rows(QL, PL, U, KQ, KP, RM, RM, RM, QM, LSE, TOK, TOK, TOK, TOK, s_x, 0, N, V, NC, 0, temperature,
                 BLOCK_N, BLOCK_V, NC_PAD, HAS_TOPK, True, STRIDE_UNIT, ALIGN)


def launch(q_logits, p_logits, uniforms, temperature, top_k, block_v=None, used=None, flag=None):
    """Launch the sample (``p_logits`` None) or residual kernels, no checks: (N,) tokens and (N,) log-probs
    (residual: None). Temperature 0 is the first argmax of q (log-prob 0), without a sampling kernel.
    Sample only: with a () bool ``flag``, sets it when ``reference.nonfinite(q_logits, used)`` (used: None
    or (N,) bool), in the sampling kernel (the flags kernel at temperature 0)."""
    N, V = q_logits.shape
    residual = p_logits is not None
    if temperature == 0:
        if flag is not None:
            flag_launch(q_logits, used, flag)
        return q_logits.argmax(-1), None if residual else q_logits.new_zeros(N, dtype=torch.float32)
    cfg = split_config(V, q_logits.dtype, block_v)
    q_logits = aligned_rows(q_logits, cfg.unit)
    if residual:  # q and p rows share one stride (and so one chunk geometry)
        p_logits = aligned_rows(p_logits, cfg.unit)
        if row_stride(p_logits) != row_stride(q_logits):
            q_logits, p_logits = q_logits.contiguous(), p_logits.contiguous()
    kth = threshold(q_logits, top_k, block_v, more=p_logits)  # (N,), or (2N,) for q's and p's rows in one go
    kq, kp = (kth[:N], kth[N:]) if residual and kth is not None else (kth, None)
    tokens = torch.empty(N, dtype=torch.int64, device=q_logits.device)
    logp = None if residual else torch.empty(N, dtype=torch.float32, device=q_logits.device)
    if N == 0:
        return tokens, logp
    u = uniforms.contiguous()  # float32 or float64: the kernels round it to float32, as the reference does
    s_x = row_stride(q_logits) // cfg.unit
    grid = (triton.cdiv(N, cfg.block_n),)
    meta = dict(BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, NC_PAD=cfg.nc_pad, HAS_TOPK=kq is not None,
                STRIDE_UNIT=cfg.unit, ALIGN=cfg.align, num_warps=cfg.num_warps, **pdl_meta(q_logits.device))
    if residual:  # the token search reads the mass kernel's log-sum-exps, not q's chunk statistics
        if residual_rows.use_rows(N, q_logits.device):  # both passes over a row in one program
            rm, qm, lse = residual_rows.residual_masses_rows(q_logits, p_logits, kq, kp, temperature, cfg, s_x)
        else:  # q's and p's partials in one launch: (2N, NC), q's rows first
            m, s = chunk_stats(q_logits, kq, temperature, cfg, s_x, p_logits, kp)
            rm, qm, lse = residual_masses(q_logits, p_logits, kq, kp, m[:N], s[:N], m[N:], s[N:], temperature, cfg,
                                          s_x)
        kq_, kp_ = (kq, kp) if kq is not None else (u, u)
        _residual_kernel[grid](
            q_logits, p_logits, u, kq_, kp_, rm, qm, lse, tokens, s_x, N, V, cfg.nc,
            float(temperature), **meta,
        )
    else:
        mq, sq = chunk_stats(q_logits, kq, temperature, cfg, s_x)  # (N, NC) each
        check = 0 if flag is None else 1 if used is None else 2
        flag_u8 = (tokens if flag is None else flag).view(torch.uint8)  # without a flag: never written (check 0)
        used_u8 = flag_u8 if used is None else used.view(torch.uint8)
        s_u = used.stride(0) if used is not None and N > 1 else 0
        _sample_kernel[grid](
            q_logits, u, kq if kq is not None else u, mq, sq, tokens, logp, used_u8, flag_u8, s_x, s_u, N, V, cfg.nc,
            check, float(temperature), **meta,
        )
    return tokens, logp


def sample(
    logits: torch.Tensor,
    uniforms: torch.Tensor,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    *,
    block_v: Optional[int] = None,
    used: Optional[torch.Tensor] = None,
    flag: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row by inverse CDF.

    logits: (N, V) float32/float16/bfloat16; uniforms: (N,) in [0, 1).
    Returns tokens (N,) int64 and their log-probabilities (N,) in float32 (the
    kernels compute in float32 whatever the logits' dtype) under the processed
    distribution; temperature 0 is greedy (first argmax, log-prob 0).
    ``block_v`` (a power of two) overrides the vocabulary chunk.
    ``flag`` (a () bool tensor) is set in place, never cleared, when a row of
    ``logits`` (those where the (N,) bool ``used`` is True; every row when
    None) holds a NaN or +inf or has no finite entry, as ``flag_nonfinite``
    sets it, without reading the logits again.
    """
    check_sampling(logits, uniforms, temperature, top_k, block_v)
    check_used_rows(used, flag, logits)
    from . import ops  # noqa: F401  (registers torch.ops.sigmafast.*)

    return torch.ops.sigmafast.sample(logits, uniforms, float(temperature), top_k, block_v, used, flag)


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
    check_residual(q_logits, p_logits, uniforms, temperature, top_k, block_v)
    from . import ops  # noqa: F401  (registers torch.ops.sigmafast.*)

    return torch.ops.sigmafast.residual_sample(q_logits, p_logits, uniforms, float(temperature), top_k, block_v)
