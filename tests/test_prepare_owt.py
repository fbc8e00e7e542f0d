"""scripts/prepare_owt.py: --from-text round trips, Hugging Face sources (faked), bad input, and no lost work
(existing token files, failed runs)."""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from sigmafast.data import GPT2_EOT, encode_documents, safe_split_points, utf8_safe_cut
from sigmafast.tasks.text import TokenFileTask

from helpers import load_prepare_script

prepare_owt = load_prepare_script()


def read_bin(path: Path) -> list[int]:
    return np.fromfile(path, dtype=np.uint16).tolist()


def decode_bin(enc, path: Path) -> str:
    return enc.decode_bytes(read_bin(path)).decode("utf-8")  # strict: a cut inside a character fails here



def test_from_text_round_trip(shakespeare_bins, enc, shakespeare):
    text = shakespeare.read_text(encoding="utf-8")
    train, val = decode_bin(enc, shakespeare_bins / "train.bin"), decode_bin(enc, shakespeare_bins / "val.bin")
    assert train + val == text + "<|endoftext|>"
    n_train, n_val = len(read_bin(shakespeare_bins / "train.bin")), len(read_bin(shakespeare_bins / "val.bin"))
    assert n_train + n_val == len(enc.encode_ordinary(text)) + 1
    assert 0.09 < n_val / (n_train + n_val) < 0.11


def test_from_text_several_files_and_utf8_cut(tmp_path, enc):
    texts = ["naïve café — 東京の夜\n" * 40, "second document 🎉\r\nπ ≈ 3.14159\r\n" * 30]  # CRLF kept
    files = []
    for i, text in enumerate(texts):
        files.append(tmp_path / f"doc{i}.txt")
        files[-1].write_bytes(text.encode("utf-8"))
    expected = "".join(t + "<|endoftext|>" for t in texts)
    for fraction in ("0.05", "0.13", "0.5", "0.77"):
        out = tmp_path / f"out{fraction}"
        prepare_owt.main(["--from-text", *map(str, files), "--data-dir", str(out), "--val-fraction", fraction])
        train, val = decode_bin(enc, out / "train.bin"), decode_bin(enc, out / "val.bin")
        assert train and val
        assert train + val == expected


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("a\nb\n\nc\n \nd \ne\n\n\n f's\n'll\n\t\nx\n1\n2\n!\n?", id="whitespace-runs"),
        pytest.param("line one\nline two\n" * 50, id="plain-lines"),
        pytest.param("no newline at all " * 20, id="no-newline"),
    ],
)
def test_parallel_chunked_encoding_matches_whole_text(text, enc):
    assert safe_split_points(text, 1) == sorted(set(safe_split_points(text, 1)))
    (chunked,) = encode_documents([text], enc, num_threads=2, chunk_chars=1)
    assert chunked.tolist() == enc.encode_ordinary(text) + [GPT2_EOT]


def test_parallel_chunked_encoding_matches_on_shakespeare(shakespeare, enc):
    text = shakespeare.read_text(encoding="utf-8")
    assert len(safe_split_points(text, 4096)) > 200
    (chunked,) = encode_documents([text], enc, num_threads=2, chunk_chars=4096)
    assert chunked.tolist() == enc.encode_ordinary(text) + [GPT2_EOT]


def test_utf8_safe_cut_moves_past_continuation_bytes(enc):
    tokens = np.array(enc.encode_ordinary("東京🎉" * 5))
    for cut in range(len(tokens) + 1):
        safe = utf8_safe_cut(tokens, cut, enc)
        assert safe >= cut
        enc.decode_bytes(tokens[:safe].tolist()).decode("utf-8")
        enc.decode_bytes(tokens[safe:].tolist()).decode("utf-8")
        for c in range(cut, safe):  # and it is the smallest safe cut
            with pytest.raises(UnicodeDecodeError):
                enc.decode_bytes(tokens[:c].tolist()).decode("utf-8")


def _fake_datasets(monkeypatch, splits: dict[str, list[str]], calls: list):
    def load_dataset(name, config=None, *, split, streaming=False, **kwargs):
        calls.append(dict(name=name, config=config, split=split, streaming=streaming, **kwargs))
        rows = [{"text": t} for t in splits[split]]
        return iter(rows) if streaming else rows

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))


