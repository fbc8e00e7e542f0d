"""Triton accept/reject decisions: every order's accepted prefix and the best order in one kernel.

``reference.decide`` turns per-draft scores into decisions with about a dozen
small ops (the uniform's cast, the per-token test, the paper rule's forced
first token, the validity mask, a cumulative product, a sum, an argmax and a
copy), each a kernel launch on a GPU, once per burst iteration. Here the
ratio ``exp(log q - log p)`` is computed by PyTorch exactly as the reference
computes it, and ``_decide_kernel``, grid (B,), does the rest: it streams the
(O, R) tests of a row in (BLOCK_O, BLOCK_R) tiles, carrying each order's
accepted count and whether it is still accepting, then picks the first order
with the longest prefix. Everything after the ratio is comparisons and
integer logic, so the decisions are bit-identical to the reference's. Given a
flag, it also sets it at a NaN ratio of a step below the row's length (the
verifier's row is not finite: ``reference.flag_nan_ratios``), the burst step's
check of its verifier outputs without another read of them.

The kernel takes float32 ratios (the engine's scores are float32 at least);
other score dtypes go to the reference. Compiles at most twice (the greedy
flag picks integer or float loads): the tiles are fixed, and every size,
stride and the rule are run-time arguments in ``do_not_specialize``.
"""

from __future__ import annotations

import torch
import triton.language as tl

from . import reference
from .reference import Acceptance
from .utils import gdc_enter, jit, pdl_meta

BLOCK_O = 16
BLOCK_R = 128

_STRIDES = ["s_sb", "s_so", "s_db", "s_do", "s_ub", "s_uo"]


@jit(do_not_specialize=_STRIDES + ["O", "R", "paper", "check"],
     do_not_specialize_on_alignment=["SCORE", "DRAFT", "U", "LENS", "ACCEPT", "N_ACC", "FIRST", "BEST",
                                     "N_BEST", "FLAG"])
def _decide_kernel(
    SCORE, DRAFT, U, LENS, ACCEPT, N_ACC, FIRST, BEST, N_BEST, FLAG,
    s_sb, s_so, s_db, s_do, s_ub, s_uo, O, R, paper, check,
    GREEDY: tl.constexpr, TILE_O: tl.constexpr, TILE_R: tl.constexpr, USE_GDC: tl.constexpr,
):
    gdc_enter(USE_GDC)
    i_b = tl.program_id(0).to(tl.int64)
    length = tl.load(LENS + i_b).to(tl.int32)
    best_n = tl.full((), -1, tl.int32)
    best_o = tl.full((), 0, tl.int32)
    n_nan = tl.full((), 0, tl.int32)  # NaN ratios at valid steps (counted when ``check``)
    o_r0 = tl.arange(0, TILE_R)
    for o0 in range(0, O, TILE_O):
        o_o = o0 + tl.arange(0, TILE_O)
        m_o = o_o < O
        p_s = SCORE + i_b * s_sb + o_o.to(tl.int64)[:, None] * s_so
        p_d = DRAFT + i_b * s_db + o_o.to(tl.int64)[:, None] * s_do
        p_u = U + i_b * s_ub + o_o.to(tl.int64)[:, None] * s_uo
        p_a = ACCEPT + (i_b * O + o_o.to(tl.int64)[:, None]) * R
        n = tl.zeros((TILE_O,), tl.int32)
        alive = m_o
        for r0 in range(0, R, TILE_R):
            o_r = r0 + o_r0
            m = m_o[:, None] & (o_r < R)[None, :]
            if GREEDY:  # the verifier's argmax against the draft
                ok = tl.load(p_s + o_r[None, :], mask=m, other=0) == tl.load(p_d + o_r[None, :], mask=m, other=0)
            else:  # u < q/p, u rounded to float32 as the reference does
                b_u = tl.load(p_u + o_r[None, :], mask=m, other=1.0).to(tl.float32)
                b_t = tl.load(p_s + o_r[None, :], mask=m, other=0.0)
                ok = b_u < b_t
                n_nan += tl.sum(tl.sum(((b_t != b_t) & m & (o_r < length)[None, :]).to(tl.int32), 1), 0)
            ok = ok | ((o_r == 0) & (paper != 0))[None, :]  # the paper rule always accepts the first token
            tl.store(p_a + o_r[None, :], ok.to(tl.uint8), mask=m)
            good = ok & m & (o_r < length)[None, :]
            first_bad = tl.min(tl.where(good, TILE_R, o_r0[None, :]), 1)  # (TILE_O,) TILE_R when all good
            n += tl.where(alive, first_bad, 0)
            alive = alive & (first_bad == TILE_R)
        tl.store(N_ACC + i_b * O + o_o, n.to(tl.int64), mask=m_o)
        tl.store(FIRST + i_b * O + o_o, n.to(tl.int64), mask=m_o)
        n_m = tl.where(m_o, n, -1)
        top = tl.max(n_m, 0)
        arg = tl.min(tl.where(n_m == top, o_o, O), 0)  # the first order with the most
        better = top > best_n
        best_o = tl.where(better, arg, best_o)
        best_n = tl.where(better, top, best_n)
    tl.store(BEST + i_b, best_o.to(tl.int64))
    tl.store(N_BEST + i_b, best_n.to(tl.int64))
    tl.store(FLAG, tl.full((), 1, tl.uint8), mask=n_nan * check > 0)


