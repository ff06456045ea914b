"""Atomic writes: the file appears whole or not at all, with the usual permissions."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from treegrpo.io import atomic_write, atomic_write_text, jsonl_objects


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


def test_jsonl_objects_name_the_line_of_each_problem(tmp_path: Path) -> None:
    p = tmp_path / "d.jsonl"
    p.write_bytes(b'\xef\xbb\xbf{"a": 1}\n\n{"b": 2}\n')  # a BOM on the first line; a blank line skipped
    assert list(jsonl_objects(p, ValueError)) == [(1, f"{p}:1", {"a": 1}), (3, f"{p}:3", {"b": 2})]
    cases = [(b'{"a": 1}\n{nope\n', f"{p}: row 2: not valid JSON"), (b"[1]\n", f"{p}: row 1: each line must be a JSON object {{x}}"),
             (b'{"a": 1}\n\xff\n', f"{p}: row 2: not UTF-8 text \\(byte 0 of the line\\)")]  # fmt: skip
    for data, message in cases:
        p.write_bytes(data)
        with pytest.raises(KeyError, match=message):
            list(jsonl_objects(p, KeyError, "{path}: row {line}", " {x}"))
