"""Triton commit: append the chosen order's accepted inputs to the KV cache and the canvas in two kernels.

After a verification over O orders, row b keeps the first ``n[b]`` steps of
order ``choice[b]``. In plain PyTorch that is about 30 small ops (one gather
of the chosen keys and values per tensor, the cache destinations, two
scatters into the cache, the canvas and known-mask scatters, the new last
token and position); on a GPU each is a kernel launch, and a CUDA-graph replay
of an autoregressive GPT-2 step had about 90 such bookkeeping kernels beside
its 120 layer kernels (benchmarks/RESULTS.md). Here:

* ``_commit_kv_kernel``, grid (B·H, n_layer): copies the ``n[b]`` accepted
  key and value rows of order ``choice[b]`` straight from the verification's
  (n_layer, B, O, H, R, D) keys (any strides: views of the shared QKV
  projection buffer) to ``cache[lens[b]:lens[b] + n[b]]``, BLOCK_R rows at a
  time, looping only over the accepted rows;
* ``_commit_state_kernel``, grid (B,): writes the accepted tokens into the
  canvas at the chosen positions, marks them known, moves the last token and
  position to step ``n[b] - 1`` (unchanged when ``n[b] == 0``) and advances
  ``lens``. It runs second: the first kernel reads the old ``lens``. Under the
  lossless rule it also splices in the residual token at the first rejected
  step (``residual``, ``residual_step``), which would otherwise be a kernel of
  its own.

A burst iteration also asks for its status (``status``: the largest unknown
count of a row, the rows with one, the non-finite flag), which the sampling
loop reads; a separate kernel would be one launch more per iteration. The first
program of the KV copy zeroes the two counts; then each state program, after
its own writes to the known mask (a thread barrier makes them visible), counts
its row's unknown positions and folds them in with an atomic max and an atomic
add (integers: the order of the programs does not matter), and stores the flag.

Unlike the reference, the kernels write nothing for the steps past ``n[b]``
(the reference sends them to the cache's scratch slot, which nobody reads).
Compiles once per dtype and head dim: sizes and strides are in
``do_not_specialize``; ``STRIDE_UNIT`` (16 when every stride allows it) keeps
the head-dim rows' loads vectorised, as in :mod:`.attention`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference
from .step_checks import check_commit
from .utils import gdc_enter, in_units, jit, pdl_meta, strides

BLOCK_R = 16  # accepted rows per loop step of the KV copy
STATE_BLOCK = 64  # steps per loop step of the canvas writes
STATUS_BLOCK = 1024  # positions per pass of a row's unknown count


@triton.jit
def _wide(stride, UNIT: tl.constexpr):
    """A stride passed in units of ``UNIT`` elements, in elements as int64."""
    return stride.to(tl.int64) * UNIT


_KV_STRIDES = [f"s_{t}{d}" for t in "kv" for d in "lboh"] + ["s_kr", "s_vr"] + [f"s_c{d}" for d in "lbhs"]


@jit(do_not_specialize=_KV_STRIDES + ["H", "R", "max_len", "has_status"],
     do_not_specialize_on_alignment=["CHOICE", "N", "LENS", "STATUS"])
def _commit_kv_kernel(
    K, V, KC, VC, CHOICE, N, LENS, STATUS,
    s_kl, s_kb, s_ko, s_kh, s_vl, s_vb, s_vo, s_vh, s_kr, s_vr, s_cl, s_cb, s_ch, s_cs,
    H, R, max_len, has_status,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr, STRIDE_UNIT: tl.constexpr, USE_GDC: tl.constexpr,
):
    gdc_enter(USE_GDC)
    pid_bh = tl.program_id(0)
    i_l = tl.program_id(1).to(tl.int64)
    o_z = tl.arange(0, 2)  # the status counts, zeroed by the first program when there is a status
    tl.store(STATUS + o_z, tl.zeros([2], tl.int64),
             mask=o_z < tl.where((pid_bh == 0) & (i_l == 0), 2 * has_status, 0))
    i_b = (pid_bh // H).to(tl.int64)
    i_h = (pid_bh % H).to(tl.int64)
    i_o = tl.load(CHOICE + i_b).to(tl.int64)
    n = tl.minimum(tl.load(N + i_b).to(tl.int64), R)
    start = tl.load(LENS + i_b).to(tl.int64)

    # strides come in units of STRIDE_UNIT elements (see utils); the head-dim stride is 1. The layer and batch
    # strides are multiplied back in int64: one of 2^31 elements or more (the cache's layer stride B·H·(L + 1)·D
    # of a large batch) arrives as an int32 under 2^31 once divided by 16, and the int32 product would wrap
    s_kl, s_kb, s_vl, s_vb = _wide(s_kl, STRIDE_UNIT), _wide(s_kb, STRIDE_UNIT), _wide(s_vl, STRIDE_UNIT), \
        _wide(s_vb, STRIDE_UNIT)
    s_cl, s_cb = _wide(s_cl, STRIDE_UNIT), _wide(s_cb, STRIDE_UNIT)
    s_ko, s_kh, s_kr = s_ko * STRIDE_UNIT, s_kh * STRIDE_UNIT, s_kr * STRIDE_UNIT
    s_vo, s_vh, s_vr = s_vo * STRIDE_UNIT, s_vh * STRIDE_UNIT, s_vr * STRIDE_UNIT
    s_ch, s_cs = s_ch * STRIDE_UNIT, s_cs * STRIDE_UNIT

    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    p_k = K + i_l * s_kl + i_b * s_kb + i_o * s_ko + i_h * s_kh
    p_v = V + i_l * s_vl + i_b * s_vb + i_o * s_vo + i_h * s_vh
    c_off = i_l * s_cl + i_b * s_cb + i_h * s_ch + start * s_cs
    for r0 in range(0, n, BLOCK):
        o_r = r0 + tl.arange(0, BLOCK).to(tl.int64)
        m = ((o_r < n) & (start + o_r < max_len))[:, None] & m_d[None, :]
        b_k = tl.load(p_k + o_r[:, None] * s_kr + o_d[None, :], mask=m)
        b_v = tl.load(p_v + o_r[:, None] * s_vr + o_d[None, :], mask=m)
        o_c = c_off + o_r[:, None] * s_cs + o_d[None, :]
        tl.store(KC + o_c, b_k.to(KC.dtype.element_ty), mask=m)
        tl.store(VC + o_c, b_v.to(VC.dtype.element_ty), mask=m)


@jit(do_not_specialize=["s_ob", "s_oo", "s_tb", "s_to", "s_cb", "s_mb", "R", "T", "has_status",
                        "has_residual"],
     do_not_specialize_on_alignment=["ORDERS", "CHOICE", "N", "TOKENS", "LAST_TOK", "LAST_POS", "LENS",
                                     "FLAG", "STATUS", "RES", "RES_STEP"])
def _commit_state_kernel(
    ORDERS, CHOICE, N, TOKENS, CANVAS, KNOWN, LAST_TOK, LAST_POS, LENS, FLAG, STATUS, RES, RES_STEP,
    s_ob, s_oo, s_tb, s_to, s_cb, s_mb, R, T, has_status, has_residual,
    BLOCK: tl.constexpr, BLOCK_T: tl.constexpr, USE_GDC: tl.constexpr,
):
    gdc_enter(USE_GDC)
    i_b = tl.program_id(0).to(tl.int64)
    i_o = tl.load(CHOICE + i_b).to(tl.int64)
    n = tl.minimum(tl.load(N + i_b).to(tl.int64), R)
    i_r = i_b * has_residual  # row 0 of the stand-in pointers without a residual
    r_step = tl.where(has_residual != 0, tl.load(RES_STEP + i_r).to(tl.int64), -1)  # -1: no step holds it
    r_tok = tl.load(RES + i_r).to(tl.int64)
    p_o = ORDERS + i_b * s_ob + i_o * s_oo  # the chosen order's positions (inner stride 1)
    p_t = TOKENS + i_b * s_tb + i_o * s_to  # the chosen order's tokens (s_to = 0: one row of tokens)
    for r0 in range(0, n, BLOCK):
        o_r = r0 + tl.arange(0, BLOCK).to(tl.int64)
        m_r = o_r < n
        b_pos = tl.load(p_o + o_r, mask=m_r, other=0).to(tl.int64)
        b_tok = tl.where(o_r == r_step, r_tok, tl.load(p_t + o_r, mask=m_r))
        tl.store(CANVAS + i_b * s_cb + b_pos, b_tok, mask=m_r)
        tl.store(KNOWN + i_b * s_mb + b_pos, tl.full((BLOCK,), 1, tl.uint8), mask=m_r)
    moved = n > 0
    last = tl.maximum(n - 1, 0)
    tl.store(LAST_POS + i_b, tl.load(p_o + last), mask=moved)
    tl.store(LAST_TOK + i_b, tl.where(last == r_step, r_tok, tl.load(p_t + last)), mask=moved)
    tl.store(LENS + i_b, tl.load(LENS + i_b) + n)

    tl.debug_barrier()  # this program's known writes are visible to all its threads
    left = tl.full((), 0, tl.int32)
    for t0 in range(0, T * has_status, BLOCK_T):  # no pass without a status
        o_t = t0 + tl.arange(0, BLOCK_T)
        left += tl.sum((tl.load(KNOWN + i_b * s_mb + o_t, mask=o_t < T, other=1) == 0).to(tl.int32), 0)
    m_s = has_status != 0
    tl.atomic_max(STATUS, left.to(tl.int64), mask=m_s)
    tl.atomic_add(STATUS + 1, (left > 0).to(tl.int64), mask=m_s)
    tl.store(STATUS + 2, (tl.load(FLAG, mask=m_s, other=0) != 0).to(tl.int64), mask=m_s)


def _kv_unit(*stride_values: int) -> int:
    return 16 if all(s % 16 == 0 for s in stride_values) else 1


def launch(orders, choice, n, tokens, keys, values, canvas, known, last_tok, last_pos, k_cache, v_cache, lens,
           flag=None, status=None, residual=None, residual_step=None):
    """Launch both kernels (no input checks; see :func:`commit`)."""
    B, O, R = orders.shape
    n_layer, _, H, L1, D = k_cache.shape
    keys, values = (t if t.stride(-1) == 1 else t.contiguous() for t in (keys, values))
    has_residual = residual is not None
    residual, residual_step = (residual, residual_step) if has_residual else (n, n)  # stand-ins: read, unused
    choice, n, residual, residual_step = (t if t.is_contiguous() else t.contiguous()
                                          for t in (choice, n, residual, residual_step))  # read at row b
    fused = status is not None and n_layer * B * H * R > 0  # else (no rows) the reference's status
    status_ptr = status if fused else lens  # never written without a status (masked)
    if n_layer * B * H * R > 0:
        sk, sv, sc = strides(keys), strides(values), strides(k_cache)
        kv_strides = (*sk[:4], *sv[:4], sk[4], sv[4], *sc[:4])
        unit = _kv_unit(*kv_strides)
        _commit_kv_kernel[(B * H, n_layer)](
            keys, values, k_cache, v_cache, choice, n, lens, status_ptr, *in_units(unit, *kv_strides), H, R, L1 - 1,
            int(fused), D=D, BLOCK_D=triton.next_power_of_2(D), BLOCK=BLOCK_R, STRIDE_UNIT=unit, num_warps=1,
            **pdl_meta(keys.device),
        )
    orders = orders if orders.stride(-1) == 1 else orders.contiguous()
    tokens = tokens if tokens.stride(-1) == 1 else tokens.contiguous()
    tokens = tokens[:, None].expand(B, O, R) if tokens.ndim == 2 else tokens  # (B, O, R), stride 0 or not
    mask = known.view(torch.uint8)
    if B * R > 0:
        _commit_state_kernel[(B,)](
            orders, choice, n, tokens, canvas, mask, last_tok, last_pos, lens,
            flag.view(torch.uint8) if fused else mask, status_ptr, residual, residual_step,
            *strides(orders)[:2], *strides(tokens)[:2], strides(canvas)[0], strides(mask)[0], R, known.shape[1],
            int(fused), int(has_residual), BLOCK=STATE_BLOCK, BLOCK_T=STATUS_BLOCK, num_warps=1,
            **pdl_meta(orders.device),
        )
    if status is not None and not fused:
        status.copy_(reference.burst_status(known, flag))


def commit(orders, choice, n, tokens, keys, values, *, canvas, known, last_tok, last_pos, k_cache, v_cache, lens,
           flag=None, status=None, residual=None, residual_step=None):
    """Append the first ``n[b]`` steps of order ``choice[b]`` to a session's buffers, in place.

    orders: (B, O, R) int64 positions; choice, n: (B,) int64 (0 <= n <= R); tokens: (B, R) int64, the
    chosen order's tokens by step, or (B, O, R), every order's (order ``choice[b]`` is read); keys,
    values: (n_layer, B, O, H, R, D); canvas: (B, T) int64;
    known: (B, T) bool; last_tok, last_pos, lens: (B,) int64; k_cache, v_cache: (n_layer, B, H, L + 1, D),
    valid up to ``lens``, with a scratch slot L. Every size and stride is checked; the values are not
    (no host read): ``lens[b] + n[b] <= L`` is the caller's contract. With a (3,) int64 ``status`` (and the
    () bool ``flag``) it also writes the burst status after the commit into ``status``, as
    ``reference.burst_status(known, flag)``: the largest unknown count of a row, the rows with one, the flag.
    With (B,) int64 ``residual`` tokens and ``residual_step``, the token committed at that step (when below
    n[b]) is ``residual[b]``: the lossless rule's draw at its first rejected step, spliced in by the commit.
    """
    check_commit(orders, choice, n, tokens, keys, values, canvas, known, last_tok, last_pos, k_cache, v_cache, lens,
                 flag, status, residual, residual_step)
    from . import ops  # noqa: F401  (registers torch.ops.sigmafast.*)

    torch.ops.sigmafast.commit(orders, choice, n, tokens, keys, values, canvas, known, last_tok, last_pos,
                               k_cache, v_cache, lens, flag, status, residual, residual_step)

