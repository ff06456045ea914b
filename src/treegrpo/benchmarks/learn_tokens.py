"""The figure and terminal table of ``treegrpo bench learn --matched tokens`` (chain GRPO vs the
token-matched tree at equal generated tokens), drawn from a result document alone
(:mod:`.equal_cost` computes what they show)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from treegrpo.benchmarks.learn_report import em_at
from treegrpo.benchmarks.learn_spec import spec_of, tree_label
from treegrpo.benchmarks.runner import pyplot, save_figure

COLORS = {"chain": "black", "random": "tab:blue", "nonroot": "tab:orange", "entropy": "tab:green"}


def _mean_curve(curves: list[list[list[float]]], points: int = 24) -> tuple[list[float], list[float]]:
    """The mean of ``curves`` on a common grid up to the shortest one's last point."""
    top = min(c[-1][0] for c in curves)
    grid = [top * k / points for k in range(points + 1)]
    ys = [statistics.fmean(v for v in (em_at(c, g) for c in curves) if v is not None) for g in grid]
    return grid, ys


def plot(result: dict[str, Any], path: Path) -> None:
    """Three panels: EM against generated tokens (mean over pairs; chain solid, token-matched trees
    dashed), the paired EM difference at equal tokens per budget, and the tokens the tree needs to
    reach the chain's final EM (÷ the chain's tokens) with the issue's bars."""
    plt = pyplot()
    rows, modes = result["rows"], result["expand_modes"]
    scope = result["equal_cost"].get("pooled") or next(iter(result["equal_cost"].values()))
    budgets = sorted({r["budget"] for r in rows})
    fig, (ax, bx, cx) = plt.subplots(1, 3, figsize=(19, 4.8))
    for b in budgets:
        for key, lab, ls in [("chain", f"chain {b}", "-")] + [(m, tree_label(b, m, tokens=True), "--") for m in modes]:
            curves = [r["em_curve"] for r in rows if spec_of(r).label == lab]
            if curves:
                xs, ys = _mean_curve(curves)
                # one legend entry per chain budget and one per pick rule (its trees at every budget)
                name = lab if key == "chain" else f"token-matched tree, {key} picks" if b == budgets[0] else None
                ax.plot([x / 1000 for x in xs], ys, ls=ls, color=COLORS[key], alpha=0.4 + 0.15 * budgets.index(b),
                        label=name)  # fmt: skip
    ax.set_xscale("log")
    ax.set_xlabel("generated tokens spent (thousands, log)")
    ax.set_ylabel("held-out EM, sampled T=1 (mean over pairs)")
    ax.set_title("EM per generated token: chain B (solid), tree at chain B's tokens (dashed)")
    ax.legend(fontsize=6)
    width = 0.8 / len(modes)
    for j, m in enumerate(modes):
        for i, b in enumerate(budgets):
            c = scope["equal_tokens"].get(str(b), {}).get(m)
            if c is None:
                continue
            x = i + (j - (len(modes) - 1) / 2) * width
            bx.bar(x, c["diff"]["mean"], width * 0.9, yerr=c["diff"]["std"], color=COLORS[m], alpha=0.6, capsize=3,
                   label=m if i == 0 else None)  # fmt: skip
            bx.scatter([x] * c["pairs"], [p["diff"] for p in c["per_pair"]], color="k", s=8, zorder=3)
            bx.text(x, 0, f"{c['wins']}/{c['pairs']}", ha="center", va="bottom", fontsize=7)
            if c["reach"]:
                cx.bar(x, c["reach"]["mean"], width * 0.9, yerr=c["reach"]["std"], color=COLORS[m], alpha=0.6, capsize=3,
                       label=m if i == 0 else None)  # fmt: skip
                cx.scatter([x] * c["reached"], [p["reach"] for p in c["per_pair"] if p["reach"] is not None], color="k", s=8)
            cx.text(x, 0.02, f"{c['reached']}/{c['pairs']}", ha="center", fontsize=7)
    bx.axhline(0, color="gray", lw=0.8)
    bx.set_xticks(range(len(budgets)), [f"chain {b}'s tokens" for b in budgets])
    bx.set_ylabel("tree − chain EM at equal generated tokens")
    bx.set_title("paired by seed and world (mean ± sd; wins/pairs)")
    bx.legend(fontsize=7)
    cx.axhline(1.0, color="gray", lw=0.8)
    for i, bar in ((budgets.index(2) if 2 in budgets else None, 0.75), (budgets.index(4) if 4 in budgets else None, 0.85)):
        if i is not None:
            cx.hlines(bar, i - 0.45, i + 0.45, color="tab:red", ls=":", label=f"target {bar}")
    cx.set_xticks(range(len(budgets)), [f"budget {b}" for b in budgets])
    cx.set_ylabel("tokens to reach chain's final EM ÷ chain's tokens")
    cx.set_title("tokens to reach (mean ± sd over pairs that reach; reached/pairs)")
    cx.legend(fontsize=7)
    reg = result["regime"]
    fig.suptitle(f"bench learn --matched tokens · regime {reg['name']} · {reg['steps']} steps × {reg['prompts_per_step']} "
                 f"prompts, lr {reg['lr']} · seeds {result['seeds']} · worlds {result['world_seeds']}", fontsize=9)  # fmt: skip
    save_figure(fig, path)


def print_table(result: dict[str, Any], console: Any) -> None:
    """Per budget and pick rule: EM at equal tokens and tool calls, tokens to reach, the verdicts."""
    from rich.table import Table

    for scope, s in result["equal_cost"].items():
        t = Table(title=f"{scope}: token-matched tree vs chain, paired by seed and world")
        for col in ("budget", "picks", "EM tree @ chain's tokens", "EM chain", "wins", "tokens to reach", "tree/chain tokens",
                    "EM tree @ chain's tool calls", "wins (tools)"):  # fmt: skip
            t.add_column(col, justify="right")
        for b, per in s["equal_tokens"].items():
            for m, c in per.items():
                tools = s["equal_tool_calls"].get(b, {}).get(m)
                r = c["reach"]
                t.add_row(
                    b, m, f"{c['tree_em']['mean']:.3f} ± {c['tree_em']['std']:.3f}", f"{c['chain_em']['mean']:.3f}",
                    f"{c['wins']}/{c['pairs']}", f"{r['mean']:.2f}× ({c['reached']}/{c['pairs']})" if r else "never",
                    f"{c['cost_ratio']['mean']:.3f}", f"{tools['tree_em']['mean']:.3f} vs {tools['chain_em']['mean']:.3f}" if tools else "",
                    f"{tools['wins']}/{tools['pairs']}" if tools else "",
                )  # fmt: skip
        console.print(t)
        for name, v in s["targets"].items():
            console.print(f"{scope:8s} {name:36s} {'[green]pass[/]' if v['pass'] else '[red]FAIL[/]'} {v}")


__all__ = ["plot", "print_table"]
