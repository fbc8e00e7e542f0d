"""Build GPT-2 BPE token files ``train.bin`` / ``val.bin`` for ``--task owt`` and ``--task wikitext103``.

Sources (tokens are uint16, each document followed by ``<|endoftext|>``):

* ``--source openwebtext`` (default, into data/owt): Hugging Face ``datasets``
  (``pip install -e ".[data]"``). The whole corpus (~8M documents) is downloaded
  once; ``--max-docs N`` instead streams the first N documents, no full download.
  A fraction ``--val-fraction`` (default 0.0005) of the documents, evenly spaced,
  goes to val.bin.
* ``--source wikitext103`` (into data/wikitext103): wikitext-103-raw-v1, one
  document per article, its official train and validation splits.
* ``--from-text FILE...``: local UTF-8 files, each file one document, in order.
  The token stream of all of them is cut once: the first ``1 - val_fraction``
  (default 0.9) goes to train.bin, the rest to val.bin. The cut never falls
  inside a UTF-8 character, so decode(train.bin) + decode(val.bin) is exactly
  the files' text, each followed by ``<|endoftext|>``. Offline, set
  TIKTOKEN_CACHE_DIR to a folder with tiktoken's cached gpt2 files.

Tokenisation runs on ``--num-workers`` threads (tiktoken releases the GIL).
An existing train.bin or val.bin in ``--data-dir`` stops the script before any
download unless ``--overwrite`` is given; each file is written under a temporary
name, and both are renamed into place only once both are complete. Ctrl-C
removes the temporary files and exits with status 130; those of a run killed
outright are removed by the next.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

import numpy as np

from sigmafast.data import (
    GPT2_VOCAB_SIZE,
    TokenWriter,
    encode_documents,
    gpt2_encoding,
    progress,
    read_text,
    split_paths,
    utf8_safe_cut,
)

SOURCES = {
    "openwebtext": dict(dataset="Skylion007/openwebtext", config=None, val_split=None, data_dir="data/owt", task="owt"),
    "wikitext103": dict(
        dataset="Salesforce/wikitext",
        config="wikitext-103-raw-v1",
        val_split="validation",
        data_dir="data/wikitext103",
        task="wikitext103",
    ),
}
OWT_VAL_FRACTION = 0.0005
FROM_TEXT_VAL_FRACTION = 0.1
DOCS_PER_BATCH = 512


def load_hf_split(name: str, config: Optional[str], split: str, revision: Optional[str], streaming: bool,
                  num_proc: int):
    """A Hugging Face dataset split; ``streaming`` reads it lazily instead of downloading it whole."""
    try:
        import datasets
    except ImportError as exc:
        raise ImportError(
            f"the Hugging Face `datasets` package is needed for {name}: pip install -e \".[data]\" "
            "(or use --from-text FILE... for local text)"
        ) from exc
    kwargs = dict(split=split, streaming=streaming)
    if revision is not None:
        kwargs["revision"] = revision
    if not streaming and num_proc > 1:
        kwargs["num_proc"] = num_proc
    return datasets.load_dataset(name, config, **kwargs)


def texts_of(rows: Iterable[dict]) -> Iterator[str]:
    for row in rows:
        yield row["text"]


def wikitext_articles(lines: Iterable[str]) -> Iterator[str]:
    """Group WikiText rows (one line each) into articles, each opening with its ' = Title = ' line."""
    article: list[str] = []
    for line in lines:
        if line.startswith(" = ") and not line.startswith(" = = ") and article and any(s.strip() for s in article):
            yield "".join(article)
            article = []
        article.append(line)
    if any(s.strip() for s in article):
        yield "".join(article)


def val_document_indices(num_docs: int, val_fraction: float) -> set[int]:
    """Evenly spaced indices of max(1, round(num_docs * val_fraction)) validation documents."""
    if num_docs < 2:
        raise ValueError(f"need at least 2 documents to split into train and val, got {num_docs}")
    count = min(num_docs - 1, max(1, round(num_docs * val_fraction)))
    return {int((i + 0.5) * num_docs / count) for i in range(count)}


def write_documents(docs: Iterable[str], outputs: dict[str, Path], val_docs: Optional[set[int]], num_threads: int,
                    total: Optional[int], desc: str) -> dict[str, TokenWriter]:
    """Tokenise ``docs`` into ``outputs``; returns their writers, finished but not published (see
    :func:`publish_all`).

    With ``val_docs``, ``outputs`` has "train" and "val" and the documents whose
    index is in ``val_docs`` go to "val"; without, ``outputs`` has one file that
    gets every document.
    """
    enc = gpt2_encoding()
    if val_docs is None and len(outputs) != 1:
        raise ValueError(f"without val_docs, outputs must name one file, got {sorted(outputs)}")
    writers = {key: TokenWriter(path, GPT2_VOCAB_SIZE) for key, path in outputs.items()}
    only = next(iter(outputs))
    docs_per_file = dict.fromkeys(outputs, 0)
    try:
        stream = progress(docs, total=total, desc=desc, unit="docs")
        index = 0
        while batch := list(itertools.islice(stream, DOCS_PER_BATCH)):
            parts: dict[str, list[np.ndarray]] = {key: [] for key in outputs}
            for ids in encode_documents(batch, enc, num_threads):
                key = only if val_docs is None else ("val" if index in val_docs else "train")
                parts[key].append(ids)
                docs_per_file[key] += 1
                index += 1
            for key, arrays in parts.items():
                if arrays:
                    writers[key].write(np.concatenate(arrays))
        empty = [str(outputs[key]) for key, count in docs_per_file.items() if count == 0]
        if empty:
            raise ValueError(f"no documents went to {' and '.join(empty)} ({index} documents were read)")
        for writer in writers.values():
            writer.finish()
    except BaseException:
        abort_all(writers)
        raise
    return writers


def abort_all(writers: dict[str, TokenWriter]) -> None:
    for writer in writers.values():
        writer.abort()


def publish_all(writers: dict[str, TokenWriter]) -> dict[str, int]:
    """Rename the finished files into place together, once every one is complete (a failed run leaves no new
    train.bin beside an old val.bin); returns the token count of each."""
    for writer in writers.values():
        writer.publish()
    return {key: writer.num_tokens for key, writer in writers.items()}


def prepare_from_text(files: Sequence[str], data_dir: Path, val_fraction: float, num_threads: int
                      ) -> dict[str, TokenWriter]:
    texts = [read_text(name, "--from-text", exact=True) for name in files]
    enc = gpt2_encoding()
    tokens = np.concatenate(encode_documents(texts, enc, num_threads, desc="tokenising"))
    cut = utf8_safe_cut(tokens, int(round(len(tokens) * (1.0 - val_fraction))), enc)
    if not 0 < cut < len(tokens):
        raise ValueError(
            f"--from-text: {len(tokens)} tokens are too few to give both train and val tokens "
            f"with --val-fraction {val_fraction}"
        )
    writers = {key: TokenWriter(path, GPT2_VOCAB_SIZE) for key, path in split_paths(data_dir).items()}
    try:
        for key, part in (("train", tokens[:cut]), ("val", tokens[cut:])):
            writers[key].write(part)
            writers[key].finish()
    except BaseException:
        abort_all(writers)
        raise
    return writers


def prepare_hf(source: str, data_dir: Path, max_docs: Optional[int], val_fraction: Optional[float],
               num_workers: int, dataset: Optional[str], revision: Optional[str]) -> dict[str, TokenWriter]:
    spec = SOURCES[source]
    name = dataset or spec["dataset"]
    streaming = max_docs is not None
    train = load_hf_split(name, spec["config"], "train", revision, streaming, num_workers)
    paths = split_paths(data_dir)
    if source == "wikitext103":
        articles = wikitext_articles(texts_of(train))
        if max_docs is not None:
            articles = itertools.islice(articles, max_docs)
        writers = write_documents(articles, {"train": paths["train"]}, None, num_workers, max_docs, "train articles")
        try:
            val = load_hf_split(name, spec["config"], spec["val_split"], revision, streaming, num_workers)
            return {**writers, **write_documents(wikitext_articles(texts_of(val)), {"val": paths["val"]}, None,
                                                 num_workers, None, "val articles")}
        except BaseException:
            abort_all(writers)
            raise
    total = max_docs if streaming else len(train)
    docs = texts_of(itertools.islice(train, max_docs) if streaming else train)
    return write_documents(docs, paths, val_document_indices(total, val_fraction), num_workers, total, "documents")


def existing_outputs(data_dir: Path) -> list[Path]:
    """The output files already in ``data_dir`` (a run would replace them)."""
    return [path for path in split_paths(data_dir).values() if os.path.lexists(path)]


def remove_empty_dirs(folders: Sequence[Path]) -> None:
    """Remove ``folders`` (deepest first), stopping at the first that is not an empty folder."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


