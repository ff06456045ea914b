"""The analysis of ``treegrpo bench budget`` measurements: pure functions of the call records, the
forests and the result rows (:data:`treegrpo.benchmarks.budget.ROW_KEYS`) — costs per phase, pick
statistics, consistency checks, the issue's targets, the terminal table and the plot. The runner
(specs, instrumentation, running, one row per measurement) is :mod:`treegrpo.benchmarks.budget`;
nothing here imports it.

**Per row** (``phases`` in the JSON; :func:`treegrpo.benchmarks.budget.summarize`): costs per phase (``init`` / ``expand``)
against what an ideal prefix cache must prefill, where expansions started, the expansion cost
fraction measured and expected, the model's work, and count checks against the forests.

**Targets** (``targets``; :func:`compute_targets`; tree (2,2,1) vs chain 4; counts with reuse on,
the forests being the same with reuse off): trajectories per 1k generated tokens ≥ 1.25× (random) /
≥ 1.4× (nonroot); tool calls per trajectory ≤ 0.8× / ≤ 0.7×; ``wall/traj(tree) ≤ 1.1 ·
wall/traj(chain) · gen/traj(tree) / gen/traj(chain)`` (i.e. wall per generated token ≤ 1.1× the
chain's), with reuse on and off; expansion prefill with reuse on = the uncached tokens exactly (the
reuse-off count reported beside it).
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from treegrpo.benchmarks.runner import pyplot, save_figure
from treegrpo.rollout.engine import Generation
from treegrpo.rollout.planner import PAPER_PAIRS
from treegrpo.tree import Forest

FORMAT = "treegrpo.bench.budget/v1"
#: One engine call as recorded: ``(contexts, generations, phases)`` (``init`` / ``expand`` each).
Call = tuple[list[Sequence[int]], list[Generation], list[str]]


# -- analysis -------------------------------------------------------------------------------------


def uncached_tokens(calls: Sequence[Call]) -> dict[str, int]:
    """Per phase, the context tokens of every request that no earlier request of the rollout (or an
    earlier request of the same call) had computed — what an ideal prefix cache must prefill. A
    request whose context was entirely computed still runs its last token (its logits): 1.

    A request computes its context; after its call, the tokens it fed back during decoding
    (``step[:-1]``: the last sampled token is never run) are computed too.
    """
    trie: dict[int, dict] = {}
    out: dict[str, int] = {}
    for contexts, gens, phases in calls:
        for ctx, phase in zip(contexts, phases, strict=True):
            node, new = trie, 0
            for tok in ctx:
                nxt = node.get(tok)
                if nxt is None:
                    nxt = node[tok] = {}
                    new += 1
                node = nxt
            out[phase] = out.get(phase, 0) + max(new, 1)
        for ctx, g in zip(contexts, gens, strict=True):
            node = trie
            for tok in itertools.chain(ctx, g.tokens[:-1]):
                node = node.setdefault(tok, {})
    return out


def phase_costs(calls: Sequence[Call]) -> dict[str, dict[str, int]]:
    """Per phase (``init`` / ``expand``): generated and prefill tokens, requests, engine calls that
    served the phase (a call may serve both), context tokens, and uncached tokens
    (:func:`uncached_tokens`)."""
    out: dict[str, dict[str, int]] = {}
    for contexts, gens, phases in calls:
        for phase in set(phases):
            out.setdefault(phase, dict.fromkeys(("generated_tokens", "prefill_tokens", "requests", "engine_calls", "context_tokens"), 0))
            out[phase]["engine_calls"] += 1
        for ctx, g, phase in zip(contexts, gens, phases, strict=True):
            p = out[phase]
            p["generated_tokens"] += len(g.tokens)
            p["prefill_tokens"] += g.prefill_tokens
            p["requests"] += 1
            p["context_tokens"] += len(ctx)
    for phase, n in uncached_tokens(calls).items():
        out[phase]["uncached_tokens"] = n
    return out


def _initial_chain(tree: Any) -> set[int]:
    """Node ids of a tree's initial chain: from the root, always the oldest child (a tree's
    expansions start only after its initial chain ended, so its nodes are the oldest)."""
    kids = tree.children
    ids, at = set(), tree.root.id
    while kids[at]:
        at = min(kids[at])
        ids.add(at)
    return ids


def forest_counts(forests: Sequence[Forest]) -> dict[str, Any]:
    """Counts read off the forests alone: trajectories (leaves), generated tokens (policy tokens),
    tool calls (search steps that ran), steps (one engine request each), the context tokens of every
    step's request (what prefill computes without any reuse), and per phase (``init``: the nodes
    of each tree's initial chain, ``expand``: the rest) generated tokens, tool calls and steps."""
    traj = gen = tools = steps = ctx_tokens = 0
    phases = {ph: {"generated_tokens": 0, "tool_calls": 0, "steps": 0} for ph in ("init", "expand")}
    for f in forests:
        for tree in f.trees:
            traj += len(tree.leaves())
            init = _initial_chain(tree)
            for nd in tree.nodes:
                if nd.parent is None:
                    continue
                g, t = sum(nd.policy_mask), int(nd.extra.get("kind") == "search" and not nd.extra.get("refused"))
                steps += 1
                gen += g
                tools += t
                ctx_tokens += len(tree.context(nd.parent))
                ph = phases["init" if nd.id in init else "expand"]
                ph["generated_tokens"] += g
                ph["tool_calls"] += t
                ph["steps"] += 1
    return {"trajectories": traj, "generated_tokens": gen, "tool_calls": tools, "steps": steps,
            "context_tokens": ctx_tokens, "phases": phases}  # fmt: skip


