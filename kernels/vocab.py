"""Split-V pieces shared by the vocabulary sampling kernels (sampling and residual sampling).

Why split-V. A row of GPT-2 logits is 50257 values (100 KB in bf16). One program
per row (the previous design) gives N programs that each walk a long serial
loop: with few rows the GPU is mostly idle, and even with 1024 rows each SM has
few loads in flight. Here the vocabulary is cut into chunks of ``BLOCK_V``
columns and every (BLOCK_N, BLOCK_V) tile of the (row blocks x chunks) stream
is read exactly once, by one wide, fully coalesced load (8192 elements, 16-byte
vectors). Each tile writes a few fp32/int32 per (row, chunk) (``NC =
cdiv(V, BLOCK_V)`` chunks per row, 25 for GPT-2): a few hundred bytes per row
against the 100 KB read.

Persistent streaming (``stream_grid``). One program per tile (``PERSISTENT``
False) loads its tile, waits, reduces it and exits, so an SM's loads drain at
every tile: the likely reason the H200 measured these kernels at a third to a
half of copy bandwidth (``bench_kernels.py`` times both layouts). Instead one
wave of programs, as many as the SMs hold
(``utils.resident_programs``), strides over the tiles, and each issues the
loads of its next tile before it reduces the current one (a register
prefetch: ``stream_load`` returns the raw tile, ``stream_values`` converts and
masks it), so every SM keeps about a tile per program in flight. With
``STREAM_STAGES`` > 1 (opt-in until a GPU measures it) the chunk statistics'
and the top-k chunk maxima's loops are ``tl.range(num_stages=STREAM_STAGES)``
over one load with a single mask, which Triton pipelines through shared memory
(``cp.async``): ``STREAM_STAGES - 1`` tiles in flight per program, and fewer
registers (bf16 chunk statistics on sm_90: 117 instead of 167). The values,
and so the partials, are bit-identical to one program per tile either way
(tests/test_kernels_vocab.py).

* :func:`chunk_stats` (``_chunk_stats_kernel``): per (row, chunk) the max of the
  processed logits (temperature, top-k threshold) and the sum of ``exp(x - max)``.
  A pair of tensors of one row stride (the residual's q and p) takes one launch:
  their row blocks follow each other in the stream, each tile reads one tensor.
  ``row_masses`` combines them into the row max, the row total
  ``sum exp(x - row max)`` and each chunk's share of it
  (``s_c * exp(m_c - row max)``), exactly like an online log-sum-exp.
* the residual sampler's second pass over the same tiles, in ``residual``.

Only a row's first and last chunks need column masks (its aligned window starts
up to ALIGN - 1 columns early and ends past V): every other chunk
(``is_interior``, a test on the program's chunk index alone, so the branch is
uniform) loads with the row mask only, and its per-element work is the
conversion, the max and the exponential. Without the branch the masks cost
about as many integer operations per element as the arithmetic, and on the
H200 these kernels were bound by per-element work, not by loads (fp32 rows,
twice the bytes, took 1.36x the time of bf16 ones).

Tiles are functions of V (and of an explicit ``block_v``) only, never of the
row count; sizes, counts and strides are not specialised (see utils).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .utils import exp_ftz, gdc_enter, jit, num_sms, pdl_meta, resident_programs, rows_ready

CHUNK = 2048  # default BLOCK_V: 4 KB (bf16) to 8 KB (fp32) per row per program
TILE = 8192  # elements per (BLOCK_N, BLOCK_V) tile, and per (BLOCK_N, NC_PAD) tile of partials
MAX_ROWS = 256
PERSISTENT = True  # streaming kernels: one wave of looping programs (False: one program per tile)
STREAM_WARPS = 4  # warps of the kernels that stream every chunk (see split_config)
STREAM_STAGES = 1  # > 1: the streaming loops' loads pipelined by Triton, STREAM_STAGES - 1 tiles in flight
MIN_NC_PAD = 8  # Triton 3.6 fails to lower the token search's cumsum over a (BLOCK_N, 2 or 4) tile with 8 warps


class SplitConfig(tuple):
    """(BLOCK_V, BLOCK_N, NC, NC_PAD, num_warps, STRIDE_UNIT, ALIGN, stream_warps) of the split-V kernels:
    ``stream_warps`` for the kernels that stream every chunk (``chunk_stats``, the residual masses),
    ``num_warps`` for the others."""

    __slots__ = ()
    block_v = property(lambda s: s[0])
    block_n = property(lambda s: s[1])
    nc = property(lambda s: s[2])
    nc_pad = property(lambda s: s[3])
    num_warps = property(lambda s: s[4])
    unit = property(lambda s: s[5])
    align = property(lambda s: s[6])
    stream_warps = property(lambda s: s[7])


def split_config(V: int, dtype: torch.dtype, block_v: Optional[int] = None) -> SplitConfig:
    """The tiling of a vocabulary of V ``dtype`` logits (``block_v``, a power of two, overrides the
    chunk): a function of V, the dtype and ``block_v`` only, never of the row count. The chunks are
    aligned windows (see ``row_window``), so a row spans up to ALIGN - 1 more columns.

    Warps (sm_90 SASS, ``benchmarks/compile_sm90.py``): the streaming kernels take 4, so that each thread
    holds 64 elements of the 8192-element tile and the row reductions' shuffles are shared by twice as many
    (bf16 chunk statistics 14.8 -> 10.6 instructions per element, residual masses 34.0 -> 20.5); the
    per-row kernels (token search, radix histogram) keep 8, which they need to stay clear of spills.

    The chunk partials are padded to at least ``MIN_NC_PAD`` columns (masked): with 2 or 4, Triton 3.6 fails
    to compile the token search for sm_90 (an assertion in its scan lowering, ``ScanOpToLLVM.cpp``) at
    vocabularies of about 257 to 4097, where a row has 1 to 4 chunks (Triton 3.9 compiles them)."""
    align = 16 // torch.empty((), dtype=dtype).element_size()  # elements per 16 bytes
    block_v = block_v or min(triton.next_power_of_2(V), CHUNK)
    nc = triton.cdiv(V + align - 1, block_v)
    nc_pad = max(MIN_NC_PAD, triton.next_power_of_2(nc))
    block_n = max(1, min(TILE // block_v, TILE // nc_pad, MAX_ROWS))
    num_warps = 4 if block_n * block_v <= 2048 else 8
    return SplitConfig((block_v, block_n, nc, nc_pad, num_warps, 16 if V % 16 == 0 else 1, align, STREAM_WARPS))


@triton.jit
def row_window(o_n64, s_x, V, ALIGN: tl.constexpr):
    """Aligned windows: (BLOCK_N,) element offset of each row's window, a multiple of ALIGN (16 bytes),
    (BLOCK_N,) int32 shift of the row start into it, and (BLOCK_N,) window end, ``shift + V`` rounded up
    to ALIGN. Column ``j`` of a row is at window offset ``j + shift``; chunk c is window offsets
    [c * BLOCK_V, (c + 1) * BLOCK_V). The launchers pass 16-byte aligned base pointers, so every chunk
    load is a run of aligned 16-byte vectors, even for an odd row stride (V = 50257): the load mask
    (``window_load``) is uniform over each vector, and the few extra values it reads, in the same
    16-byte blocks as the row's first and last elements (so inside the allocation), are masked after."""
    o_row = o_n64 * s_x
    shift = (o_row % ALIGN).to(tl.int32)
    end = tl.multiple_of((shift + V + (ALIGN - 1)) // ALIGN * ALIGN, ALIGN)
    return tl.multiple_of(o_row - shift, ALIGN), shift, end


@triton.jit
def window_masks(o_b, shift, end, m_n, V):
    """Window offsets o_b (1, BLOCK_V) of the rows of ``row_window`` -> (BLOCK_N, BLOCK_V) columns o_v, the
    vector-granular load mask m_w (inside the row's aligned window) and the column mask m_v (inside the row)."""
    o_v = o_b - shift[:, None]
    m_w = m_n[:, None] & (o_b < end[:, None])
    return o_v, m_w, m_w & (o_v >= 0) & (o_v < V)


@triton.jit
def processed(b_x, kth, temperature, HAS_TOPK: tl.constexpr):
    """fp32 logits -> -inf below the top-k threshold ``kth``, over the temperature."""
    if HAS_TOPK:
        b_x = tl.where(b_x < kth, float("-inf"), b_x)
    if temperature != 1.0:  # a uniform branch: x / 1 is x, and the IEEE division costs more than the load
        b_x = tl.math.div_rn(b_x, temperature)  # as torch's logits / temperature
    return b_x


@triton.jit
def window_load(ptr, o_b, m_w, m_v, kth, temperature, HAS_TOPK: tl.constexpr):
    """Logits at window offsets o_b as fp32 (vector-granular load mask m_w, column mask m_v after), -inf
    where masked or below the top-k threshold, over the temperature."""
    b_x = tl.load(ptr + o_b, mask=m_w, other=float("-inf")).to(tl.float32)
    return processed(tl.where(m_v, b_x, float("-inf")), kth, temperature, HAS_TOPK)


@triton.jit
def is_interior(c, V, BLOCK_V: tl.constexpr, ALIGN: tl.constexpr):
    """Whether window chunk c lies inside the columns of every row, whatever its shift (< ALIGN): column
    ``j = o_b - shift`` of its offsets o_b in [c * BLOCK_V, (c + 1) * BLOCK_V) is then in [0, V)."""
    return (c * BLOCK_V >= ALIGN) & ((c + 1) * BLOCK_V <= V)


@triton.jit
def chunk_load(ptr, o_b, shift, end, m_n, V, interior, kth, temperature, HAS_TOPK: tl.constexpr):
    """``window_load`` of one chunk (o_b: (1, BLOCK_V) window offsets) of the rows at ``ptr`` (BLOCK_N, 1).
    ``interior`` (``is_interior``, uniform over the program) skips the column masks: all but the first and
    last chunks of a long row (23 of GPT-2's 25), whose per-element work is then the exponential alone."""
    if interior:
        b_x = tl.load(ptr + o_b, mask=m_n[:, None], other=float("-inf")).to(tl.float32)
        b_x = processed(b_x, kth, temperature, HAS_TOPK)
    else:
        _, m_w, m_v = window_masks(o_b, shift, end, m_n, V)
        b_x = window_load(ptr, o_b, m_w, m_v, kth, temperature, HAS_TOPK)
    return b_x


def aligned_rows(t: torch.Tensor, unit: int) -> torch.Tensor:
    """``utils.rows_ready`` rows whose data pointer is also 16-byte aligned (a copy for the rare offset view
    that is not), as the aligned windows need."""
    t = rows_ready(t, unit)
    if t.data_ptr() % 16:
        t = t.clone(memory_format=torch.contiguous_format)
    return t


@triton.jit
def stream_tile(t, n_rb, N, NC, s_x, V, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, ALIGN: tl.constexpr,
                CHUNK: tl.constexpr, n_rb_x=None, N_X=None):
    """Tile t of a (row blocks x window tiles of BLOCK_V columns) stream, row blocks fastest: (BLOCK_N,) int64
    rows, their mask (all False past the last tile), the tile c, its window offsets as (BLOCK_V // CHUNK, CHUNK)
    (one row of BLOCK_V when CHUNK == BLOCK_V; smaller chunks with BLOCK_N == 1 only), the rows'
    ``row_window``, ``is_interior(c)`` and whether the tile reads the second tensor of a pair (see
    ``stream_load``). A pair's rows: the first ``n_rb_x`` row blocks hold the first tensor's N_X rows, the
    others the second's N - N_X rows, which are rows N_X.. of the stream (``o_n64``)."""
    c = t // n_rb
    i_rb = t - c * n_rb
    second = False
    o_n = i_rb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_rows = N
    if n_rb_x is not None:
        second = i_rb >= n_rb_x
        o_n = o_n - tl.where(second, n_rb_x * BLOCK_N, 0)
        n_rows = tl.where(second, N - N_X, N_X)
    o_n64 = o_n.to(tl.int64)
    o_base, shift, end = row_window(o_n64, s_x, V, ALIGN)
    o_b = c * BLOCK_V + tl.arange(0, BLOCK_V // CHUNK)[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
    m_n = o_n < tl.where(c < NC, n_rows, 0)
    if n_rb_x is not None:
        o_n64 = o_n64 + tl.where(second, N_X, 0)
    return o_n64, m_n, c, o_b, o_base, shift, end, is_interior(c, V, BLOCK_V, ALIGN), second


@triton.jit
def stream_load(ptr, t, n_rb, N, NC, s_x, V, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, ALIGN: tl.constexpr,
                CHUNK: tl.constexpr, ptr_y=None, n_rb_x=None, N_X=None, ONE_MASK: tl.constexpr = False):
    """The raw logits of ``stream_tile`` t of the rows at ``ptr`` (a pair's: its rows at ``ptr``, then those
    at ``ptr_y``, of the same row stride), unconverted. Lanes of masked rows, and of an edge tile outside the
    rows' windows, are undefined: ``in_rows`` masks the columns and the kernels store masked rows' results
    nowhere. ``ONE_MASK``: every tile with the edge tiles' mask (one load instead of a branch between two)."""
    _, m_n, _, o_b, o_base, _, end, interior, second = stream_tile(t, n_rb, N, NC, s_x, V, BLOCK_N, BLOCK_V, ALIGN,
                                                                   CHUNK, n_rb_x, N_X)
    if ptr_y is not None:
        ptr = tl.where(second, ptr_y, ptr)  # uniform over the tile: its loads stay 16-byte vectors
    p_x = ptr + o_base[:, None] + o_b
    if ONE_MASK:  # one load, no branch: what Triton's loop pipelining takes
        b_raw = tl.load(p_x, mask=m_n[:, None] & (o_b < end[:, None]))
    elif interior:
        b_raw = tl.load(p_x, mask=tl.broadcast_to(m_n[:, None], p_x.shape))
    else:
        b_raw = tl.load(p_x, mask=m_n[:, None] & (o_b < end[:, None]))
    return b_raw


@triton.jit
def in_rows(o_b, shift, V):
    """Whether window offsets o_b are columns of the rows (of the shifts ``shift``) of a stream tile."""
    o_v = o_b - shift[:, None]
    return (o_v >= 0) & (o_v < V)


@triton.jit
def stream_values(b_raw, o_b, shift, V, interior, kth, temperature, HAS_TOPK: tl.constexpr):
    """``stream_load``'s raw tile -> processed fp32 logits, -inf outside the rows: on the rows' lanes the same
    values as ``chunk_load`` (the same conversion, masks and ``processed``)."""
    b_x = b_raw.to(tl.float32)
    if not interior:
        b_x = tl.where(in_rows(o_b, shift, V), b_x, float("-inf"))
    return processed(b_x, kth, temperature, HAS_TOPK)


@triton.jit
def chunk_partials(b_x):
    """(rows, columns) processed logits -> per row their max and sum of exp(x - max) (0 for a row of -inf)."""
    b_m = tl.max(b_x, 1)
    m_use = tl.where(b_m == float("-inf"), 0.0, b_m)
    return b_m, tl.sum(exp_ftz(b_x - m_use[:, None]), 1)


@triton.jit
def _chunk_stats_tile(b_raw, t, KX, KY, M, S, s_x, N, N_X, V, NC, n_rb, n_rb_x, temperature,
                      BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, HAS_TOPK: tl.constexpr, ALIGN: tl.constexpr):
    """One tile of ``_chunk_stats_kernel`` from its raw logits: the rows' chunk max and sum of exponentials."""
    o_n64, m_n, c, o_b, _, shift, _, interior, second = stream_tile(t, n_rb, N, NC, s_x, V, BLOCK_N, BLOCK_V,
                                                                    ALIGN, BLOCK_V, n_rb_x, N_X)
    kth = tl.zeros([BLOCK_N, 1], tl.float32)
    if HAS_TOPK:
        p_k = tl.where(second, KY - N_X, KX) + o_n64
        kth = tl.load(p_k, mask=m_n, other=0.0).to(tl.float32)[:, None]
    b_m, b_s = chunk_partials(stream_values(b_raw, o_b, shift, V, interior, kth, temperature, HAS_TOPK))
    o_p = o_n64 * NC + c
    tl.store(M + o_p, b_m, mask=m_n)
    tl.store(S + o_p, b_s, mask=m_n)


@jit(do_not_specialize=["s_x", "N", "N_X", "NC", "n_rb", "n_rb_x", "n_tiles"],
     do_not_specialize_on_alignment=["KX", "KY"])
def _chunk_stats_kernel(
    X, Y, KX, KY, M, S, s_x, N, N_X, V, NC, n_rb, n_rb_x, n_tiles, temperature,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, HAS_TOPK: tl.constexpr, STRIDE_UNIT: tl.constexpr,
    ALIGN: tl.constexpr, STAGES: tl.constexpr, USE_GDC: tl.constexpr,
):
    """(N, NC) chunk max M and sum of exp(x - M) S of the processed logits: the N_X rows of X (top-k
    thresholds KX), in its first n_rb_x row blocks, then the N - N_X rows of Y (KY). Each program strides over
    the (row block, chunk) tiles: with ``STAGES`` > 1 Triton pipelines the loads (``STAGES - 1`` tiles in
    flight through shared memory), else it loads tile i + 1 into registers before it reduces tile i (see
    ``stream_grid``)."""
    gdc_enter(USE_GDC)
    s_x = s_x * STRIDE_UNIT  # see utils for STRIDE_UNIT
    if STAGES > 1:
        for t in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), num_stages=STAGES):
            b_raw = stream_load(X, t, n_rb, N, NC, s_x, V, BLOCK_N, BLOCK_V, ALIGN, BLOCK_V, Y, n_rb_x, N_X, True)
            _chunk_stats_tile(b_raw, t, KX, KY, M, S, s_x, N, N_X, V, NC, n_rb, n_rb_x, temperature,
                              BLOCK_N, BLOCK_V, HAS_TOPK, ALIGN)
    else:
        t = tl.program_id(0)
        step = tl.num_programs(0)
        b_raw = stream_load(X, t, n_rb, N, NC, s_x, V, BLOCK_N, BLOCK_V, ALIGN, BLOCK_V, Y, n_rb_x, N_X)
        for _ in range(t, n_tiles, step):
            b_next = stream_load(X, t + step, n_rb, N, NC, s_x, V, BLOCK_N, BLOCK_V, ALIGN, BLOCK_V, Y, n_rb_x, N_X)
            _chunk_stats_tile(b_raw, t, KX, KY, M, S, s_x, N, N_X, V, NC, n_rb, n_rb_x, temperature,
                              BLOCK_N, BLOCK_V, HAS_TOPK, ALIGN)
            b_raw = b_next
            t += step


