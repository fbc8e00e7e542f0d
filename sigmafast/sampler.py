"""σ-GPT sampling: any-order autoregressive and burst (rejection) sampling, infilling,
conditional densities and log-likelihoods.

One algorithm runs on any *conditionals* object: the neural model through its
KV-cached adapter (:mod:`sigmafast.engine`) or an exact task oracle
(:mod:`sigmafast.tasks.oracles`). The protocol::

    conds.vocab_size, conds.block_size
    session = conds.prefill(canvas (B, T), known (B, T))   # known tokens, ascending positions
    session.draft(positions (B, R)) -> (B, R, V)            # p(x_j | visited) for each j
    session.verify(orders (B, O, R), drafts (B, O, R)) -> (B, O, R, V)
        # step k of order o: q(x_ok | visited, x̃_o0 … x̃_o(k-1))
    session.commit(choice (B,), n (B,), canvas, known)      # order choice[b]'s first n[b] steps
    session.select(rows (B',))                              # keep only these rows (drop finished ones)

Randomness protocol (shared with :mod:`sigmafast.reference`). Every draw is an
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
drafts and verifier; ``temperature=0`` is greedy.

Acceptance rules: ``"paper"`` (the σ-GPT seed's rule; step 0 is force-accepted,
the order with the longest accepted prefix wins, first on ties; not exact:
best-of-N selection over-accepts) and ``"lossless"`` (one order, speculative
sampling with a residual draw at the first rejection: exactly the model's
random-order autoregressive law).
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from . import kernels
from .engine import NeuralConditionals
from .request import SampleStats, ar_rank, build_stats, draw, draw_burst, eval_mode, is_sigma_gpt, prepare

__all__ = ["generate", "conditional_density", "log_likelihood", "as_conditionals", "SampleStats"]


def as_conditionals(model):
    """A SigmaGPT wrapped in its cached adapter; an oracle is returned as is."""
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
    num_orders: int = 5,
    acceptance: str = "paper",
    generator: Optional[torch.Generator] = None,
    return_stats: bool = False,
    on_iteration: Optional[Callable[[torch.Tensor, torch.Tensor], None]] = None,
):
    """Sample the unknown positions of a canvas; returns (B, T) tokens [and :class:`SampleStats`].

    - Prompt: ``idx`` (B, P) at positions 0..P-1 plus ``max_new_tokens`` -> (B, P + max_new_tokens).
    - Infilling: ``idx`` (B, T) canvas and ``known`` (B, T) bool (may differ per row);
      known tokens are returned unchanged.
    - Unconditional: ``idx`` of shape (B, 0) and ``max_new_tokens = T``.

    ``strategy`` is "burst" (draft all, verify ``num_orders`` random orders,
    ``acceptance`` "paper" or "lossless" (needs ``num_orders=1``)) or
    "autoregressive" (one token per model call in ``order``: "random",
    "left-to-right", "fractal" or a (B, T) tensor). ``on_iteration(canvas,
    known)``, when given, is called after every iteration (it may sync).
    """
    req = prepare(model, idx, max_new_tokens, temperature, top_k, known, strategy, order, num_orders,
                  acceptance, generator)
    t0 = time.perf_counter()
    conds = as_conditionals(model)
    canvas, known_now = req.canvas.clone(), req.known.clone()
    autoregressive = req.strategy == "autoregressive"
    with torch.no_grad(), eval_mode(model):
        if bool(known_now.all()):  # nothing to sample: no model call
            accepted, lengths, calls, prefill_calls = [], None if autoregressive else [], 0, 0
        else:
            session = conds.prefill(canvas, known_now)
            prefill_calls = int(bool(known_now.any()))
            run = _autoregressive if autoregressive else _burst
            accepted, lengths, calls = run(session, req, canvas, known_now, on_iteration)
    if canvas.is_cuda:
        torch.cuda.synchronize(canvas.device)  # wall time of the finished work
    stats = build_stats(accepted, lengths, canvas.shape[0], canvas.device, prefill_calls + calls,
                        time.perf_counter() - t0)
    return (canvas, stats) if return_stats else canvas


def _autoregressive(session, req, canvas, known, on_iteration):
    """One token per call: the last token is queried at the next position and its k, v committed."""
    B, T = canvas.shape
    device = canvas.device
    is_random = isinstance(req.order, str) and req.order == "random"
    keys = draw(req.generator, (B, T), device) if is_random else None
    u = draw(req.generator, (B, T), device)
    positions = torch.arange(T, device=device)
    rank = ar_rank(req.order, keys, B, T, device)
    visit = torch.where(known, (positions - T).to(rank.dtype), rank).argsort(dim=1, stable=True)  # (B, T)
    n_known = known.sum(1)
    remaining = T - n_known
    n_steps = int(remaining.max())
    zeros = torch.zeros(B, dtype=torch.long, device=device)
    accepted = []
    for s in range(n_steps):
        active = remaining > s  # (B,)
        j = visit.gather(1, (n_known + s).clamp(max=T - 1)[:, None])  # (B, 1)
        logits = session.verify(j[:, None], canvas.gather(1, j)[:, None])[:, 0, 0]  # (B, V)
        tok, _ = kernels.sample(logits, u.gather(1, j).squeeze(1), req.temperature, req.top_k)
        tok = torch.where(active, tok, canvas.gather(1, j).squeeze(1))
        canvas.scatter_(1, j, tok[:, None])
        known.scatter_(1, j, known.gather(1, j) | active[:, None])
        step = active.long()
        session.commit(zeros, step, canvas, known)
        accepted.append(step)
        if on_iteration is not None:
            on_iteration(canvas, known)
    return accepted, None, n_steps


def _burst(session, req, canvas, known, on_iteration):
    """Draft, verify, accept, commit until every row is complete.

    Rows that are finished are dropped from the working batch once they are at
    least half of it (a row gather of the cache, at most log2(B) times), using
    the counts read by the iteration's single host read.
    """
    B, T = canvas.shape
    device = canvas.device
    live = torch.arange(B, device=device)  # full-batch row of each working row
    work_canvas, work_known = canvas, known
    remaining = (~known).sum(1)  # (B_work,)
    accepted, lengths, calls = [], [], 0
    while True:
        counts = remaining.tolist()  # the iteration's single host read
        if max(counts) == 0:
            break
        n_live = sum(c > 0 for c in counts)
        if n_live <= len(counts) // 2:
            keep = (remaining == 0).to(torch.int8).argsort(stable=True)[:n_live]  # unfinished rows, in order
            _write_back(canvas, known, live, work_canvas, work_known)
            live, work_canvas, work_known, remaining = live[keep], work_canvas[keep], work_known[keep], remaining[keep]
            session.select(keep)
        d = draw_burst(req.generator, B, req.num_orders, T, device)
        if work_canvas is not canvas:
            d = type(d)(*(t[live] for t in d))
        calls += 2
        n_commit, n = _burst_step(session, req, work_canvas, work_known, remaining, d, max(counts))
        remaining = remaining - n_commit
        zeros = torch.zeros(B, dtype=torch.long, device=device)
        accepted.append(zeros.index_copy(0, live, n_commit))
        lengths.append(zeros.index_copy(0, live, n))
        if on_iteration is not None:
            _write_back(canvas, known, live, work_canvas, work_known)
            on_iteration(canvas, known)
    _write_back(canvas, known, live, work_canvas, work_known)
    return accepted, lengths, calls


def _write_back(canvas, known, live, work_canvas, work_known) -> None:
    if work_canvas is not canvas:
        canvas.index_copy_(0, live, work_canvas)
        known.index_copy_(0, live, work_known)


def _burst_step(session, req, canvas, known, remaining, d, R: int):
    """One iteration on the working batch; updates canvas and known in place.

    Returns the committed counts (B,) and the chosen orders' accepted draft lengths (B,).
    """
    B, T = canvas.shape
    O, temp, top_k = req.num_orders, req.temperature, req.top_k
    device = canvas.device
    rows = torch.arange(B, device=device)
    steps = torch.arange(R, device=device)

    # Draft: p(x_j | visited) at every remaining position (unknown first, ascending; then padding).
    rem_pos = known.to(torch.int8).argsort(dim=1, stable=True)[:, :R]  # (B, R)
    p_logits = session.draft(rem_pos)  # (B, R, V)
    tok, logp = kernels.sample(p_logits.flatten(0, 1), d.u_draft.gather(1, rem_pos).flatten(), temp, top_k)
    draft_tok = canvas.scatter(1, rem_pos, tok.view(B, R))  # (B, T) by position
    draft_logp = torch.zeros(B, T, dtype=logp.dtype, device=device).scatter(1, rem_pos, logp.view(B, R))
    slot = torch.zeros(B, T, dtype=torch.long, device=device).scatter(1, rem_pos, steps.expand(B, R))

    # Verify O random orders of the remaining positions at once.
    orders = d.keys.masked_fill(known[:, None, :], 2.0).argsort(dim=-1, stable=True)[..., :R]  # (B, O, R)
    drafts = draft_tok[:, None, :].expand(B, O, T).gather(2, orders)
    accept_args = (
        drafts, draft_logp[:, None, :].expand(B, O, T).gather(2, orders),
        d.u_accept[:, None, :].expand(B, O, T).gather(2, orders), remaining, temp, top_k, req.acceptance,
    )
    hidden = q_logits = None
    if hasattr(session, "verify_hidden"):  # score drafts from hidden states: no (B, O, R, V) logits
        hidden = session.verify_hidden(orders, drafts)  # (B, O, R, C)
        res = kernels.acceptance_from_hidden(hidden, session.head_weight, *accept_args)
    else:
        q_logits = session.verify(orders, drafts)  # (B, O, R, V)
        res = kernels.acceptance(q_logits, *accept_args)
    choice = res.best if req.acceptance == "paper" else torch.zeros_like(res.best)
    n = res.n_accept[rows, choice]  # (B,)
    chosen = orders[rows, choice]  # (B, R)
    new_tok = drafts[rows, choice]  # (B, R)
    n_commit = n
    if req.acceptance == "lossless":
        rejected = n < remaining
        k = n.clamp(max=R - 1)
        j = chosen.gather(1, k[:, None]).squeeze(1)  # (B,) position of the first rejection
        p_rows = p_logits[rows, slot.gather(1, j[:, None]).squeeze(1)]  # (B, V)
        q_rows = session.head(hidden[rows, choice, k]) if hidden is not None else q_logits[rows, choice, k]
        r_tok = kernels.residual_sample(q_rows, p_rows,
                                        d.u_residual.gather(1, j[:, None]).squeeze(1), temp, top_k)
        new_tok = torch.where((steps[None, :] == k[:, None]) & rejected[:, None], r_tok[:, None], new_tok)
        n_commit = n + rejected.long()

    # Commit: the chosen order's first n_commit steps.
    take = steps[None, :] < n_commit[:, None]  # (B, R)
    canvas.scatter_(1, chosen, torch.where(take, new_tok, canvas.gather(1, chosen)))
    known.scatter_(1, chosen, take | known.gather(1, chosen))
    session.commit(choice, n_commit, canvas, known)
    return n_commit, n


def conditional_density(model, idx: torch.Tensor, known: torch.Tensor) -> torch.Tensor:
    """(B, T, V) probabilities p(x_j | known) for every unknown j in one burst forward; one-hot
    on known positions. Known tokens are fed in ascending position order."""
    req = prepare(model, idx, None, 1.0, None, known, "burst", "random", 1, "paper", None)
    B, T = req.canvas.shape
    conds = as_conditionals(model)
    with torch.no_grad(), eval_mode(model):
        session = conds.prefill(req.canvas, req.known)
        positions = torch.arange(T, device=req.canvas.device).expand(B, T)
        p = torch.softmax(session.draft(positions), dim=-1) if T > 0 else None
    V = conds.vocab_size
    one_hot = torch.nn.functional.one_hot(req.canvas, V).to(p.dtype if p is not None else torch.float32)
    return one_hot if p is None else torch.where(req.known[..., None], one_hot, p)


def log_likelihood(model, idx: torch.Tensor, order) -> torch.Tensor:
    """(B,) exact log-probability of ``idx`` (B, T) visited in ``order`` (a (B, T) permutation tensor,
    "left-to-right" or "fractal"): teacher forcing, one forward."""
    from . import orders as orders_mod
    from .request import check_order_tensor

    full = torch.ones_like(idx, dtype=torch.bool) if isinstance(idx, torch.Tensor) else None
    req = prepare(model, idx, None, 1.0, None, full, "burst", "random", 1, "paper", None)
    x = req.canvas
    B, T = x.shape
    if isinstance(order, str):
        if order not in ("left-to-right", "fractal"):
            raise ValueError(f"order must be 'left-to-right', 'fractal' or a (B, T) tensor, got {order!r}")
        order = orders_mod.make_orders(order, B, T, device=x.device)
    elif isinstance(order, torch.Tensor):
        order = check_order_tensor(order.to(x.device), x.shape)
    else:
        raise TypeError(f"order must be a str or a (B, T) tensor, got {type(order).__name__}")
    with torch.no_grad(), eval_mode(model):
        if is_sigma_gpt(model):
            cfg = model.config
            tokens, in_pos, out_pos, targets = orders_mod.shuffle(x, order, cfg.bos_token_id, cfg.start_pos)
            logits, _ = model(tokens, in_pos, out_pos)
        else:
            session = model.prefill(x, torch.zeros_like(x, dtype=torch.bool))
            targets = x.gather(1, order)
            logits = session.verify(order[:, None], targets[:, None])[:, 0]
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, targets[..., None]).squeeze(-1).sum(-1)
