"""The figures and terminal tables of ``treegrpo bench learn`` and ``bench learn --gigpo``, drawn
from a result document alone (:mod:`.learn_report` computes what they show)."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from treegrpo.benchmarks.learn_report import compare, em_at, labels, summarize
from treegrpo.benchmarks.learn_spec import ABLATION_BUDGET, EXPAND_MODES, spec_of, tree_label
from treegrpo.benchmarks.runner import pyplot, save_figure
from treegrpo.rollout.planner import PAPER_PAIRS


def _with_range(ax: Any, xs: list[float], s: list[dict[str, float]], **kw: Any) -> None:
    """Means with min–max error bars."""
    err = [[x["mean"] - x["min"] for x in s], [x["max"] - x["mean"] for x in s]]
    ax.errorbar(xs, [x["mean"] for x in s], yerr=err, capsize=3, **kw)


def plot(result: dict[str, Any], path: Path) -> None:
    """Three panels: held-out EM vs budget (mean, min–max over seeds), the paired tree ÷ chain
    ratios per budget, and EM vs generated tokens."""
    plt = pyplot()
    rows = result["rows"]
    summary = summarize(rows)
    fig, (ax, cx, bx) = plt.subplots(1, 3, figsize=(19, 4.8), gridspec_kw={"width_ratios": [1.1, 0.9, 1.1]})
    colors = {"chain": "black", "random": "tab:blue", "nonroot": "tab:orange", "entropy": "tab:green"}
    budgets = sorted({r["budget"] for r in rows})
    series: list[tuple[str, str, list[str]]] = [("chain", "chain GRPO", [f"chain {b}" for b in budgets])]
    series += [(m, f"Tree-GRPO {m}", [tree_label(b, m) for b in budgets]) for m in EXPAND_MODES]
    for i, (key, name, labs) in enumerate(series):
        pts = [
            (b * (1 + 0.03 * (i - 1.5)), summary[lab]["em_end"])
            for b, lab in zip(budgets, labs, strict=True)
            if lab in summary
        ]
        if pts:
            _with_range(ax, [x for x, _ in pts], [s for _, s in pts], marker="o", color=colors[key], label=name,
                        linestyle="-" if key == "chain" else "--")  # fmt: skip
    for adv, marker in (("intra_only", "v"), ("inter_only", "^")):
        lab = tree_label(ABLATION_BUDGET, "random", adv) if ABLATION_BUDGET in PAPER_PAIRS else ""
        if lab in summary:
            _with_range(ax, [ABLATION_BUDGET * 1.08], [summary[lab]["em_end"]], marker=marker, color="tab:purple",
                        linestyle="none", label=f"tree random, {adv}")  # fmt: skip
    if rows:
        ax.axhline(statistics.fmean(r["em_start"] for r in rows), color="gray", linestyle=":", label="start")
    ax.set_xscale("log", base=2)
    ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.set_xlabel("budget (chains per prompt; tree at the paper's matched (M,N,L))")
    ax.set_ylabel("held-out EM, sampled T=1 (end of run)")
    ax.set_title("EM vs budget: mean, min–max over seeds")
    ax.legend(fontsize=7)
    # paired ratios tree / chain at each budget, per world (dots) and pooled (bars)
    worlds = sorted({r["world_seed"] for r in rows})
    width = 0.8 / len(EXPAND_MODES)
    for j, mode in enumerate(EXPAND_MODES):
        for i, b in enumerate(budgets):
            pooled = compare(rows, tree_label(b, mode), f"chain {b}")
            if pooled is None:
                continue
            per_world = [
                compare([r for r in rows if r["world_seed"] == w], tree_label(b, mode), f"chain {b}")
                for w in worlds
            ]
            x = i + (j - 1) * width
            cx.bar(
                x,
                pooled["ratio"],
                width=width * 0.9,
                color=colors[mode],
                alpha=0.6,
                label=mode if i == 0 else None,
            )
            ys = [c["ratio"] for c in per_world if c is not None]
            cx.scatter([x] * len(ys), ys, color="k", s=10, zorder=3)
    cx.set_ylim(bottom=0.8)
    cx.axhline(1.0, color="gray", linewidth=0.8)
    cx.axhline(1.15, color="tab:red", linestyle=":", linewidth=0.8, label="budget-2 target 1.15")
    cx.set_xticks(range(len(budgets)), [str(b) for b in budgets])
    cx.set_xlabel("budget")
    cx.set_ylabel("tree EM / chain EM (end, paired seeds)")
    cx.set_title("tree ÷ chain: pooled (bars), per world (dots)")
    cx.legend(fontsize=7)
    for lab, s in summary.items():
        if s["advantage"] not in ("grpo", "tree_grpo") or (
            s["mode"] == "tree" and s["expand_mode"] not in ("random",)
        ):
            continue
        curves = [r["em_curve"] for r in rows if spec_of(r).label == lab]
        top = min(c[-1][0] for c in curves)
        grid = [top * k / 20 for k in range(21)]
        ys = [statistics.fmean(v for v in (em_at(c, g) for c in curves) if v is not None) for g in grid]
        bx.plot([g / 1000 for g in grid], ys, linestyle="-" if s["mode"] == "chain" else "--",
                color=plt.cm.viridis(math.log2(s["budget"]) / 4.2), label=lab)  # fmt: skip
    bx.set_xlabel("generated tokens spent (thousands)")
    bx.set_ylabel("held-out EM, sampled (mean over seeds)")
    bx.set_title("EM vs generated tokens: chain (solid), tree random (dashed)")
    bx.legend(fontsize=7)
    reg = result["regime"]
    title = f"regime {reg['name']} · {reg['steps']} steps × {reg['prompts_per_step']} prompts, lr {reg['lr']}"
    fig.suptitle(
        f"bench learn · {title} · seeds {result['seeds']} · worlds {result['world_seeds']}", fontsize=9
    )
    save_figure(fig, path)


def _table(title: str, columns: tuple[str, ...]) -> Any:
    from rich.table import Table

    t = Table(title=title)
    for col in columns:
        t.add_column(col, justify="left" if col == "config" else "right")
    return t


def _em(s: dict[str, Any]) -> str:
    e = s["em_end"]
    return f"{e['mean']:.3f} ± {e['std']:.3f} [{e['min']:.2f}, {e['max']:.2f}]"


def print_table(result: dict[str, Any], console: Any) -> None:
    """The per-configuration table and every target with its verdict."""
    t = _table("held-out EM (sampled T=1): mean ± std [min, max] over seeds and worlds",
               ("config", "runs", "EM start", "EM end", "greedy end", "gen tokens", "traj", "tools/traj", "wall s"))  # fmt: skip
    for lab, s in result["summary"].items():
        t.add_row(
            lab, str(s["runs"]), f"{s['em_start']:.3f}", _em(s), f"{s['em_greedy_end']['mean']:.3f}",
            f"{s['generated_tokens']:.0f}", f"{s['trajectories']:.0f}",
            f"{s['tool_calls_per_traj_start']:.2f} → {s['tool_calls_per_traj_end']:.2f}", f"{s['wall_s']:.0f}",
        )  # fmt: skip
    console.print(t)
    for scope, ts in result["targets"].items():
        for name, v in ts.items():
            if isinstance(v, dict) and "pass" in v:
                verdict = "[green]pass[/]" if v["pass"] else "[red]FAIL[/]"
                detail = (
                    f"ratio {v['ratio']:.3f} (pairs {v['pair_ratios']}; over the run {v['curve_mean_ratio']:.3f})"
                    if "ratio" in v
                    else f"tree {v['tree_em']:.3f} vs chain {v['chain_em']:.3f}"
                    if "tree_em" in v
                    else f"both {v['both']:.3f} · inter {v['inter_only']:.3f} · intra {v['intra_only']:.3f}"
                )
                console.print(f"{scope:8s} {name:34s} {detail} {verdict}")


# -- the GiGPO table ---------------------------------------------------------------------------------


def plot_gigpo(result: dict[str, Any], path: Path) -> None:
    """Two panels: end EM per configuration and budget (mean, min–max over seeds), and the
    fraction of steps with anchor-state peers (all steps / after the first)."""
    plt = pyplot()
    summary, budgets = result["summary"], result["budgets"]
    kinds = ("chain", "chain_gigpo", "tree", "tree_gigpo")
    names = {
        "chain": "chain GRPO",
        "chain_gigpo": "chain GiGPO",
        "tree": "Tree-GRPO",
        "tree_gigpo": "Tree-GRPO + GiGPO step",
    }
    colors = {"chain": "black", "chain_gigpo": "tab:orange", "tree": "tab:blue", "tree_gigpo": "tab:green"}
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(14, 4.8))
    width = 0.8 / len(kinds)
    for j, kind in enumerate(kinds):
        for i, b in enumerate(budgets):
            s = summary.get(labels(b)[kind])
            if s is None:
                continue
            x, name = i + (j - 1.5) * width, names[kind] if i == 0 else None
            ax.bar(x, s["em_end"]["mean"], width * 0.9, color=colors[kind], alpha=0.75, label=name)
            _with_range(ax, [x], [s["em_end"]], color="k")
            bx.bar(x, s["anchor_shared_frac"], width * 0.9, color=colors[kind], alpha=0.35, label=name)
            bx.bar(x, s["anchor_deep_shared_frac"], width * 0.5, color=colors[kind], alpha=0.95)
    if result.get("start"):
        ax.axhline(result["start"]["eval/success_sampled"], color="gray", linestyle=":", label="start")
    for a in (ax, bx):
        a.set_xticks(range(len(budgets)), [f"budget {b}" for b in budgets])
    ax.legend(fontsize=7, loc="lower center")
    bx.legend(fontsize=7, loc="lower center", framealpha=0.9)
    ax.set_ylabel("held-out EM, sampled T=1 (end of run)")
    ax.set_title("EM at the end: mean, min–max over seeds")
    bx.set_ylim(0, 1.05)
    bx.set_ylabel("fraction of steps with an anchor-state peer")
    bx.set_title("anchor groups: all steps (light), steps after the first (dark)")
    reg, task = result["regime"], result["task"]
    title = f"task {task} · {reg['steps']} steps × {reg['prompts_per_step']} prompts, lr {reg['lr']}"
    fig.suptitle(f"bench learn --gigpo · {title} · seeds {result['seeds']}", fontsize=9)
    save_figure(fig, path)


def print_gigpo_table(result: dict[str, Any], console: Any) -> None:
    """The per-configuration table with the anchor diagnostic, and every paired comparison."""
    t = _table(f"task {result['task']}: held-out EM (sampled T=1), mean ± std [min, max] over seeds; anchor-state peers",
               ("config", "runs", "EM start", "EM end", "greedy end", "gen tokens", "shared", "after 1st", "group", "wall s"))  # fmt: skip
    for lab, s in result["summary"].items():
        t.add_row(
            lab, str(s["runs"]), f"{s['em_start']:.3f}", _em(s), f"{s['em_greedy_end']['mean']:.3f}",
            f"{s['generated_tokens']:.0f}", f"{s['anchor_shared_frac']:.2f}", f"{s['anchor_deep_shared_frac']:.2f}",
            f"{s['anchor_group_size']:.2f}", f"{s['wall_s']:.0f}",
        )  # fmt: skip
    console.print(t)
    for b, per in result["compare"].items():
        for name, c in per.items():
            console.print(
                f"budget {b} {name:22s} {c['tree_em_end']:.3f} vs {c['chain_em_end']:.3f} · ratio {c['ratio']:.3f} · "
                f"pair diffs {c['pair_diffs']} · first wins {c['tree_wins']}/{c['pairs']}"
            )


__all__ = ["plot", "plot_gigpo", "print_gigpo_table", "print_table"]
