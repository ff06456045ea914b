"""The figures of ``treegrpo bench tools`` from its recorded rows: medians per row, the limit, the
issue's targets and where a pipelined step's time goes (:func:`summarize`, pure), the result
document (:func:`document`) and its plot (:func:`plot`).

Per job and sampler (a *group*), with medians over the measured steps:

- ``baseline_wall_s``: the ``none/today`` row's wall per step (no latency, every default);
- per row: ``wall_s``, ``over_baseline`` = ``wall_s / baseline_wall_s``, the tool metrics, and for
  a treegrpo row with latency ``limit_s`` = ``baseline_wall_s`` + the chain latency (the median over
  steps of the longest chain of dependent calls, ``tools/chain_latency_s``, as the ``serial`` row
  timed it — serial, concurrent and pipelined grow the same forests, so the same chain, and calls
  timed one at a time with the engine idle are not stretched by the process's own work; named in
  ``limit_chain_from``), ``over_limit`` = ``wall_s / limit_s``, and ``per_step``: step k's wall, the
  baseline's step k (the same prompts), the chain, limit and ratio;
- ``gap`` of a pipelined row with latency: ``wall_s - limit_s`` split into ``engine_extra_s``
  (its engine seconds over the no-latency pipelined row's: more, smaller engine calls),
  ``idle_over_chain_s`` (engine idle beyond the chain's latency: waits the chain does not
  explain), ``update_extra_s`` (update seconds over the baseline's) and ``other_s`` (the rest:
  the loop's own work, the baseline's rollout overheads the pipelined row does not share);
  ``own_chain_stretch_s`` (not in the sum): the row's own chain latency over the limit's — the
  same calls timed while the process generates and trains (a sleeping call waits for the GIL).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from treegrpo.benchmarks.runner import pyplot, save_figure

#: The issue's targets: (name, latency, what, bound, sense). ``what``: a row figure of the pipelined
#: row, or ``speedup`` (the serial row's wall over the pipelined row's).
TARGETS: tuple[tuple[str, str, str, float, str], ...] = (
    ("constant: pipelined wall <= 1.2x the limit", "constant", "over_limit", 1.2, "<="),
    ("constant: pipelined >= 10x faster than tool_concurrency=1", "constant", "speedup", 10.0, ">="),
    ("heavy: pipelined wall <= 1.3x the limit", "heavy", "over_limit", 1.3, "<="),
    ("no latency: pipelined wall <= 1.05x today's", "none", "over_baseline", 1.05, "<="),
)
_FIGURES = ("tools_wall_s", "peak_in_flight", "engine_idle_s", "engine_s", "chain_latency_s", "tool_calls",
            "generated_tokens", "rollout_s", "update_s")  # fmt: skip


def median(values: Sequence[float | None]) -> float | None:
    """The median of the values that are not ``None`` (``None`` when there are none)."""
    got = [float(v) for v in values if v is not None]
    return statistics.median(got) if got else None


def _div(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def row_figures(row: dict[str, Any]) -> dict[str, Any]:
    """A row's medians over its measured steps: ``wall_s`` and :data:`_FIGURES`."""
    steps = row["steps"]
    return {"wall_s": median([s["wall_s"] for s in steps]), **{k: median([s.get(k) for s in steps]) for k in _FIGURES}}


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``{"groups": {job/sampler: {...}}, "targets": [...]}`` from the recorded rows (module
    docstring); a group without its baseline row gets no ratios."""
    groups: dict[str, dict[str, Any]] = {}
    steps: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        name, key = f"{r['job']}/{r['sampler']}", f"{r['latency']}/{r['mode']}"
        groups.setdefault(name, {"rows": {}})["rows"][key] = row_figures(r)
        steps[name, key] = r["steps"]
    targets = []
    for name, g in groups.items():
        rs = g["rows"]
        base = rs.get("none/today")
        g["baseline_wall_s"] = b = base["wall_s"] if base else None
        for key, f in rs.items():
            f["over_baseline"] = _div(f["wall_s"], b)
            lat, mode = key.split("/")
            ref = f"{lat}/serial" if f"{lat}/serial" in rs else key  # the chain's calls, timed alone
            chains = [s["chain_latency_s"] for s in steps[name, ref]]
            if lat != "none" and mode != "trl" and b is not None and None not in chains:
                f["limit_chain_from"] = ref
                f["limit_s"] = b + median(chains)  # type: ignore[operator]
                f["over_limit"] = _div(f["wall_s"], f["limit_s"])
                f["per_step"] = per_step(steps[name, key], steps[name, "none/today"], chains)
        for lat in ("constant", "heavy"):
            p, s, t = rs.get(f"{lat}/pipelined"), rs.get(f"{lat}/serial"), rs.get(f"{lat}/trl")
            if p is not None and s is not None:
                p["speedup_vs_serial"] = _div(s["wall_s"], p["wall_s"])
            if p is not None and t is not None:
                t["over_pipelined"] = _div(t["wall_s"], p["wall_s"])
                t["over_serial"] = _div(t["wall_s"], s["wall_s"]) if s else None
            if p is not None and p.get("limit_s") is not None:
                p["gap"] = gap(p, rs.get("none/pipelined"), base)
        for label, lat, what, bound, sense in TARGETS:
            p = rs.get(f"{lat}/pipelined")
            value = None if p is None else p.get("speedup_vs_serial" if what == "speedup" else what)
            if value is not None:
                ok = value <= bound if sense == "<=" else value >= bound
                targets.append({"group": name, "target": label, "value": value, "bound": bound, "sense": sense, "met": ok})
    return {"groups": groups, "targets": targets}


def per_step(row: Sequence[dict[str, Any]], base: Sequence[dict[str, Any]], chains: Sequence[float]) -> list[dict[str, float | None]]:
    """Step k of a latency row against step k of the baseline (the same prompts): its wall, the
    baseline's, the chain latency ``chains[k]``, the limit (baseline wall + chain) and the wall over it."""
    out = []
    for s, b, c in zip(row, base, chains, strict=False):
        limit = b["wall_s"] + c
        out.append({"wall_s": s["wall_s"], "baseline_wall_s": b["wall_s"], "chain_latency_s": c,
                    "limit_s": limit, "over_limit": _div(s["wall_s"], limit)})  # fmt: skip
    return out


