"""σ-GPT sampling: any-order autoregressive and burst (rejection) sampling, and infilling (conditional
densities and log-likelihoods are in :mod:`sigmafast.density`).

One algorithm runs on any *conditionals* object: the neural model through its
KV-cached adapter (:mod:`sigmafast.engine`) or an exact task oracle
(:mod:`sigmafast.tasks.oracles`). The protocol::

    conds.vocab_size, conds.block_size
    session = conds.prefill(canvas (B, T), known (B, T))   # known tokens, ascending positions
    session.canvas, session.known                           # (B, T), updated in place by the steps
    session.batch_size, session.nonfinite                   # rows (with padding); () bool, set by the steps
    session.draft(positions (B, R)) -> (B, R, V)            # p(x_j | visited) for each j
    session.verify(orders (B, O, R), drafts (B, O, R)) -> Verified
        # step k of order o: q(x_ok | visited, x̃_o0 … x̃_o(k-1)), as logits or hidden states
    session.commit(verified, choice (B,), n (B,), tokens (B, R) or (B, O, R), status=None,
                   residual=None, residual_step=None)
        # keeps order choice[b]'s first n[b] steps; status: None or a (3,) int64 buffer for the burst
        # status after it (largest unknown count, rows left, nonfinite); residual (B,): the lossless
        # rule's token, committed at step residual_step[b] instead of the draft
    session.select(rows (B',))                              # keep only these rows (drop finished ones)

The steps themselves are :mod:`sigmafast.steps` (static shapes, no host
read); :mod:`sigmafast.runner` runs them eagerly or as CUDA graphs. The
burst loops read one status per iteration on the host (the largest remaining
count, which ends the loop and picks the R bucket, with the step's non-finite
flag). With static shapes (an :class:`~sigmafast.runner.Engine` with buckets
and ``lookahead=True``) the read lags one iteration behind the launches: iteration i + 1 is queued,
its R bucket bounded from iteration i - 1's status, before iteration i's status
is read, so the device never waits for the host between iterations. The
autoregressive loop reads one value (after the loop, the non-finite flag the
steps accumulated on the device); its step count is the largest unknown count
of a row, which ``generate`` read before the prefill.
Non-finite model outputs raise a ``ValueError``.

Randomness protocol (shared with :mod:`sigmafast.naive`). Every draw is an
explicit float64 tensor from the user's ``generator`` (the global CPU RNG when
None), drawn on the generator's device and moved to the canvas' device,
always over all T positions and indexed by position, so padding and finished
rows never shift the stream:

- ``strategy="autoregressive"``: order keys ``(B, T)`` once (only for
  ``order="random"``), then ``u (B, T)`` once; position j is sampled with
  ``u[b, j]``.
- ``strategy="burst"``, per iteration, always all four in this order:
  ``u_draft (B, T)``, ``keys (B, O, T)``, ``u_accept (B, T)``,
  ``u_residual (B, T)``. Order o of row b visits the remaining positions by
  increasing ``keys[b, o]``; the draft at j uses ``u_draft[b, j]``, its test
  ``u_accept[b, j]`` (shared by all orders), a residual at j ``u_residual[b, j]``.

Known tokens are fed first in ascending position order. The autoregressive
strategy then visits the unknown positions in the order's relative order
(``"random"``: by increasing key). Sampling is by inverse CDF
(:func:`sigmafast.kernels.sample`); temperature and top-k apply identically to
drafts and verifier; ``temperature=0`` is greedy: every committed token is the
argmax of its conditional. The orders stay random, so the output is
deterministic for a fixed generator (burst, ``order="random"``) or a fixed order.

Acceptance rules: ``"lossless"``, the default (one order, speculative
sampling with a residual draw at the first rejection: exactly the model's
random-order autoregressive law), and ``"paper"``, opt-in (the σ-GPT seed's
rule; step 0 is force-accepted, the order with the longest accepted prefix
wins, first on ties; not exact: best-of-N selection over-accepts).
"""

from __future__ import annotations

import collections
import time
from typing import Callable, Optional

import torch

from .engine import NeuralConditionals
from .request import (BurstDraws, SampleStats, ar_rank, build_stats, check_callback, check_int, check_request_memory,
                      check_return_stats, draw, draw_burst, inference, is_sigma_gpt, nonfinite_error, prepare)
from .runner import Engine, runner_for
from .steps import ARPlan, ar_plan

__all__ = ["generate", "warmup", "SampleStats"]


def unwrap_model(model):
    """The model an :class:`~sigmafast.runner.Engine` wraps, or ``model`` itself."""
    return model.model if isinstance(model, Engine) else model


def as_conditionals(model):
    """A SigmaGPT wrapped in its cached adapter; an oracle is returned as is."""
    model = unwrap_model(model)
    if is_sigma_gpt(model):
        return NeuralConditionals(model)
    if hasattr(model, "prefill"):
        return model
    raise TypeError(f"model must be a SigmaGPT or an oracle, got {type(model).__name__}")


