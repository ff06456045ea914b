"""Run plots (``treegrpo plot RUN_DIR [RUN_DIR ...]``): matplotlib PNGs from ``metrics.jsonl``.

One figure per panel of :data:`PANELS` and an ``overview.png`` with every panel that has data.
The x axis is the run's cumulative generated tokens (``budget/total_generated_tokens``; the
starting evaluation sits at 0), so chain and tree runs compare at a matched cost; ``x="step"``
plots against the step instead. Several runs share each figure, one colour per run, labelled
``<folder> · <sampler shape>`` from the run's ``config.json``. A series a run does not have (e.g.
``rollout/logprob_diff`` in older runs, ``loss/kl`` without a KL term) is left out of the figure;
a panel no run has is not drawn.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from treegrpo.errors import ConfigError
from treegrpo.viz.data import read_metrics, run_estimator

TOKENS_KEY = "budget/total_generated_tokens"


@dataclass(frozen=True)
class Panel:
    """One figure: its file stem, title, y label and the series ``(metric key, label)`` it draws
    (the first series solid, the next dashed, then dotted)."""

    name: str
    title: str
    ylabel: str
    series: tuple[tuple[str, str], ...]


PANELS: tuple[Panel, ...] = (
    Panel("reward", "Training reward", "mean leaf reward", (("reward/mean", "reward"),)),
    Panel(
        "heldout_em",
        "Held-out EM",
        "exact match",
        (("eval/success_sampled", "sampled"), ("eval/success_greedy", "greedy")),
    ),
    Panel("tool_calls", "Tool calls per trajectory", "calls", (("budget/tool_calls_per_traj", "tool calls"),)),
    Panel("kl", "KL", "nats / token", (("loss/kl", "to reference"), ("actor/approx_kl", "to rollout policy"))),
    Panel("entropy", "Policy entropy", "nats / token", (("actor/entropy", "entropy"),)),
    Panel("grad_norm", "Gradient norm", "‖g‖ (before clipping)", (("actor/grad_norm", "grad norm"),)),
    Panel(
        "informative_groups",
        "Informative groups",
        "fraction of prompts with mixed rewards",
        (("rollout/informative_groups", "informative"),),
    ),
    Panel("logprob_gap", "Engine–trainer log-prob gap", "|Δ log p|", (("rollout/logprob_diff", "gap"),)),
)
_STYLES = ("-", "--", ":")


@dataclass
class RunSeries:
    """The metric rows of one run and its legend label."""

    folder: Path
    label: str
    rows: list[dict[str, Any]]

    def xy(self, key: str, x: Literal["tokens", "step"]) -> tuple[list[float], list[float]]:
        """``(xs, ys)`` of the rows that have ``key`` as a finite number."""
        xs, ys = [], []
        for row in self.rows:
            v = row.get(key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v in (float("inf"), float("-inf")):
                continue
            xv = row.get("step", 0) if x == "step" else row.get(TOKENS_KEY, 0 if row.get("step", 0) == 0 else None)
            if xv is None:
                continue
            xs.append(float(xv))
            ys.append(float(v))
        return xs, ys


def run_label(folder: Path, config: dict[str, Any]) -> str:
    """``<folder name> · <sampler and shape>`` (just the folder name without a config)."""
    s = config.get("sampler")
    if s == "chain":
        shape = f"chain G={config.get('group_size')}"
    elif s == "eptree":
        shape = f"eptree ({config.get('m')},{config.get('n')},{config.get('l')},{config.get('t')})"
    elif s:
        shape = f"{s} ({config.get('m')},{config.get('n')},{config.get('l')}) {config.get('expand_mode', '')}".strip()
    else:
        return folder.name
    adv = run_estimator(config)
    return f"{folder.name} · {shape}" + (f" · {adv}" if adv else "")


def load_run(folder: str | Path) -> RunSeries:
    """A run folder's metrics and label; a one-line :class:`ConfigError` if it has no metrics."""
    folder = Path(folder)
    path = folder / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"{folder}: no metrics.jsonl here (give a folder written by treegrpo train)")
    rows = read_metrics(path)
    if not rows:
        raise ConfigError(f"{path}: no metric rows")
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        config = {}
    return RunSeries(folder, run_label(folder, config if isinstance(config, dict) else {}), rows)