def test_openwebtext_max_docs_streams_and_splits_by_document(tmp_path, enc, monkeypatch):
    docs = [f"Document number {i}.\nIt has some text, {i * 7} words." for i in range(50)]
    calls = []
    _fake_datasets(monkeypatch, {"train": docs}, calls)
    out = tmp_path / "owt"
    prepare_owt.main(["--max-docs", "40", "--val-fraction", "0.1", "--data-dir", str(out), "--num-workers", "2"])
    assert calls == [dict(name="Skylion007/openwebtext", config=None, split="train", streaming=True)]
    train_docs = decode_bin(enc, out / "train.bin").split("<|endoftext|>")[:-1]
    val_docs = decode_bin(enc, out / "val.bin").split("<|endoftext|>")[:-1]
    assert len(val_docs) == 4 and len(train_docs) == 36
    assert sorted(train_docs + val_docs) == sorted(docs[:40])
    assert [d for d in docs[:40] if d in val_docs] == val_docs  # order kept


def test_wikitext103_groups_articles_and_uses_validation_split(tmp_path, enc, monkeypatch):
    def article(title, n):
        return [f" = {title} = \n", "", *[f" Sentence {i} about {title} . \n" for i in range(n)], " = = Part = = \n",
                " more . \n"]

    train_lines = [""] + article("Alpha", 3) + article("Beta", 2) + article("Gamma", 4)
    val_lines = [""] + article("Delta", 2)
    calls = []
    _fake_datasets(monkeypatch, {"train": train_lines, "validation": val_lines}, calls)
    out = tmp_path / "wt"
    prepare_owt.main(["--source", "wikitext103", "--data-dir", str(out), "--num-workers", "1"])
    assert {(c["name"], c["config"], c["split"]) for c in calls} == {
        ("Salesforce/wikitext", "wikitext-103-raw-v1", "train"),
        ("Salesforce/wikitext", "wikitext-103-raw-v1", "validation"),
    }
    train_articles = decode_bin(enc, out / "train.bin").split("<|endoftext|>")[:-1]
    assert [a.splitlines()[0] for a in train_articles] == [" = Alpha = ", " = Beta = ", " = Gamma = "]
    assert "".join(train_articles) == "".join(train_lines)
    assert decode_bin(enc, out / "val.bin") == "".join(val_lines) + "<|endoftext|>"
    task = TokenFileTask("wikitext103", data_dir=out, seq_len=8)
    assert task.num_tokens("val") == len(read_bin(out / "val.bin"))