def generate(
    model,
    idx: torch.Tensor,
    max_new_tokens: Optional[int] = None,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    *,
    known: Optional[torch.Tensor] = None,
    strategy: str = "burst",
    order="random",
    num_orders: int = 1,
    acceptance: str = "lossless",
    generator: Optional[torch.Generator] = None,
    return_stats: bool = False,
    on_iteration: Optional[Callable[[torch.Tensor, torch.Tensor], None]] = None,
):
    """Sample the unknown positions of a canvas; returns (B, T) tokens [and :class:`SampleStats`].

    ``model`` is a SigmaGPT, an :class:`~sigmafast.runner.Engine` (see :func:`warmup`) or an oracle.

    - Prompt: ``idx`` (B, P) at positions 0..P-1 plus ``max_new_tokens`` -> (B, P + max_new_tokens).
    - Infilling: ``idx`` (B, T) canvas and ``known`` (B, T) bool (may differ per row);
      known tokens are returned unchanged.
    - Unconditional: ``idx`` of shape (B, 0) and ``max_new_tokens = T``.

    ``strategy`` is "burst" (draft all, verify ``num_orders`` random orders) or
    "autoregressive" (one token per model call in ``order``: "random",
    "left-to-right", "fractal" or a (B, T) tensor). Burst ``acceptance`` is
    "lossless" by default (one order, ``num_orders=1``: exactly the model's
    random-order autoregressive law) or, opt-in, "paper" (the σ-GPT rule over
    ``num_orders`` orders: fewer iterations, not exact); values other than the
    defaults are errors under "autoregressive", which verifies no drafts.
    ``on_iteration(canvas,
    known)``, when given, is called after every iteration (it may sync) with copies of the (B, T) canvas and
    mask: frames kept need no clone, and writing into them changes nothing.
    """
    target = unwrap_model(model)
    req = prepare(target, idx, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, known=known,
                  strategy=strategy, order=order, num_orders=num_orders, acceptance=acceptance, generator=generator)
    runner = runner_for(model)
    check_callback(on_iteration)
    check_return_stats(return_stats)
    t0 = time.perf_counter()
    n_known = req.known.sum(1)
    fewest, most = torch.stack([n_known.min(), n_known.max()]).tolist()  # one host read for the tests below
    if not runner.holds_session(*req.canvas.shape):  # a kept session's memory is not free, nor needed again
        check_request_memory(target, req, runner.session_rows(req.canvas.shape[0]), most)
    canvas, known_now = req.canvas.clone(), req.known.clone()
    autoregressive = req.strategy == "autoregressive"
    with inference(target):
        if fewest == canvas.shape[1]:  # nothing to sample: no model call
            accepted, lengths, calls, prefill_calls = [], None if autoregressive else [], 0, 0
        else:
            session = runner.start(canvas, known_now, most)
            prefill_calls = int(most > 0)
            if autoregressive:
                accepted, lengths, calls = _autoregressive(runner, session, req, canvas, known_now, on_iteration,
                                                           n_steps=canvas.shape[1] - fewest)
            else:
                accepted, lengths, calls = _burst(runner, session, req, canvas, known_now, on_iteration,
                                                  max_left=canvas.shape[1] - fewest)
    if canvas.is_cuda:
        torch.cuda.synchronize(canvas.device)  # wall time of the finished work
    stats = build_stats(accepted, lengths, canvas.shape[0], canvas.device, prefill_calls + calls,
                        time.perf_counter() - t0)
    return (canvas, stats) if return_stats else canvas


def _pad_rows(t: torch.Tensor, live: Optional[torch.Tensor], size: int) -> torch.Tensor:
    """Rows ``live`` of a full-batch tensor (all rows when None), zero-padded to ``size`` rows."""
    if live is not None:
        t = t[live]
    if t.shape[0] == size:
        return t
    return torch.cat([t, t.new_zeros(size - t.shape[0], *t.shape[1:])])


def _write_back(canvas, known, live, session) -> None:
    """Copy the working rows of the session into the full-batch canvas and mask."""
    n = canvas.shape[0] if live is None else live.shape[0]
    if live is None:
        canvas.copy_(session.canvas[:n])
        known.copy_(session.known[:n])
    else:
        canvas.index_copy_(0, live, session.canvas[:n])
        known.index_copy_(0, live, session.known[:n])


def _per_row(values: torch.Tensor, live: Optional[torch.Tensor], batch_size: int) -> torch.Tensor:
    """(B,) full-batch counts from the working rows' values (0 for dropped rows)."""
    if live is None:
        return values[:batch_size]
    return values.new_zeros(batch_size).index_copy(0, live, values[: live.shape[0]])


