"""Triton acceptance: log q of each draft from split-V log-sum-exp partials plus a gather.

log q(d) = x_d / T - logsumexp(x / T) over the processed (temperature, top-k)
logits. ``vocab.chunk_stats`` streams every (row block, vocabulary chunk) tile
once with 16-byte loads (the split-V design of vocab.py) and writes a max and a
sum of exponentials per (row, chunk); ``_logq_finish_kernel`` combines a row's
partials into its log-sum-exp and reads the draft's one logit. Greedy
verification takes the first argmax instead (``_draft_argmax_kernel``, one
pass over aligned row windows). Only (B, O, R) values are written; the
probabilities are never materialised. Top-k uses the k-th largest logit per
row as a threshold (``topk.threshold``, no sort). On CUDA, when the top-k
prefilter applies (``topk.prefilter_config``: k up to 98 for GPT-2), log q
needs no second read of the row: the prefilter's candidates hold every logit
>= the k-th largest, so ``_topk_logq_kernel`` takes the log-sum-exp over them
(over the whole row for a row whose candidates overflowed), and top-k
acceptance reads the logits about 1.1 times (the chunk maxima, then the
qualifying chunks) instead of about 2.1 (then the chunk statistics). Each log q
kernel also writes log q - log p (the reference's difference, bit for bit), so
that the accept/reject decisions (:mod:`.decide`) take one exp and one kernel
after it, and agree with the reference exactly for the same log q. On an H200 at 1280 rows ×
50257 bf16 this takes 72.7 µs at temperature 1 (100 µs at 0.9, which divides)
where the previous single-pass kernel (one row per program, a serial loop over
the row) took 133 µs: CUDA-graph timings, benchmarks/RESULTS.md.

:func:`acceptance_from_hidden` takes the final hidden states and the LM-head
weight instead: by default a cuBLAS matmul per row chunk feeding the same
kernels (one chunk of logits at a time), or (``scoring="fused"``) the LM head
and the log-sum-exp in one streaming kernel (:mod:`.lm_head`), which never
writes the (B·O·R, V) logits.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .decide import decide
from .checks import (check_acceptance, check_block_v, check_hidden, check_ratio_flag, check_scoring,
                     check_scoring_name)
from .reference import Acceptance
from .radix import key_value
from .topk import CAP, CHUNKS_PER_K, SCAN_V, prefilter, prefilter_config, threshold
from .utils import LOG2E, exp_ftz, gdc_enter, jit, online_lse, pdl_meta, row_stride, vocab_config
from .vocab import (aligned_rows, chunk_stats, processed, row_masses, row_window, split_config, window_load,
                    window_masks)


SCORING = "matmul"  # H200, 1280 x 768 -> 50257 bf16, graphed: fused 0.89 ms, padded head + log q kernel 0.25 ms
CHUNK_ELEMENTS = 1 << 25  # logits per matmul chunk (64 MiB in bf16)
FINISH_ROWS = 64  # rows per program of _logq_finish_kernel
FIXED_ONE = tl.constexpr(2.0 ** 50)  # the unit of fixed_point_lse
CANDIDATE_DEVICES = ("cuda",)  # top-k log q from the prefilter's candidates (interpreted: slow over many rows)


def _score_dtype(dtype: torch.dtype) -> torch.dtype:
    """log q is float32 at least, as the kernels compute it (and the reference, from 16-bit logits'
    float32 values): bf16 would round q/p by up to 1%, and send the decisions to the reference's ops."""
    return torch.promote_types(dtype, torch.float32)


@triton.jit
def store_logq(LOGQ, DLP, RATIO, o_n64, m_n, b_logq, HAS_DLP: tl.constexpr):
    """Store the rows' float32 log q and, with the drafts' log p DLP (any float dtype), the log ratio
    ``log q - float32(log p)`` to RATIO: the reference's difference, bit for bit (one IEEE subtraction), so
    that the decisions need one op after it (the exp) instead of two."""
    tl.store(LOGQ + o_n64, b_logq, mask=m_n)
    if HAS_DLP:
        b_lp = tl.load(DLP + o_n64, mask=m_n, other=0.0).to(tl.float32)
        tl.store(RATIO + o_n64, b_logq - b_lp, mask=m_n)


