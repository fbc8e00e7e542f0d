"""Plain PyTorch references of the sampler's kernels (the model layers' are in ``reference_layers``).

These are the ground truth for the Triton kernels' tests and benchmarks, and
the CPU path of the sampler. Keep them short and obviously right.

Sampling conventions shared by every implementation:

* ``temperature > 0``: logits are divided by the temperature, then, with
  ``top_k``, every logit below the k-th largest is set to ``-inf`` (ties with the
  k-th value are kept). ``temperature == 0`` means greedy: the token is the
  first argmax and its log-prob is 0.
* Inverse CDF: with ``probs`` the resulting distribution, the sampled token is
  the first index ``i`` with ``cumsum(probs)[i] > u * sum(probs)``, clamped to
  the last index of nonzero probability.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

RULES = ("paper", "lossless")


def _scale(q: torch.Tensor, scale: Optional[float]) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def burst_attention(q, k, v, k_cache, v_cache, cache_lens, scale=None) -> torch.Tensor:
    """Attention of R independent queries over a KV cache plus their own key.

    q, k, v: (B, H, R, D); k_cache, v_cache: (B, H, L, D); cache_lens: (B,).
    Query r attends to ``cache[:cache_lens[b]]`` and to ``(k[r], v[r])`` only.
    Returns (B, H, R, D).
    """
    q = q * _scale(q, scale)
    L = k_cache.shape[2]
    valid = torch.arange(L, device=q.device) < cache_lens[:, None]  # (B, L)
    s_cache = (q @ k_cache.transpose(-1, -2)).masked_fill_(~valid[:, None, None, :], float("-inf"))  # (B, H, R, L)
    s_self = (q * k).sum(-1, keepdim=True)  # (B, H, R, 1)
    p = torch.softmax(torch.cat([s_cache, s_self], dim=-1), dim=-1)
    return p[..., :L] @ v_cache + p[..., L:] * v


def verify_attention(q, k, v, k_cache, v_cache, cache_lens, scale=None) -> torch.Tensor:
    """Causal attention of O orders of R tokens that share one KV-cache prefix.

    q, k, v: (B, O, H, R, D); k_cache, v_cache: (B, H, L, D); cache_lens: (B,).
    Token r of order o attends to ``cache[:cache_lens[b]]`` and to tokens
    ``0..r`` of order o. Returns (B, O, H, R, D). With more queries than the
    head dim (R > D) the keys are ``[cache; order o's tokens]``, the prefix
    repeated per order, and one product scores them; with fewer, the prefix is
    scored once for every order's queries and the orders' own keys apart,
    which saves copying the prefix (the Triton kernel reads it once either way).
    """
    B, O, H, R, D = q.shape
    L = k_cache.shape[2]
    q = q * _scale(q, scale)
    valid = torch.arange(L, device=q.device) < cache_lens[:, None]  # (B, L)
    causal = torch.ones(R, R, dtype=torch.bool, device=q.device).tril()
    hidden = ~torch.cat([valid[:, None, :].expand(B, R, L), causal.expand(B, R, R)], dim=-1)[:, None, None]
    if R > D:
        keys = torch.cat([k_cache[:, None].expand(B, O, H, L, D), k], dim=3)  # (B, O, H, L + R, D)
        values = torch.cat([v_cache[:, None].expand(B, O, H, L, D), v], dim=3)
        p = torch.softmax((q @ keys.transpose(-1, -2)).masked_fill_(hidden, float("-inf")), dim=-1)
        return p @ values
    q_rows = q.transpose(1, 2).reshape(B, H, O * R, D)  # every order's queries against the one prefix
    s_cache = (q_rows @ k_cache.transpose(-1, -2)).view(B, H, O, R, L).transpose(1, 2)  # (B, O, H, R, L)
    scores = torch.cat([s_cache, q @ k.transpose(-1, -2)], dim=-1)  # (B, O, H, R, L + R)
    p = torch.softmax(scores.masked_fill_(hidden, float("-inf")), dim=-1)
    p_cache = p[..., :L].transpose(1, 2).reshape(B, H, O * R, L)
    return (p_cache @ v_cache).view(B, H, O, R, D).transpose(1, 2) + p[..., L:] @ v


def process_logits(logits: torch.Tensor, temperature: float, top_k: Optional[int]) -> torch.Tensor:
    """Temperature and top-k applied to (..., V) logits (temperature > 0). At temperature 1 without top-k this
    is ``logits`` itself (x / 1 == x): not to be written in place."""
    out = logits if temperature == 1 else logits / temperature
    if top_k is not None and top_k < out.shape[-1]:
        out = torch.where(out < kth_largest(out, top_k)[..., None], float("-inf"), out)  # NaN kept, as masked_fill
    return out


KTH_CHUNK = 64  # columns per chunk of kth_largest's prefilter


def kth_largest(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """(...,) k-th largest value of each (..., V) row, the top-k threshold (values equal to it are kept).

    Exactly ``logits.topk(top_k).values[..., -1]``, NaN counted as the largest value as in ``topk``. Rows of
    at least ``8 * top_k`` whole chunks of ``KTH_CHUNK`` columns take a prefilter, and ``topk`` then reads the
    k chunks with the largest maxima and the partial last chunk instead of the whole row. Why it is exact: let
    m be the k-th largest chunk maximum and t the k-th largest value. k values are >= m, so m <= t. If t > m,
    every value >= t lies in a chunk whose maximum exceeds m, and all such chunks are picked; if t == m, the k
    picked maxima are values >= t. Either way the kept columns hold k values >= t, and no value above it.
    """
    V = logits.shape[-1]
    G = V // KTH_CHUNK
    if G < 8 * top_k:
        return logits.topk(top_k, dim=-1).values[..., -1]
    chunks = logits[..., : G * KTH_CHUNK].unflatten(-1, (G, KTH_CHUNK))  # (..., G, S), a view
    picked = chunks.amax(-1).topk(top_k, dim=-1, sorted=False).indices  # (..., k)
    kept = chunks.gather(-2, picked[..., None].expand(*picked.shape, KTH_CHUNK)).flatten(-2)  # (..., k * S)
    return torch.cat([kept, logits[..., G * KTH_CHUNK:]], dim=-1).topk(top_k, dim=-1).values[..., -1]


def log_probs(logits: torch.Tensor, temperature: float, top_k: Optional[int]) -> torch.Tensor:
    """(..., V) log-probabilities of the processed distribution (temperature > 0)."""
    return torch.log_softmax(process_logits(logits, temperature, top_k), dim=-1)


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """(N, V) unnormalised probabilities and (N,) uniforms -> (N,) token ids."""
    cdf = probs.cumsum(-1)  # nondecreasing: probs >= 0
    total = cdf[:, -1:].contiguous()
    target = uniforms.to(cdf.dtype)[:, None] * total  # <= total
    token = torch.searchsorted(cdf, target, right=True)  # the first i with cdf[i] > target
    last = torch.searchsorted(cdf, total)  # the first i with cdf[i] == total: the sum's last growth, or 0
    return torch.minimum(token, last).squeeze(-1).clamp_max_(probs.shape[-1] - 1)  # the clamp: NaN rows


def upcast(logits: torch.Tensor) -> torch.Tensor:
    """16-bit logits as float32: probabilities are compared in float32 at least (as the kernels do)."""
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


def sample(logits, uniforms, temperature=1.0, top_k=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row by inverse CDF.

    logits: (N, V); uniforms: (N,) in [0, 1). Returns tokens (N,) int64 and
    their log-probabilities (N,) under the processed distribution, in float32
    for 16-bit logits (computed from their float32 values), else the logits' dtype.
    A row that is not finite (a NaN or +inf, or no finite entry) has no
    distribution: its token is unspecified (the backends may differ) and its
    log-prob NaN; ``kernels.sample(..., flag=)`` reports such rows.
    """
    logits = upcast(logits)
    if temperature == 0:
        return logits.argmax(-1), torch.zeros(logits.shape[0], dtype=logits.dtype, device=logits.device)
    probs = torch.softmax(process_logits(logits, temperature, top_k), dim=-1)
    tokens = inverse_cdf(probs, uniforms)
    return tokens, probs.gather(-1, tokens[:, None]).squeeze(-1).log()


def residual_sample(q_logits, p_logits, uniforms, temperature=1.0, top_k=None) -> torch.Tensor:
    """Sample from normalize(max(0, q - p)), the speculative-sampling residual.

    q_logits, p_logits: (N, V); uniforms: (N,). Rows whose residual is all zero
    (q == p) sample from q. Greedy (temperature 0) returns argmax q.
    Returns (N,) int64 tokens. 16-bit logits are read as float32.
    """
    q_logits, p_logits = upcast(q_logits), upcast(p_logits)
    if temperature == 0:
        return q_logits.argmax(-1)
    q = torch.softmax(process_logits(q_logits, temperature, top_k), dim=-1)
    p = torch.softmax(process_logits(p_logits, temperature, top_k), dim=-1)
    r = (q - p).clamp_min(0)
    empty = r.sum(-1, keepdim=True) <= 0
    return inverse_cdf(torch.where(empty, q, r), uniforms)


class Acceptance(NamedTuple):
    logq: torch.Tensor  # (B, O, R) log q of each draft (0 when greedy)
    accept: torch.Tensor  # (B, O, R) bool, per-token test (first forced for "paper")
    n_accept: torch.Tensor  # (B, O) int64 accepted prefix length, <= lengths
    best: torch.Tensor  # (B,) int64 order with the longest prefix (first on ties)
    first_reject: torch.Tensor  # (B, O) int64 index of the first rejection, == lengths if none
    n_best: torch.Tensor  # (B,) int64 the best order's accepted prefix length


def acceptance(
    logits, drafts, draft_logp, uniforms, lengths, temperature=1.0, top_k=None, rule="paper"
) -> Acceptance:
    """Accept/reject drafts scored by the verification forward.

    logits: (B, O, R, V) verifier logits (q); drafts: (B, O, R) int64 draft tokens
    in visiting order; draft_logp: (B, O, R) their log p under the draft;
    uniforms: (B, O, R); lengths: (B,) number of valid steps per row (R_b <= R).

    Token k is accepted when ``u_k < exp(logq_k - logp_k)``; greedy (temperature
    0) accepts when the draft is the verifier's argmax. A draft outside the
    vocabulary has log q = -inf: it is rejected. The "paper" rule always
    accepts k = 0 (q = p there mathematically); "lossless" does not. log q is
    float32 for 16-bit logits (computed from their float32 values, as ``sample``
    does), else in the logits' dtype.
    """
    if rule not in RULES:
        raise ValueError(f"acceptance rule must be one of {RULES}, got {rule!r}")
    return decide(draft_scores(logits, drafts, temperature, top_k), drafts, draft_logp, uniforms, lengths,
                  temperature, rule)


def draft_scores(logits, drafts, temperature=1.0, top_k=None) -> torch.Tensor:
    """(...) scores of the (...) drafts under the (..., V) logits, as :func:`decide` takes them: log q of
    each draft (-inf outside the vocabulary), or the logits' argmax when greedy (temperature 0)."""
    if temperature == 0:
        return logits.argmax(-1)
    V = logits.shape[-1]
    scores = log_probs(upcast(logits), temperature, top_k).gather(-1, drafts.clamp(0, V - 1)[..., None])
    return scores.squeeze(-1).masked_fill((drafts < 0) | (drafts >= V), float("-inf"))


def decide(scores, drafts, draft_logp, uniforms, lengths, temperature=1.0, rule="paper") -> Acceptance:
    """The accept/reject decisions from per-draft scores (B, O, R).

    ``scores`` is log q of each draft, or the verifier's argmax token when
    ``temperature == 0``. Shared by the reference and the Triton kernels, so
    that both decide identically from the same scores.
    """
    R = drafts.shape[-1]
    if temperature == 0:
        logq = torch.zeros(drafts.shape, dtype=draft_logp.dtype, device=drafts.device)
        ok = scores == drafts
    else:
        logq = scores
        ok = uniforms.to(logq.dtype) < torch.exp(logq - draft_logp.to(logq.dtype))
    steps = torch.arange(R, device=drafts.device)
    if rule == "paper":
        ok = ok | (steps == 0)
    valid = steps[None, None, :] < lengths[:, None, None]  # (B, 1, R)
    prefix = (ok & valid).long().cumprod(-1)
    n_accept = prefix.sum(-1)  # (B, O)
    best = n_accept.argmax(-1)
    return Acceptance(logq, ok, n_accept, best, n_accept.clone(), n_accept.amax(-1))


def chosen_order(orders: torch.Tensor, choice: torch.Tensor) -> torch.Tensor:
    """(B, O, R) orders (or per-order tokens) and (B,) choices -> (B, R) the chosen order of each row; a
    (B, R) tensor, already one row per batch row, as is."""
    if orders.ndim == 2:
        return orders
    return orders[:, 0] if orders.shape[1] == 1 else rows_at(orders, choice)


def write_canvas(canvas, known, chosen, n, tokens) -> None:
    """Write ``tokens[b, :n[b]]`` at the positions ``chosen[b, :n[b]]`` (B, R) of canvas and mark them known."""
    take = torch.arange(chosen.shape[1], device=n.device)[None, :] < n[:, None]  # (B, R)
    canvas.scatter_(1, chosen, torch.where(take, tokens, canvas.gather(1, chosen)))
    known.scatter_(1, chosen, take | known.gather(1, chosen))


def append_kv(k_cache, v_cache, lens, k_new, v_new, n) -> None:
    """Append rows ``r < n[b]`` of k_new, v_new (n_layer, B, H, R, D) after each row's ``lens[b]`` in the
    (n_layer, B, H, L + 1, D) caches; the other rows go to the scratch slot L. Advances ``lens``."""
    L, B, H, R, D = k_new.shape
    max_len = k_cache.shape[3] - 1
    steps = torch.arange(R, device=n.device)
    dest = torch.where(steps[None, :] < n[:, None], lens[:, None] + steps[None, :], max_len)  # (B, R)
    index = dest[None, :, None, :, None].expand(L, B, H, R, D)
    k_cache.scatter_(3, index, k_new.to(k_cache.dtype))
    v_cache.scatter_(3, index, v_new.to(v_cache.dtype))
    lens += n


def commit(orders, choice, n, tokens, keys, values, *, canvas, known, last_tok, last_pos, k_cache, v_cache,
           lens, flag=None, status=None, residual=None, residual_step=None) -> None:
    """Append the first ``n[b]`` steps of order ``choice[b]`` to a session's buffers, in place.

    orders: (B, O, R) positions; choice, n: (B,) (0 <= n <= R); tokens: (B, R), the chosen order's
    tokens by step, or (B, O, R), every order's; keys, values: (n_layer, B, O, H, R, D) the
    verification's inputs. Writes the tokens into canvas (B, T) and known, the keys and values after
    ``lens`` into the caches (n_layer, B, H, L + 1, D), advances ``lens`` and sets last_tok, last_pos (B,)
    to step ``n[b] - 1`` where n[b] > 0. With a (3,) ``status`` and the () bool ``flag``, then writes
    :func:`burst_status` of the new known mask into ``status``. With (B,) ``residual`` tokens and their
    ``residual_step``, the token committed at that step (when below n) is the residual one (the lossless
    rule's draw at its first rejected step).
    """
    B, O, R = orders.shape
    chosen, tokens = chosen_order(orders, choice), chosen_order(tokens, choice)  # (B, R) each
    if residual is not None:
        tokens = splice(tokens, residual_step, residual)
    write_canvas(canvas, known, chosen, n, tokens)
    if O == 1:
        k, v = keys[:, :, 0], values[:, :, 0]  # (n_layer, B, H, R, D) views
    else:
        rows = torch.arange(B, device=orders.device)
        k, v = keys[:, rows, choice], values[:, rows, choice]  # one gather for every layer
    append_kv(k_cache, v_cache, lens, k, v, n)
    last = (n - 1).clamp_min(0)[:, None]
    moved = n > 0
    last_pos.copy_(torch.where(moved, chosen.gather(1, last).squeeze(1), last_pos))
    last_tok.copy_(torch.where(moved, tokens.gather(1, last).squeeze(1), last_tok))
    if status is not None:
        status.copy_(burst_status(known, flag))


def nonfinite(values: torch.Tensor, used: Optional[torch.Tensor] = None) -> torch.Tensor:
    """() bool: some used row of ``values`` (..., N) holds a NaN or +inf, or has no finite entry.

    ``used`` (the leading dims of ``values``, broadcastable; None: every row) masks padding and
    finished rows. A row's maximum is finite exactly when the row is usable: NaN propagates through
    it, and an oracle's -inf (probability 0) entries are fine as long as one entry is finite."""
    m = values.amax(-1)
    bad = (m - m) != 0  # NaN exactly when m is NaN or ±inf: two ops where isfinite takes five on CUDA
    return (bad if used is None else bad & used).any()


def flag_nonfinite(values, used, flag) -> None:
    """Set the () bool ``flag`` in place when some used row of ``values`` (..., N) holds a NaN or +inf,
    or has no finite entry (:func:`nonfinite`; ``used``: None or a bool mask
    broadcastable to the leading dims). Never clears it."""
    flag.logical_or_(nonfinite(values, used))


def flag_nan_ratios(logq, draft_logp, lengths, flag) -> None:
    """Set the () bool ``flag`` in place when the ratio ``exp(log q - log p)`` of a (B, O, R) step below its
    row's ``lengths`` (B,) is NaN (never clears it): log q is NaN exactly when the verifier's logits row holds
    a NaN or +inf or has no finite entry (and log p when the draft's does; a drawn draft has log p > -inf)."""
    valid = torch.arange(logq.shape[-1], device=logq.device) < lengths[:, None, None]  # (B, 1, R)
    flag.logical_or_((torch.isnan(logq - draft_logp.to(logq.dtype)) & valid).any())


def flagged(res: Acceptance, draft_logp, lengths, flag) -> Acceptance:
    """``res`` after :func:`flag_nan_ratios` of its log q when a () bool ``flag`` is given (None: no check)."""
    if flag is not None:
        flag_nan_ratios(res.logq, draft_logp, lengths, flag)
    return res


def burst_status(known, flag) -> torch.Tensor:
    """(3,) int64 from the (B, T) known mask and the () bool flag: the largest unknown count of a row
    (0 with no rows), the number of rows with one, and 1 if ``flag`` else 0."""
    left = (~known).sum(1)
    top = left.max() if left.numel() else left.new_zeros(())
    return torch.stack([top, (left > 0).sum(), flag.long()])


def plan_step(steps, step) -> torch.Tensor:
    """The (W, B) column ``step`` (a () int64) of the (W, B, T) ``steps``; then ``step += 1``, in place."""
    W, B, _ = steps.shape
    now = steps.gather(2, step.expand(W, B, 1)).squeeze(2)
    step.add_(1)
    return now


def along(values: torch.Tensor, orders: torch.Tensor) -> torch.Tensor:
    """(B, T) values by position -> (B, O, S) in the visiting order of each of the (B, O, S) ``orders``."""
    B, O, S = orders.shape
    return values[:, None, :].expand(B, O, values.shape[1]).gather(2, orders)


def residual_pick(n, remaining, orders, slots, u_residual, drafts, verifier):
    """The lossless rule's residual draw of each row at step k = min(n, R - 1) of the (B, R) order: the (B, T)
    uniform at its position, the committed count n + rejected (a row rejected when n < remaining: the
    residual token then goes at step n), and the rows the residual is drawn from: the (B, R', V) draft
    logits at the step's slot and the (B, R, X) verifier's at k."""
    k = n.clamp(max=orders.shape[1] - 1)[:, None]  # (B, 1)
    u = u_residual.gather(1, orders.gather(1, k)).squeeze(1)
    slot = slots.gather(1, k).squeeze(1)
    return u, n + (n < remaining).long(), rows_at(drafts, slot), rows_at(verifier, k.squeeze(1))


def rows_at(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(B, R, X) rows of ``x`` at the (B,) ``index``: (B, X), one gather."""
    return x.gather(1, index[:, None, None].expand(-1, 1, x.shape[-1])).squeeze(1)


def splice(tokens, step, tok):
    """``tokens`` (B, R) with ``tok`` (B,) at ``step`` (B,) (none where step is outside [0, R))."""
    at = torch.arange(tokens.shape[1], device=step.device)[None, :] == step[:, None]  # (B, R)
    return torch.where(at, tok[:, None], tokens)


def draft_slots(known, uniforms, keys, R: int):
    """A burst iteration's R draft slots of a (B, T) known mask: positions (a row's unknown positions in
    increasing order, then its known ones), the (B, T) uniforms at them, used (slot < the row's unknown
    count), the (B,) unknown counts and the (B, O, R) visiting orders of the (B, O, T) ``keys``
    (:func:`visit_orders`)."""
    positions = known.to(torch.int8).argsort(dim=1, stable=True)[:, :R]  # (B, R)
    remaining = (~known).sum(1)  # (B,)
    used = torch.arange(R, device=known.device)[None, :] < remaining[:, None]
    return positions, uniforms.gather(1, positions), used, remaining, visit_orders(keys, known, R)


def visit_orders(keys, known, R: int):
    """The first R steps of a burst iteration's (B, O, T) visiting orders: each order's unknown positions by
    increasing key (ties by position), then the row's known positions in increasing order."""
    return keys.masked_fill(known[:, None, :], 2.0).argsort(dim=-1, stable=True)[..., :R]  # keys in [0, 1)


def gather_drafts(positions, tokens, logp, canvas, known, uniforms, orders):
    """Each (B, O, S) order step's draft token, log-prob, uniform and slot in the (B, R) ``positions``:
    the draft of its position, or at a known position the canvas token, log-prob 0 and slot 0."""
    B, R = positions.shape
    slot_of = torch.zeros_like(canvas).scatter(1, positions, torch.arange(R, device=canvas.device).expand(B, R))
    known_o = along(known, orders)
    slot_o = along(slot_of, orders).masked_fill(known_o, 0)
    flat = slot_o.flatten(1)
    tok_o = torch.where(known_o, along(canvas, orders), tokens.gather(1, flat).view_as(slot_o))
    logp_o = logp.gather(1, flat).view_as(slot_o).masked_fill(known_o, 0.0)
    return tok_o, logp_o, along(uniforms, orders), slot_o
