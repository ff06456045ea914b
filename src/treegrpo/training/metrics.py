"""Metrics: slash-namespaced keys to JSONL (and TensorBoard when installed).

``metrics.jsonl`` is an append log, one JSON object per line. Each line is appended with one write
and an fsync (:func:`treegrpo.io.append_line`), so a run killed mid-write leaves at most a torn
last line; resuming drops it (and any rows past the checkpoint's step) with a message.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from treegrpo.io import append_line, atomic_write_text


def peak_rss_gb() -> float | None:
    """This process's peak resident memory so far (its high-water mark), GiB; ``None`` where the
    platform has no ``resource`` module (Windows)."""
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / (2**30 if sys.platform == "darwin" else 2**20)


class MetricsLogger:
    """Appends one JSON object per step to ``metrics.jsonl``; mirrors scalars to TensorBoard.

    ``resume_step=None`` starts a new log; otherwise the log keeps the rows up to that step (what
    the checkpoint had seen) and continues after them. ``say`` prints the messages about dropped rows.
    """

    def __init__(
        self,
        out_dir: Path,
        tensorboard: bool = True,
        resume_step: int | None = None,
        say: Callable[[str], Any] = print,
    ) -> None:
        self.path = Path(out_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict[str, Any]] = []  # every row of the log, as written (the monitors' history)
        if resume_step is None:
            atomic_write_text(self.path, "")
        elif self.path.exists():
            kept = keep_rows(self.path, resume_step, say)
            atomic_write_text(self.path, "".join(ln + "\n" for ln in kept))
            self.rows = [json.loads(ln) for ln in kept]
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(Path(out_dir) / "tb"))
            except Exception:  # tensorboard is optional
                self.tb = None

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, **metrics}
        append_line(self.path, json.dumps(row))
        self.rows.append(row)
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def keep_rows(path: Path, up_to_step: int, say: Callable[[str], Any] = print) -> list[str]:
    """The lines of a metrics log whose row has ``step <= up_to_step``, as written. A line that is
    not a JSON object (a torn write) is dropped with a message saying where it was."""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    kept: list[str] = []
    dropped_later = 0
    for i, ln in enumerate(lines):
        if not ln.strip():
            continue
        try:
            row = json.loads(ln)
        except json.JSONDecodeError:
            row = None
        if not isinstance(row, dict):
            where = "its torn last line" if i == len(lines) - 1 else f"unreadable line {i + 1}"
            say(f"{path}: dropped {where} (a run killed mid-write)")
            continue
        if row.get("step", 0) <= up_to_step:
            kept.append(ln)
        else:
            dropped_later += 1
    if dropped_later:
        say(f"{path}: dropped {dropped_later} row(s) after step {up_to_step}, the checkpoint's step")
    return kept


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Rows of a ``metrics.jsonl`` (a broken line, e.g. from a killed run, is skipped)."""
    rows = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                rows.append(row)
    return rows