@triton.jit(do_not_specialize=["s_x", "N"])
def _draft_argmax_kernel(
    X, ARGMAX, s_x, N, V,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, STRIDE_UNIT: tl.constexpr, ALIGN: tl.constexpr, USE_GDC: tl.constexpr,
):
    """(N,) first argmax of each logit row (greedy verification), over aligned row windows."""
    gdc_enter(USE_GDC)
    o_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    o_n64 = o_n.to(tl.int64)
    o_base, shift, end = row_window(o_n64, s_x * STRIDE_UNIT, V, ALIGN)  # (BLOCK_N,) each; see vocab
    p_x = X + o_base[:, None]  # (BLOCK_N, 1)
    b_best = tl.full([BLOCK_N], float("-inf"), tl.float32)
    b_arg = tl.zeros([BLOCK_N], tl.int32)
    for start in range(0, V + ALIGN - 1, BLOCK_V):
        o_b = start + tl.arange(0, BLOCK_V)[None, :]  # (1, BLOCK_V) window offsets
        o_v, m_w, m_v = window_masks(o_b, shift, end, m_n, V)  # (BLOCK_N, BLOCK_V) each
        b_x = tl.load(p_x + o_b, mask=m_w, other=float("-inf")).to(tl.float32)
        b_x = tl.where(m_v, b_x, float("-inf"))
        c_max = tl.max(b_x, 1)
        c_arg = tl.min(tl.where((b_x == c_max[:, None]) & m_v, o_v, V), 1)  # first index of the chunk max
        b_arg = tl.where(c_max > b_best, c_arg, b_arg)
        b_best = tl.maximum(b_best, c_max)
    tl.store(ARGMAX + o_n64, b_arg.to(tl.int64), mask=m_n)


@jit(do_not_specialize=["s_x", "N", "NC"], do_not_specialize_on_alignment=["DRAFT", "KTH", "DLP", "RATIO"])
def _logq_finish_kernel(
    X, DRAFT, KTH, M, S, LOGQ, DLP, RATIO, s_x, N, V, NC, temperature,
    BLOCK_N: tl.constexpr, NC_PAD: tl.constexpr, HAS_TOPK: tl.constexpr, STRIDE_UNIT: tl.constexpr,
    HAS_DLP: tl.constexpr, USE_GDC: tl.constexpr,
):
    """(N,) log q of the drafts from the (N, NC) chunk partials of ``vocab.chunk_stats``: the draft's
    processed logit minus the row log-sum-exp (and the log ratio, :func:`store_logq`)."""
    gdc_enter(USE_GDC)
    o_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    o_n64 = o_n.to(tl.int64)
    r_m, _, r_t = row_masses(M, S, o_n64, m_n, NC, NC_PAD)  # (BLOCK_N,) row max and sum exp(x - max)
    d = tl.load(DRAFT + o_n64, mask=m_n, other=0).to(tl.int64)
    m_d = m_n & (d >= 0) & (d < V)  # a draft outside the vocabulary has log q = -inf
    kth = tl.zeros([BLOCK_N], tl.float32)
    if HAS_TOPK:
        kth = tl.load(KTH + o_n64, mask=m_n, other=0.0).to(tl.float32)
    b_xd = window_load(X + o_n64 * (s_x * STRIDE_UNIT), d, m_d, m_d, kth, temperature, HAS_TOPK)  # as chunk_stats
    store_logq(LOGQ, DLP, RATIO, o_n64, m_n, b_xd - r_m - tl.log(r_t), HAS_DLP)


@triton.jit
def fixed_point_lse(b_x):
    """(1, CAP) candidates -> their max and sum of exp(x - max), the same whatever their order in the list
    (``topk._collect_kernel`` appends them by atomic slots, in an order that varies between runs on a GPU): each
    term in [0, 1] is truncated to a multiple of 2^-50 and the terms are added as int64, exactly (1024 of them
    stay below 2^61). A NaN term makes the sum NaN, as a float sum would."""
    b_m = tl.max(b_x, 1)
    m_use = tl.where(b_m == float("-inf"), 0.0, b_m)
    b_e = exp_ftz(b_x - m_use[:, None])
    b_fix = tl.sum(tl.where(b_e == b_e, b_e * FIXED_ONE, 0.0).to(tl.int64), 1)
    return b_m, b_fix.to(tl.float32) * (1.0 / FIXED_ONE) + tl.sum(tl.where(b_e == b_e, 0.0, b_e), 1)


