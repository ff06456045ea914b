"""The analysis of ``treegrpo bench learn`` (and ``--gigpo``) results: per-configuration
statistics, paired comparisons (at the end of the run, over the run, and at equal generated
tokens), the issue's targets, GiGPO's per-budget comparisons. Pure functions of the result rows
(:data:`~treegrpo.benchmarks.learn_spec.ROW_KEYS`, :data:`~treegrpo.benchmarks.learn_spec.GIGPO_ROW_KEYS`),
so a saved JSON can be re-analysed; the plots and tables are :mod:`.learn_plots`."""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from typing import Any

from treegrpo.benchmarks.learn_spec import ABLATION, ABLATION_BUDGET, EXPAND_MODES, spec_of, tree_label
from treegrpo.benchmarks.runner import spread
from treegrpo.rollout.planner import PAPER_PAIRS


def em_at(curve: Sequence[Sequence[float]], tokens: float) -> float | None:
    """Linear interpolation of an ``em_curve`` (``[tokens, em]`` points, tokens increasing) at
    ``tokens``; ``None`` beyond its last point."""
    pts = sorted((float(t), float(e)) for t, e in curve)
    if not pts or tokens > pts[-1][0] + 1e-9 or tokens < pts[0][0] - 1e-9:
        return None
    for (t0, e0), (t1, e1) in itertools.pairwise(pts):
        if t0 <= tokens <= t1:
            return e0 if t1 == t0 else e0 + (e1 - e0) * (tokens - t0) / (t1 - t0)
    return pts[-1][1]


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per configuration label (all seeds and worlds pooled): mean / min / max / std of the end EMs,
    tokens, trajectories and tool calls per trajectory."""
    out: dict[str, dict[str, Any]] = {}
    for label in dict.fromkeys(spec_of(r).label for r in rows):
        mine = [r for r in rows if spec_of(r).label == label]

        def mean(key: str, mine: list[dict[str, Any]] = mine) -> float:
            return statistics.fmean(r[key] for r in mine)

        out[label] = {
            **{k: mine[0][k] for k in ("mode", "budget", "expand_mode", "advantage")},
            "runs": len(mine),
            "em_start": mean("em_start"),
            "em_end": spread(r["em_end"] for r in mine),
            "em_greedy_end": spread(r["em_greedy_end"] for r in mine),
            **{k: mean(k) for k in ("generated_tokens", "trajectories", "tool_calls_per_traj_start",
                                    "tool_calls_per_traj_end", "wall_s")},
        }  # fmt: skip
    return out


def _pairs(rows: Sequence[dict[str, Any]], a: str, b: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Rows of configurations ``a`` and ``b`` with the same seed and world seed."""
    by = {(spec_of(r).label, r["seed"], r["world_seed"]): r for r in rows}
    return [(by[(a, s, w)], by[(b, s, w)]) for (lab, s, w) in by if lab == a and (b, s, w) in by]


def _curve_mean(row: dict[str, Any]) -> float:
    """Mean held-out EM over a run's evaluations after the start."""
    return statistics.fmean([e for _, e in row["em_curve"][1:]] or [row["em_end"]])


def compare(rows: Sequence[dict[str, Any]], tree: str, chain: str) -> dict[str, Any] | None:
    """Paired comparison of two configurations: end EMs (ratio of means, per-pair ratios and
    differences), the ratio of EMs averaged over each run's evaluations (``curve_mean_ratio``), and
    EM at equal generated tokens (both curves interpolated at the smaller of the two runs' total
    tokens)."""
    pairs = _pairs(rows, tree, chain)
    if not pairs:
        return None
    t_end = [p[0]["em_end"] for p in pairs]
    c_end = [p[1]["em_end"] for p in pairs]
    ends = list(zip(t_end, c_end, strict=True))
    eq_t, eq_c = [], []
    for t, c in pairs:
        tokens = min(t["generated_tokens"], c["generated_tokens"])
        et, ec = em_at(t["em_curve"], tokens), em_at(c["em_curve"], tokens)
        if et is not None and ec is not None:
            eq_t.append(et)
            eq_c.append(ec)
    out: dict[str, Any] = {
        "pairs": len(pairs),
        "tree": tree,
        "chain": chain,
        "tree_em_end": statistics.fmean(t_end),
        "chain_em_end": statistics.fmean(c_end),
        "ratio": statistics.fmean(t_end) / max(statistics.fmean(c_end), 1e-9),
        "pair_ratios": [round(t / max(c, 1e-9), 3) for t, c in ends],
        "pair_diffs": [round(t - c, 4) for t, c in ends],
        "tree_wins": sum(t > c for t, c in ends),
        # learning speed over the whole run: EM averaged over the evaluations after the start
        # (both runs evaluate at the same steps), less sensitive to where the run stops
        "curve_mean_ratio": statistics.fmean(_curve_mean(p[0]) for p in pairs)
        / max(statistics.fmean(_curve_mean(p[1]) for p in pairs), 1e-9),
        "tree_tokens": statistics.fmean(p[0]["generated_tokens"] for p in pairs),
        "chain_tokens": statistics.fmean(p[1]["generated_tokens"] for p in pairs),
    }
    if eq_t:
        out["equal_tokens_tree_em"] = statistics.fmean(eq_t)
        out["equal_tokens_chain_em"] = statistics.fmean(eq_c)
    return out


