"""Comparisons at equal cost: two configurations of a learning table paired by seed and world, read
off their EM curves at the same number of generated tokens (or tool calls) instead of at the same
nominal budget. Pure functions of result rows (``em_curve``: ``[generated tokens, EM]`` points;
``tool_curve``: ``[tool calls, EM]``), so any saved table can be restated.

Per pair (tree row ``t``, chain row ``c``):

- **at equal cost**: both curves interpolated linearly at ``x = min(total_t, total_c)`` — the
  chain's total whenever the tree spent at least as much — giving ``tree_em``, ``chain_em`` and
  their difference; a tree that spent less than the chain is read at its own total.
- **cost to reach**: the least cost at which the tree's curve reaches the chain's final EM
  (:func:`reach`), divided by the chain's total (the issue's "tokens to reach", ``None`` when the
  tree never gets there); ``chain_reach`` is the same for the chain's own curve (≤ 1: a curve that
  peaked before its end reaches its final EM early).
- ``cost_ratio``: the tree's total over the chain's (1 for a perfectly matched pair).

Summaries: mean ± sd over pairs, ``wins`` (tree > chain), ``at_least`` (tree ≥ chain), ``losses``;
the reach ratio's mean ± sd over the pairs that reached, how many did, and the median over all
pairs (an unreached pair counts as infinitely late).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from typing import Any

from treegrpo.benchmarks.learn_report import em_at
from treegrpo.benchmarks.learn_spec import ABLATION, ABLATION_BUDGET, spec_of, tree_label
from treegrpo.benchmarks.runner import spread

#: What a comparison is at equal: ``tokens`` (``em_curve``, ``generated_tokens``) or ``tool_calls``.
COSTS: dict[str, tuple[str, str]] = {"tokens": ("em_curve", "generated_tokens"), "tool_calls": ("tool_curve", "tool_calls")}


def reach(curve: Sequence[Sequence[float]], target: float) -> float | None:
    """The least cost at which the linearly interpolated ``curve`` (``[cost, EM]`` points) reaches
    ``target``; ``None`` when it never does."""
    pts = sorted((float(x), float(e)) for x, e in curve)
    if not pts:
        return None
    if pts[0][1] >= target:
        return pts[0][0]
    for (x0, e0), (x1, e1) in itertools.pairwise(pts):
        if e1 >= target:
            return x0 + (x1 - x0) * (target - e0) / (e1 - e0)
    return None


def pair_at_equal_cost(t: dict[str, Any], c: dict[str, Any], cost: str = "tokens") -> dict[str, Any] | None:
    """One pair's figures (module docstring); ``None`` when a row has no curve for ``cost``."""
    curve, total = COSTS[cost]
    if not t.get(curve) or not c.get(curve) or not c[total]:
        return None
    x = min(t[total], c[total])
    te, ce = em_at(t[curve], x), em_at(c[curve], x)
    if te is None or ce is None:
        return None
    target = c[curve][-1][1]
    tr, cr = reach(t[curve], target), reach(c[curve], target)
    return {
        "seed": t["seed"], "world_seed": t["world_seed"], "at": x, "at_frac": x / c[total],
        "tree_em": te, "chain_em": ce, "diff": te - ce, "cost_ratio": t[total] / c[total],
        "reach": None if tr is None else tr / c[total], "chain_reach": None if cr is None else cr / c[total],
    }  # fmt: skip


def _median_with_inf(values: list[float | None]) -> float | None:
    v = sorted(math.inf if x is None else x for x in values)
    mid = statistics.median(v) if v else math.inf
    return None if math.isinf(mid) else mid


