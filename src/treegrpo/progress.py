"""Progress display and thread settings shared by long-running builds (bootstraps, warm-ups)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


@contextmanager
def progress_bars(enabled: bool) -> Iterator[Any]:
    """A rich progress display (``None`` when not ``enabled``), closed on exit. When the output is
    not a terminal (a log file, a pipe), where a bar shows nothing until it ends, a
    :class:`PlainProgress` instead: the same calls, printed as plain lines."""
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console()
    if not console.is_terminal:
        yield PlainProgress(Console(soft_wrap=True))  # a log's lines are not folded at 80 columns
        return
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as p:
        yield p


class PlainProgress:
    """The part of rich's ``Progress`` a bootstrap uses (``add_task``, ``update``, ``console``),
    for output that is not a terminal: a task's description, its count and the time elapsed,
    printed as one plain line each time another ``1 / parts`` of its total is done."""

    def __init__(self, console: Any, parts: int = 20) -> None:
        self.console = console
        self.parts = parts
        self._tasks: list[dict[str, Any]] = []

    def add_task(self, description: str, total: float | None = None, **_: Any) -> int:
        self._tasks.append({"description": description, "total": total, "done": 0.0, "said": 0, "t0": time.perf_counter()})
        return len(self._tasks) - 1

    def update(self, task_id: int, advance: float = 0.0, description: str | None = None, **_: Any) -> None:
        t = self._tasks[task_id]
        t["done"] += advance
        if description is not None:
            t["description"] = description
        if not t["total"]:
            return
        part = self.parts if t["done"] >= t["total"] else int(t["done"] * self.parts // t["total"])
        if part > t["said"]:
            t["said"] = part
            line = f"{t['description']} · {t['done']:.0f}/{t['total']:.0f} · {time.perf_counter() - t['t0']:.0f}s"
            self.console.print(line, markup=False, highlight=False)


@contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run with ``n`` torch intra-op threads, restoring the previous setting afterwards."""
    old = torch.get_num_threads()
    if n is not None and n != old:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != old:
            torch.set_num_threads(old)


def phase(progress: Any, text: str) -> None:
    """Print one bootstrap phase line above the progress bars (nothing without a display)."""
    if progress is not None:
        progress.console.print(f"[bold]bootstrap[/bold] {text}")