def _scope_targets(rs: list[dict[str, Any]], budgets: list[int]) -> dict[str, Any]:
    t: dict[str, Any] = {}
    c2 = compare(rs, tree_label(2, "random"), "chain 2") if 2 in budgets else None
    if c2:
        t["budget2_tree_vs_chain_em"] = {**c2, "op": ">=", "threshold": 1.15, "pass": c2["ratio"] >= 1.15}
    for b in (x for x in budgets if x <= 4):
        for mode in EXPAND_MODES:
            c = compare(rs, tree_label(b, mode), f"chain {b}")
            if c and "equal_tokens_tree_em" in c:
                note = {} if mode == "random" else {"note": "guided picks (reported; the target is on random)"}
                t[f"budget{b}_{mode}_equal_tokens"] = {
                    "tree_em": c["equal_tokens_tree_em"], "chain_em": c["equal_tokens_chain_em"], "op": ">=",
                    "pass": c["equal_tokens_tree_em"] >= c["equal_tokens_chain_em"], **note,
                }  # fmt: skip
    for b in budgets:
        base = compare(rs, tree_label(b, "random"), f"chain {b}")
        for mode in EXPAND_MODES[1:]:
            g = compare(rs, tree_label(b, mode), f"chain {b}")
            if base and g:
                t[f"budget{b}_{mode}_vs_random"] = {
                    "random_ratio_to_chain": base["ratio"], f"{mode}_ratio_to_chain": g["ratio"],
                    "widens_gap": g["ratio"] > base["ratio"], "em_end_diff_vs_random": g["tree_em_end"] - base["tree_em_end"],
                }  # fmt: skip
    if ABLATION_BUDGET in budgets:
        ems = {}
        for adv in ("tree_grpo", *ABLATION):
            mine = [r for r in rs if spec_of(r).label == tree_label(ABLATION_BUDGET, "random", adv)]
            if mine:
                ems[adv] = statistics.fmean(r["em_end"] for r in mine)
        if len(ems) == 3:
            t["ablation_order"] = {
                "both": ems["tree_grpo"], "inter_only": ems["inter_only"], "intra_only": ems["intra_only"],
                "op": "both > inter_only >= intra_only",
                "pass": ems["tree_grpo"] > ems["inter_only"] >= ems["intra_only"],
            }  # fmt: skip
    t["tool_calls_per_traj_start_end"] = {
        label: [round(s["tool_calls_per_traj_start"], 3), round(s["tool_calls_per_traj_end"], 3)]
        for label, s in summarize(rs).items()
    }
    if 16 in budgets and 4 in budgets:
        h = compare(rs, tree_label(4, "random"), "chain 16")
        if h:
            t["headline_tree4_vs_chain16"] = {**h, "op": ">=", "threshold": 1.0, "pass": h["ratio"] >= 1.0}
    return t


def targets(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The issue's comparisons, per world seed and pooled, with pass/fail where the issue sets a bar."""
    worlds = sorted({r["world_seed"] for r in rows})
    scopes = [(f"world {w}", [r for r in rows if r["world_seed"] == w]) for w in worlds]
    if len(worlds) > 1:
        scopes.append(("pooled", list(rows)))
    budgets = sorted({r["budget"] for r in rows})
    return {scope: _scope_targets(rs, budgets) for scope, rs in scopes}


# -- the GiGPO table ---------------------------------------------------------------------------------


def labels(budget: int) -> dict[str, str]:
    """The four configurations of one budget: ``chain``, ``chain_gigpo``, ``tree``, ``tree_gigpo``."""
    tree = "tree ({},{},{}) random".format(*PAPER_PAIRS[budget])
    return {"chain": f"chain {budget}", "chain_gigpo": f"chain {budget} gigpo", "tree": tree,
            "tree_gigpo": f"{tree} tree_gigpo"}  # fmt: skip


#: The paired comparisons per budget: (name, first configuration, second configuration).
PAIRS: tuple[tuple[str, str, str], ...] = (
    ("chain_gigpo_vs_chain", "chain_gigpo", "chain"),
    ("tree_vs_chain", "tree", "chain"),
    ("tree_vs_chain_gigpo", "tree", "chain_gigpo"),
    ("tree_gigpo_vs_tree", "tree_gigpo", "tree"),
)


def summarize_gigpo(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``summary``: :func:`summarize` per configuration plus the anchor diagnostic's mean over
    seeds; ``compare``: per budget, each pair of :data:`PAIRS` (:func:`compare` with
    ``first``/``second`` named; its ``tree_*`` fields are the first configuration's, ``chain_*``
    the second's)."""
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


__all__ = ["PAIRS", "compare", "em_at", "labels", "summarize", "summarize_gigpo", "targets"]
