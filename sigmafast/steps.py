"""One sampling step as a function of static-shape tensors.

Each function reads and updates a session in place (its canvas, known mask,
KV cache and last token; see :mod:`sigmafast.engine`) and never reads a tensor
value on the host, so that one burst iteration (:func:`burst_step`) or one
autoregressive token (:func:`ar_step`) can be captured as a CUDA graph or
traced by ``torch.compile(fullgraph=True)``. Shapes depend only on the batch
B, the canvas length T, the number of orders O and the padded remaining count
R (a bucket, see :func:`bucket`); rows that need fewer than R steps, and
finished or padding rows, are handled by masks:

- the remaining positions of a row come first in ``positions``, followed by
  known positions whose drafts are never used;
- acceptance counts steps only below each row's remaining count, so a
  padded step is never accepted and never committed.

The burst iteration is ``draft`` → ``along_orders`` (the drafts read along the
orders) → ``verify`` → ``accept`` → (``residual``) → ``commit`` (the session's:
it writes the canvas and the KV cache). See :mod:`sigmafast.sampler` for the
randomness protocol.
"""

from __future__ import annotations

import sys
from typing import NamedTuple, Optional

import torch

from . import kernels
from .engine import NeuralSession, Verified, traced
from .kernels import Acceptance
from .request import BurstDraws
from .scoring import MeasuredScoring

MIN_BUCKET = 16


def bucket(n: int, cap: int) -> int:
    """The static size used for ``n`` items: the next power of two >= 16, at most ``cap``."""
    size = MIN_BUCKET
    while size < n:
        size *= 2
    return min(size, cap)


class Drafts(NamedTuple):
    positions: torch.Tensor  # (B, R) remaining positions first, ascending, then padding
    logits: Optional[torch.Tensor]  # (B, R, V) draft logits p(x_j | visited), or None (see ``hidden``)
    tokens: torch.Tensor  # (B, R) the draft at each queried position
    logp: torch.Tensor  # (B, R) log p of each draft
    hidden: Optional[torch.Tensor] = None  # (B, R, C) the network's final hidden states when ``logits`` is None


class Along(NamedTuple):
    """The drafts read along the (B, O, R) visiting orders (``kernels.gather_drafts``)."""

    tokens: torch.Tensor  # (B, O, R) the draft at each step (the canvas token at a known position)
    logp: torch.Tensor  # (B, O, R) its log p (0 at a known position)
    u_accept: torch.Tensor  # (B, O, R) the acceptance uniform of the step's position
    slot: torch.Tensor  # (B, O, R) the step's row of the drafts (0 at a known position)


class ARPlan(NamedTuple):
    """The static inputs of autoregressive sampling (built by :func:`ar_plan`).

    ``steps`` packs what step s reads into one int64 column, so that a step reads it and advances ``step``
    with one op (``kernels.plan_step``): the position it samples (a row's last one again once the row is
    complete), 1 if it samples a token (s < the row's unknown count) else 0, the float64 uniform of that
    position (its bits, :data:`AR_U`), and 0 (the index of the only order)."""

    steps: torch.Tensor  # (4, B, T) int64, per step s: position, live, uniform bits, 0
    step: torch.Tensor  # () int64 step counter, advanced in place by :func:`ar_step`
    nonfinite: torch.Tensor  # () bool, set in place by :func:`ar_step` when a used logits row is not finite


AR_POS, AR_LIVE, AR_U, AR_ORDER = range(4)  # the columns of ``ARPlan.steps``


def ar_plan(visit: torch.Tensor, u: torch.Tensor, n_known: torch.Tensor) -> ARPlan:
    """The plan of rows visiting ``visit`` (B, T) (their ``n_known`` (B,) known positions first, then the
    unknown ones in visiting order) with float64 uniforms ``u`` (B, T) by position, at step 0."""
    B, T = visit.shape
    s = torch.arange(T, device=visit.device)
    queue = visit.gather(1, (n_known[:, None] + s).clamp(max=T - 1))  # (B, T)
    live = (s[None, :] < (T - n_known)[:, None]).long()
    u_bits = u.to(torch.float64).gather(1, queue).view(torch.int64)  # exact: the same 64 bits
    steps = torch.stack([queue, live, u_bits, torch.zeros_like(queue)])
    return ARPlan(steps, torch.zeros((), dtype=torch.long, device=visit.device),
                  torch.zeros((), dtype=torch.bool, device=visit.device))


def _backend(session) -> Optional[str]:
    return getattr(session, "backend", None)


def _flags_backend(session) -> Optional[str]:
    """The backend of the flag ops: the reference when traced (an in-place custom op would be
    functionalised into copies), else the session's."""
    return "reference" if traced() else _backend(session)


