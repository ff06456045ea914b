"""Progress display and thread settings shared by long-running builds (bootstraps, warm-ups)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch


@contextmanager
def progress_bars(enabled: bool) -> Iterator[Any]:
    """A rich progress display (``None`` when not ``enabled``), closed on exit."""
    if not enabled:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        transient=False,
    ) as p:
        yield p


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



def plain_printer(progress: Any) -> Callable[[str], None] | None:
    """A printer of plain progress lines on ``progress``'s console when that console is not a
    terminal (a log file, a pipe: a bar there shows nothing until it ends), else ``None``."""
    if progress is None or progress.console.is_terminal:
        return None
    console = progress.console
    return lambda line: console.print(line, markup=False, highlight=False)
