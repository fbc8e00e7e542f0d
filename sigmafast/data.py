"""Token datasets: uint16 ``train.bin`` / ``val.bin`` files read with ``np.memmap``.

A token file is a flat array of uint16 ids, GPT-2 BPE for text data (each
document followed by ``<|endoftext|>``). Training draws random windows of
``seq_len`` consecutive tokens, so a usable file holds at least ``seq_len``
tokens. Writing goes through :class:`TokenWriter`, which appends to a temp file
and renames it into place on success, so a half-written ``.bin`` never exists.
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence, Union

import numpy as np
import torch

from .files import publish, temp_path

TOKEN_DTYPE = np.uint16
MAX_VOCAB_SIZE = int(np.iinfo(TOKEN_DTYPE).max) + 1  # ids 0..65535
GPT2_VOCAB_SIZE = 50257
GPT2_EOT = 50256
SPLITS = ("train", "val")

PathLike = Union[str, os.PathLike]


def gpt2_encoding():
    """The GPT-2 BPE tokenizer; honours ``TIKTOKEN_CACHE_DIR`` for offline use."""
    import tiktoken

    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as exc:  # no cached files, and no network to fetch them
        raise FileNotFoundError(
            "could not load the GPT-2 BPE files for tiktoken; offline, point TIKTOKEN_CACHE_DIR at a "
            f"folder holding tiktoken's cached gpt2 files ({type(exc).__name__}: {exc})"
        ) from exc


def read_text(path: PathLike, what: str, exact: bool = False) -> str:
    """The UTF-8 content of a non-empty text file; ``what`` names it in the errors. Line ends become "\\n"
    unless ``exact`` (then the text is the file's, "\\r\\n" included)."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{what}: {path} is a folder, not a text file")
    if not path.is_file():
        raise FileNotFoundError(f"{what}: {path} does not exist")
    try:
        text = path.read_bytes().decode("utf-8") if exact else path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{what}: {path} is not UTF-8 text ({exc})") from exc
    if not text:
        raise ValueError(f"{what}: {path} is empty")
    return text


def check_vocab_size(vocab_size: int) -> None:
    """Raise ValueError unless every id of a ``vocab_size`` vocabulary fits in uint16."""
    if not isinstance(vocab_size, (int, np.integer)) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
    if vocab_size > MAX_VOCAB_SIZE:
        raise ValueError(
            f"vocabulary of {vocab_size} ids does not fit uint16 token files: ids must be <= "
            f"{MAX_VOCAB_SIZE - 1} (vocab_size <= {MAX_VOCAB_SIZE})"
        )


def split_paths(data_dir: PathLike) -> dict[str, Path]:
    """``{"train": data_dir/train.bin, "val": data_dir/val.bin}``."""
    return {split: Path(data_dir) / f"{split}.bin" for split in SPLITS}


def load_token_file(path: PathLike, seq_len: int) -> np.memmap:
    """Open a uint16 token file read-only, checking it holds at least one window.

    A window is ``seq_len`` tokens: the model predicts every token of it,
    the first one from the BOS start token, so no extra target token is needed.
    """
    path = Path(path)
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    if not path.is_file():
        raise FileNotFoundError(f"token file {path} does not exist")
    num_bytes = path.stat().st_size
    item = np.dtype(TOKEN_DTYPE).itemsize
    if num_bytes == 0:
        raise ValueError(f"token file {path} is empty")
    if num_bytes % item:
        raise ValueError(
            f"token file {path} has {num_bytes} bytes, not a whole number of {item}-byte uint16 tokens "
            "(truncated or not a token file)"
        )
    num_tokens = num_bytes // item
    if num_tokens < seq_len:
        raise ValueError(
            f"token file {path} holds {num_tokens} tokens, fewer than one window of seq_len={seq_len}"
        )
    return np.memmap(path, dtype=TOKEN_DTYPE, mode="r")


def sample_windows(
    tokens: np.ndarray,
    batch_size: int,
    seq_len: int,
    generator: Optional[torch.Generator] = None,
    vocab_size: Optional[int] = None,
) -> torch.Tensor:
    """(B, T) int64 windows of ``tokens`` at uniformly random offsets drawn with ``generator``."""
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    num_windows = len(tokens) - seq_len + 1
    if num_windows < 1:
        raise ValueError(f"{len(tokens)} tokens are fewer than one window of seq_len={seq_len}")
    device = generator.device if generator is not None else "cpu"
    starts = torch.randint(num_windows, (batch_size,), generator=generator, device=device).cpu().numpy()
    index = starts[:, None] + np.arange(seq_len)  # (B, T)
    batch = np.asarray(tokens[index], dtype=np.int64)
    if vocab_size is not None and batch.max() >= vocab_size:
        raise ValueError(
            f"token id {int(batch.max())} in the data is >= vocab_size={vocab_size}: "
            "the token file was written with another tokenizer"
        )
    return torch.from_numpy(batch)


class TokenWriter:
    """Append uint16 token ids to ``path``; the file appears only when :meth:`close` (or :meth:`finish` then
    :meth:`publish`) succeeds, written whole (:mod:`sigmafast.files`).

    Use as a context manager: an exception inside the block removes the temp file.
    """

    def __init__(self, path: PathLike, vocab_size: int) -> None:
        check_vocab_size(vocab_size)
        self.path = Path(path)
        self.vocab_size = int(vocab_size)
        self.num_tokens = 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = temp_path(self.path)
        self._file = open(self._tmp, "wb")

    def write(self, tokens: Union[Sequence[int], np.ndarray]) -> None:
        ids = np.asarray(tokens)
        if ids.size == 0:
            return
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"tokens must be a 1-D sequence of ints, got shape {ids.shape} dtype {ids.dtype}")
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= self.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.vocab_size}), got range [{low}, {high}]")
        ids.astype(TOKEN_DTYPE).tofile(self._file)
        self.num_tokens += ids.size

    def finish(self) -> None:
        """Write the tokens to disk, under the temporary name."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()

    def publish(self) -> Path:
        """Rename the finished file to ``path``."""
        publish(self._tmp, self.path)
        return self.path

    def close(self) -> Path:
        self.finish()
        return self.publish()

    def abort(self) -> None:
        self._file.close()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> "TokenWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_tokens(path: PathLike, tokens: Union[Sequence[int], np.ndarray], vocab_size: int) -> Path:
    """Write ``tokens`` as one uint16 file atomically."""
    with TokenWriter(path, vocab_size) as writer:
        writer.write(tokens)
    return Path(path)


def safe_split_points(text: str, chunk_chars: int) -> list[int]:
    """Offsets, about ``chunk_chars`` apart, where cutting ``text`` leaves GPT-2 BPE unchanged.

    A cut right after a single newline between two non-whitespace characters
    is safe: GPT-2's pre-tokenizer emits that newline as a token of its own, so
    no pre-token (and hence no BPE merge) crosses the cut, and encoding the
    pieces separately gives exactly the tokens of the whole text.
    """
    if chunk_chars < 1:
        raise ValueError(f"chunk_chars must be >= 1, got {chunk_chars}")
    points = []
    pos = chunk_chars
    while pos < len(text):
        newline = text.find("\n", pos)
        while newline != -1:
            cut = newline + 1
            if cut < len(text) and newline >= 1 and not text[newline - 1].isspace() and not text[cut].isspace():
                break
            newline = text.find("\n", cut)
        if newline == -1:
            break
        points.append(newline + 1)
        pos = newline + 1 + chunk_chars
    return points


def encode_documents(
    texts: Sequence[str], enc, num_threads: int = 1, chunk_chars: int = 1 << 18, desc: Optional[str] = None
) -> list[np.ndarray]:
    """Encode each text with GPT-2 BPE and append ``<|endoftext|>``, in parallel.

    Long texts are cut at :func:`safe_split_points` so one big file also uses
    every thread; tiktoken releases the GIL, so threads run truly in parallel.
    Special-token text inside a document is encoded as ordinary text. With
    ``desc``, a progress bar counts the encoded chunks.
    """
    pieces, owners = [], []
    for doc, text in enumerate(texts):
        cuts = [0, *safe_split_points(text, chunk_chars), len(text)]
        for start, end in zip(cuts[:-1], cuts[1:]):
            pieces.append(text[start:end])
            owners.append(doc)
    with ThreadPoolExecutor(max(1, num_threads)) as pool:
        encoded = pool.map(enc.encode_ordinary, pieces)
        if desc is not None:
            encoded = progress(encoded, total=len(pieces), desc=desc, unit="chunks")
        encoded = list(encoded)
    parts: list[list[np.ndarray]] = [[] for _ in texts]
    for doc, ids in zip(owners, encoded):
        parts[doc].append(np.asarray(ids, dtype=np.int64))
    eot = np.array([enc.eot_token], dtype=np.int64)
    return [np.concatenate([*doc_parts, eot]) for doc_parts in parts]


def utf8_safe_cut(tokens: np.ndarray, cut: int, enc) -> int:
    """Move ``cut`` forward until the token there does not start inside a UTF-8 character.

    Then the two halves of the stream each decode to valid text, and their
    decodings concatenate to the decoding of the whole stream.
    """
    while cut < len(tokens):
        head = enc.decode_single_token_bytes(int(tokens[cut]))
        if not head or (head[0] & 0xC0) != 0x80:
            break
        cut += 1
    return cut


def progress(items: Iterable, total: Optional[int] = None, desc: str = "", unit: str = "it") -> Iterator:
    """Iterate with a tqdm bar when tqdm is installed, else a stderr line every few seconds."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None:
        yield from tqdm(items, total=total, desc=desc, unit=unit)
        return
    start = last = time.monotonic()
    count = 0
    for count, item in enumerate(items, 1):
        yield item
        now = time.monotonic()
        if now - last >= 5.0:
            last = now
            of = f"/{total}" if total is not None else ""
            print(f"{desc}: {count}{of} {unit} ({count / (now - start):.1f} {unit}/s)", file=sys.stderr)
    print(f"{desc}: {count} {unit} done in {time.monotonic() - start:.1f}s", file=sys.stderr)
