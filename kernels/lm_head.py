"""Triton LM head + log-sum-exp: log q of the drafts straight from hidden states (``scoring="fused"``).

The logits ``hidden @ weight.T`` are computed tile by tile with ``tl.dot`` and
never stored. The layout is flash attention's forward pass without its value
product: a program holds a block of ``BLOCK_N`` hidden rows (in registers, for
a model at most ``ONE_C_MAX`` wide) and streams a contiguous range of
``BLOCK_V``-row weight tiles, folding each (BLOCK_N, BLOCK_V) logit tile into
per-row running (max, sum of exponentials), the draft's logit, or (greedy) the
first argmax. The weight loads of the next tiles are in flight while it reduces
the current one (Triton's software pipeline, ``num_stages``). The grid is
(row blocks, vocabulary splits), row blocks fastest, so that the programs
running together read the same weight tiles (from L2 after the first); the
split count fills the GPU with one wave (``utils.resident_programs``) and is a
runtime argument, so it never compiles a variant. ``_lm_head_finish_kernel``
then combines each row's split partials (``vocab.row_masses``).

Temperature T enters the exponent, ``exp2((x - m) * log2(e) / T)``: one fused
multiply-add per logit instead of an IEEE division; the stored maxima and the
draft's logit are divided by T once per row (``div_rn``, so they equal the
reference's ``max(x / T)`` and ``x_d / T`` exactly), and the partials combine
as the split-V kernels' do. The previous design (one 64 × 128 tile per program
and a partial per tile, 393 per GPT-2 row) took 889 µs at 1280 × 768 → 50257
on an H200 and 204 µs at C = 128, slower than the padded matmul (243 and
149 µs); benchmarks/RESULTS.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .accept import ratio_args, store_logq
from .utils import LOG2E, gdc_enter, jit, num_sms, online_lse, pdl_meta, resident_programs, row_stride, rows_ready
from .vocab import row_masses

ONE_C_MAX = 128  # widest model whose hidden rows a program keeps in registers (one tl.dot per weight tile)
MAX_SPLITS = 256  # vocabulary splits per row at most: the finish kernel's partials per row
NUM_STAGES = 3  # weight tiles in flight per program (16-bit: 3 x 32 KB of shared memory at C = 128)
FINISH_C = 32  # columns per step of the finish kernel's draft dot products (64: a stack frame under Triton 3.6)


def lm_head_tiles(C: int, dtype: torch.dtype) -> dict:
    """The stream kernel's constexpr tiles and launch meta for width C and dtype: they depend on nothing
    else (never on the row count), so one model compiles one variant per rule (greedy or not)."""
    if dtype == torch.float32:  # IEEE fp32 dots: smaller tiles, the rows reloaded (in registers they spill, sm_90)
        return dict(BLOCK_N=64, BLOCK_V=64, BLOCK_C=32, ONE_C=False, EVEN_C=C % 32 == 0, num_warps=8, num_stages=2)
    one_c = C <= ONE_C_MAX
    block_c = max(16, triton.next_power_of_2(C)) if one_c else 64
    return dict(BLOCK_N=64, BLOCK_V=128, BLOCK_C=block_c, ONE_C=one_c, EVEN_C=C % block_c == 0, num_warps=4,
                num_stages=NUM_STAGES)


@triton.jit
def _logit_tile(HID, W, b_h, o_n64, m_n, o_v, m_v, s_h, s_w, C,
                BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_C: tl.constexpr, ONE_C: tl.constexpr,
                EVEN_C: tl.constexpr, DOT_PREC: tl.constexpr):
    """(BLOCK_N, BLOCK_V) fp32 logits of rows o_n64 and vocabulary rows o_v, -inf past the vocabulary.
    EVEN_C: BLOCK_C divides C, so no column mask (which would cut the loads to single elements, and keep
    Triton from pipelining them)."""
    o_c = tl.arange(0, BLOCK_C)
    if ONE_C:
        b_wt = tl.load(W + o_v.to(tl.int64)[None, :] * s_w + o_c[:, None],
                       mask=m_v[None, :] & ((o_c < C)[:, None] | EVEN_C), other=0.0)  # (BLOCK_C, BLOCK_V)
        b_x = tl.dot(b_h, b_wt, input_precision=DOT_PREC)
    else:
        b_x = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)
        for c0 in range(0, C, BLOCK_C):
            m_c = (c0 + o_c < C) | EVEN_C
            b_hc = tl.load(HID + o_n64[:, None] * s_h + (c0 + o_c)[None, :], mask=m_n[:, None] & m_c[None, :],
                           other=0.0)
            b_wt = tl.load(W + o_v.to(tl.int64)[None, :] * s_w + (c0 + o_c)[:, None],
                           mask=m_v[None, :] & m_c[:, None], other=0.0)
            b_x = tl.dot(b_hc, b_wt, b_x, input_precision=DOT_PREC)
    return tl.where(m_v[None, :], b_x, float("-inf"))


@triton.jit(do_not_specialize=["s_h", "s_w", "N", "V", "C", "NVT", "TPS", "NS"])
def _lm_head_stream_kernel(
    HID, W, M, S, s_h, s_w, N, V, C, NVT, TPS, NS, temperature,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_C: tl.constexpr, ONE_C: tl.constexpr,
    EVEN_C: tl.constexpr, GREEDY: tl.constexpr, STRIDE_UNIT: tl.constexpr, DOT_PREC: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    """Program (row block, split) streams weight tiles [split * TPS, min(NVT, split * TPS + TPS)) and writes
    its rows' (N, NS) partials: the max M and sum of exp(x - M) S of the processed logits (x / T); greedy: the
    max and its first index (S, as int32 bits)."""
    gdc_enter(USE_GDC)
    s_h = s_h * STRIDE_UNIT  # see utils for STRIDE_UNIT
    s_w = s_w * STRIDE_UNIT
    pid_s = tl.program_id(1)
    o_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    o_n64 = o_n.to(tl.int64)
    t0 = pid_s * TPS
    t1 = tl.minimum(t0 + TPS, NVT)
    b_h = tl.zeros([BLOCK_N, BLOCK_C], HID.dtype.element_ty)
    if ONE_C:
        o_c = tl.arange(0, BLOCK_C)
        b_h = tl.load(HID + o_n64[:, None] * s_h + o_c[None, :], mask=m_n[:, None] & ((o_c < C)[None, :] | EVEN_C),
                      other=0.0)
    b_m = tl.full([BLOCK_N], float("-inf"), tl.float32)
    if GREEDY:
        b_arg = tl.zeros([BLOCK_N], tl.int32) + t0 * BLOCK_V
        for t in range(t0, t1):
            o_v = t * BLOCK_V + tl.arange(0, BLOCK_V)
            b_x = _logit_tile(HID, W, b_h, o_n64, m_n, o_v, o_v < V, s_h, s_w, C, BLOCK_N, BLOCK_V, BLOCK_C, ONE_C,
                              EVEN_C, DOT_PREC)
            m_t = tl.max(b_x, 1)
            a_t = tl.min(tl.where(b_x == m_t[:, None], o_v[None, :], V), 1)  # the tile's first argmax
            b_arg = tl.where(m_t > b_m, a_t, b_arg)  # strictly greater: on a tie the earlier tile keeps it
            b_m = tl.maximum(b_m, m_t)
        tl.store(S + o_n64 * NS + pid_s, b_arg.to(tl.float32, bitcast=True), mask=m_n)
    else:
        scale = LOG2E / temperature
        b_s = tl.zeros([BLOCK_N], tl.float32)
        for t in range(t0, t1):
            o_v = t * BLOCK_V + tl.arange(0, BLOCK_V)
            b_x = _logit_tile(HID, W, b_h, o_n64, m_n, o_v, o_v < V, s_h, s_w, C, BLOCK_N, BLOCK_V, BLOCK_C, ONE_C,
                              EVEN_C, DOT_PREC)
            b_m, b_s = online_lse(b_m, b_s, b_x, scale)
        tl.store(S + o_n64 * NS + pid_s, b_s, mask=m_n)
        if temperature != 1.0:  # a uniform branch, as vocab.processed
            b_m = tl.math.div_rn(b_m, temperature)
    tl.store(M + o_n64 * NS + pid_s, b_m, mask=m_n)


@jit(do_not_specialize=["s_h", "s_w", "N", "V", "C", "NS"],
     do_not_specialize_on_alignment=["DRAFT", "DLP", "RATIO"])
def _lm_head_finish_kernel(
    HID, W, DRAFT, M, S, LOGQ, ARGMAX, DLP, RATIO, s_h, s_w, N, V, C, NS, temperature,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, NC_PAD: tl.constexpr, GREEDY: tl.constexpr,
    HAS_DLP: tl.constexpr, STRIDE_UNIT: tl.constexpr, USE_GDC: tl.constexpr,
):
    """(N,) log q of the drafts from the (N, NS) split partials (and the log ratio, ``store_logq``), or the
    first argmax when greedy. A draft's logit is its own dot product ``hidden[n] . weight[d]`` in float32: it
    may differ from the stream kernel's tile value in the last bits (another summation order), so log q is
    capped at 0."""
    gdc_enter(USE_GDC)
    o_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    o_n64 = o_n.to(tl.int64)
    if GREEDY:
        o_t = tl.arange(0, NC_PAD)[None, :]
        m_t = m_n[:, None] & (o_t < NS)
        b_m = tl.load(M + o_n64[:, None] * NS + o_t, mask=m_t, other=float("-inf"))
        r_m = tl.max(b_m, 1)
        first = tl.min(tl.where((b_m == r_m[:, None]) & m_t, o_t, NC_PAD), 1)  # the first split with the max
        arg = tl.load(S + o_n64 * NS + first, mask=m_n & (first < NS), other=0.0).to(tl.int32, bitcast=True)
        tl.store(ARGMAX + o_n64, arg.to(tl.int64), mask=m_n)
    else:
        s_h = s_h * STRIDE_UNIT
        s_w = s_w * STRIDE_UNIT
        r_m, _, r_t = row_masses(M, S, o_n64, m_n, NS, NC_PAD)
        d = tl.load(DRAFT + o_n64, mask=m_n, other=-1)
        m_d = m_n & (d >= 0) & (d < V)  # a draft outside the vocabulary has log q = -inf
        o_d = tl.where(m_d, d, 0).to(tl.int64)
        o_c = tl.arange(0, BLOCK_C)
        b_xd = tl.zeros([BLOCK_N], tl.float32)
        for c0 in range(0, C, BLOCK_C):
            m_c = (c0 + o_c < C)[None, :]
            b_h = tl.load(HID + o_n64[:, None] * s_h + (c0 + o_c)[None, :], mask=m_d[:, None] & m_c, other=0.0)
            b_w = tl.load(W + o_d[:, None] * s_w + (c0 + o_c)[None, :], mask=m_d[:, None] & m_c, other=0.0)
            b_xd += tl.sum(b_h.to(tl.float32) * b_w.to(tl.float32), 1)
        if temperature != 1.0:
            b_xd = tl.math.div_rn(b_xd, temperature)
        b_logq = tl.where(m_d, b_xd, float("-inf")) - r_m - tl.log(r_t)
        store_logq(LOGQ, DLP, RATIO, o_n64, m_n, tl.where(b_logq > 0.0, 0.0, b_logq), HAS_DLP)  # NaN stays NaN


def split_count(n_row_blocks: int, nvt: int, programs: int) -> tuple[int, int]:
    """(splits, tiles per split) for ``nvt`` weight tiles, so that n_row_blocks x splits fills at most
    ``programs`` (one wave: a few programs past it would take a whole second wave's time) and no split is
    empty: every split holds tiles_per_split tiles, the last one at least one."""
    want = max(1, min(nvt, MAX_SPLITS, programs // n_row_blocks))
    tps = -(-nvt // want)
    return -(-nvt // tps), tps


def lm_head_logq(hidden, weight, drafts, temperature, draft_logp=None, log_ratio=None) -> torch.Tensor:
    """Launch (no checks): (N, C) hidden states, (V, C) weight, (N,) drafts -> (N,) float32 log q of
    the drafts under softmax(hidden @ weight.T / temperature), or the (N,) int64 argmax at temperature 0.
    ``draft_logp`` and ``log_ratio`` as in :func:`accept.draft_logq`."""
    N, C = hidden.shape
    V = weight.shape[0]
    greedy = temperature == 0
    res = torch.empty(N, dtype=torch.int64 if greedy else torch.float32, device=hidden.device)
    if N == 0:
        return res
    unit = 16 if C % 16 == 0 else 1
    rows, w = rows_ready(hidden, unit), rows_ready(weight, unit)
    meta = dict(lm_head_tiles(C, hidden.dtype), GREEDY=greedy, STRIDE_UNIT=unit,
                DOT_PREC="ieee" if hidden.dtype == torch.float32 else "tf32", **pdl_meta(hidden.device))
    nvt = triton.cdiv(V, meta["BLOCK_V"])
    n_rb = triton.cdiv(N, meta["BLOCK_N"])
    drafts = drafts.contiguous()
    args = (row_stride(rows) // unit, row_stride(w) // unit, N, V, C)
    part = hidden.new_empty(0, dtype=torch.float32)
    probe = (rows, w, part, part, *args, 1, 1, 1, 1.0)  # for the variant only: sizes are never specialised
    wave = resident_programs(_lm_head_stream_kernel, probe, meta, hidden.device) * num_sms(hidden.device)
    ns, tps = split_count(n_rb, nvt, wave)
    m = torch.empty(N, ns, dtype=torch.float32, device=hidden.device)
    s = torch.empty_like(m)
    t = 1.0 if greedy else float(temperature)
    _lm_head_stream_kernel[(n_rb, ns)](rows, w, m, s, *args, nvt, tps, ns, t, **meta)
    nc_pad = max(2, triton.next_power_of_2(min(nvt, MAX_SPLITS, wave)))  # per model and device, not per call
    rows_per = max(1, min(64, 8192 // nc_pad))
    _lm_head_finish_kernel[(triton.cdiv(N, rows_per),)](
        rows, w, drafts, m, s, res, res, *ratio_args(draft_logp, log_ratio, res), *args, ns, t, BLOCK_N=rows_per,
        BLOCK_C=min(FINISH_C, meta["BLOCK_C"]), NC_PAD=nc_pad, GREEDY=greedy, HAS_DLP=draft_logp is not None,
        STRIDE_UNIT=unit, num_warps=4, **pdl_meta(hidden.device),
    )
    return res
