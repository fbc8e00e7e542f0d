"""Files written whole or not at all: each is written under a temporary name in its folder (``.<name>.<pid>.<8
hex>.tmp``), synced, and renamed over its target once complete; the temporary files that a killed process left
behind are removed by the next write of the same target."""

from __future__ import annotations

import os
import re
import uuid
from contextlib import suppress
from pathlib import Path


def temp_path(path: Path) -> Path:
    """A fresh temporary name for ``path``, in its folder."""
    return path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


def _tmp_pattern(name: str) -> re.Pattern:
    return re.compile(rf"\.{re.escape(name)}\.(\d+)\.[0-9a-f]{{8}}\.tmp")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # gone, or a pid no process can have
        return False
    except OSError:  # alive, but another user's
        pass
    return True


def remove_stale_tmp(path: Path) -> None:
    """Remove the temporary files for ``path`` that a killed process left behind (those whose process is gone
    from this host); never another file."""
    pattern = _tmp_pattern(path.name)
    for entry in path.parent.iterdir():
        match = pattern.fullmatch(entry.name)
        if match and int(match.group(1)) != os.getpid() and not pid_alive(int(match.group(1))):
            with suppress(OSError):
                entry.unlink()


def publish(tmp: Path, path: Path) -> None:
    """Rename the complete, synced ``tmp`` over ``path`` and sync the folder, so that the rename survives a
    power loss too; then tidy up after killed writes (never failing the write for it)."""
    os.replace(tmp, path)
    with suppress(OSError):  # some file systems cannot sync a folder
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    with suppress(OSError):
        remove_stale_tmp(path)