def equal_cost(rows: Sequence[dict[str, Any]], tree: str, chain: str, cost: str = "tokens") -> dict[str, Any] | None:
    """Configurations ``tree`` and ``chain`` (labels) compared at equal ``cost``, paired by seed
    and world (module docstring); ``None`` without a pair."""
    by = {(spec_of(r).label, r["seed"], r["world_seed"]): r for r in rows}
    pairs = [
        p for (lab, s, w), r in by.items() if lab == tree and (chain, s, w) in by
        if (p := pair_at_equal_cost(r, by[(chain, s, w)], cost)) is not None
    ]  # fmt: skip
    if not pairs:
        return None
    te, ce = [p["tree_em"] for p in pairs], [p["chain_em"] for p in pairs]
    reached = [p["reach"] for p in pairs if p["reach"] is not None]
    return {
        "tree": tree, "chain": chain, "cost": cost, "pairs": len(pairs),
        "tree_em": spread(te), "chain_em": spread(ce), "diff": spread(p["diff"] for p in pairs),
        "ratio": statistics.fmean(te) / max(statistics.fmean(ce), 1e-9),
        "wins": sum(p["diff"] > 0 for p in pairs), "at_least": sum(p["diff"] >= 0 for p in pairs),
        "losses": sum(p["diff"] < 0 for p in pairs), "cost_ratio": spread(p["cost_ratio"] for p in pairs),
        "reach": spread(reached) if reached else None, "reached": len(reached),
        "reach_median": _median_with_inf([p["reach"] for p in pairs]),
        "chain_reach": spread(p["chain_reach"] for p in pairs if p["chain_reach"] is not None),
        "per_pair": [{k: round(v, 4) if isinstance(v, float) else v for k, v in p.items()} for p in pairs],
    }  # fmt: skip


def _scope(rows: list[dict[str, Any]], budgets: list[int], modes: list[str], tokens: bool) -> dict[str, Any]:
    """Every budget's trees vs its chain at equal tokens and tool calls, the ablation, the headline."""
    out: dict[str, Any] = {"equal_tokens": {}, "equal_tool_calls": {}}
    for b in budgets:
        for cost, key in (("tokens", "equal_tokens"), ("tool_calls", "equal_tool_calls")):
            per = {m: equal_cost(rows, tree_label(b, m, tokens=tokens), f"chain {b}", cost) for m in modes}
            if any(per.values()):
                out[key][str(b)] = {m: c for m, c in per.items() if c}
    if ABLATION_BUDGET in budgets:
        abl = {adv: equal_cost(rows, tree_label(ABLATION_BUDGET, "random", adv, tokens), f"chain {ABLATION_BUDGET}")
               for adv in ("tree_grpo", *ABLATION)}  # fmt: skip
        if all(abl.values()):
            ems = {adv: c["tree_em"]["mean"] for adv, c in abl.items() if c}
            out["ablation"] = {
                "budget": ABLATION_BUDGET, **{adv: c for adv, c in abl.items()},
                "order": "both > inter_only >= intra_only",
                "holds": ems["tree_grpo"] > ems["inter_only"] >= ems["intra_only"],
            }  # fmt: skip
    return out


def headline(c: dict[str, Any], budget: int) -> str:
    """The headline sentence of one equal-token comparison."""
    r = c["reach"]
    got = (f"reaches chain {budget}'s final EM with {r['mean']:.2f}× ± {r['std']:.2f} its tokens ({c['reached']}/"
           f"{c['pairs']} pairs get there)" if r else f"never reaches chain {budget}'s final EM")  # fmt: skip
    return (f"at equal generated tokens, Tree-GRPO ({c['tree']}) {got}; EM at chain {budget}'s tokens "
            f"{c['tree_em']['mean']:.3f} vs {c['chain_em']['mean']:.3f} ({c['ratio']:.2f}×, pairs won {c['wins']}/{c['pairs']})")  # fmt: skip


def _smallest_matching(by: dict[tuple[str, int, int], dict[str, Any]], labels: Sequence[tuple[int, str]], top: int) -> dict[str, Any] | None:
    """The first ``(budget, label)`` of ``labels`` whose final EM (``em_end``: mean over the pairs
    with chain ``top``, paired by seed and world) reaches chain ``top``'s (``chain_em_end``), with
    its share of chain ``top``'s generated tokens (``token_fraction``); ``None`` when none does."""
    for b, lab in labels:
        pairs = [(r, by[(f"chain {top}", s, w)]) for (x, s, w), r in by.items() if x == lab and (f"chain {top}", s, w) in by]
        if not pairs:
            continue
        t_end = statistics.fmean(t["em_end"] for t, _ in pairs)
        c_end = statistics.fmean(ch["em_end"] for _, ch in pairs)
        if t_end >= c_end:
            return {
                "budget": b, "label": lab, "em_end": t_end, "chain_em_end": c_end, "pairs": len(pairs),
                "pairs_at_least": sum(t["em_end"] >= ch["em_end"] for t, ch in pairs),
                "token_fraction": statistics.fmean(t["generated_tokens"] for t, _ in pairs)
                / statistics.fmean(ch["generated_tokens"] for _, ch in pairs),
            }  # fmt: skip
    return None