def _draw(ax: Any, panel: Panel, runs: list[RunSeries], x: Literal["tokens", "step"], legend: bool = True) -> bool:
    import matplotlib.pyplot as plt

    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    drawn = False
    several_series = len(panel.series) > 1
    for ri, run in enumerate(runs):
        for si, (key, label) in enumerate(panel.series):
            xs, ys = run.xy(key, x)
            if not xs:
                continue
            name = run.label if len(runs) > 1 else ""
            if several_series:
                name = f"{name} · {label}" if name else label
            ax.plot(xs, ys, _STYLES[si % len(_STYLES)], color=colors[ri % len(colors)], marker="o", ms=3, lw=1.5, label=name or None)
            drawn = True
    if drawn:
        ax.set_title(panel.title, fontsize=10)
        ax.set_xlabel("generated tokens (cumulative)" if x == "tokens" else "step", fontsize=8)
        ax.set_ylabel(panel.ylabel, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if legend and ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    return drawn


@dataclass
class PlotResult:
    """What :func:`plot_runs` did: the folder, the PNGs written, the panels left out because no
    run has their series, and the x axis used."""

    folder: Path
    written: list[Path]
    skipped: list[str]
    x: str

    def line(self) -> str:
        """One line for the console."""
        skipped = f"; no data: {', '.join(self.skipped)}" if self.skipped else ""
        return f"wrote {len(self.written)} PNGs to {self.folder} (x axis: {self.x}{skipped})"


def plot_runs(
    folders: list[str | Path], out_dir: str | Path | None = None, x: Literal["tokens", "step"] | str = "tokens"
) -> PlotResult:
    """Write one PNG per panel with data, and ``overview.png``, into ``out_dir`` (default:
    ``RUN_DIR/plots`` for one run, ``./plots`` for several). A run that does not log
    ``budget/total_generated_tokens`` puts every run on the ``step`` axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if x not in ("tokens", "step"):
        raise ConfigError(f"x axis {x!r}: choose tokens or step")
    runs = [load_run(f) for f in folders]
    if x == "tokens" and any(not any(TOKENS_KEY in r for r in run.rows) for run in runs):
        x = "step"
    out = Path(out_dir) if out_dir is not None else (Path(folders[0]) / "plots" if len(folders) == 1 else Path("plots"))
    out.mkdir(parents=True, exist_ok=True)
    written, skipped, have = [], [], []
    for panel in PANELS:
        fig, ax = plt.subplots(figsize=(5.2, 3.4))
        if _draw(ax, panel, runs, x):
            fig.tight_layout()
            path = out / f"{panel.name}.png"
            fig.savefig(path, dpi=100)
            written.append(path)
            have.append(panel)
        else:
            skipped.append(panel.name)
        plt.close(fig)
    if have:
        cols = 3 if len(have) > 4 else 2
        rows = -(-len(have) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 2.9 * rows), squeeze=False)
        for k, (ax, panel) in enumerate(zip(axes.flat, have, strict=False)):
            _draw(ax, panel, runs, x, legend=k == 0 or len(panel.series) > 1)  # runs: once; series: where several
        for ax in list(axes.flat)[len(have) :]:
            ax.axis("off")
        fig.suptitle(" vs ".join(r.label for r in runs) if len(runs) <= 3 else f"{len(runs)} runs", fontsize=10)
        fig.tight_layout()
        path = out / "overview.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        written.append(path)
    return PlotResult(out, written, skipped, x)


__all__ = ["PANELS", "Panel", "PlotResult", "RunSeries", "load_run", "plot_runs", "run_label"]