def pick_stats(forests: Sequence[Forest]) -> dict[str, Any]:
    """Where expansions started: a node with ``c`` children was picked ``c - 1`` times (its first
    child is the trajectory that made it; every pick adds one child)."""
    root = deeper = 0
    depths: list[int] = []
    for f in forests:
        for tree in f.trees:
            kids = tree.children
            for nd in tree.nodes:
                extra = len(kids[nd.id]) - 1
                if extra <= 0:
                    continue
                d = tree.depth(nd.id)
                depths += [d] * extra
                if nd.parent is None:
                    root += extra
                else:
                    deeper += extra
    picks = root + deeper
    return {"picks": picks, "root_picks": root, "nonroot_picks": deeper, "root_fraction": root / picks if picks else None,
            "mean_pick_depth": sum(depths) / len(depths) if depths else None}  # fmt: skip


def expected_fractions(forests: Sequence[Forest], expand_mode: str | None) -> dict[str, float | None]:
    """What one expansion should cost relative to a whole chain, from the initial chains and the
    pick rule alone (first round): a pick at a non-root node ``j`` of a chain continues from ``j``'s
    context, so it re-generates on average what the policy generates after ``j`` — estimated by
    what the chain did generate after ``j``; a root pick is a whole new chain — the mean initial
    chain. ``random`` picks uniformly among the root and the chain's non-leaf nodes; ``nonroot``
    among the non-leaf nodes (the root when there are none).

    Returns ``f_expected`` (generated tokens) and ``tool_fraction_expected`` (tool calls), to hold
    against the measured ``f_measured`` / ``tool_fraction_measured``; ``None`` for other pick rules.
    """
    if expand_mode not in ("random", "nonroot"):
        return {"f_expected": None, "tool_fraction_expected": None}
    chains: list[tuple[list[int], list[int]]] = []
    for f in forests:
        for tree in f.trees:
            nodes = [tree.node(i) for i in sorted(_initial_chain(tree))]  # ids grow along a chain
            chains.append(
                (
                    [sum(nd.policy_mask) for nd in nodes],
                    [int(nd.extra.get("kind") == "search" and not nd.extra.get("refused")) for nd in nodes],
                )
            )
    if not chains:
        return {"f_expected": None, "tool_fraction_expected": None}
    mean_t = sum(sum(t) for t, _ in chains) / len(chains)
    mean_c = sum(sum(c) for _, c in chains) / len(chains)
    exp_t = exp_c = 0.0
    for toks, tools in chains:
        # candidate 0 = the root (a new chain); candidate j >= 1 = the chain's j-th node (non-leaf)
        cand_t = [mean_t] + [sum(toks[j:]) for j in range(1, len(toks))]
        cand_c = [mean_c] + [sum(tools[j:]) for j in range(1, len(tools))]
        if expand_mode == "nonroot" and len(cand_t) > 1:
            cand_t, cand_c = cand_t[1:], cand_c[1:]
        exp_t += sum(cand_t) / len(cand_t)
        exp_c += sum(cand_c) / len(cand_c)
    n = len(chains)
    return {
        "f_expected": exp_t / n / mean_t if mean_t else None,
        "tool_fraction_expected": exp_c / n / mean_c if mean_c else None,
    }


