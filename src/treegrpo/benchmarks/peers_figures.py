"""The table, checks and plot of ``bench peers``, from the rows' per-step lists (the docs' and README's
text made from them: :mod:`treegrpo.benchmarks.peers_report`).

A row runs ``repeats`` times (rows interleaved: every row of repeat 1, then every row of repeat 2,
the same seed for every row of a repeat). Per run, each figure is the median over steps 2..K of a
per-step figure (the first step is dropped as warm-up; with one step it is kept); a table line gives
the median over the repeats and its spread (``spread``: min and max over the repeats).

The figures: CPU seconds (rollout + update) per trajectory — the headline: a trajectory is the unit
of learning signal, and CPU seconds are what a loaded machine does not inflate the way it inflates
wall time — and per generated token; rollout and update CPU seconds; generated tokens (the model's
own: tool results excluded) per step and per trajectory (``completion_len_mean`` / ``_max``);
trajectories per 1k generated tokens; the work per phase (``prefill_positions``: positions run
through the model in prefill, padding included, KV reused from a cache not; ``decode_steps`` and
``decode_positions``: batched decode forwards and rows x those steps; ``update_positions``: positions
of the update's forwards, padding included) and CPU-ms per position of each phase; the load
(``cpu_per_wall``: CPU seconds per wall second per thread, 1.0 = the row had its threads to itself);
peak RSS while training and held-out EM before and after.

A ratio between two rows is paired by repeat (the same seed) and refused (``None``, with the
reason) when the two rows' mean completion lengths differ by more than
:data:`COMPLETION_LEN_TOLERANCE`: then the two sides did not do the same work per trajectory.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from treegrpo.benchmarks.runner import pyplot, save_figure

#: The issue's targets (this 2-core CPU, side by side in one run): (row, over row, figure, op, bound).
TARGETS: dict[str, tuple[str, str, str, str, float]] = {
    "single_turn_cpu_per_trajectory": ("single_turn/chain", "single_turn/trl", "cpu_s_per_trajectory", "<=", 0.35),
    "single_turn_peak_rss": ("single_turn/chain", "single_turn/trl", "peak_rss_gb", "<=", 0.6),
    "multi_turn_traj_per_1k": ("multi_turn/tree_2_2_1", "multi_turn/trl", "trajectories_per_1k_tokens", ">=", 1.25),
    "multi_turn_cpu_per_trajectory": ("multi_turn/chain", "multi_turn/trl", "cpu_s_per_trajectory", "<=", 0.5),
}  # fmt: skip
#: Ratios reported without a target: each mechanism's share (an ablation over the row it ablates)
#: and the figures the targets do not cover.
REPORTED: dict[str, tuple[str, str, str]] = {
    "single_turn_cpu_per_token": ("single_turn/chain", "single_turn/trl", "cpu_s_per_generated_token"),
    "single_turn_no_sharing_cpu_per_trajectory": ("single_turn/chain_no_sharing", "single_turn/chain", "cpu_s_per_trajectory"),
    "single_turn_no_packing_cpu_per_trajectory": ("single_turn/chain_no_packing", "single_turn/chain", "cpu_s_per_trajectory"),
    "multi_turn_tree_cpu_per_trajectory": ("multi_turn/tree_2_2_1", "multi_turn/trl", "cpu_s_per_trajectory"),
    "multi_turn_chain_peak_rss": ("multi_turn/chain", "multi_turn/trl", "peak_rss_gb"),
    "multi_turn_tree_vs_chain_traj_per_1k": ("multi_turn/tree_2_2_1", "multi_turn/chain", "trajectories_per_1k_tokens"),
    "multi_turn_no_sharing_cpu_per_trajectory": ("multi_turn/tree_2_2_1_no_sharing", "multi_turn/tree_2_2_1", "cpu_s_per_trajectory"),
    "multi_turn_no_packing_cpu_per_trajectory": ("multi_turn/tree_2_2_1_no_packing", "multi_turn/tree_2_2_1", "cpu_s_per_trajectory"),
    "long_completion_cpu_per_trajectory": ("long_completion/chain", "long_completion/trl", "cpu_s_per_trajectory"),
    "long_completion_cpu_per_token": ("long_completion/chain", "long_completion/trl", "cpu_s_per_generated_token"),
    "long_completion_rollout_cpu": ("long_completion/chain", "long_completion/trl", "rollout_cpu_s"),
    "long_completion_update_cpu": ("long_completion/chain", "long_completion/trl", "update_cpu_s"),
    "long_completion_peak_rss": ("long_completion/chain", "long_completion/trl", "peak_rss_gb"),
}  # fmt: skip
#: The most two rows' mean completion lengths may differ (either way) for a ratio between them.
COMPLETION_LEN_TOLERANCE = 1.3
#: Per-step lists a row may lack (a side that cannot count a phase): its figures are then ``None``.
PHASES = ("prefill_positions", "decode_steps", "decode_positions", "update_positions")


def steps_median(xs: Sequence[float | None]) -> float | None:
    """The median over steps 2..K (all steps when there is only one); ``None`` if any is missing."""
    xs = list(xs)
    if not xs or any(x is None for x in xs):
        return None
    return float(statistics.median(xs[1:] if len(xs) > 1 else xs))  # type: ignore[type-var]


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b is not None and b > 0 else None


def run_figures(r: dict[str, Any]) -> dict[str, Any]:
    """One run's figures (module docstring): medians over its steps 2..K."""
    roll, upd, gen, traj = r["rollout_cpu_s"], r["update_cpu_s"], r["generated_tokens"], r["trajectories"]
    per = range(len(gen))
    threads = max(1, int(r["settings"].get("threads") or 1))
    phases = {k: r.get(k) or [None] * len(gen) for k in PHASES}
    rolled = [None if phases["prefill_positions"][i] is None or phases["decode_positions"][i] is None
              else phases["prefill_positions"][i] + phases["decode_positions"][i] for i in per]  # fmt: skip
    return {
        "step_wall_s": steps_median(r["step_wall_s"]),
        "rollout_cpu_s": steps_median(roll),
        "update_cpu_s": steps_median(upd),
        "cpu_s_per_trajectory": steps_median([_ratio(roll[i] + upd[i], traj[i]) for i in per]),
        "cpu_s_per_generated_token": steps_median([_ratio(roll[i] + upd[i], gen[i]) for i in per]),
        "generated_tokens": steps_median(gen),
        "trained_tokens": steps_median(r["trained_tokens"]),
        "computed_tokens": steps_median(r["computed_tokens"]),
        "trajectories": steps_median(traj),
        "trajectories_per_1k_tokens": steps_median([_ratio(1000.0 * traj[i], gen[i]) for i in per]),
        "generated_tokens_per_cpu_s": steps_median([_ratio(gen[i], roll[i]) for i in per]),
        "trained_tokens_per_cpu_s": steps_median([_ratio(r["trained_tokens"][i], upd[i]) for i in per]),
        "completion_len_mean": steps_median(r.get("completion_len_mean") or [None]),
        "completion_len_max": max(r["completion_len_max"]) if r.get("completion_len_max") else None,
        "tool_calls": steps_median(r.get("tool_calls") or [None]),
        **{k: steps_median(v) for k, v in phases.items()},
        "rollout_ms_per_position": steps_median([_ratio(1000.0 * roll[i], rolled[i]) for i in per]),
        "update_ms_per_position": steps_median([_ratio(1000.0 * upd[i], phases["update_positions"][i]) for i in per]),
        "cpu_per_wall": steps_median([_ratio(roll[i] + upd[i], r["step_wall_s"][i] * threads) for i in per]),
        "peak_rss_gb": r["peak_rss_gb"],
        "em_before": r["em_before"],
        "em_after": r["em_after"],
    }  # fmt: skip