def _autoregressive(runner, session, req, canvas, known, on_iteration, n_steps: int):
    """One token per step in each row's visiting order, with no host read inside the loop. ``n_steps``, the
    largest count of unknown positions of a row, read before the prefill (``T - fewest``): reading it again
    here would stall the host until the prefill has run before the first step is queued."""
    B, T = canvas.shape
    device = canvas.device
    is_random = isinstance(req.order, str) and req.order == "random"
    keys = draw(req.generator, (B, T), device) if is_random else None
    u = draw(req.generator, (B, T), device)
    positions = torch.arange(T, device=device)
    rank = ar_rank(req.order, keys, B, T, device)
    visit = torch.where(known, (positions - T).to(rank.dtype), rank).argsort(dim=1, stable=True)  # (B, T)
    n_known = known.sum(1)
    todo = T - n_known  # (B,); its max is n_steps
    plan = runner.static(session, "ar", _pad_plan(ar_plan(visit, u, n_known), session.batch_size))
    for _ in range(n_steps):
        runner.ar(session, plan, req.temperature, req.top_k)
        if on_iteration is not None:
            _write_back(canvas, known, None, session)
            on_iteration(canvas.clone(), known.clone())  # snapshots: the caller may keep or change them
    if bool(plan.nonfinite):  # one read after the loop, of the flag the steps accumulated on the device
        raise nonfinite_error("logits")
    _write_back(canvas, known, None, session)
    accepted = (todo[:, None] > torch.arange(n_steps, device=device)).long()  # (B, n_steps): one op, not n_steps
    return accepted, None, n_steps


def _rng(generator: Optional[torch.Generator]) -> torch.Generator:
    return generator if generator is not None else torch.default_generator  # draw's default: the CPU RNG


def _burst_static(runner, session, req, canvas, known, on_iteration, max_left: int):
    """The static-shape burst loop (bucketed runners), up to one iteration ahead of the host read.

    Every unfinished row commits at least one token per iteration (the paper rule
    force-accepts step 0; lossless draws a residual at the first rejection), so
    after iteration i - 1 left at most ``m`` positions in any row, iteration
    i + 1 has at most ``m - 1`` (with i in flight). With ``runner.lookahead`` and
    no ``on_iteration`` (which sees each iteration's canvas), iteration i + 1 is
    launched, its R bucket chosen from that bound, before iteration i's status
    is read; R larger than needed only pads (the masks cover it: the tokens are
    the same). Otherwise each status is read before the next launch. When
    iteration i completes every row (or its outputs are not finite and the loop
    raises), a queued iteration i + 1 (complete rows: it commits nothing) is
    dropped and its draws are given back to the generator, so the tokens, the
    statistics and the generator's state never depend on the lookahead.
    ``max_left``, the largest count of unknown positions of a row, read before
    the prefill, bounds the first launch.
    """
    B, T = canvas.shape
    gen = _rng(req.generator)
    depth = 2 if runner.lookahead and on_iteration is None else 1  # iterations queued ahead of a read
    bound = max_left
    accepted, lengths, calls = [], [], 0
    in_flight = collections.deque()  # (status, n_commit, n, generator state before the draws)
    while True:
        while bound > 0 and len(in_flight) < depth:
            state = gen.get_state()
            d = draw_burst(req.generator, B, req.num_orders, T, canvas.device,
                           out=runner.draw_buffers(session, req.num_orders))
            n_commit, n, status = runner.burst(session, _padded(d, session.batch_size), runner.r_bucket(bound, T),
                                               req.temperature, req.top_k, req.acceptance)
            in_flight.append((status, n_commit, n, state))
            bound -= 1
        if not in_flight:
            break
        status, n_commit, n, _ = in_flight.popleft()
        max_left, _, bad = status.tolist()  # waits for this iteration only; the next one may be queued
        if (bad or max_left == 0) and in_flight:  # launched after the last needed one (or an error): dropped
            gen.set_state(in_flight[0][3])
        if bad:
            raise nonfinite_error("logits or hidden states")
        calls += 2
        accepted.append(n_commit[:B])
        lengths.append(n[:B])
        if on_iteration is not None:
            _write_back(canvas, known, None, session)
            on_iteration(canvas.clone(), known.clone())  # snapshots: the caller may keep or change them
        if max_left == 0:
            break
        bound = max_left - len(in_flight)
    _write_back(canvas, known, None, session)
    return accepted, lengths, calls


def _padded(d: BurstDraws, size: int) -> BurstDraws:
    return BurstDraws(*(_pad_rows(t, None, size) for t in d))