@jit(do_not_specialize=["s_x", "N", "V"], do_not_specialize_on_alignment=["DRAFT", "KTH", "DLP", "RATIO"])
def _topk_logq_kernel(
    X, DRAFT, KTH, CAND, COUNT, LOGQ, DLP, RATIO, s_x, N, V, temperature,
    CAP: tl.constexpr, SCAN_V: tl.constexpr, STRIDE_UNIT: tl.constexpr, ALIGN: tl.constexpr, HAS_DLP: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    """(N,) log q of the drafts under top-k: the log-sum-exp over the row's prefilter candidates, which hold
    every logit >= the k-th largest (no second read of the row), or over the whole row when they overflowed."""
    gdc_enter(USE_GDC)
    o_n64 = tl.program_id(0).to(tl.int64) + tl.arange(0, 1)  # (1,) this row
    m_n = o_n64 < N
    s_x = s_x * STRIDE_UNIT
    kth = tl.load(KTH + o_n64, mask=m_n, other=0.0)
    count = tl.load(COUNT + o_n64, mask=m_n, other=0)
    b_m = tl.full([1], float("-inf"), tl.float32)
    b_s = tl.zeros([1], tl.float32)
    if tl.max(count) > CAP:  # uniform: one row per program
        o_base, shift, end = row_window(o_n64, s_x, V, ALIGN)
        for start in range(0, V + ALIGN - 1, SCAN_V):
            o_b = start + tl.arange(0, SCAN_V)[None, :]
            _, m_w, m_v = window_masks(o_b, shift, end, m_n, V)
            b_x = window_load(X + o_base[:, None], o_b, m_w, m_v, kth[:, None], temperature, True)
            b_m, b_s = online_lse(b_m, b_s, b_x, LOG2E)
    else:
        o_s = tl.arange(0, CAP)[None, :]
        m_s = o_s < count[:, None]
        b_key = tl.load(CAND + o_n64[:, None] * CAP + o_s, mask=m_s, other=0)
        b_x = tl.where(m_s, key_value(b_key.to(tl.uint32, bitcast=True).to(tl.int64)), float("-inf"))
        b_m, b_s = fixed_point_lse(processed(b_x, kth[:, None], temperature, True))  # as the chunk path
    d = tl.load(DRAFT + o_n64, mask=m_n, other=0).to(tl.int64)
    m_d = m_n & (d >= 0) & (d < V)  # a draft outside the vocabulary has log q = -inf
    b_xd = window_load(X + o_n64 * s_x, d, m_d, m_d, kth, temperature, True)
    r_m = tl.where(b_m == float("-inf"), 0.0, b_m)
    store_logq(LOGQ, DLP, RATIO, o_n64, m_n, b_xd - r_m - tl.log(b_s), HAS_DLP)


def topk_logq(logits, drafts, temperature, top_k, block_v=None, chunk=None, cap=CAP, chunks_per_k=CHUNKS_PER_K,
              draft_logp=None, log_ratio=None):
    """Launch (no checks): (N,) float32 log q of the (N,) drafts under top-k of (N, V) logits (0 < temperature,
    1 <= top_k < V) from the top-k prefilter's candidates (``topk.prefilter``), or None when the prefilter
    does not apply (too few chunks per k). ``draft_logq`` takes it on CUDA; the tests override the tiling as
    for ``topk.kth_largest``. With the (N,) ``draft_logp``, also writes ``log q - log p`` into the contiguous
    (N,) float32 ``log_ratio``."""
    N, V = logits.shape
    config = prefilter_config(V, logits.dtype, top_k, block_v, chunk, chunks_per_k)
    if config is None:
        return None
    res = torch.empty(N, dtype=torch.float32, device=logits.device)
    if N == 0:
        return res
    cfg = config[0]
    logits = aligned_rows(logits, cfg.unit)
    kth, cand, count = prefilter(logits, top_k, config, cap)
    _topk_logq_kernel[(N,)](
        logits, drafts.contiguous(), kth, cand, count, res, *ratio_args(draft_logp, log_ratio, res),
        row_stride(logits) // cfg.unit, N, V, float(temperature),
        CAP=cap, SCAN_V=SCAN_V, STRIDE_UNIT=cfg.unit, ALIGN=cfg.align, HAS_DLP=draft_logp is not None, num_warps=4,
        **pdl_meta(logits.device),
    )
    return res


def ratio_args(draft_logp, log_ratio, dummy) -> tuple:
    """The kernels' DLP and RATIO pointers: the drafts' (N,) log p (contiguous) and the (N,) log-ratio output,
    or a dummy for both (HAS_DLP False: never read)."""
    if draft_logp is None:
        return dummy, dummy
    return draft_logp.contiguous(), log_ratio


def draft_logq(logits, drafts, temperature, top_k=None, block_v=None, draft_logp=None, log_ratio=None
               ) -> torch.Tensor:
    """Launch (no checks): (N, V) logits, (N,) drafts -> (N,) float32 log q of the drafts, or the
    (N,) int64 argmax when ``temperature`` is 0. With the drafts' (N,) log p ``draft_logp`` (temperature
    > 0), also writes ``log q - log p`` (:func:`store_logq`) into the contiguous (N,) float32 ``log_ratio``."""
    N, V = logits.shape
    greedy = temperature == 0
    res = torch.empty(N, dtype=torch.int64 if greedy else torch.float32, device=logits.device)
    if N == 0:
        return res
    drafts = drafts.contiguous()
    if greedy:
        block_v, block_n, num_warps, unit = vocab_config(V, block_v)
        logits = aligned_rows(logits, unit)
        _draft_argmax_kernel[(triton.cdiv(N, block_n),)](
            logits, res, row_stride(logits) // unit, N, V,
            BLOCK_N=block_n, BLOCK_V=block_v, STRIDE_UNIT=unit, ALIGN=16 // logits.element_size(),
            num_warps=num_warps, **pdl_meta(logits.device),
        )
        return res
    if logits.device.type in CANDIDATE_DEVICES and top_k is not None and top_k < V:  # one read of the row
        scored = topk_logq(logits, drafts, temperature, top_k, block_v, draft_logp=draft_logp, log_ratio=log_ratio)
        if scored is not None:
            return scored
    cfg = split_config(V, logits.dtype, block_v)
    logits = aligned_rows(logits, cfg.unit)
    kth = threshold(logits, top_k, block_v)
    s_x = row_stride(logits) // cfg.unit
    m, s = chunk_stats(logits, kth, temperature, cfg, s_x)  # (N, NC) each
    _logq_finish_kernel[(triton.cdiv(N, FINISH_ROWS),)](
        logits, drafts, kth if kth is not None else res, m, s, res, *ratio_args(draft_logp, log_ratio, res), s_x, N,
        V, cfg.nc, float(temperature), BLOCK_N=FINISH_ROWS, NC_PAD=cfg.nc_pad, HAS_TOPK=kth is not None,
        STRIDE_UNIT=cfg.unit, HAS_DLP=draft_logp is not None, num_warps=4, **pdl_meta(logits.device),
    )
    return res


def acceptance(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    draft_logp: torch.Tensor,
    uniforms: torch.Tensor,
    lengths: torch.Tensor,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    rule: str = "paper",
    *,
    block_v: Optional[int] = None,
    flag: Optional[torch.Tensor] = None,
) -> Acceptance:
    """Accept/reject drafts scored by the verification forward.

    logits: (B, O, R, V) verifier logits (q), float32/float16/bfloat16;
    drafts: (B, O, R) int64 in visiting order; draft_logp: (B, O, R) their log p
    under the draft; uniforms: (B, O, R); lengths: (B,) valid steps per row.
    Returns :class:`Acceptance` (logq (B, O, R), float32 for 16-bit logits, else in their dtype; accept,
    n_accept, best, first_reject, n_best), with the reference's semantics. ``flag`` (a () bool tensor,
    temperature > 0) is set in place, never cleared, when a valid step's ratio q/p is NaN
    (``reference.flag_nan_ratios``: its verifier row is not finite), by the decisions' kernel.
    """
    check_acceptance(logits, drafts, draft_logp, uniforms, lengths, temperature, top_k, rule)
    check_block_v(block_v)
    check_ratio_flag(flag, temperature, logits.device)
    from . import ops  # noqa: F401  (registers torch.ops.sigmafast.*)

    B, O, R, V = logits.shape
    greedy = temperature == 0
    logp, ratio = _ratio_buffers(draft_logp, temperature, logits.dtype)
    res = torch.ops.sigmafast.draft_logq(logits.reshape(B * O * R, V), drafts.reshape(-1), float(temperature),
                                         None if greedy else top_k, block_v, logp, ratio)
    scores = res.view(B, O, R) if greedy else res.view(B, O, R).to(_score_dtype(logits.dtype))
    return decide(scores, drafts, draft_logp, uniforms, lengths, temperature, rule, flag,
                  log_ratio=None if ratio is None else ratio.view(B, O, R))


def _ratio_buffers(draft_logp: torch.Tensor, temperature: float, dtype: torch.dtype):
    """The log q kernels' (N,) draft log p and new (N,) log-ratio output for (B, O, R) ``draft_logp``, when the
    decisions take the ratio from them (temperature > 0, float32 log q); else (None, None)."""
    if temperature == 0 or _score_dtype(dtype) != torch.float32:
        return None, None
    logp = draft_logp.reshape(-1)
    return logp, logp.new_empty(logp.shape, dtype=torch.float32)


def acceptance_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    drafts: torch.Tensor,
    draft_logp: torch.Tensor,
    uniforms: torch.Tensor,
    lengths: torch.Tensor,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    rule: str = "paper",
    *,
    scoring: str = SCORING,
    vocab_size: Optional[int] = None,
    flag: Optional[torch.Tensor] = None,
) -> Acceptance:
    """:func:`acceptance` of the logits ``hidden @ weight.T``, never all written at once.

    hidden: (B, O, R, C) final hidden states (after the last layer norm);
    weight: (V, C) LM-head weight (no bias), same dtype. ``scoring``:

    - ``"matmul"``: cuBLAS ``hidden @ weight.T`` over row chunks of at most
      ``CHUNK_ELEMENTS`` logits, each streamed once by the log q kernel (the
      logits of one chunk exist at a time; top-k is supported);
    - ``"fused"``: the logits live only tile by tile in one kernel (the
      cut-cross-entropy idea); with ``top_k`` it falls back to ``"matmul"``.

    The default, ``SCORING``, is the faster on the GPU (benchmarks/RESULTS.md). ``vocab_size``: only
    the first rows of ``weight`` are the vocabulary, the others zero padding that keeps the matmul's
    output rows aligned (cuBLAS is several times slower on a 50257-wide output than a 50304-wide one).
    ``flag``: as in :func:`acceptance`.
    """
    check_scoring_name(scoring)
    V = check_hidden(hidden, weight, vocab_size)
    B, O, R, C = hidden.shape
    check_scoring((B, O, R), hidden.device, drafts, draft_logp, uniforms, lengths, temperature, top_k, rule)
    check_ratio_flag(flag, temperature, hidden.device)
    from . import ops  # noqa: F401  (registers torch.ops.sigmafast.*)

    greedy = temperature == 0
    rows, flat_drafts = hidden.reshape(B * O * R, C), drafts.reshape(-1)
    logp, ratio = _ratio_buffers(draft_logp, temperature, hidden.dtype)
    if scoring == "matmul" or (top_k is not None and top_k < V and not greedy):
        step = max(1, CHUNK_ELEMENTS // max(V, 1))
        rows_of = [slice(i, i + step) for i in range(0, max(B * O * R, 1), step)]
        parts = [
            torch.ops.sigmafast.draft_logq((rows[r] @ weight.T)[:, :V], flat_drafts[r], float(temperature),
                                           None if greedy else top_k, None,
                                           *((None, None) if ratio is None else (logp[r], ratio[r])))
            for r in rows_of
        ]
        res = (parts[0] if len(parts) == 1 else torch.cat(parts))[: B * O * R]
    else:
        res = torch.ops.sigmafast.lm_head_logq(rows, weight[:V], flat_drafts, float(temperature), logp, ratio)
    scores = res.view(B, O, R) if greedy else res.view(B, O, R).to(_score_dtype(hidden.dtype))
    return decide(scores, drafts, draft_logp, uniforms, lengths, temperature, rule, flag,
                  log_ratio=None if ratio is None else ratio.view(B, O, R))
