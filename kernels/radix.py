"""Order-preserving integer keys of floats, and the k-th largest logit of each row by radix select.

Keys. Each float maps to a uint32 key with the same order (``order_key32``;
every NaN to the largest key, as torch.topk ranks NaN above +inf). No float has
key 0, which marks the columns outside a row. bf16 values need the top 16 bits
of their fp32 key, fp16 24, fp32 all 32 (``KEY_BITS``); below them a key's bits
are 0 for positive values and 1 for negative ones (the sign flip).

Radix select (``radix_kth_largest``: ``topk.kth_largest``'s fallback when its
prefilter does not apply, top-k above ~V / 512). The key is found 8 bits at a
time, from the top: pass p histograms digit p of the keys whose higher digits
equal the prefix found so far, and the digit where the count from the top
reaches the remaining rank is the next digit of the k-th largest key (2 passes
for bf16, 3 for fp16, 4 for fp32).

* ``_radix_hist_kernel``, grid (rows, NC): one row × one aligned window chunk
  of ``RADIX_CHUNK`` columns; one ``tl.histogram`` of the matching keys'
  digits, added into the row's (256,) int32 counts by atomics on the nonzero
  bins only (logits fall in few exponent bins, so there are few atomics).
* ``_radix_select_kernel``, grid (row blocks,): picks each row's digit, updates
  its prefix and remaining rank, zeroes the counts for the next pass, and
  writes the float of the prefix (after the last pass, the k-th largest value).

One row per program because of how ``tl.histogram`` compiles: up to Triton
3.7 by warp ballots, bins / 32 per element and thread (256 bins: 67 sm_90 SASS
instructions per element; 1280 bf16 rows of GPT-2 took 491 µs on the H200),
from 3.8 by one shared-memory atomic per element (19 instructions).

Both kernels take every size, count and shift at run time (``do_not_specialize``),
and ``more``'s rows after those of ``logits`` (``pair_rows``), as ``topk`` does.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .utils import gdc_enter, pdl_meta
from .vocab import aligned_rows, is_interior, row_window, split_config, window_masks

BINS = tl.constexpr(256)
DIGIT_BITS = tl.constexpr(8)
RADIX_CHUNK = 4096  # columns per histogram program
SELECT_ROWS = 16
KEY_BITS = {torch.bfloat16: 16, torch.float16: 24, torch.float32: 32}  # top key bits that can differ


@triton.jit
def order_key32(b_x):
    """fp32 -> uint32 keys with the floats' order (-inf lowest at 0x7FFFFF, any NaN highest at 0xFFFFFFFF):
    positive floats get the sign bit set, negative ones every bit flipped."""
    b_i = tl.where(b_x == b_x, b_x.to(tl.int32, bitcast=True), 0x7FFFFFFF)
    return (b_i ^ ((b_i >> 31) | -2147483648)).to(tl.uint32, bitcast=True)


@triton.jit
def key_value(key):
    """Inverse of ``order_key32`` for int64 keys in [0, 2^32) -> fp32."""
    b_i = (key - 2147483648).to(tl.int32)
    b_i = b_i ^ ((b_i >> 31) & 0x7FFFFFFF)
    return b_i.to(tl.float32, bitcast=True)


@triton.jit
def low_filled(prefix, n_low):
    """int64 keys in [0, 2^32) resolved above their ``n_low`` lowest bits -> the fp32 values: the bits below
    are those of the input dtype's keys (0 for positive values, 1 for negative ones: the sign flip), so the
    value is exact once every bit the dtype can set is resolved."""
    ones = (tl.full(prefix.shape, 1, tl.int64) << n_low) - 1
    return key_value(prefix | tl.where(prefix < 2147483648, ones, 0))


@triton.jit
def pair_row(X, Y, n, N_X):
    """Row n of the rows of X (n < N_X) followed by those of Y: its tensor's pointer and its (1,) row there
    (uniform: one row per program, so the loads keep their vector width)."""
    second = n >= N_X
    return tl.where(second, Y, X), n - tl.where(second, N_X, 0) + tl.arange(0, 1)


@triton.jit(do_not_specialize=["s_x", "N", "N_X", "V", "shift"])
def _radix_hist_kernel(
    X, Y, PREFIX, HIST, s_x, N, N_X, V, shift,
    BLOCK_V: tl.constexpr, STRIDE_UNIT: tl.constexpr, ALIGN: tl.constexpr, USE_GDC: tl.constexpr,
):
    """Add the histogram of key digit ``(key >> shift) & 255`` of chunk c of row n (of X's N_X rows then
    Y's), over the keys whose bits above ``shift + 8`` equal the row's prefix, into the row's (256,) counts."""
    gdc_enter(USE_GDC)
    n = tl.program_id(0).to(tl.int64)
    o_n64 = n + tl.arange(0, 1)  # (1,) this row
    c = tl.program_id(1)
    m_n = o_n64 < N
    X, o_r64 = pair_row(X, Y, n, N_X)
    o_base, r_shift, end = row_window(o_r64, s_x * STRIDE_UNIT, V, ALIGN)  # (1,) each
    o_b = c * BLOCK_V + tl.arange(0, BLOCK_V)[None, :]  # (1, BLOCK_V) window offsets
    prefix = tl.load(PREFIX + o_n64).to(tl.uint32)[:, None]  # (1, 1) resolved key bits (int64 in [0, 2^32))
    # the bits above the digit (0 at first); ``^ 0xFFFFFFFF`` rather than ``~``: the interpreters of Triton 3.4
    # and 3.5 invert an unsigned integer with np.full(1, -1, uint32), which NumPy 2 rejects
    high = ((tl.full((), 2, tl.uint32) << (shift + DIGIT_BITS - 1)) - 1) ^ 0xFFFFFFFF
    if is_interior(c, V, BLOCK_V, ALIGN):  # uniform: no column masks inside the rows (vocab.chunk_load)
        b_key = order_key32(tl.load(X + o_base[:, None] + o_b).to(tl.float32))
        m_k = ((b_key ^ prefix) & high) == 0
    else:
        _, m_w, m_v = window_masks(o_b, r_shift, end, m_n, V)  # (1, BLOCK_V) each
        b_key = order_key32(tl.load(X + o_base[:, None] + o_b, mask=m_w, other=0.0).to(tl.float32))
        m_k = m_v & (((b_key ^ prefix) & high) == 0)
    b_d = ((b_key >> shift) & (BINS - 1)).to(tl.int32)
    b_h = tl.histogram(tl.reshape(b_d, [BLOCK_V]), BINS, mask=tl.reshape(m_k, [BLOCK_V]))  # (BINS,)
    o_h = o_n64 * BINS + tl.arange(0, BINS)
    tl.atomic_add(HIST + o_h, b_h, mask=b_h > 0)


@triton.jit(do_not_specialize=["N", "shift"])
def _radix_select_kernel(PREFIX, KREM, HIST, OUT, N, shift, BLOCK_N: tl.constexpr, USE_GDC: tl.constexpr):
    """Each row's next digit: the largest d whose count of digits >= d reaches the remaining rank."""
    gdc_enter(USE_GDC)
    o_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    o_n64 = o_n.to(tl.int64)
    o_d = tl.arange(0, BINS)[None, :]
    o_h = o_n64[:, None] * BINS + o_d  # (BLOCK_N, BINS)
    b_h = tl.load(HIST + o_h, mask=m_n[:, None], other=0)  # (BLOCK_N, BINS) int32
    krem = tl.load(KREM + o_n64, mask=m_n, other=1)
    total = tl.sum(b_h, 1)
    b_c = tl.cumsum(b_h, 1)  # count of digits <= d
    b_ge = total[:, None] - b_c + b_h  # count of digits >= d
    d = tl.maximum(tl.max(tl.where(b_ge >= krem[:, None], o_d, -1), 1), 0)  # (BLOCK_N,)
    above = total - tl.sum(tl.where(o_d == d[:, None], b_c, 0), 1)  # count of digits > d
    prefix = tl.load(PREFIX + o_n64, mask=m_n, other=0) | (d.to(tl.int64) << shift)
    tl.store(PREFIX + o_n64, prefix, mask=m_n)
    tl.store(KREM + o_n64, krem - above, mask=m_n)
    tl.store(HIST + o_h, tl.zeros([BLOCK_N, BINS], tl.int32), mask=m_n[:, None])
    tl.store(OUT + o_n64, low_filled(prefix, shift), mask=m_n)  # exact after the dtype's last pass


def pair_rows(logits: torch.Tensor, more: Optional[torch.Tensor], unit: int) -> tuple:
    """The kernels' (X, Y, N_X, N, row stride in units): ``logits``' rows then ``more``'s (None: none), 16-byte
    aligned (``vocab.aligned_rows``) and of one row stride, a multiple of ``unit`` (both copied when the
    strides of two tensors of several rows differ; a single row's stride is never used)."""
    x = aligned_rows(logits, unit)
    y = x if more is None else aligned_rows(more, unit)
    strides = {t.stride(0) for t in (x, y) if t.shape[0] > 1}
    if len(strides) > 1:
        x, y = x.contiguous(), y.contiguous()
        strides = {x.stride(0)}
    N_X = x.shape[0]
    return x, y, N_X, N_X + (0 if more is None else y.shape[0]), next(iter(strides), 0) // unit


def radix_kth_largest(logits: torch.Tensor, top_k: int, block_v: Optional[int] = None,
                      more: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``kth_largest`` by radix select (``block_v`` overrides the columns per histogram program)."""
    V = logits.shape[1]
    cfg = split_config(V, logits.dtype, block_v or min(RADIX_CHUNK, triton.next_power_of_2(V)))
    x, y, N_X, N, s_x = pair_rows(logits, more, cfg.unit)
    out = torch.empty(N, dtype=torch.float32, device=logits.device)
    if N == 0:
        return out
    prefix = torch.zeros(N, dtype=torch.int64, device=logits.device)
    krem = torch.full((N,), top_k, dtype=torch.int32, device=logits.device)
    hist = torch.zeros(N, BINS.value, dtype=torch.int32, device=logits.device)
    warps = max(1, min(8, cfg.block_v // 512))  # 16 elements per thread
    for shift in range(32 - DIGIT_BITS.value, 31 - KEY_BITS[logits.dtype], -DIGIT_BITS.value):
        _radix_hist_kernel[(N, cfg.nc)](
            x, y, prefix, hist, s_x, N, N_X, V, shift,
            BLOCK_V=cfg.block_v, STRIDE_UNIT=cfg.unit, ALIGN=cfg.align, num_warps=warps, **pdl_meta(x.device),
        )
        _radix_select_kernel[(triton.cdiv(N, SELECT_ROWS),)](prefix, krem, hist, out, N, shift,
                                                              BLOCK_N=SELECT_ROWS, num_warps=4,
                                                              **pdl_meta(prefix.device))
    return out
