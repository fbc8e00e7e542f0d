"""The k-th largest logit of each row (the top-k threshold) by radix select, without a sort.

Top-k sampling keeps the logits ``>= kth`` of a row, where ``kth`` is its k-th
largest value (ties with it are kept, as in ``reference.process_logits``). The
reference is ``torch.topk(x, k).values[:, -1]``, which sorts k values per row
and, on a GPU, costs several times the read of the logits (H200, 1280 × 50257
bf16 rows, top-k 50: 85% of the vocabulary ops' time).

Radix select. Each float maps to an integer key with the same order (below).
The key is found 8 bits at a time, from the top: pass p histograms digit p of
the keys whose higher digits equal the prefix found so far, and the digit where
the count from the top reaches the remaining rank is the next digit of the k-th
largest key. bf16 values need the top 16 bits of their fp32 key (2 passes),
fp16 the top 24 (3), fp32 all 32 (4).

* ``_radix_hist_kernel``, grid (rows, NC): one row × one aligned window chunk
  of ``RADIX_CHUNK`` columns (``vocab.row_window``); one ``tl.histogram`` of
  the matching keys' digits, added into the row's (256,) int32 counts by
  atomics on the nonzero bins only (logits fall in few exponent bins, so there
  are few atomics). The keys are uint32 (``order_key32``: one integer op).
* ``_radix_select_kernel``, grid (row blocks,): picks each row's digit, updates
  its prefix and remaining rank, zeroes the counts for the next pass, and
  writes the float of the prefix (after the last pass, the k-th largest value).

One row per program because of how ``tl.histogram`` compiles. Up to Triton
3.7 (3.6 is what torch 2.11 brings) it counts by warp ballots: every element
pays for every bin a thread owns, bins / 32 of them. Four rows of 256 bins
cost 152 sm_90 SASS instructions per element of an interior chunk; one row,
67. From Triton 3.8 it is a shared-memory atomic per element, and the count
falls from 25.5 to 19. bf16 keys under 3.6: 8-bit digits (two passes) cost
about what 4- to 7-bit digits do in their three or four passes, so the digits
stay 8 bits (``benchmarks/RESULTS.md``).

Every pass reads each row once, so the threshold costs 2 reads of bf16 logits.
The launchers call ``threshold``, which takes these kernels on CUDA (not yet
timed on a GPU: benchmarks/bench_kernels.py ``test_topk_threshold``).
The shift and all sizes are run-time arguments (``do_not_specialize``): each
kernel compiles once per dtype.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import reference
from .utils import row_stride
from .vocab import aligned_rows, is_interior, row_window, split_config, window_masks

BINS = tl.constexpr(256)
DIGIT_BITS = tl.constexpr(8)
RADIX_CHUNK = 4096  # columns per histogram program
SELECT_ROWS = 16
KEY_BITS = {torch.bfloat16: 16, torch.float16: 24, torch.float32: 32}  # top key bits that can differ


@triton.jit
def order_key32(b_x):
    """fp32 -> uint32 keys with the floats' order (-inf lowest, NaN above +inf): positive floats get the
    sign bit set, negative ones every bit flipped."""
    b_i = b_x.to(tl.int32, bitcast=True)
    return (b_i ^ ((b_i >> 31) | -2147483648)).to(tl.uint32, bitcast=True)


@triton.jit
def key_value(key):
    """Inverse of ``order_key32`` for int64 keys in [0, 2^32) -> fp32."""
    b_i = (key - 2147483648).to(tl.int32)
    b_i = b_i ^ ((b_i >> 31) & 0x7FFFFFFF)
    return b_i.to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["s_x", "N", "V", "shift"])
def _radix_hist_kernel(
    X, PREFIX, HIST, s_x, N, V, shift,
    BLOCK_V: tl.constexpr, STRIDE_UNIT: tl.constexpr, ALIGN: tl.constexpr,
):
    """Add the histogram of key digit ``(key >> shift) & 255`` of chunk c of row n, over the keys whose
    bits above ``shift + 8`` equal the row's prefix, into the row's (256,) counts."""
    o_n64 = tl.program_id(0).to(tl.int64) + tl.arange(0, 1)  # (1,) this row
    c = tl.program_id(1)
    m_n = o_n64 < N
    o_base, r_shift, end = row_window(o_n64, s_x * STRIDE_UNIT, V, ALIGN)  # (1,) each
    o_b = c * BLOCK_V + tl.arange(0, BLOCK_V)[None, :]  # (1, BLOCK_V) window offsets
    prefix = tl.load(PREFIX + o_n64).to(tl.uint32)[:, None]  # (1, 1) resolved key bits (int64 in [0, 2^32))
    high = ~((tl.full((), 2, tl.uint32) << (shift + DIGIT_BITS - 1)) - 1)  # the bits above the digit (0 at first)
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
def _radix_select_kernel(PREFIX, KREM, HIST, OUT, N, shift, BLOCK_N: tl.constexpr):
    """Each row's next digit: the largest d whose count of digits >= d reaches the remaining rank."""
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
    # bits below ``shift`` are not resolved yet; in the input dtype's keys they are 0 for positive values
    # and 1 for negative ones (the sign flip), so the value is exact after the dtype's last pass
    low = tl.where(prefix < 2147483648, (tl.full([BLOCK_N], 1, tl.int64) << shift) - 1, 0)
    tl.store(OUT + o_n64, key_value(prefix | low), mask=m_n)


