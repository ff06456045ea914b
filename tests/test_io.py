"""Atomic writes: the file appears whole or not at all, with the usual permissions."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from treegrpo.io import atomic_write, atomic_write_text


def test_atomic_write_text_replaces_whole_file_with_umask_permissions(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "result.json"
    atomic_write_text(path, "first")
    atomic_write_text(path, "second")
    assert path.read_text() == "second"
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~mask
    assert [p.name for p in path.parent.iterdir()] == ["result.json"]  # no temp file left


def test_a_failed_write_leaves_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "result.json"
    atomic_write_text(path, "old")

    def broken(tmp: Path) -> None:
        tmp.write_text("half")
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        atomic_write(path, broken)
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]
