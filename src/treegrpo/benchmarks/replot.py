"""Re-draw a benchmark's figure from its result JSON (``treegrpo plot benchmarks/results/X.json``).

Each benchmark that draws a figure keeps its own ``plot`` function; this module only recognises
which benchmark wrote a result file (its ``bench`` or ``benchmark`` field) and calls that function,
so a figure can be re-made (or made elsewhere) without re-running the measurement.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from treegrpo.errors import ConfigError


def _budget(doc: dict[str, Any], png: Path) -> None:
    from treegrpo.benchmarks.budget_report import plot

    plot(doc["rows"], png)


def _packing(doc: dict[str, Any], png: Path) -> None:
    from treegrpo.benchmarks.packing import plot

    plot(doc["rows"], png)


def _eptree(doc: dict[str, Any], png: Path) -> None:
    from treegrpo.benchmarks.eptree import plot

    plot(doc, png)


def _learn(doc: dict[str, Any], png: Path) -> None:
    from treegrpo.benchmarks.learn_plots import plot

    plot(doc, png)


def _learn_gigpo(doc: dict[str, Any], png: Path) -> None:
    from treegrpo.benchmarks.learn_plots import plot_gigpo

    plot_gigpo(doc, png)


def _learn_tokens(doc: dict[str, Any], png: Path) -> None:
    from treegrpo.benchmarks.learn_tokens import plot

    plot(doc, png)


PLOTTERS: dict[str, Callable[[dict[str, Any], Path], None]] = {
    "budget": _budget,
    "packing": _packing,
    "eptree": _eptree,
    "learn": _learn,
    "learn_gigpo": _learn_gigpo,
    "learn_tokens": _learn_tokens,
}


def benchmark_name(doc: Any) -> str | None:
    """The benchmark that wrote ``doc`` (its ``bench`` or ``benchmark`` field), if any."""
    if not isinstance(doc, dict):
        return None
    name = doc.get("bench", doc.get("benchmark"))
    return name if isinstance(name, str) else None


def replot(result: str | Path, out: str | Path | None = None) -> Path:
    """Draw the figure of the benchmark result ``result``; returns the PNG written (default:
    beside the JSON, ``.png``; ``out`` a folder or a ``.png`` path)."""
    src = Path(result)
    try:
        doc = json.loads(src.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"{src}: cannot read ({e.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{src}: not a JSON file ({e})") from None
    name = benchmark_name(doc)
    if name not in PLOTTERS:
        what = f"benchmark {name!r}" if name else "no 'bench' field"
        raise ConfigError(
            f"{src}: {what}; plots exist for the {', '.join(sorted(PLOTTERS))} benchmarks "
            "(for a training run, give its folder)"
        )
    png = src.with_suffix(".png")
    if out is not None:
        o = Path(out)
        png = o if o.suffix == ".png" else o / f"{src.stem}.png"
    png.parent.mkdir(parents=True, exist_ok=True)
    try:
        PLOTTERS[name](doc, png)
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise ConfigError(f"{src}: a {name} result, but not one its plot can read ({type(e).__name__}: {e})") from None
    return png


__all__ = ["PLOTTERS", "benchmark_name", "replot"]