def _burst(runner, session, req, canvas, known, on_iteration, max_left: int):
    """Draft, verify, accept, commit until every row is complete.

    Bucketed runners keep the batch static and mask finished rows
    (:func:`_burst_static`); exact-shape ones drop finished rows once they are at
    least half of the working batch (a row gather of the cache, at most log2(B)
    times) and read each status before the next iteration.
    """
    if runner.buckets:
        return _burst_static(runner, session, req, canvas, known, on_iteration, max_left)
    B, T = canvas.shape
    device = canvas.device
    live = None  # full-batch row of each working row; None while they are rows 0..B-1
    left = (~session.known).sum(1)
    status = torch.stack([left.max(), (left > 0).sum(), torch.zeros_like(left.max())])
    accepted, lengths, calls = [], [], 0
    while True:
        max_left, n_live, bad = status.tolist()  # the iteration's single host read
        if bad:
            raise nonfinite_error("logits or hidden states")
        if max_left == 0:
            break
        n_work = B if live is None else live.shape[0]
        if n_live <= n_work // 2:
            keep = ((~session.known).sum(1) == 0).to(torch.int8).argsort(stable=True)[:n_live]  # unfinished, in order
            _write_back(canvas, known, live, session)
            live = keep if live is None else live[keep]
            session.select(keep)
        d = BurstDraws(*(_pad_rows(t, live, session.batch_size)
                         for t in draw_burst(req.generator, B, req.num_orders, T, device)))
        n_commit, n, status = runner.burst(session, d, max_left, req.temperature, req.top_k, req.acceptance)
        calls += 2
        accepted.append(_per_row(n_commit, live, B))
        lengths.append(_per_row(n, live, B))
        if on_iteration is not None:
            _write_back(canvas, known, live, session)
            on_iteration(canvas.clone(), known.clone())  # snapshots: the caller may keep or change them
    _write_back(canvas, known, live, session)
    return accepted, lengths, calls


def warmup(model, batch_size: int, seq_len: int, *, strategy: str = "burst", num_orders: int = 1,
           acceptance: str = "lossless", temperature: float = 1.0, top_k: Optional[int] = None) -> Engine:
    """Compile and capture, ahead of time, the steps that :func:`generate` will run for calls with
    these settings, ``batch_size`` rows and canvases of ``seq_len`` tokens; returns the engine to pass
    to ``generate`` in place of the model. ``generate`` works without it (it captures on the fly).
    Engines without buckets (the CPU default) run exact shapes: there is nothing to prepare."""
    engine = model if isinstance(model, Engine) else Engine.for_model(model)
    target = engine.model
    batch_size, seq_len = check_int("batch_size", batch_size, 1), check_int("seq_len", seq_len, 0)
    if seq_len > target.config.block_size:
        raise ValueError(f"seq_len {seq_len} exceeds the model's block_size {target.config.block_size}")
    device = next(target.parameters()).device
    idx = torch.zeros(batch_size, 0, dtype=torch.long, device=device)
    req = prepare(target, idx, max_new_tokens=seq_len, temperature=temperature, top_k=top_k, strategy=strategy,
                  num_orders=num_orders, acceptance=acceptance)
    if not engine.holds_session(batch_size, seq_len):  # it prefills up to seq_len
        check_request_memory(target, req, engine.session_rows(batch_size), most=seq_len)
    if seq_len == 0 or not engine.buckets:  # exact shapes: every call has its own; nothing to prepare
        return engine
    g = torch.Generator(device="cpu").manual_seed(0)
    B, T = req.canvas.shape
    with inference(target):
        positions = torch.arange(T, device=device)
        for M in sorted({engine.r_bucket(m, T) for m in range(1, T + 1)}):  # the prompts' prefill buckets
            for _ in range(2):  # eager (compiles), then captured
                engine.start(req.canvas, (positions < M).expand(B, T))
        if req.strategy == "autoregressive":
            session = engine.start(req.canvas, req.known)
            plan = ar_plan(positions.expand(B, T), draw(g, (B, T), device),
                           torch.zeros(B, dtype=torch.long, device=device))
            plan = engine.static(session, "ar", _pad_plan(plan, session.batch_size))
            for _ in range(min(2, T)):  # eager (compiles), then captured; a plan has T steps
                engine.ar(session, plan, req.temperature, req.top_k)
            return engine
        for R in sorted({engine.r_bucket(r, T) for r in range(1, T + 1)}):
            session = engine.start(req.canvas, (positions >= R).expand(B, T))  # R left: a burst's precondition
            for _ in range(2):
                d = _padded(draw_burst(g, B, req.num_orders, T, device), session.batch_size)
                engine.burst(session, d, R, req.temperature, req.top_k, req.acceptance)
    return engine


def _pad_plan(plan: ARPlan, size: int) -> ARPlan:
    """The plan with zero rows up to ``size``: padding rows are never live."""
    steps = _pad_rows(plan.steps.transpose(0, 1), None, size).transpose(0, 1)  # (4, B, T): rows along dim 1
    return ARPlan(steps, plan.step, plan.nonfinite)
