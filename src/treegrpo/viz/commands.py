"""The ``treegrpo view`` and ``treegrpo plot`` commands, registered on the CLI's app by
:func:`register`. Re-drawing a benchmark's figure needs the benchmarks, which no library module
imports: the CLI passes that function in (``replot``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import typer

from treegrpo.errors import ConfigError

Replot = Callable[[Path, "Path | None"], Path]


def _report(task: Callable[[], list[str]]) -> None:
    """Run ``task``; print its lines, or one error line and exit 2 on a user error."""
    try:
        lines = task()
    except (ConfigError, OSError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    for line in lines:
        typer.echo(line, err=True)


def view(source: Path, out: Path | None) -> list[str]:
    """Write the viewer page of ``source``; the console line."""
    from treegrpo.viz.page import write_view

    path, data = write_view(source, out)
    return [f"wrote {path} ({len(data.forests)} forests, {len(data.index['steps'])} step files)"]


def plot(sources: list[Path], out: Path | None, x: str, replot: Replot) -> list[str]:
    """Re-draw each benchmark result file with ``replot``; plot the run folders together."""
    from treegrpo.viz.plots import plot_runs

    lines = [f"wrote {replot(f, out)}" for f in sources if not f.is_dir()]
    runs: list[str | Path] = [s for s in sources if s.is_dir()]
    if runs:
        lines.append(plot_runs(runs, out, x).line())
    return lines


def register(app: typer.Typer, replot: Replot) -> None:
    """Add ``view`` and ``plot`` to ``app``."""

    @app.command("view")
    def view_cmd(
        source: Path = typer.Argument(..., help="A run folder (rollouts/step_*.jsonl) or a forest .json/.jsonl file."),
        out: Path | None = typer.Option(None, "--out", "-o", help="HTML file (default: RUN_DIR/view.html, or FILE.html)."),
    ) -> None:
        """Write one self-contained HTML page (no network) to browse a run's forests: steps, prompts,
        trees coloured by advantage and reward, each node's text, observation and per-token log-probs."""
        _report(lambda: view(source, out))

    @app.command("plot")
    def plot_cmd(
        sources: list[Path] = typer.Argument(..., help="Run folders (one figure set, runs overlaid) and/or benchmark result JSONs."),
        out: Path | None = typer.Option(None, "--out", "-o", help="Folder for the PNGs (default: RUN_DIR/plots, ./plots for several runs; a benchmark's PNG beside its JSON)."),
        x: str = typer.Option("tokens", "--x", help="x axis of run plots: tokens (cumulative generated) | step."),
    ) -> None:
        """PNGs of reward, held-out EM, tool calls, KL, entropy, grad norm, informative groups and the
        engine–trainer log-prob gap against generated tokens; several runs on one figure. A benchmark
        result JSON gets its benchmark's figure re-drawn."""
        _report(lambda: plot(sources, out, x, replot))


__all__ = ["plot", "register", "view"]
