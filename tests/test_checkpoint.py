"""Checkpoints: contents, atomic writes, loading, and the errors of unreadable files."""

import os
import subprocess
import sys

import pytest
import torch

import sigmafast.checkpoint as checkpoint_mod
from sigmafast.checkpoint import atomic_save, out_dir_lock, read_checkpoint
from sigmafast.train import load_checkpoint, train
from helpers import small_cfg


def test_checkpoint_contents_and_load(tmp_path):
    result = train(small_cfg(tmp_path, max_iters=5))
    assert sorted(os.listdir(tmp_path)) == [".lock", "ckpt.pt"]
    ckpt = read_checkpoint(tmp_path / "ckpt.pt")
    assert ckpt["iter"] == 5 and len(ckpt["rng"]) == 1
    assert set(ckpt["best_val_loss"]) == {"random", "l2r"}
    assert ckpt["best_val_loss"]["random"] == min(h["val_loss_random"] for h in result.history)
    assert ckpt["optimizer"]["state"], "optimizer moments are saved"
    model, task, cfg = load_checkpoint(tmp_path / "ckpt.pt")
    assert task.name == "permutation" and task.seq_len == 12
    assert cfg.max_iters == 5 and cfg.lr == 3e-3 and cfg.weight_decay == 0.0  # resolved: the permutation recipe's
    assert not model.training
    for (n, p), q in zip(model.named_parameters(), result.model.parameters()):
        assert torch.equal(p, q), n


def test_atomic_save_keeps_old_file_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    atomic_save({"v": 1}, path)

    def broken_save(obj, f):
        f.write(b"partial")
        raise RuntimeError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(RuntimeError, match="disk full"):
        atomic_save({"v": 2}, path)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["ckpt.pt"]
    assert torch.load(path) == {"v": 1}