def test_missing_datasets_package_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` raise ImportError
    with pytest.raises(SystemExit, match=r'pip install -e "\.\[data\]"'):
        prepare_owt.main(["--max-docs", "10", "--data-dir", str(tmp_path / "owt")])
    assert not (tmp_path / "owt" / "train.bin").exists()


@pytest.mark.parametrize(
    "argv, match",
    [
        pytest.param(["--from-text", "EMPTY"], "is empty", id="empty-file"),
        pytest.param(["--from-text", "MISSING"], "does not exist", id="missing-file"),
        pytest.param(["--from-text", "FOLDER"], "is a folder, not a text file", id="folder"),
        pytest.param(["--from-text", "BINARY"], "not UTF-8", id="not-utf8"),
    ],
)
def test_prepare_bad_input(argv, match, tmp_path, enc):
    (tmp_path / "EMPTY").write_text("")
    (tmp_path / "BINARY").write_bytes(b"\xff\xfe\x00bad")
    (tmp_path / "FOLDER").mkdir()
    argv = [str(tmp_path / a) if a.isupper() else a for a in argv]
    with pytest.raises(SystemExit, match=match):
        prepare_owt.main([*argv, "--data-dir", str(tmp_path / "out")])
    assert not (tmp_path / "out" / "train.bin").exists()


def test_unwritable_data_dir_fails_before_tokenising(tmp_path, monkeypatch):
    (tmp_path / "afile").write_text("x")

    def must_not_run(*args, **kwargs):
        raise AssertionError("tokenised before checking --data-dir")

    monkeypatch.setattr(prepare_owt, "prepare_from_text", must_not_run)
    monkeypatch.setattr(prepare_owt, "prepare_hf", must_not_run)
    for argv in (["--from-text", str(tmp_path / "afile")], ["--max-docs", "10"]):
        with pytest.raises(SystemExit, match=r"--data-dir .*afile.sub is not a writable folder"):
            prepare_owt.main([*argv, "--data-dir", str(tmp_path / "afile" / "sub")])


def test_existing_token_files_need_overwrite(tmp_path, enc, monkeypatch, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("Some local text.\n" * 50, encoding="utf-8")
    out = tmp_path / "out"
    out.mkdir()
    (out / "train.bin").write_text("precious")
    calls = []
    _fake_datasets(monkeypatch, {"train": ["a doc"] * 20}, calls)
    for argv in (["--from-text", str(corpus)], ["--max-docs", "10"], ["--source", "wikitext103"]):
        with pytest.raises(SystemExit) as exc:
            prepare_owt.main([*argv, "--data-dir", str(out)])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert f"error: --data-dir {out} already holds {out / 'train.bin'}: pass --overwrite" in err
    assert calls == [] and (out / "train.bin").read_text() == "precious" and not (out / "val.bin").exists()
    assert prepare_owt.main(["--from-text", str(corpus), "--data-dir", str(out), "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["train.bin", "val.bin"]  # no temp file left behind
    assert decode_bin(enc, out / "train.bin") + decode_bin(enc, out / "val.bin") == corpus.read_text() + "<|endoftext|>"


@pytest.mark.parametrize("source", ["wikitext103", "openwebtext"])
def test_from_text_rejects_source(source, tmp_path, capsys):
    (tmp_path / "corpus.txt").write_text("text\n")
    with pytest.raises(SystemExit) as exc:
        prepare_owt.main(["--from-text", str(tmp_path / "corpus.txt"), "--source", source,
                          "--data-dir", str(tmp_path / "out")])
    assert exc.value.code == 2
    assert "error: --from-text reads local files: --source," in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_failed_run_leaves_no_empty_folder(tmp_path, monkeypatch):
    def offline():
        raise FileNotFoundError("could not load the GPT-2 BPE files for tiktoken")

    (tmp_path / "corpus.txt").write_text("text\n")
    monkeypatch.setattr(prepare_owt, "gpt2_encoding", offline)
    (tmp_path / "kept").mkdir()
    for name in ("nope.txt", "corpus.txt"):  # a missing input file; then tiktoken offline without its files
        for data_dir in (tmp_path / "new" / "deeper", tmp_path / "kept"):
            with pytest.raises(SystemExit, match="does not exist|could not load"):
                prepare_owt.main(["--from-text", str(tmp_path / name), "--data-dir", str(data_dir)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "kept"]  # "kept" was there before


def test_ctrl_c_exits_130_and_a_killed_runs_temp_files_are_removed(tmp_path, enc, monkeypatch, capsys):
    """Ctrl-C during tokenising leaves nothing behind and exits 130 with one line, no traceback; the next run
    removes the temporary files of a run killed outright (a process that no longer exists), not those of one
    still running."""
    docs = [f"Document {i}.\n" for i in range(20)]
    _fake_datasets(monkeypatch, {"train": docs}, [])
    out = tmp_path / "owt"

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(prepare_owt, "encode_documents", interrupted)
        with pytest.raises(SystemExit) as exc:
            prepare_owt.main(["--max-docs", "10", "--data-dir", str(out), "--num-workers", "1"])
    assert exc.value.code == 130 and "interrupted; nothing was written" in capsys.readouterr().err
    assert not out.exists()  # the folder it created is gone too
    out.mkdir()
    dead = 2**22 + 12345  # above Linux's default pid_max (2**22), so no process has it
    stale, live = out / f".train.bin.{dead}.0123abcd.tmp", out / f".val.bin.{os.getppid()}.0123abcd.tmp"
    stale.write_bytes(b"\0\0"), live.write_bytes(b"\0\0")
    prepare_owt.main(["--max-docs", "10", "--data-dir", str(out), "--num-workers", "1"])
    assert not stale.exists() and live.exists()
    assert sorted(p.name for p in out.iterdir()) == [live.name, "train.bin", "val.bin"]


def test_a_failure_before_both_files_are_complete_replaces_neither(tmp_path, enc, monkeypatch):
    """wikitext103 reads its validation split after tokenising the training one (lazily, as a stream): when
    that fails, the train.bin already in --data-dir (and its val.bin) stay as they were, with no temporary
    file left."""
    out = tmp_path / "wt"
    out.mkdir()
    for name in ("train.bin", "val.bin"):
        (out / name).write_bytes(b"old")

    def rows(split):
        yield {"text": " = Title = \n"}
        if split == "validation":
            raise ConnectionError("the Hub is unreachable")
        yield {"text": "Some text.\n"}

    def load_dataset(name, config=None, split=None, streaming=False, **kwargs):
        return rows(split)

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    with pytest.raises(SystemExit, match="error: the Hub is unreachable"):
        prepare_owt.main(["--source", "wikitext103", "--max-docs", "5", "--data-dir", str(out), "--overwrite",
                          "--num-workers", "1"])
    assert sorted(p.name for p in out.iterdir()) == ["train.bin", "val.bin"]
    assert (out / "train.bin").read_bytes() == b"old"
