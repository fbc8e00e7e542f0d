"""A user's numeric time series as a task: ``--task series --csv FILE --column NAME``.

Data. One column of a CSV file whose first row names the columns (read with
Python's :mod:`csv` module, blank lines skipped); the rows in file order are the
time axis. Every cell of the column must be a finite number. The first
``1 - val_fraction`` of the values are the train split and the rest the
validation split (a chronological split: validation data come after the
training data). A sequence is a window of ``seq_len`` consecutive values at a
uniformly random offset inside one split, so each split must hold one window.

Quantisation (:class:`UniformBins`). ``n_bins`` bins of equal width
``w = (hi - lo) / n_bins`` over a robust range ``[lo, hi]`` of the *train split
only*: its ``range_quantile`` and ``1 - range_quantile`` quantiles (0.1% and
99.9% by default, so a few outliers do not stretch every bin; 0 gives the
minimum and maximum). Token ``k`` stands for the bin centre
``lo + (k + 1/2) w``, so a value inside ``[lo, hi]`` decodes within ``w / 2`` of
itself; values outside are clipped to the first or last bin. BOS = ``n_bins``.

Checkpoints. The learned range is the constructor argument ``value_range``, and
:meth:`SeriesTask.checkpoint_kwargs` returns it, so a checkpoint rebuilds the
task with the bins it was trained with. Given a ``value_range``, the CSV is only
read when data are drawn, so a checkpoint still decodes if the file changed or
is gone.
"""

from __future__ import annotations

import csv as csv_module
import io
import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np
import torch

from ..data import sample_windows
from .base import Task, distinct_indices