def test_atomic_save_syncs_the_file_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    """A crash (power loss) right after a save must leave the old or the new checkpoint, never an empty or
    partial one: the temporary file's data reach the disk before it is renamed over ckpt.pt, and the folder
    holding the rename is synced after it."""
    path = tmp_path / "ckpt.pt"
    atomic_save({"v": 1}, path)
    events, real_fsync, real_replace = [], os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.fstat(fd).st_ino))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.stat(src).st_ino, os.fspath(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    atomic_save({"v": 2}, path)
    monkeypatch.undo()
    renamed = [e for e in events if e[0] == "replace"]
    assert len(renamed) == 1 and renamed[0][2] == str(path)
    at, inode = events.index(renamed[0]), renamed[0][1]
    assert ("fsync", inode) in events[:at], events  # the new checkpoint's data, before it replaces the old one
    assert ("fsync", os.stat(tmp_path).st_ino) in events[at:], events  # the rename itself
    assert torch.load(path) == {"v": 2}


class _Foreign:
    """A class torch.load(weights_only=True) refuses to unpickle."""


@pytest.mark.parametrize("kind", ["junk", "truncated", "foreign-object", "empty"])
def test_corrupt_checkpoint_error_has_no_unsafe_advice(tmp_path, trained_dir, kind):
    path = tmp_path / "bad.pt"
    if kind == "junk":
        path.write_bytes(b"not a checkpoint")
    elif kind == "truncated":
        data = (trained_dir / "ckpt.pt").read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif kind == "foreign-object":
        torch.save({"model": _Foreign()}, path)
    else:
        path.write_bytes(b"")
    with pytest.raises(ValueError, match="not a readable sigmafast checkpoint") as info:
        load_checkpoint(path)
    message = str(info.value)
    assert "weights_only" not in message and "\n" not in message, message


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_load_checkpoint_on_cuda_without_cuda(trained_dir):
    with pytest.raises(ValueError, match="device 'cuda' requested but CUDA is not available"):
        load_checkpoint(trained_dir / "ckpt.pt", device="cuda")
    with pytest.raises(ValueError, match="device must be a torch device"):
        load_checkpoint(trained_dir / "ckpt.pt", device="gpu")


@pytest.mark.parametrize("content,reason", [
    (b"date,price\n2024-01-01,3.5\n", "not a torch.save file (not a zip archive; it starts with b'date,price\\n"),
    (b"", "the file is empty"),
    ("zip", "torch.load failed (corrupt, or written by something else): file in archive is not in a subdirectory"),
    ("truncated", "not a complete torch.save file (its zip archive is truncated or damaged)"),
    ("damaged", "the file is corrupt (member "),
    ([1, 2], "is not a sigmafast checkpoint: it holds a list, not a dict"),
    ({"model": {}, "iter": 3}, "is not a sigmafast checkpoint: missing keys ['best_val_loss', 'history', "),
], ids=["csv", "empty", "other-zip", "truncated", "damaged", "list", "other-dict"])
def test_load_checkpoint_says_why_a_file_is_not_a_checkpoint(tmp_path, trained_dir, content, reason):
    path = tmp_path / "file"
    if content == "zip":
        import zipfile
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("notes.txt", "hello")
    elif content == "truncated":
        data = (trained_dir / "ckpt.pt").read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif content == "damaged":  # bytes flipped inside the weights: a zip archive that looks whole
        data = bytearray((trained_dir / "ckpt.pt").read_bytes())
        data[len(data) // 2: len(data) // 2 + 64] = bytes(b ^ 0xFF for b in data[len(data) // 2: len(data) // 2 + 64])
        path.write_bytes(bytes(data))
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        torch.save(content, path)
    with pytest.raises(ValueError) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert message.startswith(f"{path} is not a ") and reason in message, message
    assert "\n" not in message and "operand" not in message, message


def test_load_checkpoint_refuses_the_meta_device(trained_dir):
    with pytest.raises(ValueError, match="device 'meta' holds no data"):
        load_checkpoint(trained_dir / "ckpt.pt", device="meta")
    with pytest.raises(ValueError, match="device 'meta' holds no data"):
        load_checkpoint(trained_dir / "ckpt.pt", device=torch.device("meta"))


def test_a_second_run_in_a_held_out_dir_stops_before_reading_or_writing(tmp_path):
    """Another process holds the folder's lock: a second run stops at start, naming its process id, and
    neither resumes from nor replaces the checkpoint; once the holder ends, the run resumes."""
    train(small_cfg(tmp_path, max_iters=2))
    before = (tmp_path / "ckpt.pt").read_bytes()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from sigmafast.checkpoint import out_dir_lock\n"
         "with out_dir_lock(sys.argv[1]):\n    print('held', flush=True); sys.stdin.read()", str(tmp_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        for cfg in (small_cfg(tmp_path, max_iters=4, resume=True), small_cfg(tmp_path, overwrite=True)):
            with pytest.raises(ValueError, match=rf"out_dir '{tmp_path}' is in use by another training run "
                                                 rf"\(process {holder.pid}\)"):
                train(cfg)
        assert (tmp_path / "ckpt.pt").read_bytes() == before
    finally:
        holder.communicate("")
    assert train(small_cfg(tmp_path, max_iters=4, resume=True)).history[-1]["iter"] == 4


def test_a_run_releases_the_lock_even_when_it_fails(tmp_path):
    train(small_cfg(tmp_path, max_iters=2))
    with pytest.raises(ValueError, match="already holds a checkpoint"):  # raised with the lock held
        train(small_cfg(tmp_path, max_iters=2))
    with out_dir_lock(tmp_path):
        pass


def test_a_new_folder_is_checked_again_once_locked(tmp_path, monkeypatch):
    """The out_dir did not exist at the first check; a run that saved there before this one took the lock is
    not overwritten."""
    folder = tmp_path / "new"
    real_lock = checkpoint_mod.out_dir_lock

    def lock_after_another_run(out_dir):
        atomic_save({"iter": 3}, folder / "ckpt.pt")
        return real_lock(out_dir)

    monkeypatch.setattr(checkpoint_mod, "out_dir_lock", lock_after_another_run)
    with pytest.raises(ValueError, match="already holds a checkpoint"):
        train(small_cfg(folder, max_iters=2))
    assert torch.load(folder / "ckpt.pt") == {"iter": 3}
