"""Naive reference sampler: every strategy of :func:`sigmafast.generate`, uncached.

Each conditional is one full forward pass of the whole visited sequence
``[BOS, x_σ1 … x_σm]`` (in_pos ``[START, σ1 … σm]``, out_pos ``[σ1 … σm, j]``),
recomputed from scratch for every draft position and every verification step
of every order. Python loops over rows, orders and steps are deliberate: this
file is meant to be checked by eye, not to be fast. Several queries are
batched into one forward by padding *after* each sequence, which a causal model
cannot see.

It consumes the random tensors of :mod:`sigmafast.request` in the order
documented in :mod:`sigmafast.sampler`, so with the same ``torch.Generator`` it
returns the same tokens and statistics as the cached sampler (float64 models
make rounding ties negligible). Known tokens are fed first, in ascending
position order, like the cached sampler.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from .kernels import reference as ref
from .request import (ar_rank, build_stats, check_callback, check_request_memory, check_return_stats, draw, draw_burst,
                      inference, is_sigma_gpt, nonfinite_error, prepare)


def naive_logits(model, queries: list, seq_len: int) -> torch.Tensor:
    """(N, V) logits of N queries ``(positions, tokens, target)``.

    Query i feeds ``tokens`` at ``positions`` in that order after BOS and predicts
    position ``target``. Oracles get the same information as a canvas and mask.
    """
    N = len(queries)
    if is_sigma_gpt(model):
        cfg = model.config
        device = next(model.parameters()).device
        L = max(len(q[0]) for q in queries) + 1
        tokens = torch.full((N, L), cfg.bos_token_id, dtype=torch.long)
        in_pos = torch.full((N, L), cfg.start_pos, dtype=torch.long)
        out_pos = torch.zeros(N, L, dtype=torch.long)
        last = torch.zeros(N, dtype=torch.long)
        for i, (pos, tok, target) in enumerate(queries):
            m = len(pos)
            tokens[i, 1 : m + 1] = torch.tensor(tok, dtype=torch.long)
            in_pos[i, 1 : m + 1] = torch.tensor(pos, dtype=torch.long)
            out_pos[i, :m] = torch.tensor(pos, dtype=torch.long)
            out_pos[i, m] = target
            last[i] = m
        logits, _ = model(tokens.to(device), in_pos.to(device), out_pos.to(device))
        logits = logits[torch.arange(N, device=device), last.to(device)]
    else:
        canvas = torch.zeros(N, seq_len, dtype=torch.long)
        known = torch.zeros(N, seq_len, dtype=torch.bool)
        targets = torch.zeros(N, 1, dtype=torch.long)
        for i, (pos, tok, target) in enumerate(queries):
            canvas[i, pos] = torch.tensor(tok, dtype=torch.long)
            known[i, pos] = True
            targets[i, 0] = target
        dev = model.device
        logits = model.logits(canvas.to(dev), known.to(dev), targets.to(dev))[:, 0]
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    if bool(ref.nonfinite(logits)):
        raise nonfinite_error("logits")
    return logits


def _u(u: float) -> torch.Tensor:
    return torch.tensor([u], dtype=torch.float64)


def sample_one(logits, u: float, temperature: float, top_k: Optional[int]) -> int:
    """One inverse-CDF draw from (V,) logits, by the kernels' reference rule."""
    return int(ref.sample(logits[None], _u(u), temperature, top_k)[0][0])


def accept_one(q_logits, p_logits, x: int, u: float, temperature: float, top_k: Optional[int]) -> bool:
    """u < q(x) / p(x); greedy: x is the verifier's argmax."""
    if temperature == 0:
        return int(q_logits.argmax()) == x
    log_q = ref.log_probs(q_logits, temperature, top_k)[x]
    log_p = ref.log_probs(p_logits, temperature, top_k)[x]
    return u < float(torch.exp(log_q - log_p))


