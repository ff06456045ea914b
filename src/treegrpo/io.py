"""Small file helpers: atomic writes and durable appends (nothing half-written survives an
interrupted run), file checksums."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp)`` on a temp path beside ``path``, fsync it, then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600 files; give the usual permissions
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(Path(path), lambda tmp: tmp.write_text(text, encoding="utf-8"))


def atomic_write_json(path: Path, data: Any) -> None:
    """``data`` as indented JSON, written atomically."""
    atomic_write_text(path, json.dumps(data, indent=1))


def append_line(path: Path, line: str) -> None:
    """Append ``line`` + newline as one write, then fsync: after a kill the file ends either
    before the line or after it, or (a kill inside the write itself) with a torn tail that has no
    newline, which a reader can recognise and drop."""
    data = (line + "\n").encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        view = memoryview(data)
        while view:  # a regular file takes the whole write; loop for the rare short write
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def fsync_path(path: Path) -> None:
    """Flush a file's (or a folder's entries') data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def user_cache_dir() -> Path:
    """Where bootstrapped models and indexes live: ``$TREEGRPO_CACHE`` or ``~/.cache/treegrpo``."""
    env = os.environ.get("TREEGRPO_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "treegrpo"


def atomic_write_dir(folder: Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp)`` on a temp folder beside ``folder``, then rename it into place (an
    existing ``folder`` is swapped out and removed): readers see the old folder or the new one."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}-{time.monotonic_ns()}"
    try:
        write(tmp)
        old = None
        if folder.exists():
            old = folder.parent / f".{folder.name}.old-{os.getpid()}-{time.monotonic_ns()}"
            os.replace(folder, old)
        os.replace(tmp, folder)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)



def jsonl_objects(
    path: Path, error: Callable[[str], Exception], where: str = "{path}:{line}", shape: str = ""
) -> Iterator[tuple[int, str, dict[str, Any]]]:
    """``(line number, where, object)`` for every non-blank line of the JSONL file ``path`` (a UTF-8 BOM on the
    first line allowed), ``where`` the line's place for the caller's own messages (``{path}`` and
    ``{line}`` filled in). A line that is not UTF-8, not JSON or not a JSON object raises
    ``error(message)`` naming the line (``shape``: what an object holds, added to that message)."""
    with Path(path).open("rb") as fh:
        for i, raw in enumerate(fh, 1):
            at = where.format(path=path, line=i)
            try:
                line = raw.decode("utf-8-sig" if i == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise error(f"{at}: not UTF-8 text (byte {e.start} of the line); save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise error(f"{at}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise error(f"{at}: each line must be a JSON object{shape}")
            yield i, at, row