@dataclass(frozen=True)
class UniformBins:
    """``n_bins`` equal bins over ``[low, high)``; token k decodes to the bin centre."""

    low: float
    high: float
    n_bins: int

    def __post_init__(self) -> None:
        if isinstance(self.n_bins, bool) or not isinstance(self.n_bins, int) or self.n_bins < 1:
            raise ValueError(f"n_bins must be an int >= 1, got {self.n_bins!r}")
        for name in ("low", "high"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if not self.high > self.low:
            raise ValueError(f"the bin range must have high > low, got [{self.low}, {self.high}]")

    @property
    def width(self) -> float:
        return (self.high - self.low) / self.n_bins

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        """Float values -> int64 tokens, clipped to ``0 .. n_bins - 1``."""
        k = ((values.double() - self.low) / self.width).floor()
        return k.clamp(0, self.n_bins - 1).long()

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """Tokens -> float64 bin centres; ids outside ``0 .. n_bins - 1`` are clipped to the nearest bin."""
        return self.low + (tokens.clamp(0, self.n_bins - 1).double() + 0.5) * self.width


def read_column(path: Union[str, Path], column: str) -> np.ndarray:
    """(N,) float64 values of ``column`` in the CSV file ``path``; clear errors for every bad input."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"series task: no CSV file at {path} (pass the file with --csv FILE)")
    values: list[float] = []
    try:
        text = path.read_bytes().decode("utf-8-sig")  # -sig: drop a spreadsheet's byte-order mark
    except UnicodeDecodeError as exc:
        raise ValueError(f"series task: {path} is not UTF-8 text ({exc})") from None
    with io.StringIO(text, newline="") as f:
        reader = csv_module.reader(f)
        header = next(reader, None)
        if header is None:
            raise ValueError(f"series task: {path} is empty; expected a header row naming the columns")
        names = [name.strip() for name in header]
        if column not in names:
            raise ValueError(
                f"series task: column {column!r} is not in {path}; available columns: {', '.join(map(repr, names))}"
            )
        index = names.index(column)
        for row in reader:
            if not row:
                continue
            cell = row[index].strip() if index < len(row) else ""
            try:
                value = float(cell)
            except ValueError:
                value = math.nan
            if not math.isfinite(value):
                raise ValueError(
                    f"series task: {path} line {reader.line_num}: column {column!r} holds {cell!r}, "
                    "expected a finite number"
                )
            values.append(value)
    return np.asarray(values, dtype=np.float64)


def _check_split(split: str) -> str:
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    return split


class SeriesTask(Task):
    """Windows of one numeric CSV column, quantised into ``n_bins`` tokens (see the module docstring)."""

    name = "series"

    def __init__(
        self,
        csv: Union[str, Path, None] = None,
        column: Optional[str] = None,
        seq_len: int = 64,
        n_bins: int = 256,
        val_fraction: float = 0.2,
        range_quantile: float = 0.001,
        value_range: Optional[Sequence[float]] = None,
    ) -> None:
        if csv is None:
            raise ValueError("the series task needs csv=PATH (--csv FILE), a CSV file with a header row")
        if not isinstance(column, str) or not column:
            raise ValueError(f"the series task needs column=NAME (--column NAME), got {column!r}")
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
        if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0 < val_fraction < 1:
            raise ValueError(f"val_fraction must be a number in (0, 1), got {val_fraction!r}")
        if isinstance(range_quantile, bool) or not isinstance(range_quantile, (int, float)) \
                or not 0 <= range_quantile < 0.5:
            raise ValueError(f"range_quantile must be a number in [0, 0.5), got {range_quantile!r}")
        self.path, self.column = Path(csv), column
        self.unit = f"{column} units"
        self.seq_len, self.val_fraction, self.range_quantile = seq_len, float(val_fraction), float(range_quantile)
        if value_range is None:
            train = self._splits["train"]
            lo, hi = np.quantile(train, [self.range_quantile, 1.0 - self.range_quantile])
            if not hi > lo:
                raise ValueError(
                    f"series task: column {column!r} of {self.path} is constant ({lo!r}) over the robust range of "
                    "its train split: nothing to model"
                )
            value_range = (float(lo), float(hi))
        elif not isinstance(value_range, (tuple, list)) or len(value_range) != 2:
            raise ValueError(f"value_range must be a pair (low, high), got {value_range!r}")
        self.bins = UniformBins(value_range[0], value_range[1], n_bins)
        self.vocab_size = n_bins + 1
        self.bos = n_bins

    @functools.cached_property
    def _splits(self) -> dict[str, np.ndarray]:
        """The column's values cut chronologically into train and val; read on first use."""
        values = read_column(self.path, self.column)
        cut = int(len(values) * (1.0 - self.val_fraction))
        splits = {"train": values[:cut], "val": values[cut:]}
        for split, data in splits.items():
            if len(data) < self.seq_len:
                need = math.ceil(self.seq_len / min(self.val_fraction, 1.0 - self.val_fraction))
                raise ValueError(
                    f"series task: column {self.column!r} of {self.path} has {len(values)} rows; its {split} split "
                    f"({len(data)} rows) is shorter than one window of seq_len={self.seq_len} "
                    f"(need about {need} rows, or a smaller --seq-len)"
                )
        return splits

    @property
    def value_positions(self) -> torch.Tensor:
        """(T,) bool: the positions holding values (all of them)."""
        return torch.ones(self.seq_len, dtype=torch.bool)

    def split_values(self, split: str) -> np.ndarray:
        """(N,) float64 raw values of ``split``."""
        return self._splits[_check_split(split)]

    @functools.cached_property
    def _tokens(self) -> dict[str, np.ndarray]:
        return {split: self.bins.encode(torch.from_numpy(v)).numpy() for split, v in self._splits.items()}

    def sample_batch(self, batch_size: int, split: str = "train", generator: Optional[torch.Generator] = None):
        """(B, T) tokens of windows at uniformly random offsets of ``split``, drawn with ``generator``."""
        return sample_windows(self._tokens[_check_split(split)], batch_size, self.seq_len, generator)

    def val_sequences(self, num_sequences: int, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """(num_sequences, T) int64 windows of the val split that share no value (its windows at offsets 0, T,
        2T, ...), picked with ``generator`` (the first ones when None), for statistics that take them as
        independent."""
        tokens = self._tokens["val"]
        starts = torch.arange(0, len(tokens) - self.seq_len + 1, self.seq_len)
        what = (f"windows of seq_len={self.seq_len} that share no value in the val split of {self.path} "
                f"({len(tokens)} values): ask for fewer sequences, or use a longer series")
        index = starts[distinct_indices(num_sequences, len(starts), generator, what)]
        index = index[:, None] + torch.arange(self.seq_len)  # (N, T)
        return torch.from_numpy(np.asarray(tokens[index.numpy()], dtype=np.int64))

    def checkpoint_kwargs(self) -> dict:
        return {"value_range": [self.bins.low, self.bins.high], "n_bins": self.bins.n_bins}

    def decode(self, tokens) -> str:
        """Values of the bin centres (6 significant digits), ``<bos>`` for BOS, ``?`` for other ids."""
        ids = torch.as_tensor([int(t) for t in tokens], dtype=torch.long)
        centres = self.bins.decode(ids).tolist()
        n = self.bins.n_bins
        return " ".join(f"{v:.6g}" if 0 <= t < n else "<bos>" if t == self.bos else "?"
                        for t, v in zip(ids.tolist(), centres))
