"""The task interface shared by every data source (synthetic, maze, text)."""

from __future__ import annotations

from typing import Optional

import torch


def distinct_indices(num: int, total: int, generator: Optional[torch.Generator], what: str) -> torch.Tensor:
    """(num,) int64 CPU indices of ``num`` distinct items among ``total``, drawn with ``generator`` (the first
    ``num`` when None); a ``ValueError`` naming ``what`` the items are when there are fewer than ``num``."""
    if not isinstance(num, int) or isinstance(num, bool) or num < 1:
        raise ValueError(f"num_sequences must be an int >= 1, got {num!r}")
    if num > total:
        raise ValueError(f"num_sequences ({num}) exceeds the {total} {what}")
    if generator is None:
        return torch.arange(num)
    return torch.randperm(total, generator=generator, device=generator.device)[:num].cpu()


class Task:
    """A source of (B, T) token sequences with a reserved BOS id.

    Subclasses set ``name``, ``vocab_size`` (BOS included), ``seq_len`` and
    ``bos``, and implement :meth:`sample_batch`.
    """

    name: str = "task"
    vocab_size: int
    seq_len: int
    bos: int
    fixed_length: bool = False  # decode takes exactly seq_len tokens (a layout, such as the maze's)
    bos_in_data: bool = False  # the BOS id is also a data token (GPT-2's <|endoftext|> between documents)

    def sample_batch(
        self, batch_size: int, split: str = "train", generator: Optional[torch.Generator] = None
    ) -> torch.Tensor:
        """(B, T) int64 sequences in natural order, from ``split`` in {"train", "val"}."""
        raise NotImplementedError

    @property
    def prompt_mask(self) -> torch.Tensor:
        """(T,) bool: the positions given at test time (none by default)."""
        return torch.zeros(self.seq_len, dtype=torch.bool)

    def evaluate(self, samples: torch.Tensor) -> dict[str, float]:
        """Validity metrics of (B, T) generated sequences; {} when the task has none."""
        return {}

    def oracle(self):
        """An exact conditional "model" usable by ``sigmafast.generate``."""
        raise NotImplementedError(f"task {self.name!r} has no exact oracle")

    def check_data(self) -> None:
        """Raise now if the task's data is missing or unusable (tasks that read files do it lazily, so that
        a checkpoint loads without them); the trainer calls it first."""

    def checkpoint_kwargs(self) -> dict:
        """Arguments learned from the data (e.g. quantisation bins) that a checkpoint stores so that
        ``get_task(name, **kwargs, **checkpoint_kwargs())`` rebuilds this exact task; none by default."""
        return {}

    def decode(self, tokens) -> str:
        """Human-readable rendering of one sequence (of ``seq_len`` tokens when ``fixed_length``)."""
        return " ".join(str(int(t)) for t in tokens)

    def token_text(self, token: int) -> str:
        """One token as :meth:`decode` shows it inside a sequence (the live view renders tokens one by one)."""
        return self.decode([token])

    def encode(self, text: str) -> list[int]:
        """Token ids of a text prompt (text tasks only)."""
        raise NotImplementedError(f"task {self.name!r} does not take text prompts")