@triton.jit
def row_masses(M, S, o_n64, m_n, NC, NC_PAD: tl.constexpr):
    """Combine a row block's (BLOCK_N, NC) chunk partials: (BLOCK_N,) row max (0 where the row has no
    finite logit, or is padding), (BLOCK_N, NC_PAD) chunk masses sum_chunk exp(x - row max) (0 past NC)
    and (BLOCK_N,) row total (1 for padding rows)."""
    o_c = tl.arange(0, NC_PAD)[None, :]
    m_c = m_n[:, None] & (o_c < NC)
    o_p = o_n64[:, None] * NC + o_c  # (BLOCK_N, NC_PAD)
    b_m = tl.load(M + o_p, mask=m_c, other=float("-inf"))
    b_s = tl.load(S + o_p, mask=m_c, other=0.0)
    r_m = tl.max(b_m, 1)
    r_m = tl.where(r_m == float("-inf"), 0.0, r_m)
    b_w = b_s * exp_ftz(b_m - r_m[:, None])  # (BLOCK_N, NC_PAD)
    r_t = tl.where(m_n, tl.sum(b_w, 1), 1.0)
    return r_m, b_w, r_t


def stream_grid(kernel, n_tiles: int, args: tuple, meta: dict, device: torch.device) -> tuple:
    """Grid of a streaming kernel over n_tiles tiles: one wave of as many programs as the SMs hold
    (``utils.resident_programs``), each looping over its share of the tiles, or one program per tile when
    ``PERSISTENT`` is False. A persistent program that finishes a tile has its next tile's loads in flight, so
    the SMs keep loads queued between tiles instead of draining and relaunching."""
    if not PERSISTENT:
        return (max(1, n_tiles),)
    return (max(1, min(n_tiles, resident_programs(kernel, args, meta, device) * num_sms(device))),)


