"""The console table and the plot of ``treegrpo bench stateful`` (:mod:`treegrpo.benchmarks.stateful`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from treegrpo.benchmarks.runner import pyplot, save_figure


def table(result: dict[str, Any]) -> list[str]:
    """The headline figures as plain lines."""
    lines = ["depth | restore ms | replay ms | replayed calls | speedup | snapshot ms (paid per node)"]
    for d in result["cost"]["depths"]:
        lines.append(
            f"{d['depth']:5d} | {d['snapshot']['ms']:10.4f} | {d['replay']['ms']:9.4f} | "
            f"{d['replay']['tool_calls']:14d} | {d['speedup']:6.2f}x | {d['snapshot']['snapshot_ms']:.4f}"
        )
    ro = result["cost"]["rollout"]
    for key in [k for k in ro if k.startswith("pool_")]:
        r = ro[key]
        lines.append(
            f"whole rollouts ({ro['prompts']} prompts, (2,2,2), random SQL actions, {key.replace('_', ' ')}): snapshot "
            f"{r['snapshot']['ms_per_expansion_amortized']:.3f} ms/expansion vs replay "
            f"{r['replay']['ms_per_expansion_amortized']:.3f} ms/expansion (+{r['replay']['replayed_per_expansion']:.2f} "
            "replayed tool calls per expansion)"
        )
    ex = result["exactness"]
    lines.append(
        f"exactness: {ex['mismatches']} mismatches over {ex['trees']} random trees "
        f"(sql {ex['sql']['trees']}, kv {ex['kv']['trees']}); leaked states {ex['leaked_states']}"
    )
    learn = result.get("learn")
    if learn:
        for b, c in learn["compare"].items():
            if c is None:
                continue
            lines.append(
                f"budget {b}: {c['tree']} EM {c['tree_em_end']:.3f} vs {c['chain']} EM {c['chain_em_end']:.3f} "
                f"(paired diffs {c['pair_diffs']}, tree wins {c['tree_wins']}/{c['pairs']})"
            )
    return lines


def plot(result: dict[str, Any], path: Path) -> None:
    """Three panels: ms per expansion vs depth, exactness, held-out EM start → end per run."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    depths = result["cost"]["depths"]
    xs = [d["depth"] for d in depths]
    ax = axes[0]
    ax.plot(xs, [d["snapshot"]["ms"] for d in depths], "o-", label="snapshot: restore")
    ax.plot(xs, [d["replay"]["ms"] for d in depths], "s-", label="replay from the root")
    ax.plot(xs, [d["snapshot"]["snapshot_ms"] for d in depths], ":", color="gray", label="taking a snapshot")
    ax.set_xlabel("depth of the expanded node (steps)")
    ax.set_ylabel("ms per expansion (median)")
    ax.set_title("SQL env: state of a branch node")
    ax.legend(fontsize=8)
    ax = axes[1]
    ex = result["exactness"]
    names = ["sql", "kv"]
    ax.bar(names, [ex[n]["trees"] for n in names], color="tab:green", label="trees checked")
    ax.bar(names, [ex[n]["mismatches"] for n in names], color="tab:red", label="mismatching trees")
    for i, n in enumerate(names):
        ax.text(i, ex[n]["trees"], f"{ex[n]['mismatches']} / {ex[n]['trees']}", ha="center", va="bottom")
    ax.set_title("exactness: mismatches / random trees")
    ax.legend(fontsize=8)
    ax = axes[2]
    learn = result.get("learn")
    if learn:
        labels = list(learn["summary"])
        for i, label in enumerate(labels):
            mine = [r for r in learn["rows"] if (r["mode"] == "chain" and label == f"chain {r['budget']}") or (r["mode"] == "tree" and label.startswith(f"tree ({r['M']},{r['N']},{r['L']})"))]
            for r in mine:
                ax.plot([i - 0.15, i + 0.15], [r["em_start"], r["em_end"]], "o-", color="tab:blue" if r["mode"] == "chain" else "tab:orange", alpha=0.7)
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, rotation=15, fontsize=8)
        ax.set_ylabel("held-out EM (sampled), start → end")
        ax.set_title("--task sql: chain vs tree (paired seeds)")
    else:
        ax.text(0.5, 0.5, "learning part skipped", ha="center")
        ax.set_axis_off()
    fig.suptitle(f"bench stateful{' (quick)' if result.get('quick') else ''} · commit {str(result.get('commit'))[:10]}")
    save_figure(fig, path)


__all__ = ["plot", "table"]