def kth_largest(logits: torch.Tensor, top_k: int, block_v: Optional[int] = None) -> torch.Tensor:
    """(N,) float32 k-th largest value of each row of (N, V) float32/float16/bfloat16 ``logits``, 1 <= top_k
    <= V (no checks: ``threshold`` is the launchers' entry). Equals ``logits.topk(top_k).values[:, -1]``
    exactly (``reference.kth_largest``); ``block_v`` (a power of two) overrides the vocabulary chunk."""
    N, V = logits.shape
    out = torch.empty(N, dtype=torch.float32, device=logits.device)
    if N == 0:
        return out
    cfg = split_config(V, logits.dtype, block_v or min(RADIX_CHUNK, triton.next_power_of_2(V)))
    logits = aligned_rows(logits, cfg.unit)
    s_x = row_stride(logits) // cfg.unit
    prefix = torch.zeros(N, dtype=torch.int64, device=logits.device)
    krem = torch.full((N,), top_k, dtype=torch.int32, device=logits.device)
    hist = torch.zeros(N, BINS.value, dtype=torch.int32, device=logits.device)
    warps = max(1, min(8, cfg.block_v // 512))  # 16 elements per thread
    for shift in range(32 - DIGIT_BITS.value, 31 - KEY_BITS[logits.dtype], -DIGIT_BITS.value):
        _radix_hist_kernel[(N, cfg.nc)](
            logits, prefix, hist, s_x, N, V, shift,
            BLOCK_V=cfg.block_v, STRIDE_UNIT=cfg.unit, ALIGN=cfg.align, num_warps=warps,
        )
        _radix_select_kernel[(triton.cdiv(N, SELECT_ROWS),)](prefix, krem, hist, out, N, shift,
                                                              BLOCK_N=SELECT_ROWS, num_warps=4)
    return out


def threshold(logits: torch.Tensor, top_k: Optional[int], block_v: Optional[int] = None) -> Optional[torch.Tensor]:
    """The vocabulary launchers' (N,) float32 top-k threshold (None when top-k keeps the whole row): radix
    select on CUDA; ``torch.topk`` in the CPU interpreter, where interpreting the radix passes over
    thousands of rows costs minutes (the radix kernels are tested there on their own)."""
    if top_k is None or top_k >= logits.shape[-1]:
        return None
    if logits.is_cuda:
        return kth_largest(logits, top_k, block_v)
    return reference.kth_largest(logits, top_k).float().contiguous()