def _median(xs: Sequence[float | None]) -> float | None:
    got = [x for x in xs if x is not None]
    return float(statistics.median(got)) if got and len(got) == len(xs) else None


def _spread(xs: Sequence[float | None]) -> list[float] | None:
    return [min(xs), max(xs)] if xs and all(x is not None for x in xs) else None  # type: ignore[type-var]


def summarize(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One table line per row name: each figure's median over the repeats, its ``spread``
    (min, max over the repeats) and the held-out EM after of every repeat (``em_after_by_seed``)."""
    out = []
    for name in dict.fromkeys(r["name"] for r in rows):
        runs = sorted((r for r in rows if r["name"] == name), key=lambda r: r.get("repeat", 0))
        figs = [run_figures(r) for r in runs]
        line: dict[str, Any] = {k: runs[0][k] for k in ("name", "system", "job", "sampler", "steps")}
        line["ablation"] = runs[0].get("ablation")
        line["repeats"] = len(runs)
        line.update({k: _median([f[k] for f in figs]) for k in figs[0]})
        longest = _spread([f["completion_len_max"] for f in figs])
        line["completion_len_max"] = longest[1] if longest else None  # the longest completion of any repeat
        line["spread"] = {k: _spread([f[k] for f in figs]) for k in figs[0]}
        line["em_after_by_seed"] = {str(r["settings"].get("seed")): r["em_after"] for r in runs}
        out.append(line)
    return out


#: The settings every row records (``settings``) that both sides must share on a job.
SHARED = ("model_dir", "group_size", "max_new_tokens", "lr", "threads", "versions", "malloc_mmap_threshold")


def shared_settings(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per job, each :data:`SHARED` setting as the rows recorded it: the value when every row of
    the job agrees, else ``{row: value}`` (Tree-GRPO's group is its trajectories per prompt)."""
    out: dict[str, dict[str, Any]] = {}
    for job in dict.fromkeys(r["job"] for r in rows):
        mine = [r for r in rows if r["job"] == job]
        out[job] = {}
        for key in SHARED:
            values = {r["name"]: r["settings"].get(key) for r in mine}
            same = all(v == next(iter(values.values())) for v in values.values())
            out[job][key] = next(iter(values.values())) if same else values
    return out


def paired_ratio(rows: Sequence[dict[str, Any]], a: str, b: str, figure: str) -> dict[str, Any] | None:
    """Row ``a``'s ``figure`` over row ``b``'s, per repeat (the same seed), with its median and
    spread; ``None`` when a row is missing. Refused (``ratio: None`` and ``refused``: why) when the
    rows' mean completion lengths differ by more than :data:`COMPLETION_LEN_TOLERANCE`."""
    fa = {r.get("repeat", 0): run_figures(r) for r in rows if r["name"] == a}
    fb = {r.get("repeat", 0): run_figures(r) for r in rows if r["name"] == b}
    reps = sorted(set(fa) & set(fb))
    if not reps:
        return None
    per = [_ratio(fa[k][figure], fb[k][figure]) for k in reps]
    la = _median([fa[k]["completion_len_mean"] for k in reps])
    lb = _median([fb[k]["completion_len_mean"] for k in reps])
    lens = _ratio(la, lb)
    out: dict[str, Any] = {"rows": [a, b], "figure": figure, "repeats": reps, "per_repeat": per,
                           "completion_len_mean": [la, lb], "completion_len_ratio": lens, "refused": None}  # fmt: skip
    if lens is None:
        out["refused"] = "a row recorded no completion lengths: the two sides' work per trajectory is not known to match"
    elif max(lens, 1 / lens) > COMPLETION_LEN_TOLERANCE:
        out["refused"] = (f"mean completion lengths {la:.1f} vs {lb:.1f} tokens differ by {max(lens, 1 / lens):.2f}x "
                          f"> {COMPLETION_LEN_TOLERANCE}x: the two sides did not stop alike")  # fmt: skip
    ok = out["refused"] is None and all(x is not None for x in per)
    out["ratio"] = float(statistics.median(per)) if ok else None  # type: ignore[type-var]
    out["spread"] = [min(per), max(per)] if ok else None  # type: ignore[type-var]
    return out


def em_pairs(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per job, every treegrpo row's held-out EM after against the TRL row's, paired by seed."""
    out: dict[str, Any] = {}
    for job in dict.fromkeys(r["job"] for r in rows):
        trl = {r["settings"].get("seed"): r["em_after"] for r in rows if r["job"] == job and r["system"] == "trl"}
        for name in dict.fromkeys(r["name"] for r in rows if r["job"] == job and r["system"] != "trl"):
            mine = {r["settings"].get("seed"): r["em_after"] for r in rows if r["name"] == name}
            seeds = sorted(set(trl) & set(mine))
            if seeds:
                diffs = [mine[s] - trl[s] for s in seeds]
                out[name] = {"seeds": seeds, "row": [mine[s] for s in seeds], "trl": [trl[s] for s in seeds],
                             "diff_mean": statistics.fmean(diffs), "wins": sum(d > 0 for d in diffs),
                             "ties": sum(d == 0 for d in diffs)}  # fmt: skip
    return out


def checks(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The targets, measured as paired ratios (:func:`paired_ratio`; ``met`` is ``None`` when the
    ratio is refused or a row is missing), the ratios without a target, and the paired EM."""
    targets: dict[str, Any] = {}
    for key, (a, b, figure, op, bound) in TARGETS.items():
        got = paired_ratio(rows, a, b, figure)
        met = None if got is None or got["ratio"] is None else (got["ratio"] <= bound if op == "<=" else got["ratio"] >= bound)
        targets[key] = {**(got or {"rows": [a, b], "figure": figure, "ratio": None, "refused": "a row did not run"}),
                        "target": f"{op} {bound}", "met": met}  # fmt: skip
    reported = {key: paired_ratio(rows, a, b, f) for key, (a, b, f) in REPORTED.items()}
    return {"targets": targets, "reported": {k: v for k, v in reported.items() if v is not None}, "em": em_pairs(rows)}


def plot(results: dict[str, Any], png: Path) -> None:
    """CPU seconds per trajectory (rollout / update, spread over repeats), CPU-ms per position of
    each phase, peak RSS and held-out EM after (median over repeats), per row."""
    plt = pyplot()
    table = results["table"]
    names = [t["name"].replace("/", "\n") for t in table]
    xs = list(range(len(table)))
    fig, axes = plt.subplots(1, 4, figsize=(22, 4.6))
    ax = axes[0]
    roll = [(t["rollout_cpu_s"] or 0) / max(t["trajectories"] or 1, 1) for t in table]
    upd = [(t["update_cpu_s"] or 0) / max(t["trajectories"] or 1, 1) for t in table]
    ax.bar(xs, roll, color="C0", label="rollout")
    ax.bar(xs, upd, bottom=roll, color="C1", label="update")
    for x, t in zip(xs, table, strict=True):
        if (s := t["spread"].get("cpu_s_per_trajectory")) is not None:
            ax.plot([x, x], s, color="k", lw=2)
    ax.set_xticks(xs, names, fontsize=7)
    ax.set_ylabel("CPU-s per trajectory (median step; bar: spread over repeats)")
    ax.set_title("cost per trajectory")
    ax.legend()
    ax = axes[1]
    ax.bar([x - 0.2 for x in xs], [t["rollout_ms_per_position"] or 0 for t in table], 0.4, label="rollout (prefill + decode)")
    ax.bar([x + 0.2 for x in xs], [t["update_ms_per_position"] or 0 for t in table], 0.4, label="update")
    ax.set_xticks(xs, names, fontsize=7)
    ax.set_ylabel("CPU-ms per position computed")
    ax.set_title("cost per position, by phase")
    ax.legend()
    ax = axes[2]
    ax.bar(xs, [t["peak_rss_gb"] or 0 for t in table], color="C2")
    ax.set_xticks(xs, names, fontsize=7)
    ax.set_ylabel("peak RSS while training, GB")
    ax.set_title("memory (the same allocator setting)")
    ax = axes[3]
    ax.bar([x - 0.2 for x in xs], [t["em_before"] or 0 for t in table], 0.4, label="before")
    ax.bar([x + 0.2 for x in xs], [t["em_after"] or 0 for t in table], 0.4, label="after (median over seeds)")
    ax.set_xticks(xs, names, fontsize=7)
    ax.set_ylim(0, 1)
    steps = results["spec"]["steps"]
    ax.set_title(f"held-out EM (greedy), {steps} steps")
    ax.legend()
    fig.suptitle("treegrpo vs TRL GRPOTrainer on the same jobs, equal stopping and allocator")
    save_figure(fig, png)