def launch(scores, drafts, uniforms, lengths, greedy: bool, paper: bool, flag=None):
    """Launch the kernel (no checks): (accept (B, O, R) bool, n_accept, first_reject (B, O), best, n_best (B,));
    sets the () bool ``flag`` (not greedy) when a ratio at a step below its row's length is NaN."""
    B, O, R = drafts.shape
    dev = drafts.device
    accept = torch.empty((B, O, R), dtype=torch.bool, device=dev)
    n_accept = torch.empty((B, O), dtype=torch.int64, device=dev)
    first = torch.empty((B, O), dtype=torch.int64, device=dev)
    best = torch.empty((B,), dtype=torch.int64, device=dev)
    n_best = torch.empty((B,), dtype=torch.int64, device=dev)
    if B == 0:
        return accept, n_accept, first, best, n_best
    scores, drafts, uniforms = (t if t.stride(-1) == 1 else t.contiguous() for t in (scores, drafts, uniforms))
    lengths = lengths.contiguous()  # read at row b
    flag_u8 = (accept if flag is None else flag).view(torch.uint8)  # without a flag: never written (check 0)
    _decide_kernel[(B,)](
        scores, drafts, uniforms, lengths, accept.view(torch.uint8), n_accept, first, best, n_best, flag_u8,
        *scores.stride()[:2], *drafts.stride()[:2], *uniforms.stride()[:2], O, R, int(paper), int(flag is not None),
        GREEDY=greedy, TILE_O=BLOCK_O, TILE_R=BLOCK_R, num_warps=8, **pdl_meta(scores.device),
    )
    return accept, n_accept, first, best, n_best


def decide(scores, drafts, draft_logp, uniforms, lengths, temperature=1.0, rule="paper", flag=None,
           log_ratio=None) -> Acceptance:
    """``reference.decide`` with one kernel after the ratio: (B, O, R) scores (log q, or the verifier's
    argmax when ``temperature == 0``), drafts, draft log p and uniforms; (B,) lengths. With a () bool
    ``flag`` (temperature > 0), also ``reference.flag_nan_ratios``, in the kernel. ``log_ratio``: the
    (B, O, R) float32 ``log q - log p`` when the log q kernel wrote it (``accept.store_logq``), else None (it
    is computed here). Called by the Triton acceptance ops after their own input checks."""
    greedy = temperature == 0
    if (not greedy and scores.dtype != torch.float32) or drafts.numel() == 0:
        return reference.flagged(reference.decide(scores, drafts, draft_logp, uniforms, lengths, temperature, rule),
                                 draft_logp, lengths, flag)
    from . import ops  # noqa: F401  (registers torch.ops.sigmafast.*)

    if greedy:
        logq = torch.zeros(drafts.shape, dtype=draft_logp.dtype, device=drafts.device)
        test = scores
    else:
        logq = scores
        diff = logq - draft_logp.to(logq.dtype) if log_ratio is None else log_ratio
        test = torch.exp(diff)  # the reference's ratio, bit for bit
    accept, n_accept, first, best, n_best = torch.ops.sigmafast.decide(test, drafts, uniforms, lengths, greedy,
                                                                       rule == "paper", flag)
    return Acceptance(logq, accept, n_accept, best, first, n_best)