def residual_one(q_logits, p_logits, u: float, temperature: float, top_k: Optional[int]) -> int:
    """A draw from normalize(max(0, q - p)) (from q when that is all zero); greedy: argmax q."""
    return int(ref.residual_sample(q_logits[None], p_logits[None], _u(u), temperature, top_k)[0])


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
    """Same arguments and results as :func:`sigmafast.generate`, computed naively."""
    req = prepare(model, idx, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, known=known,
                  strategy=strategy, order=order, num_orders=num_orders, acceptance=acceptance, generator=generator)
    check_request_memory(model, req)
    check_callback(on_iteration)
    check_return_stats(return_stats)
    t0 = time.perf_counter()
    canvas, known_now = req.canvas.clone(), req.known.clone()
    B, T = canvas.shape
    history = [[j for j in range(T) if known_now[b, j]] for b in range(B)]  # visited positions, in order
    forward_calls = int(any(history) and not bool(known_now.all()))  # the prefill
    run = _autoregressive if req.strategy == "autoregressive" else _burst
    if bool(known_now.all()):  # nothing to sample: no draw, no model call
        accepted, lengths, calls = [], None if req.strategy == "autoregressive" else [], 0
    else:
        with inference(model):
            accepted, lengths, calls = run(model, req, canvas, known_now, history, on_iteration)
    stats = build_stats(accepted, lengths, B, canvas.device, forward_calls + calls, time.perf_counter() - t0)
    return (canvas, stats) if return_stats else canvas


def _tokens(canvas, b, positions) -> list[int]:
    return [int(canvas[b, j]) for j in positions]


def _autoregressive(model, req, canvas, known, history, on_iteration):
    B, T = canvas.shape
    keys = draw(req.generator, (B, T), canvas.device) if isinstance(req.order, str) and req.order == "random" else None
    u = draw(req.generator, (B, T), canvas.device)
    rank = ar_rank(req.order, keys, B, T, canvas.device)
    todo = [sorted((j for j in range(T) if not known[b, j]), key=lambda j, b=b: float(rank[b, j])) for b in range(B)]
    n_steps = max(len(t) for t in todo)
    accepted = []
    for s in range(n_steps):
        rows = [b for b in range(B) if s < len(todo[b])]
        queries = [(history[b], _tokens(canvas, b, history[b]), todo[b][s]) for b in rows]
        logits = naive_logits(model, queries, T)
        count = torch.zeros(B, dtype=torch.long, device=canvas.device)
        for i, b in enumerate(rows):
            j = todo[b][s]
            canvas[b, j] = sample_one(logits[i], float(u[b, j]), req.temperature, req.top_k)
            known[b, j] = True
            history[b].append(j)
            count[b] = 1
        accepted.append(count)
        if on_iteration is not None:
            on_iteration(canvas.clone(), known.clone())
    return accepted, None, n_steps


def _burst(model, req, canvas, known, history, on_iteration):
    B, T = canvas.shape
    O, temp, top_k = req.num_orders, req.temperature, req.top_k
    accepted, lengths, calls = [], [], 0
    while not bool(known.all()):
        d = draw_burst(req.generator, B, O, T, canvas.device)
        calls += 2
        count = torch.zeros(B, dtype=torch.long, device=canvas.device)
        length = torch.zeros(B, dtype=torch.long, device=canvas.device)
        for b in range(B):
            remaining = [j for j in range(T) if not known[b, j]]
            if not remaining:
                continue
            hist_tok = _tokens(canvas, b, history[b])
            p = dict(zip(remaining, naive_logits(model, [(history[b], hist_tok, j) for j in remaining], T)))
            draft = {j: sample_one(p[j], float(d.u_draft[b, j]), temp, top_k) for j in remaining}
            results = []
            for o in range(O):
                order = sorted(remaining, key=lambda j: float(d.keys[b, o, j]))
                queries = [
                    (history[b] + order[:k], hist_tok + [draft[j] for j in order[:k]], order[k])
                    for k in range(len(order))
                ]
                q = naive_logits(model, queries, T)
                n = 0
                for k, j in enumerate(order):
                    forced = req.acceptance == "paper" and k == 0
                    if not (forced or accept_one(q[k], p[j], draft[j], float(d.u_accept[b, j]), temp, top_k)):
                        break
                    n += 1
                results.append((n, order, q))
            choice = 0
            for o in range(1, O):
                if results[o][0] > results[choice][0]:
                    choice = o
            n, order, q = results[choice]
            new = [(j, draft[j]) for j in order[:n]]
            if req.acceptance == "lossless" and n < len(order):
                j = order[n]
                new.append((j, residual_one(q[n], p[j], float(d.u_residual[b, j]), temp, top_k)))
            for j, tok in new:
                canvas[b, j] = tok
                known[b, j] = True
                history[b].append(j)
            count[b] = len(new)
            length[b] = n
        accepted.append(count)
        lengths.append(length)
        if on_iteration is not None:
            on_iteration(canvas.clone(), known.clone())
    return accepted, lengths, calls