def check_output_dir(data_dir: Path) -> list[Path]:
    """Create ``data_dir`` and write a probe file in it, before any download or tokenisation.

    Returns the folders this created, deepest first, for :func:`remove_empty_dirs` after a failure.
    """
    created = list(itertools.takewhile(lambda p: not os.path.lexists(p), (data_dir, *data_dir.parents)))
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=data_dir):
            pass
    except OSError as exc:
        remove_empty_dirs(created)
        raise ValueError(f"--data-dir {data_dir} is not a writable folder ({exc.strerror or exc})") from None
    return created


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", choices=sorted(SOURCES),
                        help="Hugging Face corpus to tokenise (default openwebtext)")
    parser.add_argument("--from-text", nargs="+", metavar="FILE", help="tokenise local UTF-8 text files instead")
    parser.add_argument("--data-dir", help="output folder (default data/owt, or data/wikitext103 for that source)")
    parser.add_argument("--max-docs", type=int, help="stream only the first N documents (no full download)")
    parser.add_argument("--val-fraction", type=float,
                        help=f"fraction for val.bin: of documents for openwebtext (default {OWT_VAL_FRACTION}), "
                             f"of tokens for --from-text (default {FROM_TEXT_VAL_FRACTION}); "
                             "wikitext103 uses its own validation split")
    parser.add_argument("--num-workers", type=int, default=os.cpu_count() or 1, help="tokeniser threads")
    parser.add_argument("--dataset", help="override the Hugging Face dataset id of --source")
    parser.add_argument("--revision", help="Hugging Face dataset revision, e.g. refs/convert/parquet")
    parser.add_argument("--overwrite", action="store_true", help="replace train.bin / val.bin already in --data-dir")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.num_workers < 1:
        parser.error(f"--num-workers must be >= 1, got {args.num_workers}")
    if args.max_docs is not None and args.max_docs < 1:
        parser.error(f"--max-docs must be >= 1, got {args.max_docs}")
    if args.val_fraction is not None and not 0.0 < args.val_fraction < 1.0:
        parser.error(f"--val-fraction must be in (0, 1), got {args.val_fraction}")
    if args.from_text and (args.source is not None or args.max_docs is not None or args.dataset or args.revision):
        parser.error("--from-text reads local files: --source, --max-docs, --dataset and --revision do not apply")
    if not args.from_text and args.source == "wikitext103" and args.val_fraction is not None:
        parser.error("--source wikitext103 uses its official validation split: drop --val-fraction")
    source = args.source or "openwebtext"
    spec = SOURCES[source]
    data_dir = Path(args.data_dir or spec["data_dir"])
    existing = existing_outputs(data_dir)
    if existing and not args.overwrite:
        parser.error(f"--data-dir {data_dir} already holds {' and '.join(map(str, existing))}: pass --overwrite "
                     f"to replace {'them' if len(existing) > 1 else 'it'}, or another --data-dir")
    created: list[Path] = []
    try:
        created = check_output_dir(data_dir)
        if args.from_text:
            val_fraction = args.val_fraction if args.val_fraction is not None else FROM_TEXT_VAL_FRACTION
            writers = prepare_from_text(args.from_text, data_dir, val_fraction, args.num_workers)
        else:
            val_fraction = args.val_fraction if args.val_fraction is not None else OWT_VAL_FRACTION
            writers = prepare_hf(source, data_dir, args.max_docs, val_fraction, args.num_workers,
                                 args.dataset, args.revision)
        counts = publish_all(writers)
    except BaseException as exc:
        remove_empty_dirs(created)  # a failed run leaves no empty folder of its own behind
        if isinstance(exc, KeyboardInterrupt):
            print(f"prepare_owt.py: interrupted; nothing was written to {data_dir}", file=sys.stderr)
            raise SystemExit(130) from None
        if not isinstance(exc, (ValueError, OSError, ImportError, RuntimeError)):
            raise
        raise SystemExit(f"prepare_owt.py: error: {exc}") from exc
    paths = split_paths(data_dir)
    for split in ("train", "val"):
        print(f"wrote {paths[split]}: {counts[split]:,} tokens")
    print(f"next: python scripts/train.py --task {spec['task']} --data-dir {data_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
