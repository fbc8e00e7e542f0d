"""The residual sample's second split-V pass: the chunk masses of max(0, q - p) and of q.

The residual law of speculative sampling is ``max(0, q - p)`` normalised, with q
and p the processed softmaxes of two rows of logits. Its masses need both rows'
log-sum-exps, which ``vocab.chunk_stats`` (the first pass, q's and p's rows in
one launch) gives as (N, NC) chunk partials.

* ``_residual_mass_kernel``: per (row, chunk) the masses of ``max(0, q - p)``
  and of q (normalised by the row log-sum-exps, recombined in every program from
  the (N, NC) partials, ``residual_lse``, and written once per row for the
  sampling kernel, which so sees the same q and p: ``residual_probs``). It
  streams the tiles as the chunk statistics do (``vocab.stream_grid``), q's and
  p's together.

``residual_rows`` holds the opt-in layout that runs both passes over each row in
one program, for many rows. Sizes, counts and strides are not specialised.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .utils import exp_ftz, gdc_enter, jit, pdl_meta
from .vocab import SplitConfig, chunk_load, row_masses, stream_grid, stream_load, stream_tile, stream_values


@jit(do_not_specialize=["s_x", "N", "NC", "n_rb", "n_tiles"],
     do_not_specialize_on_alignment=["KQ", "KP", "MP", "SP"])  # MP, SP: views at row N of the partials
def _residual_mass_kernel(
    QL, PL, KQ, KP, MQ, SQ, MP, SP, RM, QM, LSE, s_x, N, V, NC, n_rb, n_tiles, temperature,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, NC_PAD: tl.constexpr, HAS_TOPK: tl.constexpr,
    STRIDE_UNIT: tl.constexpr, ALIGN: tl.constexpr, USE_GDC: tl.constexpr,
):
    """(N, NC) chunk masses of max(0, q - p) (RM) and of q (QM), q and p the processed softmaxes (q and p
    rows share the row stride s_x), and the (N, 2) log-sum-exps of q and p (LSE) that normalised them, for the
    sampling kernel. Streams the tiles as ``_chunk_stats_kernel`` does, q's and p's together."""
    gdc_enter(USE_GDC)
    s_x = s_x * STRIDE_UNIT
    t = tl.program_id(0)
    step = tl.num_programs(0)
    b_rq = stream_load(QL, t, n_rb, N, NC, s_x, V, BLOCK_N, BLOCK_V, ALIGN, BLOCK_V)
    b_rp = stream_load(PL, t, n_rb, N, NC, s_x, V, BLOCK_N, BLOCK_V, ALIGN, BLOCK_V)
    # not ``for _``: the body unpacks into ``_``, which Triton 3.4 and 3.5 take for the loop variable, retyped
    for _tile in range(t, n_tiles, step):
        b_nq = stream_load(QL, t + step, n_rb, N, NC, s_x, V, BLOCK_N, BLOCK_V, ALIGN, BLOCK_V)
        b_np = stream_load(PL, t + step, n_rb, N, NC, s_x, V, BLOCK_N, BLOCK_V, ALIGN, BLOCK_V)
        o_n64, m_n, c, o_b, _, shift, _, interior, _ = stream_tile(t, n_rb, N, NC, s_x, V, BLOCK_N, BLOCK_V, ALIGN,
                                                                   BLOCK_V)
        lse_q, lse_p = residual_lse(MQ, SQ, MP, SP, o_n64, m_n, NC, NC_PAD)
        kq = tl.zeros([BLOCK_N, 1], tl.float32)
        kp = tl.zeros([BLOCK_N, 1], tl.float32)
        if HAS_TOPK:
            kq = tl.load(KQ + o_n64, mask=m_n, other=0.0).to(tl.float32)[:, None]
            kp = tl.load(KP + o_n64, mask=m_n, other=0.0).to(tl.float32)[:, None]
        b_q = exp_ftz(stream_values(b_rq, o_b, shift, V, interior, kq, temperature, HAS_TOPK) - lse_q[:, None])
        b_p = exp_ftz(stream_values(b_rp, o_b, shift, V, interior, kp, temperature, HAS_TOPK) - lse_p[:, None])
        o_p = o_n64 * NC + c
        tl.store(RM + o_p, tl.sum(tl.maximum(b_q - b_p, 0.0), 1), mask=m_n)
        tl.store(QM + o_p, tl.sum(b_q, 1), mask=m_n)
        m_first = o_n64 < tl.where(c == 0, N, 0)  # each row's log-sum-exps once, from its chunk 0
        tl.store(LSE + 2 * o_n64, lse_q, mask=m_first)
        tl.store(LSE + 2 * o_n64 + 1, lse_p, mask=m_first)
        b_rq = b_nq
        b_rp = b_np
        t += step


@triton.jit
def residual_lse(MQ, SQ, MP, SP, o_n64, m_n, NC, NC_PAD: tl.constexpr):
    """(BLOCK_N,) log-sum-exps of the processed q and p rows from their chunk partials."""
    q_m, _, q_t = row_masses(MQ, SQ, o_n64, m_n, NC, NC_PAD)
    p_m, _, p_t = row_masses(MP, SP, o_n64, m_n, NC, NC_PAD)
    return q_m + tl.log(q_t), p_m + tl.log(p_t)


@triton.jit
def residual_probs(QL, PL, o_base, o_b, shift, end, m_n, V, interior, kq, kp, lse_q, lse_p, temperature,
                   HAS_TOPK: tl.constexpr):
    """(BLOCK_N, BLOCK_V) processed probabilities q and p at window offsets o_b (0 where masked): given the mass
    kernel's log-sum-exps, bit-identical on the rows' lanes to its q and p (``stream_values``, same ops)."""
    b_q = exp_ftz(chunk_load(QL + o_base[:, None], o_b, shift, end, m_n, V, interior, kq, temperature, HAS_TOPK)
                  - lse_q[:, None])
    b_p = exp_ftz(chunk_load(PL + o_base[:, None], o_b, shift, end, m_n, V, interior, kp, temperature, HAS_TOPK)
                  - lse_p[:, None])
    return b_q, b_p


def residual_masses(q_logits, p_logits, kq, kp, mq, sq, mp, sp, temperature, cfg: SplitConfig, stride_units: int):
    """Launch ``_residual_mass_kernel`` on (N, V) q and p rows (N > 0, one row stride) with their chunk_stats
    partials: (N, NC) float32 chunk masses of max(0, q - p) and of q, and (N, 2) log-sum-exps of q and p.
    Half the rows of ``cfg`` per tile: two tiles and their prefetched successors must fit in registers."""
    N, V = q_logits.shape
    rm, qm = torch.empty_like(mq), torch.empty_like(mq)
    lse = torch.empty(N, 2, dtype=torch.float32, device=mq.device)
    block_n = max(1, cfg.block_n // 2)
    n_rb = triton.cdiv(N, block_n)
    args = (q_logits, p_logits, kq if kq is not None else mq, kp if kp is not None else mq, mq, sq, mp, sp, rm, qm,
            lse, stride_units, N, V, cfg.nc, n_rb, n_rb * cfg.nc, float(temperature))
    meta = dict(BLOCK_N=block_n, BLOCK_V=cfg.block_v, NC_PAD=cfg.nc_pad, HAS_TOPK=kq is not None,
                STRIDE_UNIT=cfg.unit, ALIGN=cfg.align, num_warps=cfg.stream_warps, **pdl_meta(q_logits.device))
    grid = stream_grid(_residual_mass_kernel, n_rb * cfg.nc, args, meta, q_logits.device)
    _residual_mass_kernel[grid](*args, **meta)
    return rm, qm, lse