def paper_headline(rows: list[dict[str, Any]], budgets: list[int], modes: list[str], tokens: bool, top: int = 16) -> dict[str, Any]:
    """The paper's headline as measured: per pick rule, the smallest budget whose tree's final EM
    (paired mean) reaches chain ``top``'s, as a fraction of chain ``top``'s generated tokens; and
    the tokens at which the ``top``-budget tree's curve reaches chain ``top``'s final EM.
    ``chain_control``: the same question asked of the smaller chains (the smallest chain budget
    below ``top`` that already matches chain ``top``), so a reader sees whether the tree's
    saving is the tree's or the task's."""
    by = {(spec_of(r).label, r["seed"], r["world_seed"]): r for r in rows}
    smaller = [(b, f"chain {b}") for b in sorted(budgets) if b < top]
    out: dict[str, Any] = {"chain": f"chain {top}", "chain_control": _smallest_matching(by, smaller, top)}
    for m in modes:
        found = _smallest_matching(by, [(b, tree_label(b, m, tokens=tokens)) for b in sorted(budgets)], top)
        same = equal_cost(rows, tree_label(top, m, tokens=tokens), f"chain {top}") if top in budgets else None
        out[m] = {"smallest_matching_budget": found, "reach_at_top": None if same is None else
                  {"reach": same["reach"], "reached": same["reached"], "pairs": same["pairs"]}}  # fmt: skip
    return out


def token_targets(scope: dict[str, Any]) -> dict[str, Any]:
    """The issue's bars on one scope: the token-matched tree ≥ chain at equal tokens in ≥ 7/9 of
    the pairs at budgets 2 and 4, and tokens to reach the chain's final EM ≤ 0.75× (budget 2) and
    ≤ 0.85× (budget 4), every pair reaching it."""
    t: dict[str, Any] = {}
    for b, bar in (("2", 0.75), ("4", 0.85)):
        for m, c in scope["equal_tokens"].get(b, {}).items():
            t[f"budget{b}_{m}_at_least_chain"] = {"at_least": c["at_least"], "pairs": c["pairs"], "op": ">= 7/9 of pairs",
                                                  "pass": c["at_least"] * 9 >= 7 * c["pairs"]}  # fmt: skip
            r = c["reach"]
            t[f"budget{b}_{m}_tokens_to_reach"] = {
                "reach_mean": None if r is None else r["mean"], "reached": c["reached"], "pairs": c["pairs"],
                "op": f"<= {bar} (every pair reaching)", "pass": bool(r) and c["reached"] == c["pairs"] and r["mean"] <= bar,
            }  # fmt: skip
    return t


def analyse(rows: Sequence[dict[str, Any]], modes: Sequence[str], tokens: bool = True) -> dict[str, Any]:
    """Per world and pooled: :func:`_scope`, the headline sentences (random picks, every budget),
    :func:`paper_headline` and :func:`token_targets`. ``tokens``: the trees are token-matched (else
    the nominal paper shapes, restated)."""
    rows = list(rows)
    worlds = sorted({r["world_seed"] for r in rows})
    budgets = sorted({r["budget"] for r in rows})
    scopes = [(f"world {w}", [r for r in rows if r["world_seed"] == w]) for w in worlds]
    if len(worlds) > 1:
        scopes.append(("pooled", rows))
    out: dict[str, Any] = {}
    for name, rs in scopes:
        s = _scope(rs, budgets, list(modes), tokens)
        s["headline"] = {b: {m: headline(c, int(b)) for m, c in per.items()} for b, per in s["equal_tokens"].items()}
        if 16 in budgets:
            s["paper_headline"] = paper_headline(rs, budgets, list(modes), tokens)
        s["targets"] = token_targets(s)
        out[name] = s
    return out


__all__ = ["COSTS", "analyse", "equal_cost", "headline", "pair_at_equal_cost", "paper_headline", "reach", "token_targets"]