class Slots(NamedTuple):
    """The R slots a burst iteration drafts and the orders it verifies along (``kernels.draft_slots``)."""

    positions: torch.Tensor  # (B, R) remaining positions first, ascending, then known ones
    u_draft: torch.Tensor  # (B, R) the draft uniform of each slot's position
    used: torch.Tensor  # (B, R) bool: the slot holds a remaining position
    remaining: torch.Tensor  # (B,) unknown positions of each row
    orders: torch.Tensor  # (B, O, R) the visiting orders: unknown positions by key, then known ones


def draft(session, slots: Slots, temperature: float, top_k: Optional[int]) -> Drafts:
    """Sample a draft at each of the R slots of every row (flagging used logits rows that are not finite). A
    network on the reference path keeps its hidden states and computes the logits a block of rows at a time
    (``kernels.sample_from_hidden``); the Triton path keeps the (B, R, V) logits, which the residual reads."""
    B, R = slots.positions.shape
    if isinstance(session, NeuralSession) and session.backend != "triton":
        hidden = session.draft_hidden(slots.positions)  # (B, R, C)
        tok, logp = kernels.sample_from_hidden(hidden.flatten(0, 1), session.head_weight, slots.u_draft.flatten(),
                                               temperature, top_k, vocab_size=session.vocab_size,
                                               used=slots.used.flatten(), flag=session.nonfinite, backend="reference")
        return Drafts(slots.positions, None, tok.view(B, R), logp.view(B, R), hidden)
    logits = session.draft(slots.positions)  # (B, R, V)
    tok, logp = sample_checked(session, logits.flatten(0, 1), slots.u_draft.flatten(), slots.used.flatten(),
                               session.nonfinite, temperature, top_k)
    return Drafts(slots.positions, logits, tok.view(B, R), logp.view(B, R))