# -- targets --------------------------------------------------------------------------------------


def _find(rows: Sequence[dict[str, Any]], reuse: bool, **match: Any) -> dict[str, Any] | None:
    for r in rows:
        if r["prefix_reuse"] == reuse and all(r[k] == v for k, v in match.items()):
            return r
    return None


def _walls(details: Sequence[dict[str, Any]], config: str, reuse: bool, key: str = "walls") -> list[float]:
    for d in details:
        if d["config"] == config and d["prefix_reuse"] == reuse:
            return list(d.get(key, []))
    return []


def _per(r: dict[str, Any], num: str, den: str, scale: float = 1.0) -> float:
    return scale * r[num] / r[den] if r[den] else float("nan")


def compute_targets(
    rows: Sequence[dict[str, Any]], details: Sequence[dict[str, Any]], budget: int = 4, shape: tuple[int, int, int] = (2, 2, 1)
) -> dict[str, dict[str, Any]]:
    """The issue's targets, measured: tree ``shape`` vs chain ``budget`` (see the module doc)."""
    m, n, l = shape
    out: dict[str, dict[str, Any]] = {}

    def put(name: str, measured: float | None, op: str, threshold: float, **extra: Any) -> None:
        ok = None if measured is None or measured != measured else (
            measured >= threshold if op == ">=" else measured <= threshold if op == "<=" else measured == threshold
        )
        out[name] = {"measured": measured, "op": op, "threshold": threshold, "pass": ok, **extra}

    thresholds = {"random": (1.25, 0.8), "nonroot": (1.4, 0.7)}
    for mode, (t_eff, t_tools) in thresholds.items():
        for reuse in (True, False):
            chain = _find(rows, reuse, mode="chain", budget=budget)
            tree = _find(rows, reuse, mode="tree", M=m, N=n, L=l, expand_mode=mode)
            if chain is None or tree is None:
                continue
            tag = f"tree{m}{n}{l}_{mode}_vs_chain{budget}"
            if reuse:  # counts: the default setting (reuse off gives the same forests up to float noise)
                eff_c = _per(chain, "trajectories", "generated_tokens", 1000.0)
                eff_t = _per(tree, "trajectories", "generated_tokens", 1000.0)
                put(f"{tag}.traj_per_1k_gen_tokens_ratio", eff_t / eff_c, ">=", t_eff,
                    tree=eff_t, chain=eff_c)
                tc = _per(chain, "tool_calls", "trajectories")
                tt = _per(tree, "tool_calls", "trajectories")
                put(f"{tag}.tool_calls_per_traj_ratio", tt / tc if tc else None, "<=", t_tools, tree=tt, chain=tc)
            # wall/traj(tree) <= 1.1 * wall/traj(chain) * gen/traj(tree) / gen/traj(chain), i.e.
            # (wall/gen-token of the tree) / (wall/gen-token of the chain) <= 1.1: the median over the
            # repeats of that ratio, each repeat's two wall times taken close in time.
            walls_t = _walls(details, f"tree ({m},{n},{l}) {mode}", reuse)
            walls_c = _walls(details, f"chain {budget}", reuse)
            k = min(len(walls_t), len(walls_c))
            per_tok_t, per_tok_c = 1 / tree["generated_tokens"], 1 / chain["generated_tokens"]
            paired = [walls_t[i] * per_tok_t / (walls_c[i] * per_tok_c) for i in range(k)]
            cpu_t = _walls(details, f"tree ({m},{n},{l}) {mode}", reuse, "cpu_s")
            cpu_c = _walls(details, f"chain {budget}", reuse, "cpu_s")
            cpu_paired = [cpu_t[i] * per_tok_t / (cpu_c[i] * per_tok_c) for i in range(min(len(cpu_t), len(cpu_c)))]
            wt, wc = _per(tree, "wall_s", "trajectories"), _per(chain, "wall_s", "trajectories")
            gt, gc_ = _per(tree, "generated_tokens", "trajectories"), _per(chain, "generated_tokens", "trajectories")
            put(
                f"{tag}.wall_per_traj_vs_bound{'_reuse' if reuse else '_no_reuse'}",
                statistics.median(paired) if paired else None,
                "<=",
                1.1,
                paired_ratios=[round(x, 3) for x in paired],
                cpu_ratio=statistics.median(cpu_paired) if cpu_paired else None,
                cpu_paired_ratios=[round(x, 3) for x in cpu_paired],
                ratio_of_medians=wt / (wc * gt / gc_),
                tree_wall_per_traj=wt,
                chain_wall_per_traj=wc,
                bound_wall_per_traj=1.1 * wc * gt / gc_,
                note="measured: median over repeats of (wall/gen-token tree)/(wall/gen-token chain), which is "
                "wall/traj(tree) / (wall/traj(chain) * gen/traj(tree) / gen/traj(chain)); cpu_ratio: the same "
                "with process CPU seconds (less sensitive to other processes on the machine)",
            )
    for d in details:
        if not d["prefix_reuse"] or "expand" not in d["phases"]:
            continue
        if d["config"] not in {f"tree ({m},{n},{l}) random", f"tree ({m},{n},{l}) nonroot"}:
            continue
        off = next((e for e in details if e["config"] == d["config"] and not e["prefix_reuse"]), None)
        exp = d["phases"]["expand"]
        put(
            f"{d['config'].replace(' ', '_')}.expansion_prefill_equals_uncached",
            exp["prefill_tokens"], "==", exp["uncached_tokens"],
            reuse_on=exp["prefill_tokens"], uncached=exp["uncached_tokens"],
            reuse_off=off["phases"]["expand"]["prefill_tokens"] if off else None,
            expansions=exp.get("requests"),
        )  # fmt: skip
    return out


