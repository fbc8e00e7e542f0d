"""Text language-modelling tasks: character-level on any file, GPT-2 BPE token files.

* ``CharTask``: vocabulary = the sorted distinct characters of one UTF-8 file
  plus one reserved BOS id (the last), first 90% for training, last 10% for
  validation. The quick demo: ``get_task("char", text="shakespeare.txt")``.
* ``TokenFileTask``: ``train.bin`` / ``val.bin`` written by
  ``scripts/prepare_owt.py`` (GPT-2 BPE, uint16, each document followed by
  ``<|endoftext|>``, which is also the BOS id 50256).

Both draw random windows of ``seq_len`` tokens; a split must hold at least one.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Optional, Union

import numpy as np
import torch

from ..data import (
    GPT2_EOT,
    GPT2_VOCAB_SIZE,
    TOKEN_DTYPE,
    check_vocab_size,
    gpt2_encoding,
    load_token_file,
    read_text,
    sample_windows,
    split_paths,
)
from .base import Task

TOKEN_DATASETS = {
    "owt": dict(data_dir="data/owt", prepare="python scripts/prepare_owt.py --data-dir {data_dir}"),
    "wikitext103": dict(
        data_dir="data/wikitext103",
        prepare="python scripts/prepare_owt.py --source wikitext103 --data-dir {data_dir}",
    ),
}


def _check_split(split: str) -> str:
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    return split


def _check_seq_len(seq_len) -> int:
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    return seq_len


def token_ids(tokens, vocab_size: int) -> list[int]:
    """``tokens`` as a list of ints; a ``ValueError`` naming the ids outside ``[0, vocab_size)``."""
    ids = [int(t) for t in tokens]
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"token ids {bad[:5]} are outside [0, {vocab_size})")
    return ids


class CharTask(Task):
    """Character-level modelling of one UTF-8 text file (``text`` is its path).

    ``chars`` (the vocabulary, stored by checkpoints) makes the task usable without the file: encoding,
    decoding and sampling from a model need only the vocabulary, and the file is read on the first batch.
    """

    def __init__(self, text: Union[str, Path, None] = None, seq_len: int = 256, val_fraction: float = 0.1,
                 chars: Optional[str] = None):
        if text is None:
            raise ValueError("the char task needs text=PATH (--text FILE), a UTF-8 text file")
        self.seq_len = _check_seq_len(seq_len)
        if not 0.0 < float(val_fraction) < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
        if chars is not None and (not isinstance(chars, str) or not chars):
            raise ValueError(f"chars must be a nonempty str (the vocabulary), got {chars!r}")
        if chars is not None and list(chars) != sorted(set(chars)):
            raise ValueError(f"chars must list distinct characters in code-point order (a checkpoint's vocabulary), "
                             f"got {chars!r}")
        self.name = "char"
        self.path = Path(text)
        self.val_fraction = float(val_fraction)
        self.chars = sorted(set(self._content)) if chars is None else list(chars)
        self.bos = len(self.chars)
        self.vocab_size = len(self.chars) + 1
        check_vocab_size(self.vocab_size)
        self._index = {c: i for i, c in enumerate(self.chars)}
        if chars is None:
            self.check_data()

    @functools.cached_property
    def _content(self) -> str:
        return read_text(self.path, "char task text file (--text FILE)")

    @functools.cached_property
    def _data(self) -> dict[str, np.ndarray]:
        """The text as token ids, cut into train and val; read on first use."""
        codepoints = np.frombuffer(self._content.encode("utf-32-le"), dtype=np.uint32)
        unique = np.array([ord(c) for c in self.chars], dtype=np.uint32)  # sorted code points = sorted chars
        ids = np.searchsorted(unique, codepoints)
        outside = (ids >= len(unique)) | (unique[np.minimum(ids, len(unique) - 1)] != codepoints)
        if outside.any():
            raise ValueError(f"char task: {self.path} holds characters outside the vocabulary of the checkpoint "
                             f"(e.g. {chr(int(codepoints[outside][0]))!r})")
        ids = ids.astype(TOKEN_DTYPE)
        cut = int(len(ids) * (1.0 - self.val_fraction))
        data = {"train": ids[:cut], "val": ids[cut:]}
        for split, part in data.items():
            if len(part) < self.seq_len:
                raise ValueError(
                    f"char task: {self.path} has {len(ids)} characters; its {split} split ({len(part)}) is "
                    f"shorter than one window of seq_len={self.seq_len}"
                )
        return data

    def check_data(self) -> None:
        self._data  # noqa: B018  (reads and checks the file)

    def checkpoint_kwargs(self) -> dict:
        return {"chars": "".join(self.chars)}

    def sample_batch(self, batch_size: int, split: str = "train", generator: Optional[torch.Generator] = None):
        return sample_windows(self._data[_check_split(split)], batch_size, self.seq_len, generator)

    def encode(self, text: str) -> list[int]:
        unknown = sorted(set(text) - self._index.keys())
        if unknown:
            raise ValueError(f"characters {unknown!r} are not in the vocabulary (the characters {self.path} held "
                             f"when the task was built: a checkpoint keeps them)")
        return [self._index[c] for c in text]

    def decode(self, tokens) -> str:
        return "".join(self.chars[i] for i in token_ids(tokens, self.vocab_size) if i != self.bos)


class TokenFileTask(Task):
    """GPT-2 BPE token files ``data_dir/{train,val}.bin`` of ``owt`` or ``wikitext103``.

    The files are opened on first use (:meth:`check_data`, the first batch): encoding, decoding and
    sampling from a model need only GPT-2's BPE."""

    bos_in_data = True

    def __init__(self, name: str = "owt", data_dir: Union[str, Path, None] = None, seq_len: int = 1024):
        if name not in TOKEN_DATASETS:
            raise ValueError(f"token dataset must be one of {sorted(TOKEN_DATASETS)}, got {name!r}")
        self.name = name
        self.seq_len = _check_seq_len(seq_len)
        self.vocab_size = GPT2_VOCAB_SIZE
        self.bos = GPT2_EOT
        self.data_dir = Path(data_dir if data_dir is not None else TOKEN_DATASETS[name]["data_dir"])

    @functools.cached_property
    def _data(self) -> dict[str, np.ndarray]:
        if self.data_dir.exists() and not self.data_dir.is_dir():
            raise ValueError(f"{self.name}: data_dir {self.data_dir} is a file; it must be the folder of the token "
                             f"files (train.bin, val.bin)")
        paths = split_paths(self.data_dir)
        missing = [str(p) for p in paths.values() if not p.is_file()]
        if missing:
            raise FileNotFoundError(self._missing_message(missing))
        try:
            return {split: load_token_file(path, self.seq_len) for split, path in paths.items()}
        except ValueError as exc:
            prepare = TOKEN_DATASETS[self.name]["prepare"].format(data_dir=self.data_dir)
            raise ValueError(
                f"{exc}. Rebuild the token files ({prepare} ...), from more text or with a larger --val-fraction "
                "if a split is too short for seq_len"
            ) from exc

    def check_data(self) -> None:
        self._data  # noqa: B018  (opens and checks the files)

    def _missing_message(self, missing: list[str]) -> str:
        prepare = TOKEN_DATASETS[self.name]["prepare"].format(data_dir=self.data_dir)
        lines = [
            f"{self.name}: missing token file(s) {', '.join(missing)}. Build them first (nothing is downloaded "
            "automatically):",
            f"  {prepare}",
        ]
        if self.name == "owt":
            lines += [
                "  (full OpenWebText, ~54 GB of downloads and ~17 GB of tokens; needs: pip install -e \".[data]\")",
                "or a streamed subset of N documents:",
                f"  python scripts/prepare_owt.py --max-docs 100000 --data-dir {self.data_dir}",
            ]
        else:
            lines.append("  (needs: pip install -e \".[data]\")")
        lines += ["or any local text files:",
                  f"  python scripts/prepare_owt.py --from-text FILE... --data-dir {self.data_dir}"]
        return "\n".join(lines)

    def num_tokens(self, split: str) -> int:
        return len(self._data[_check_split(split)])

    def sample_batch(self, batch_size: int, split: str = "train", generator: Optional[torch.Generator] = None):
        return sample_windows(self._data[_check_split(split)], batch_size, self.seq_len, generator, self.vocab_size)

    @functools.cached_property
    def _encoding(self):
        return gpt2_encoding()

    def encode(self, text: str) -> list[int]:
        return self._encoding.encode_ordinary(text)

    def decode(self, tokens) -> str:
        return self._encoding.decode(token_ids(tokens, self.vocab_size))