def chunk_stats(logits, kth, temperature, cfg: SplitConfig, stride_units: int, more=None, more_kth=None):
    """Launch ``_chunk_stats_kernel`` on (N, V) rows (N > 0): (N, NC) float32 chunk max and sum of exp. With
    ``more``, (N', V) rows of the same row stride (and their top-k thresholds ``more_kth`` when ``kth`` is
    given), one launch covers both: (N + N', NC) partials, ``more``'s rows after those of ``logits``."""
    N_X, V = logits.shape
    N = N_X + (0 if more is None else more.shape[0])
    m = torch.empty(N, cfg.nc, dtype=torch.float32, device=logits.device)
    s = torch.empty_like(m)
    n_rb_x = triton.cdiv(N_X, cfg.block_n)
    n_rb = n_rb_x + triton.cdiv(N - N_X, cfg.block_n)
    k_x = kth if kth is not None else m
    args = (logits, logits if more is None else more, k_x, k_x if more_kth is None else more_kth, m, s,
            stride_units, N, N_X, V, cfg.nc, n_rb, n_rb_x, n_rb * cfg.nc, float(temperature))
    meta = dict(BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, HAS_TOPK=kth is not None, STRIDE_UNIT=cfg.unit,
                ALIGN=cfg.align, STAGES=STREAM_STAGES, num_warps=cfg.stream_warps, **pdl_meta(logits.device))
    _chunk_stats_kernel[stream_grid(_chunk_stats_kernel, n_rb * cfg.nc, args, meta, logits.device)](*args, **meta)
    return m, s
