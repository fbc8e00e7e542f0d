"""Exact conditional "models" of the synthetic tasks, for :func:`sigmafast.generate`.

An oracle gives the true distribution of any position given any set of
revealed tokens (the order in which they were revealed does not matter), as
log-probabilities with ``-inf`` for impossible tokens (BOS always). Revealed
sets that no sequence of the task can produce (verification steps after two
drafts that contradict each other) still get a proper distribution: uniform
over the unused classes for permutation, uniform over {0, 1} for step. The
sampler's decisions never depend on them, since acceptance stops at the first
token of probability 0. Everything is vectorised and computed in float64.

Oracles implement the sampler's conditionals protocol (see
:mod:`sigmafast.sampler`) plus ``logits(canvas, known, positions)``, which the
naive reference sampler uses.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import kernels
from ..engine import Verified

NEG_INF = float("-inf")


class Oracle:
    """Base class: subclasses implement :meth:`_probs` on (B, K, T) revealed sets."""

    def __init__(self, task, n_real: int) -> None:
        self.vocab_size = task.vocab_size
        self.block_size = task.seq_len
        self.bos = task.bos
        self.n_real = n_real  # real tokens are 0 .. n_real - 1
        self.device = torch.device("cpu")

    def to(self, device) -> "Oracle":
        self.device = torch.device(device)
        return self

    def _probs(self, canvas, known, positions, drafts=None) -> torch.Tensor:
        raise NotImplementedError

    def _to_logits(self, p: torch.Tensor) -> torch.Tensor:
        """(..., n_real) probabilities -> (..., V) log-probabilities, uniform where p sums to 0."""
        total = p.sum(-1, keepdim=True)
        p = torch.where(total > 0, p / total.clamp_min(1e-300), torch.full_like(p, 1.0 / self.n_real))
        out = torch.full((*p.shape[:-1], self.vocab_size), NEG_INF, dtype=torch.float64, device=p.device)
        out[..., : self.n_real] = p.log()
        return out

    def logits(self, canvas: torch.Tensor, known: torch.Tensor, positions: torch.Tensor,
               drafts: Optional[torch.Tensor] = None) -> torch.Tensor:
        """(B, T) canvas, known mask and (B, R) positions -> (B, R, V) exact log-probabilities; or (B, O, R)
        visiting orders with the (B, O, R) drafts at them -> (B, O, R, V): step k of order o conditioned on
        the known tokens and the drafts at steps < k."""
        return self._to_logits(self._probs(canvas, known, positions, drafts=drafts))

    def prefill(self, canvas: torch.Tensor, known: torch.Tensor) -> "OracleSession":
        if canvas.shape[-1] != self.block_size:  # its laws are those of whole sequences of the task
            raise ValueError(f"an oracle samples canvases of exactly its task's seq_len = {self.block_size} tokens, "
                             f"got {canvas.shape[-1]}: give a prompt and max_new_tokens that add up to it")
        return OracleSession(self, canvas, known)


class OracleSession:
    """An oracle's side of the sampler's session protocol (see :mod:`sigmafast.engine`): it owns the
    canvas and known mask that the sampler updates in place, so committing needs no work."""

    def __init__(self, oracle: Oracle, canvas: torch.Tensor, known: torch.Tensor) -> None:
        self.oracle = oracle
        self.canvas = canvas.clone()
        self.known = known.clone()
        self.nonfinite = torch.zeros((), dtype=torch.bool, device=canvas.device)  # set by a burst step (sticky)

    @property
    def batch_size(self) -> int:
        return self.canvas.shape[0]

    def select(self, rows: torch.Tensor) -> None:
        self.canvas, self.known = self.canvas[rows], self.known[rows]

    def draft(self, positions: torch.Tensor) -> torch.Tensor:
        return self.oracle.logits(self.canvas, self.known, positions)

    def verify(self, orders: torch.Tensor, drafts: Optional[torch.Tensor]) -> Verified:
        """Step k of order o conditions on the known tokens and drafts at steps < k (``drafts`` may be
        None when R == 1: no step has drafts before it)."""
        if drafts is None:
            drafts = torch.zeros_like(orders)  # never read: the only step has no draft before it
        return Verified(orders, None, self.oracle.logits(self.canvas, self.known, orders, drafts), None, None)

    def commit(self, verified: Verified, choice: torch.Tensor, n: torch.Tensor, tokens: torch.Tensor,
               status: Optional[torch.Tensor] = None, residual: Optional[torch.Tensor] = None,
               residual_step: Optional[torch.Tensor] = None) -> None:
        """Write the first ``n[b]`` tokens of order ``choice[b]`` ((B, R), or (B, O, R): every order's; with (B,)
        ``residual`` tokens, ``residual[b]`` at step ``residual_step[b]`` instead) into the canvas: the
        conditionals read it; into a (3,) int64 ``status``, also the burst status after it."""
        ref = kernels.reference
        tokens = ref.chosen_order(tokens, choice)  # (B, R)
        if residual is not None:
            tokens = ref.splice(tokens, residual_step, residual)
        ref.write_canvas(self.canvas, self.known, ref.chosen_order(verified.orders, choice), n, tokens)
        if status is not None:
            status.copy_(ref.burst_status(self.known, self.nonfinite))


class ProductOracle(Oracle):
    """iid Bernoulli(p_one) over {0, 1}: every conditional is the marginal."""

    def __init__(self, task) -> None:
        super().__init__(task, n_real=2)
        self.p_one = task.p_one

    def _probs(self, canvas, known, positions, drafts=None):
        p = torch.tensor([1.0 - self.p_one, self.p_one], dtype=torch.float64, device=canvas.device)
        return p.expand(*positions.shape, 2)


class StepOracle(Oracle):
    """One run of ``run_length`` ones among zeros: a uniform posterior over the consistent run offsets."""

    def __init__(self, task) -> None:
        super().__init__(task, n_real=2)
        T, L = task.seq_len, task.run_length
        offsets = torch.arange(T - L + 1)[:, None]
        pos = torch.arange(T)[None, :]
        self.runs = ((pos >= offsets) & (pos < offsets + L)).double()  # (S, T) ones of each offset

    def _probs(self, canvas, known, positions, drafts=None):
        runs = self.runs.to(canvas.device)  # (S, T)
        ones = (known & (canvas == 1)).double()
        zeros = (known & (canvas == 0)).double()
        other = (known & (canvas != 0) & (canvas != 1)).double().sum(1, keepdim=True)  # never consistent
        mismatch = ones @ (1 - runs).T + zeros @ runs.T + other  # (B, S)
        if drafts is None:
            consistent = (mismatch == 0).double()[:, None, :]  # (B, 1, S)
            at = runs.T[positions]  # (B, R, S) whether each offset puts a one at the position
            p_one = (consistent * at).sum(-1)
            p_zero = (consistent * (1 - at)).sum(-1)
        else:
            at = runs.T.bool()[positions]  # (B, O, R, S)
            bad = (drafts != 0) & (drafts != 1)
            step_mismatch = (at != (drafts == 1)[..., None]) | bad[..., None]
            before = step_mismatch.to(torch.int32).cumsum(2) - step_mismatch.to(torch.int32)
            consistent = (before == 0) & (mismatch == 0)[:, None, None, :]
            p_one = (consistent & at).sum(-1).double()
            p_zero = (consistent & ~at).sum(-1).double()
        return torch.stack([p_zero, p_one], dim=-1)


class PermutationOracle(Oracle):
    """A uniform permutation: uniform over the classes no revealed token uses."""

    def __init__(self, task) -> None:
        super().__init__(task, n_real=task.n_classes)

    def _probs(self, canvas, known, positions, drafts=None):
        C = self.n_real
        real = known & (canvas < C)
        used = torch.zeros(canvas.shape[0], C, dtype=torch.float64, device=canvas.device)
        used.scatter_add_(1, canvas.clamp(0, C - 1), real.double())  # (B, C) counts
        if drafts is None:
            free = (used == 0).double()[:, None, :]
            return free.expand(*positions.shape, C)
        one_hot = torch.nn.functional.one_hot(drafts.clamp(0, C - 1), C).double()
        one_hot = one_hot * (drafts < C)[..., None]  # (B, O, R, C)
        before = one_hot.cumsum(2) - one_hot
        return ((used[:, None, None, :] + before) == 0).double()


def make_oracle(task) -> Oracle:
    """The exact oracle of a product, step or permutation task."""
    oracles = {"product": ProductOracle, "step": StepOracle, "permutation": PermutationOracle}
    name = getattr(task, "name", None)
    if name not in oracles:
        raise ValueError(f"no exact oracle for task {name!r}; expected one of {sorted(oracles)}")
    return oracles[name](task)