def document(summaries: Sequence[dict[str, Any]], specs: Sequence[Any], meta: dict[str, Any]) -> dict[str, Any]:
    """The results JSON from the ``summarize`` output of every measurement (``specs``: their
    :class:`~treegrpo.benchmarks.budget.RunSpec` values, in order): ``rows``,
    ``targets``, ``phases`` (the details), ``checks`` (every row's counts agree with its forests; per
    spec, reuse on and off gave the same counts — the same forests up to float rounding of the
    logits) and ``meta`` as given."""
    rows = [s["row"] for s in summaries]
    details = [s["detail"] for s in summaries]
    same = {}
    for s in specs:
        on, off = (_find(rows, r, mode=s.mode, budget=s.budget, M=s.m, N=s.n, L=s.l, expand_mode=s.expand_mode) for r in (True, False))
        if on and off:
            same[s.label] = all(on[k] == off[k] for k in ("trajectories", "generated_tokens", "tool_calls"))
    return {
        "format": FORMAT,
        "benchmark": "budget",
        "rows": rows,
        "targets": compute_targets(rows, details),
        "phases": details,
        "checks": {
            "all_forest_counts_consistent": all(all(d["checks"].values()) for d in details),
            "reuse_on_off_same_forests": same,
        },
        "meta": meta,
    }


