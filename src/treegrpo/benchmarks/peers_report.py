"""The table, checks and plot of ``bench peers``, from the rows' per-step lists.

Every column is the median over steps 2..K of a per-step figure (the first step is dropped as
warm-up; with one step it is kept): wall seconds per step, rollout and update CPU seconds,
generated tokens per rollout CPU-second, trained tokens per update CPU-second (the tokens of the
training sequences, every trajectory with its prompt: the same work on both sides; ``computed_tokens``
is what each update's forward ran: TRL's padded batch, treegrpo's packed rows), CPU seconds
(rollout + update) per generated token and per trajectory (the same number of trajectories on both
sides of the single-turn job, whatever each generates after the answer), trajectories per 1k
generated tokens; plus peak RSS (training) and the held-out EM before and after.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from treegrpo.benchmarks.runner import pyplot, save_figure

#: The issue's targets (this 2-core CPU, side by side in one run).
TARGETS = {
    "single_turn_cpu_per_token_ratio_max": 0.5,  # treegrpo chain / TRL, CPU-s (rollout + update) per generated token
    "single_turn_peak_rss_ratio_max": 1.0,  # treegrpo chain / TRL
    "multi_turn_traj_per_1k_ratio_min": 1.25,  # Tree-GRPO / TRL, trajectories per 1k generated tokens
}


def steps_median(xs: Sequence[float]) -> float:
    """The median over steps 2..K (all steps when there is only one)."""
    xs = list(xs)
    return float(statistics.median(xs[1:] if len(xs) > 1 else xs)) if xs else float("nan")


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def summarize(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One table line per row (module docstring)."""
    out = []
    for r in rows:
        roll, upd, gen = r["rollout_cpu_s"], r["update_cpu_s"], r["generated_tokens"]
        per = range(len(gen))
        out.append({
            "name": r["name"], "system": r["system"], "job": r["job"], "sampler": r["sampler"], "steps": r["steps"],
            "step_wall_s": steps_median(r["step_wall_s"]),
            "rollout_cpu_s": steps_median(roll),
            "update_cpu_s": steps_median(upd),
            "generated_tokens": steps_median(gen),
            "trained_tokens": steps_median(r["trained_tokens"]),
            "computed_tokens": steps_median(r["computed_tokens"]),
            "generated_tokens_per_cpu_s": steps_median([_ratio(gen[i], roll[i]) for i in per]),
            "trained_tokens_per_cpu_s": steps_median([_ratio(r["trained_tokens"][i], upd[i]) for i in per]),
            "cpu_s_per_generated_token": steps_median([_ratio(roll[i] + upd[i], gen[i]) for i in per]),
            "trajectories_per_1k_tokens": steps_median([_ratio(1000.0 * r["trajectories"][i], gen[i]) for i in per]),
            "cpu_s_per_trajectory": steps_median([_ratio(roll[i] + upd[i], r["trajectories"][i]) for i in per]),
            "peak_rss_gb": r["peak_rss_gb"],
            "em_before": r["em_before"],
            "em_after": r["em_after"],
        })  # fmt: skip
    return out


#: The settings every row records (``settings``) that both sides must share on a job.
SHARED = ("model_dir", "group_size", "max_new_tokens", "lr", "seed", "threads", "versions")


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


def _line(table: Sequence[dict[str, Any]], name: str) -> dict[str, Any] | None:
    return next((t for t in table if t["name"] == name), None)


def checks(table: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The targets, measured: each ratio and whether it met its target (``None``: a row is missing)."""
    trl, chain = _line(table, "single_turn/trl"), _line(table, "single_turn/chain")
    tree, mchain = _line(table, "multi_turn/tree_2_2_1"), _line(table, "multi_turn/chain")
    out: dict[str, Any] = {"targets": TARGETS}
    if trl and chain:
        cpu = _ratio(chain["cpu_s_per_generated_token"], trl["cpu_s_per_generated_token"])
        rss = _ratio(chain["peak_rss_gb"], trl["peak_rss_gb"])
        out["single_turn_cpu_per_token_ratio"] = cpu
        out["single_turn_cpu_per_token_met"] = cpu <= TARGETS["single_turn_cpu_per_token_ratio_max"]
        out["single_turn_cpu_per_trajectory_ratio"] = _ratio(chain["cpu_s_per_trajectory"], trl["cpu_s_per_trajectory"])
        out["single_turn_peak_rss_ratio"] = rss
        out["single_turn_peak_rss_met"] = rss <= TARGETS["single_turn_peak_rss_ratio_max"]
    out["multi_turn_traj_per_1k_ratio"] = None  # TRL has no multi-turn row (see not_run)
    if tree and mchain:  # for reference: against treegrpo's own chains, the same sampling TRL would do
        out["multi_turn_tree_vs_chain_traj_per_1k_ratio"] = _ratio(tree["trajectories_per_1k_tokens"], mchain["trajectories_per_1k_tokens"])
    return out


def plot(results: dict[str, Any], png: Path) -> None:
    """CPU seconds per generated token (rollout / update), peak RSS, held-out EM before/after, per row."""
    plt = pyplot()
    table = results["table"]
    names = [t["name"].replace("/", "\n") for t in table]
    xs = list(range(len(table)))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    roll = [1000 * t["rollout_cpu_s"] / max(t["generated_tokens"], 1) for t in table]
    upd = [1000 * t["update_cpu_s"] / max(t["generated_tokens"], 1) for t in table]
    ax.bar(xs, roll, color="C0", label="rollout")
    ax.bar(xs, upd, bottom=roll, color="C1", label="update")
    ax.set_xticks(xs, names)
    ax.set_ylabel("CPU-ms per generated token (median step)")
    ax.set_title("cost per generated token")
    ax.legend()
    ax = axes[1]
    ax.bar(xs, [t["peak_rss_gb"] for t in table], color="C2")
    ax.set_xticks(xs, names)
    ax.set_ylabel("peak RSS while training, GB")
    ax.set_title("memory")
    ax = axes[2]
    ax.bar([x - 0.2 for x in xs], [t["em_before"] for t in table], 0.4, label="before")
    ax.bar([x + 0.2 for x in xs], [t["em_after"] for t in table], 0.4, label="after")
    ax.set_xticks(xs, names)
    ax.set_ylim(0, 1)
    steps = results["spec"]["steps"]
    ax.set_title(f"held-out EM (greedy), {steps} steps")
    ax.legend()
    fig.suptitle("treegrpo vs TRL GRPOTrainer on the same job")
    save_figure(fig, png)
