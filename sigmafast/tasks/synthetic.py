"""The paper's 1-D synthetic tasks: product, step, permutation and random_walk.

Every generated task (these and the maze) shares :class:`SyntheticTask`'s
splits: "train" rows are drawn fresh from the caller's ``torch.Generator``;
"val" rows come from a fixed set of ``val_size`` rows generated once (lazily)
from :data:`VAL_SEED`, so the validation data never changes and is never written
to disk.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .base import Task, distinct_indices

VAL_SEED = 0x5167A  # seeds the fixed validation set of every generated task
SPLITS = ("train", "val")


def check_int(name: str, value, minimum: int = 1) -> int:
    """``value`` when it is an int >= ``minimum`` (a task's size argument), else a ValueError naming it."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def token_list(tokens) -> list[int]:
    """A 1-D tensor / sequence of ints as a Python list (for rendering only)."""
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        return [int(t) for t in tokens.tolist()]
    return [int(t) for t in tokens]


class SyntheticTask(Task):
    """A task whose rows come from a seeded generator (see the module docstring).

    Subclasses implement :meth:`_generate` and set ``vocab_size`` (BOS included,
    BOS = ``vocab_size - 1``) before calling ``super().__init__``.
    """

    def __init__(self, seq_len: int, vocab_size: int, val_size: int = 1024) -> None:
        self.seq_len = check_int("seq_len", seq_len)
        self.vocab_size = vocab_size
        self.bos = vocab_size - 1
        self.val_size = check_int("val_size", val_size)
        self._val_set: Optional[torch.Tensor] = None

    def _generate(self, batch_size: int, generator: torch.Generator) -> torch.Tensor:
        """(B, T) int64 fresh rows on ``generator.device``."""
        raise NotImplementedError

    def _val_rows(self) -> torch.Tensor:
        if self._val_set is None:
            self._val_set = self._generate(self.val_size, torch.Generator().manual_seed(VAL_SEED))
        return self._val_set

    def sample_batch(
        self, batch_size: int, split: str = "train", generator: Optional[torch.Generator] = None
    ) -> torch.Tensor:
        """(B, T) int64 rows on ``generator``'s device (CPU when it is None).

        - ``split="train"``: fresh rows drawn from ``generator`` (the global torch
          RNG when None).
        - ``split="val"``: rows of the fixed validation set; ``generator`` picks
          ``batch_size`` row indices uniformly (with replacement), and with no
          generator the batch is rows ``0 .. batch_size-1`` (cycling), so a
          generator in the same state always gives the same validation batch.
        """
        check_int("batch_size", batch_size)
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
        device = generator.device if generator is not None else torch.device("cpu")
        if split == "val":
            val = self._val_rows()
            if generator is None:
                index = torch.arange(batch_size) % self.val_size
            else:
                index = torch.randint(self.val_size, (batch_size,), generator=generator, device=device).cpu()
            return val[index].to(device)
        if generator is None:
            generator = torch.default_generator
        return self._generate(batch_size, generator)

    def val_sequences(self, num_sequences: int, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """(num_sequences, T) int64 distinct rows of the validation set, on ``generator``'s device, picked with
        ``generator`` (the first rows when None), for statistics that take them as independent."""
        index = distinct_indices(num_sequences, self.val_size, generator, f"validation rows of task {self.name!r}")
        return self._val_rows()[index].to(generator.device if generator is not None else "cpu")

    def _check_samples(self, samples: torch.Tensor) -> torch.Tensor:
        """Validate ``evaluate``'s input: a non-empty (B, seq_len) integer tensor, returned as int64."""
        if not isinstance(samples, torch.Tensor):
            raise TypeError(f"samples must be a torch.Tensor, got {type(samples).__name__}")
        if samples.dtype == torch.bool or samples.is_floating_point() or samples.is_complex():
            raise ValueError(f"samples must be an integer tensor of token ids, got dtype {samples.dtype}")
        if samples.dim() != 2 or samples.shape[0] < 1 or samples.shape[1] != self.seq_len:
            raise ValueError(
                f"samples must have shape (B >= 1, {self.seq_len}) for task {self.name!r}, "
                f"got {tuple(samples.shape)}"
            )
        return samples.long()


class ExactTask(SyntheticTask):
    """A synthetic task whose exact conditionals are known (:mod:`sigmafast.tasks.oracles`)."""

    def oracle(self):
        from .oracles import make_oracle

        return make_oracle(self)


class BinaryTask(ExactTask):
    """Sequences over {0, 1}; BOS = 2."""

    def decode(self, tokens) -> str:
        return "".join({0: "0", 1: "1", self.bos: "^"}.get(t, "?") for t in token_list(tokens))


class ProductTask(BinaryTask):
    """iid Bernoulli(``p_one``) tokens over {0, 1}; BOS = 2."""

    name = "product"

    def __init__(self, seq_len: int = 100, p_one: float = 0.1, val_size: int = 1024) -> None:
        if not isinstance(p_one, (int, float)) or isinstance(p_one, bool) or not 0.0 < p_one < 1.0:
            raise ValueError(f"p_one must be a float in (0, 1), got {p_one!r}")
        self.p_one = float(p_one)
        super().__init__(seq_len, vocab_size=3, val_size=val_size)

    def _generate(self, batch_size, generator):
        u = torch.rand(batch_size, self.seq_len, generator=generator, device=generator.device)
        return (u < self.p_one).long()

    def evaluate(self, samples: torch.Tensor) -> dict[str, float]:
        """``ones_rate``: the fraction of tokens equal to 1 (the data's rate is ``p_one``)."""
        x = self._check_samples(samples)
        return {"ones_rate": (x == 1).double().mean().item()}


class StepTask(BinaryTask):
    """Zeros with one run of ``run_length`` ones at a uniformly random offset; BOS = 2."""

    name = "step"

    def __init__(self, seq_len: int = 100, run_length: int = 10, val_size: int = 1024) -> None:
        self.run_length = check_int("run_length", run_length)
        if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < run_length:
            raise ValueError(f"seq_len must be an int >= run_length ({run_length}), got {seq_len!r}")
        super().__init__(seq_len, vocab_size=3, val_size=val_size)

    @property
    def n_offsets(self) -> int:
        """Number of possible run offsets (0 .. seq_len - run_length)."""
        return self.seq_len - self.run_length + 1

    def _generate(self, batch_size, generator):
        dev = generator.device
        offset = torch.randint(self.n_offsets, (batch_size, 1), generator=generator, device=dev)
        pos = torch.arange(self.seq_len, device=dev)  # (T,)
        return ((pos >= offset) & (pos < offset + self.run_length)).long()

    def evaluate(self, samples: torch.Tensor) -> dict[str, float]:
        """``valid``: fraction of rows with exactly one run of exactly ``run_length`` ones, zeros elsewhere."""
        x = self._check_samples(samples)
        binary = ((x == 0) | (x == 1)).all(dim=1)
        ones = x == 1
        n_runs = ones[:, 0].long() + (ones[:, 1:] & ~ones[:, :-1]).sum(dim=1)
        valid = binary & (ones.sum(dim=1) == self.run_length) & (n_runs == 1)
        return {"valid": valid.double().mean().item()}


class PermutationTask(ExactTask):
    """A uniformly random permutation of ``n_classes = seq_len`` classes; BOS = n_classes."""

    name = "permutation"

    def __init__(self, seq_len: int = 100, val_size: int = 1024) -> None:
        check_int("seq_len", seq_len, minimum=2)
        self.n_classes = seq_len
        super().__init__(seq_len, vocab_size=seq_len + 1, val_size=val_size)

    def _generate(self, batch_size, generator):
        keys = torch.rand(batch_size, self.seq_len, generator=generator, device=generator.device)
        return keys.argsort(dim=1)

    def evaluate(self, samples: torch.Tensor) -> dict[str, float]:
        """``valid``: fraction of rows that are permutations of ``0 .. n_classes-1``."""
        x = self._check_samples(samples)
        classes = torch.arange(self.n_classes, device=x.device)
        valid = (x.sort(dim=1).values == classes).all(dim=1)
        return {"valid": valid.double().mean().item()}

    def decode(self, tokens) -> str:
        return " ".join("<bos>" if t == self.bos else str(t) for t in token_list(tokens))


class RandomWalkTask(SyntheticTask):
    """The paper's lazy walk: start in ``starts`` uniformly, then steps -1 / +1 / 0 w.p. 0.4 / 0.4 / 0.2.

    Token = value - ``value_offset``. The vocabulary covers every value reachable
    in ``seq_len - 1`` steps from any start, plus BOS as the last id; with
    T = 100 the offset is 0, tokens equal values 0..239 and BOS = 240.
    """

    name = "random_walk"

    def __init__(
        self, seq_len: int = 100, starts: Sequence[int] = (100, 120, 130, 140), val_size: int = 1024
    ) -> None:
        check_int("seq_len", seq_len)
        starts = tuple(starts)
        if not starts or not all(isinstance(s, int) and not isinstance(s, bool) for s in starts):
            raise ValueError(f"starts must be a non-empty sequence of ints, got {starts!r}")
        self.starts = starts
        self.p_down, self.p_up, self.p_stay = 0.4, 0.4, 0.2
        self.value_offset = min(0, min(starts) - (seq_len - 1))
        max_value = max(starts) + seq_len - 1
        super().__init__(seq_len, vocab_size=max_value - self.value_offset + 2, val_size=val_size)

    def _generate(self, batch_size, generator):
        dev = generator.device
        starts = torch.tensor(self.starts, device=dev) - self.value_offset
        first = starts[torch.randint(len(self.starts), (batch_size, 1), generator=generator, device=dev)]
        u = torch.rand(batch_size, self.seq_len - 1, generator=generator, device=dev)
        steps = torch.where(u < self.p_down, -1, torch.where(u < self.p_down + self.p_up, 1, 0))  # (B, T-1)
        return torch.cat([first, first + steps.cumsum(dim=1)], dim=1)

    def evaluate(self, samples: torch.Tensor) -> dict[str, float]:
        """``valid``: fraction of rows with a valid start value and every step in {-1, 0, +1}."""
        x = self._check_samples(samples)
        # the vocabulary holds exactly the reachable values, so a valid walk never hits BOS
        starts = torch.tensor(self.starts, device=x.device) - self.value_offset
        good_start = torch.isin(x[:, 0], starts)
        good_steps = (x.diff(dim=1).abs() <= 1).all(dim=1)
        return {"valid": (good_start & good_steps).double().mean().item()}

    def decode(self, tokens) -> str:
        return " ".join("<bos>" if t == self.bos else str(t + self.value_offset) for t in token_list(tokens))