def gap(p: dict[str, Any], nolat: dict[str, Any] | None, base: dict[str, Any] | None) -> dict[str, float | None]:
    """Where a pipelined row's wall beyond its limit goes (module docstring)."""
    total = p["wall_s"] - p["limit_s"]
    chain = p["limit_s"] - (base["wall_s"] if base else 0.0)  # the chain latency of the limit
    engine = None if nolat is None or p["engine_s"] is None or nolat["engine_s"] is None else p["engine_s"] - nolat["engine_s"]
    idle = None if p["engine_idle_s"] is None else p["engine_idle_s"] - chain
    update = None if base is None else p["update_s"] - base["update_s"]
    other = total - sum(x for x in (engine, idle, update) if x is not None)
    return {"total_s": total, "engine_extra_s": engine, "idle_over_chain_s": idle, "update_extra_s": update, "other_s": other,
            "own_chain_stretch_s": p["chain_latency_s"] - chain}  # fmt: skip


def document(rows: Sequence[dict[str, Any]], meta: dict[str, Any], prov: dict[str, Any], spec: Any) -> dict[str, Any]:
    """The result JSON: what was measured, how, the rows and their summary."""
    return {
        "what": "wall per step of a tool agent against its tools' latency (issue 41): the default job with its search "
                "as a per-query tool and SmolLM2 (2 layers, warmed up) calling search(query); tools of no, constant "
                "200 ms and heavy-tailed (median 200 ms, p99 ~2 s) latency; tree (2,2,1) and chain 4; "
                "tool_concurrency=1, concurrent, pipelined, the no-latency baseline and TRL's tools= loop",
        **meta,
        "settings": {"steps": spec.steps, "warmup": spec.warmup, "threads": spec.threads,
                     "order": "per job, per latency (none first), per sampler: none/today then none/pipelined, or "
                              "serial, concurrent, pipelined (and trl beside chain 4), back to back; rows written as each finishes"},
        "summary": summarize(rows),
        "rows": list(rows),
        "provenance": prov,
    }  # fmt: skip


def plot(doc: dict[str, Any], png: Path) -> None:
    """Two panels: wall per step by row (the limit marked), and wall per step over the group's
    no-latency baseline (log scale)."""
    plt = pyplot()
    groups = doc["summary"]["groups"]
    labels, walls, limits, ratios, colors = [], [], [], [], []
    palette = {"today": "#777777", "serial": "#d62728", "concurrent": "#ff7f0e", "pipelined": "#2ca02c", "trl": "#1f77b4"}
    for gname, g in groups.items():
        for key, f in g["rows"].items():
            labels.append(f"{gname}  {key}")
            walls.append(f["wall_s"] or 0.0)
            limits.append(f.get("limit_s"))
            ratios.append(f.get("over_baseline") or float("nan"))
            colors.append(palette.get(key.split("/")[1], "#999999"))
    fig, axes = plt.subplots(1, 2, figsize=(14, 0.28 * len(labels) + 1.5), sharey=True)
    y = list(range(len(labels)))[::-1]
    axes[0].barh(y, walls, color=colors)
    for yi, lim in zip(y, limits, strict=True):
        if lim is not None:
            axes[0].plot([lim, lim], [yi - 0.4, yi + 0.4], color="black", lw=1.5)
    axes[0].set_xscale("log")
    axes[0].set_xlabel("wall per step (s, median; | = limit: baseline wall + chain latency)")
    axes[0].set_yticks(y, labels, fontsize=7)
    axes[1].barh(y, ratios, color=colors)
    axes[1].axvline(1.0, color="black", lw=0.8)
    axes[1].set_xscale("log")
    axes[1].set_xlabel("wall per step / no-latency baseline's")
    fig.suptitle("bench tools: wall per step by row (grey today, red serial, orange concurrent, green pipelined, blue TRL)")
    save_figure(fig, png)


__all__ = ["TARGETS", "document", "gap", "median", "per_step", "plot", "row_figures", "summarize"]
