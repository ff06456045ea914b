"""The analysis of ``treegrpo bench learn --gigpo`` results (:mod:`.learn_gigpo`): per-configuration
statistics with GiGPO's anchor diagnostic, paired comparisons per budget, the plot and the terminal
table. Pure functions of the result rows (:data:`~treegrpo.benchmarks.learn_gigpo.GIGPO_ROW_KEYS`),
so a saved JSON can be re-analysed."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from treegrpo.benchmarks.learn_report import compare, summarize
from treegrpo.benchmarks.learn_spec import spec_of
from treegrpo.rollout.planner import PAPER_PAIRS


def labels(budget: int) -> dict[str, str]:
    """The four configurations of one budget: ``chain``, ``chain_gigpo``, ``tree``, ``tree_gigpo``."""
    m, n, l = PAPER_PAIRS[budget]
    tree = f"tree ({m},{n},{l}) random"
    return {
        "chain": f"chain {budget}",
        "chain_gigpo": f"chain {budget} gigpo",
        "tree": tree,
        "tree_gigpo": f"{tree} tree_gigpo",
    }


#: The paired comparisons per budget: (name, first configuration, second configuration).
PAIRS: tuple[tuple[str, str, str], ...] = (
    ("chain_gigpo_vs_chain", "chain_gigpo", "chain"),
    ("tree_vs_chain", "tree", "chain"),
    ("tree_vs_chain_gigpo", "tree", "chain_gigpo"),
    ("tree_gigpo_vs_tree", "tree_gigpo", "tree"),
)


def summarize_gigpo(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``summary``: :func:`~treegrpo.benchmarks.learn_report.summarize` per configuration plus the
    anchor diagnostic's mean over seeds; ``compare``: per budget, each pair of :data:`PAIRS`
    (:func:`~treegrpo.benchmarks.learn_report.compare` with ``first``/``second`` named; its
    ``tree_*`` fields are the first configuration's, ``chain_*`` the second's)."""
    summary = summarize(rows)
    for label, s in summary.items():
        mine = [r for r in rows if spec_of(r).label == label]
        for key in ("anchor_shared_frac", "anchor_deep_shared_frac", "anchor_group_size", "em_greedy_start"):
            s[key] = statistics.fmean(r[key] for r in mine)
    comparisons: dict[str, Any] = {}
    for b in sorted({r["budget"] for r in rows}):
        lab = labels(b)
        per: dict[str, Any] = {}
        for name, first, second in PAIRS:
            c = compare(rows, lab[first], lab[second])
            if c is not None:
                per[name] = {"first": lab[first], "second": lab[second], **c}
        comparisons[str(b)] = per
    return {"summary": summary, "compare": comparisons}


def plot(result: dict[str, Any], path: Path) -> None:
    """Two panels: end EM per configuration and budget (mean, min–max over seeds), and the
    fraction of steps with anchor-state peers (all steps / after the first)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = result["summary"]
    budgets = result["budgets"]
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
            x = i + (j - 1.5) * width
            e = s["em_end"]
            ax.bar(
                x,
                e["mean"],
                width * 0.9,
                color=colors[kind],
                alpha=0.75,
                label=names[kind] if i == 0 else None,
            )
            ax.errorbar(
                [x], [e["mean"]], yerr=[[e["mean"] - e["min"]], [e["max"] - e["mean"]]], color="k", capsize=3
            )
            bx.bar(
                x,
                s["anchor_shared_frac"],
                width * 0.9,
                color=colors[kind],
                alpha=0.35,
                label=names[kind] if i == 0 else None,
            )
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
    reg = result["regime"]
    fig.suptitle(
        f"bench learn --gigpo · task {result['task']} · {reg['steps']} steps × {reg['prompts_per_step']} prompts, "
        f"lr {reg['lr']} · seeds {result['seeds']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(result: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    t = Table(
        title=f"task {result['task']}: held-out EM (sampled T=1), mean ± std [min, max] over seeds; anchor-state peers"
    )
    for col in (
        "config",
        "runs",
        "EM start",
        "EM end",
        "greedy end",
        "gen tokens",
        "shared",
        "after 1st",
        "group",
        "wall s",
    ):
        t.add_column(col, justify="left" if col == "config" else "right")
    for lab, s in result["summary"].items():
        e = s["em_end"]
        t.add_row(
            lab, str(s["runs"]), f"{s['em_start']:.3f}", f"{e['mean']:.3f} ± {e['std']:.3f} [{e['min']:.2f}, {e['max']:.2f}]",
            f"{s['em_greedy_end']['mean']:.3f}", f"{s['generated_tokens']:.0f}", f"{s['anchor_shared_frac']:.2f}",
            f"{s['anchor_deep_shared_frac']:.2f}", f"{s['anchor_group_size']:.2f}", f"{s['wall_s']:.0f}",
        )  # fmt: skip
    console.print(t)
    for b, per in result["compare"].items():
        for name, c in per.items():
            console.print(
                f"budget {b} {name:22s} {c['tree_em_end']:.3f} vs {c['chain_em_end']:.3f} · ratio {c['ratio']:.3f} · "
                f"pair diffs {c['pair_diffs']} · first wins {c['tree_wins']}/{c['pairs']}"
            )


__all__ = ["PAIRS", "labels", "plot", "print_table", "summarize_gigpo"]