def sample_checked(session, logits: torch.Tensor, u: torch.Tensor, used: torch.Tensor, flag: torch.Tensor,
                   temperature: float, top_k: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernels.sample`` of (N, V) ``logits`` that also sets the () ``flag`` when a row where the (N,) ``used``
    is True is not finite: inside the sampling kernel (no second read of the logits), or by the reference
    flag op when traced (see :func:`_flags_backend`)."""
    if traced():
        kernels.flag_nonfinite(logits, used, flag, backend=_flags_backend(session))
        return kernels.sample(logits, u, temperature, top_k, backend=_backend(session))
    return kernels.sample(logits, u, temperature, top_k, used=used, flag=flag, backend=_backend(session))


def along_orders(session, drafts: Drafts, u_accept: torch.Tensor, orders: torch.Tensor) -> Along:
    """The drafts and the (B, T) acceptance uniforms read along the (B, O, R) ``orders``."""
    return Along(*kernels.gather_drafts(drafts.positions, drafts.tokens, drafts.logp, session.canvas, session.known,
                                        u_accept, orders, backend=_backend(session)))


def accept(session, verified: Verified, along: Along, remaining: torch.Tensor, temperature: float,
           top_k: Optional[int], rule: str, flag: Optional[torch.Tensor] = None) -> Acceptance:
    """Test every order's drafts against the verifier (from hidden states when the session has them); with a
    () ``flag``, also set it when a ratio q/p of a step below ``remaining`` is NaN (its verifier row is not
    finite; temperature > 0)."""
    args = (along.tokens, along.logp, along.u_accept, remaining, temperature, top_k, rule)
    if verified.hidden is None:
        return kernels.acceptance(verified.logits, *args, flag=flag, backend=_backend(session))

    def score(scoring: Optional[str]) -> Acceptance:
        return kernels.acceptance_from_hidden(verified.hidden, session.head_weight, *args, flag=flag,
                                              backend=_backend(session), vocab_size=session.vocab_size,
                                              scoring=scoring)

    scoring = session.scoring
    if isinstance(scoring, MeasuredScoring):  # Engine(scoring="auto"): timed on the Triton path, once per shape
        hidden = verified.hidden
        measurable = _backend(session) == "triton" and not traced()
        key = (tuple(hidden.shape), hidden.dtype, str(hidden.device), float(temperature), top_k, rule)
        scoring = scoring.choose(score, key, hidden.device) if measurable else None
    return score(scoring)


def verifier_logits(session, verified: Verified, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(B, V) verifier logits of ``rows`` (B, C or V), the verifier's outputs at one step per row (default: step
    0 of order 0, a view)."""
    if rows is None:
        rows = outputs(verified)[:, 0, 0]
    return session.head(rows) if verified.hidden is not None else rows


def outputs(verified: Verified) -> torch.Tensor:
    """The verifier's (B, O, R, C or V) outputs: its final hidden states, or its logits (oracles)."""
    return verified.hidden if verified.hidden is not None else verified.logits


def residual(session, verified: Verified, drafts: Drafts, along: Along, n: torch.Tensor, remaining: torch.Tensor,
             u_residual: torch.Tensor, temperature: float, top_k: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless rule (one order): at the first rejection (step n < remaining) draw from
    normalize(max(0, q - p)).

    Returns the (B,) residual tokens and the (B,) committed counts n + rejected (the residual token goes at
    step n where the row rejected)."""
    # at step k (the rejected one, the last one where none was: unused): its uniform, the draft's row (B, V or C)
    # and the verifier's row (B, C or V)
    p_outputs = drafts.logits if drafts.hidden is None else drafts.hidden  # (B, R, V or C)
    u, n_commit, p_rows, v_rows = kernels.residual_pick(n, remaining, verified.orders[:, 0], along.slot[:, 0],
                                                        u_residual, p_outputs, outputs(verified)[:, 0],
                                                        backend=_backend(session))
    if drafts.hidden is not None:
        p_rows = session.head(p_rows)  # (B, V)
    q_rows = verifier_logits(session, verified, v_rows)  # (B, V): the head's row stride, as the Triton pick's p_rows
    tok = kernels.residual_sample(q_rows, p_rows, u, temperature, top_k, backend=_backend(session))
    return tok, n_commit


def burst_step(session, d: BurstDraws, R: int, temperature: float, top_k: Optional[int],
               rule: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One burst iteration over the whole batch, in place. ``R`` is at least every row's remaining count
    (``generate`` takes it from the largest).

    Returns the committed counts (B,), the chosen orders' accepted draft lengths (B,) and
    ``status`` (3,) int64: the largest remaining count, the number of unfinished rows after it,
    and 1 when a draft or verifier output used by this iteration, or by an earlier one of the session,
    is not finite (else 0: ``session.nonfinite`` is sticky, so no step zeroes a flag). The drafts' logits
    are checked by their sampling kernel; the verifier's rows by the decisions' kernel (a NaN ratio q/p:
    a row with a NaN or +inf logit, or none finite), or by ``flag_nonfinite`` on its outputs when greedy
    or traced.
    """
    slots = Slots(*kernels.draft_slots(session.known, d.u_draft, d.keys, R, backend=_backend(session)))
    remaining, used, orders = slots.remaining, slots.used, slots.orders  # (B,), (B, R), (B, O, R)
    drafts = draft(session, slots, temperature, top_k)
    along = along_orders(session, drafts, d.u_accept, orders)
    verified = session.verify(orders, along.tokens)
    scores = outputs(verified)  # (B, O, R, C or V)
    bad = session.nonfinite  # () bool, sticky: the loop stops at the first status that reports it
    backend = _flags_backend(session)
    fused = temperature > 0 and not traced()  # the verifier's check in the decisions' kernel (the drafts': draft())
    if not fused:
        kernels.flag_nonfinite(scores, used[:, None, :], bad, backend=backend)
    res = accept(session, verified, along, remaining, temperature, top_k, rule, bad if fused else None)
    choice = res.best  # (B,) lossless: 0, the only order
    status = remaining.new_empty(3)  # written by the commit: the known mask after it and the flag
    if rule == "paper":
        n = n_commit = res.n_best  # (B,)
        session.commit(verified, choice, n_commit, along.tokens, status)  # (B, O, R): it reads the chosen order's
    else:  # lossless: one order, and the residual token at the first rejected step
        n = res.n_accept[:, 0]
        r_tok, n_commit = residual(session, verified, drafts, along, n, remaining, d.u_residual, temperature, top_k)
        # at step n: the rejected one, or one past the commit when every step was accepted (never written)
        session.commit(verified, choice, n_commit, along.tokens[:, 0], status, residual=r_tok, residual_step=n)
    return n_commit, n, status


def ar_step(session, plan: ARPlan, temperature: float, top_k: Optional[int]) -> None:
    """Sample the next position of every row in its visiting order, in place; advances ``plan.step``."""
    now = kernels.plan_step(plan.steps, plan.step, backend=_flags_backend(session))  # (4, B): this step of each row
    j, n, first = now[AR_POS], now[AR_LIVE], now[AR_ORDER]  # (B,) each, contiguous: position, 0/1, the only order
    verified = session.verify(j[:, None, None], None)  # feeds the last token only
    logits = verifier_logits(session, verified)  # (B, V) the only step: a view, no gather
    u = now[AR_U].view(torch.float64)
    tok, _ = sample_checked(session, logits, u, bool_view(n), plan.nonfinite, temperature, top_k)
    session.commit(verified, first, n, tok[:, None])


def bool_view(flags: torch.Tensor) -> torch.Tensor:
    """(B,) contiguous int64 0/1 flags as a (B,) bool tensor: a view of their low bytes (no cast kernel) on a
    little-endian machine, else (and under torch.compile) a cast."""
    if sys.byteorder != "little" or torch.compiler.is_compiling():
        return flags.bool()
    return flags.view(torch.bool)[:: flags.element_size()]