# -- report ---------------------------------------------------------------------------------------


def print_table(rows: Sequence[dict[str, Any]], targets: dict[str, dict[str, Any]], console: Any) -> None:
    from rich.table import Table

    t = Table(title="rollout budget: chain vs Tree-GRPO (sums over all prompts)")
    for c in ("config", "reuse", "traj", "gen tok", "prefill", "tools", "wall s", "traj/1k gen", "tools/traj", "s/traj"):
        t.add_column(c, justify="left" if c == "config" else "right")
    for r in rows:
        label = f"chain {r['budget']}" if r["mode"] == "chain" else f"tree ({r['M']},{r['N']},{r['L']}) {r['expand_mode']}"
        t.add_row(
            label, "on" if r["prefix_reuse"] else "off", str(r["trajectories"]), str(r["generated_tokens"]),
            str(r["prefill_tokens"]), str(r["tool_calls"]), f"{r['wall_s']:.2f}",
            f"{1000 * r['trajectories'] / max(1, r['generated_tokens']):.2f}",
            f"{r['tool_calls'] / max(1, r['trajectories']):.2f}", f"{r['wall_s'] / max(1, r['trajectories']):.4f}",
        )  # fmt: skip
    console.print(t)
    tt = Table(title="targets")
    for c in ("target", "measured", "need", "pass"):
        tt.add_column(c, justify="left" if c == "target" else "right")
    for name, v in targets.items():
        meas = v["measured"]
        shown = f"{meas:.3f}" if isinstance(meas, float) else str(meas)
        need = f"{v['op']} {v['threshold']:.3g}" if isinstance(v["threshold"], float) else f"{v['op']} {v['threshold']}"
        ok = v["pass"]
        tt.add_row(name, shown, need, "[green]pass[/green]" if ok else "[red]FAIL[/red]" if ok is False else "n/a")
    console.print(tt)


def plot(rows: Sequence[dict[str, Any]], png: Path) -> None:
    """Three panels by chain budget: trajectories per 1k generated tokens, tool calls per
    trajectory, wall seconds per trajectory (reuse on solid, off dashed); chain vs tree modes."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    series: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        name = "chain" if r["mode"] == "chain" else f"tree {r['expand_mode']}"
        series.setdefault(name, []).append(r)
    panels = [
        (lambda r: 1000 * r["trajectories"] / max(1, r["generated_tokens"]), "trajectories per 1k generated tokens", False),
        (lambda r: r["tool_calls"] / max(1, r["trajectories"]), "tool calls per trajectory", False),
        (lambda r: r["wall_s"] / max(1, r["trajectories"]), "wall seconds per trajectory", True),
    ]
    for ax, (fn, title, both) in zip(axes, panels, strict=True):
        for (name, rs), color in zip(sorted(series.items()), ("C0", "C1", "C2", "C3"), strict=False):
            for reuse in (True, False) if both else (True,):
                pts = sorted((r["budget"], fn(r)) for r in rs if r["prefix_reuse"] == reuse)
                if not pts:
                    continue
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, marker="o", color=color, linestyle="-" if reuse else "--",
                        label=name + ("" if not both else (" reuse" if reuse else " no reuse")))  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(PAPER_PAIRS), [str(b) for b in sorted(PAPER_PAIRS)])
        ax.set_xlabel("chain budget (tree at the paper's matched shape)")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.suptitle("Rollout budget: chain vs Tree-GRPO (same prompts, model, seed)")
    save_figure(fig, png)


__all__ = [
    "FORMAT",
    "Call",
    "compute_targets",
    "document",
    "expected_fractions",
    "forest_counts",
    "phase_costs",
    "pick_stats",
    "plot",
    "print_table",
    "uncached_tokens",
]
