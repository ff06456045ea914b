"""Comparisons at equal cost (``benchmarks/equal_cost.py``) on hand-derived curves, the token table's
plan, and the token table end to end on the tiny test model (curve bookkeeping on the fixture)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from treegrpo.benchmarks import learn
from treegrpo.benchmarks.equal_cost import analyse, equal_cost, pair_at_equal_cost, paper_headline, reach
from treegrpo.benchmarks.learn_spec import (
    PAPER_PAIRS,
    TOKEN_ROW_KEYS,
    Regime,
    plan_token_runs,
    spec_of,
    tree_label,
)


def test_reach_interpolates_the_first_crossing() -> None:
    curve = [[0, 0.1], [100, 0.3], [200, 0.2], [300, 0.5]]
    assert reach(curve, 0.2) == pytest.approx(50.0)
    assert reach(curve, 0.3) == pytest.approx(100.0)  # the first time, not the last
    assert reach(curve, 0.4) == pytest.approx(200 + 100 * (0.2 / 0.3))
    assert reach(curve, 0.05) == 0.0 and reach(curve, 0.6) is None and reach([], 0.1) is None


def _row(label: str, seed: int, curve: list[list[float]], tools: list[list[float]] | None = None) -> dict:
    if label.startswith("chain"):
        b = int(label.split()[1])
        spec = {"mode": "chain", "budget": b, "M": b, "N": 0, "L": 0, "expand_mode": None, "advantage": "grpo", "budget_tokens": None}
    else:
        spec = {"mode": "tree", "budget": 2, "M": 1, "N": 2, "L": 1, "expand_mode": "random", "advantage": "tree_grpo",
                "budget_tokens": "chain:2"}  # fmt: skip
    row = {**spec, "seed": seed, "world_seed": 0, "em_start": curve[0][1], "em_end": curve[-1][1], "em_curve": curve,
           "generated_tokens": curve[-1][0], "tool_calls": (tools or [[0, 0]])[-1][0], "tool_curve": tools or []}  # fmt: skip
    assert spec_of(row).label == label
    return row


TREE = tree_label(2, "random", tokens=True)


def test_equal_cost_by_hand() -> None:
    rows = [
        # seed 0: the tree spent 1,100 tokens, the chain 1,000; at 1,000 the tree is at 0.2 + 0.4·10/11
        _row(TREE, 0, [[0, 0.2], [1100, 0.6]], [[0, 0.2], [50, 0.6]]),
        _row("chain 2", 0, [[0, 0.2], [500, 0.45], [1000, 0.4]], [[0, 0.2], [40, 0.4]]),
        # seed 1: the tree spent 900 < 1,000: both read at 900; it never reaches the chain's 0.5
        _row(TREE, 1, [[0, 0.2], [900, 0.35]], [[0, 0.2], [30, 0.35]]),
        _row("chain 2", 1, [[0, 0.2], [1000, 0.5]], [[0, 0.2], [60, 0.5]]),
    ]
    p0 = pair_at_equal_cost(rows[0], rows[1])
    assert p0 is not None and p0["at"] == 1000 and p0["at_frac"] == 1.0
    assert p0["tree_em"] == pytest.approx(0.2 + 0.4 * 1000 / 1100) and p0["chain_em"] == pytest.approx(0.4)
    assert p0["cost_ratio"] == pytest.approx(1.1)
    # the chain's final EM 0.4 is reached by the tree at 0.2 / 0.4 · 1100 = 550 tokens: 0.55 of the chain's
    assert p0["reach"] == pytest.approx(0.55)
    assert p0["chain_reach"] == pytest.approx(500 * 0.2 / 0.25 / 1000)  # its own curve passed 0.4 at 400
    c = equal_cost(rows, TREE, "chain 2")
    assert c is not None and c["pairs"] == 2
    tree_em_1 = 0.35
    chain_em_1 = 0.2 + 0.3 * 0.9
    assert c["per_pair"][1]["at"] == 900 and c["per_pair"][1]["chain_em"] == pytest.approx(chain_em_1, abs=1e-4)
    assert c["tree_em"]["mean"] == pytest.approx((p0["tree_em"] + tree_em_1) / 2)
    assert (c["wins"], c["at_least"], c["losses"]) == (1, 1, 1)
    assert c["reached"] == 1 and c["reach"]["mean"] == pytest.approx(0.55)
    assert c["reach_median"] is None  # one of two pairs never reaches: the median is infinitely late
    # tool calls the same way: at 40 calls the seed-0 tree is at 0.2 + 0.4·40/50
    t = equal_cost(rows, TREE, "chain 2", cost="tool_calls")
    assert t is not None and t["per_pair"][0]["tree_em"] == pytest.approx(0.52)
    a = analyse(rows, ["random"])["world 0"]
    assert a["equal_tokens"]["2"]["random"]["pairs"] == 2
    assert a["targets"]["budget2_random_at_least_chain"] == {"at_least": 1, "pairs": 2, "op": ">= 7/9 of pairs", "pass": False}
    assert a["targets"]["budget2_random_tokens_to_reach"]["pass"] is False  # not every pair reaches
    assert "pairs won 1/2" in a["headline"]["2"]["random"]


def _end_row(budget: int, mode: str | None, seed: int, em_end: float, tokens: int) -> dict:
    """A finished run with only what :func:`paper_headline` reads (its final EM and tokens)."""
    m, n, l = (budget, 0, 0) if mode is None else PAPER_PAIRS[budget]
    spec = {"mode": "chain" if mode is None else "tree", "budget": budget, "M": m, "N": n, "L": l, "expand_mode": mode,
            "advantage": "grpo" if mode is None else "tree_grpo", "budget_tokens": None if mode is None else f"chain:{budget}"}  # fmt: skip
    return {**spec, "seed": seed, "world_seed": 0, "em_start": 0.1, "em_end": em_end,
            "em_curve": [[0, 0.1], [tokens, em_end]], "generated_tokens": tokens, "tool_calls": 0, "tool_curve": []}  # fmt: skip


def test_paper_headline_by_hand() -> None:
    """Chain 16 ends at 0.60 and 0.70 (mean 0.65) on 16,000 and 14,000 tokens (mean 15,000). The
    budget-2 trees (0.50, 0.66: mean 0.58) fall short; the budget-4 trees (0.64, 0.67: mean 0.655)
    match it on 3,600 and 4,200 tokens: 3,900 / 15,000 = 0.26 of chain 16's tokens, one of the two
    pairs at least as high. Among the chains, chain 8 is the first to match (0.66, 0.64: 0.65)."""
    ems = {  # label -> (seed 0 EM, tokens), (seed 1 EM, tokens)
        (16, None): ((0.60, 16000), (0.70, 14000)), (8, None): ((0.66, 8000), (0.64, 7000)),
        (4, None): ((0.50, 4000), (0.70, 3500)), (2, None): ((0.40, 2000), (0.50, 1800)),
        (2, "random"): ((0.50, 2100), (0.66, 1700)), (4, "random"): ((0.64, 3600), (0.67, 4200)),
        (8, "random"): ((0.70, 8000), (0.70, 7000)), (16, "random"): ((0.58, 15000), (0.70, 14500)),
    }  # fmt: skip
    rows = [_end_row(b, m, s, em, tok) for (b, m), per in ems.items() for s, (em, tok) in enumerate(per)]
    h = paper_headline(rows, [2, 4, 8, 16], ["random"], tokens=True)
    found = h["random"]["smallest_matching_budget"]
    assert found["budget"] == 4 and found["label"] == tree_label(4, "random", tokens=True)
    assert found["em_end"] == pytest.approx(0.655) and found["chain_em_end"] == pytest.approx(0.65)
    assert (found["pairs"], found["pairs_at_least"]) == (2, 1)
    assert found["token_fraction"] == pytest.approx(3900 / 15000)
    control = h["chain_control"]
    assert control["budget"] == 8 and control["label"] == "chain 8" and control["em_end"] == pytest.approx(0.65)
    assert control["token_fraction"] == pytest.approx(7500 / 15000)
    # budget 16's tree: seed 0 ends at 0.58, never reaching chain 16's 0.60; seed 1 reaches 0.70 only
    # at its end, 14,500 tokens = 14500/14000 of its chain's
    reach16 = h["random"]["reach_at_top"]
    assert (reach16["reached"], reach16["pairs"]) == (1, 2) and reach16["reach"]["mean"] == pytest.approx(14500 / 14000)
    # no smaller configuration reaches it: None, not the top budget's own chain
    low = [r for r in rows if r["em_end"] < 0.65 or (r["budget"] == 16 and r["mode"] == "chain")]
    assert paper_headline(low, [2, 4, 8, 16], ["random"], tokens=True)["chain_control"] is None


def test_token_plan() -> None:
    specs = plan_token_runs((2, 4), seeds=(0, 1), world_seeds=(0,))
    labels = list(dict.fromkeys(s.label for s in specs))
    assert labels == [
        "chain 2", "tree (1,2) random tokens=chain 2", "tree (1,2) nonroot tokens=chain 2",
        "chain 4", "tree (2,2) random tokens=chain 4", "tree (2,2) nonroot tokens=chain 4",
        "tree (2,2) random tokens=chain 4 intra_only", "tree (2,2) random tokens=chain 4 inter_only",
    ]  # fmt: skip
    tree = next(s for s in specs if s.label == "tree (2,2) nonroot tokens=chain 4")
    assert tree.overrides() == {"sampler": "tree", "m": 2, "n": 2, "l": 1, "expand_mode": "nonroot", "advantage": "tree_grpo",
                                "seed": 0, "budget_tokens": "chain:4", "eval_every_tokens": 4000, "eval_every": 0}  # fmt: skip
    assert specs[0].overrides()["eval_every_tokens"] == 2000 and "budget_tokens" not in specs[0].overrides()


def test_token_table_end_to_end(tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real loop on the tiny test model and world: rows with dense curves (a point per token
    checkpoint passed, tokens and tool calls at the same evaluations), the equal-cost analysis,
    JSON, plot, resume."""
    regime = Regime("test", "tiny", steps=3, prompts_per_step=2, lr=1e-4, eval_every=3, eval_prompts=4, about="test")
    monkeypatch.setitem(learn.REGIMES, "test", regime)
    monkeypatch.setattr("treegrpo.benchmarks.learn_spec.TOKEN_EVAL_PER_BUDGET", 20)
    monkeypatch.setattr("treegrpo.tasks.world.bootstrap.ensure_bootstrapped", lambda preset, world_seed=None, **kw: tiny_model_dir)
    out = tmp_path / "tokens.json"
    result = learn.run_bench(out, regime="test", seeds=1, jobs=1, expand_modes=("random",), budgets=(2,), matched="tokens")
    data = json.loads(out.read_text())
    assert data["bench"] == "learn_tokens" and data["complete"] and out.with_suffix(".png").stat().st_size > 0
    assert "--matched tokens" in data["command"] and data["models"]["0"]["folder"] == str(tiny_model_dir)
    chain, tree = data["rows"]
    for r in data["rows"]:
        assert tuple(r) == TOKEN_ROW_KEYS and r["eval_every_tokens"] == 40
        xs = [x for x, _ in r["em_curve"]]
        assert xs[0] == 0 and xs[-1] == r["generated_tokens"] and xs == sorted(xs)
        # one point per checkpoint passed (several in one step: one point), and the last step's
        assert len(xs) - 1 == len({x // 40 for x in xs[1:-1]}) + 1
        assert [e for _, e in r["tool_curve"]] == [e for _, e in r["em_curve"]]
        assert r["tool_curve"][-1][0] == r["tool_calls"]
    assert tree["budget_tokens"] == "chain:2" and chain["budget_tokens"] is None
    c = result["equal_cost"]["world 0"]["equal_tokens"]["2"]["random"]
    assert c["pairs"] == 1 and 0.5 < c["cost_ratio"]["mean"] < 2.0
    again = learn.run_bench(out, regime="test", seeds=1, jobs=1, expand_modes=("random",), budgets=(2,), matched="tokens",
                            resume=True)  # fmt: skip
    assert again["rows"] == result["rows"]
    # the same start bootstrapped by changed code, in another folder: the rows are kept (not run
    # again: their wall seconds are the first run's); other weights: run again
    moved = json.loads(out.read_text())
    moved["models"]["0"] |= {"folder": "/elsewhere", "code_fingerprint": "changed", "config_hash": "changed"}
    out.write_text(json.dumps(moved))
    kept = learn.run_bench(out, regime="test", seeds=1, jobs=1, expand_modes=("random",), budgets=(2,), matched="tokens",
                           resume=True)  # fmt: skip
    assert kept["rows"] == result["rows"] and "resumed_from" in kept["provenance"]
    other = json.loads(out.read_text())
    other["provenance"]["model_hash"]["0"] = "sha256:other"
    out.write_text(json.dumps(other))
    rerun = learn.run_bench(out, regime="test", seeds=1, jobs=1, expand_modes=("random",), budgets=(2,), matched="tokens",
                            resume=True)  # fmt: skip
    assert "resumed_from" not in rerun["provenance"]


@pytest.mark.parametrize("name", ["learn_tokens_rare3.json", "learn_tokens_default.json"])
def test_the_committed_token_tables_are_whole_and_recomputable(name: str) -> None:
    """benchmarks/results/learn_tokens_*.json: every run of the plan is there, each token-matched
    tree spent its chain's tokens (a step's cap at most over, per step), and the equal-cost figures
    the docs quote are what the rows give again."""
    data = json.loads((Path(__file__).parents[2] / "benchmarks" / "results" / name).read_text())
    assert data["complete"] and data["matched"] == "tokens"
    plan = plan_token_runs(data["budgets"], data["seeds"], data["world_seeds"], data["expand_modes"])
    assert sorted(spec_of(r).key for r in data["rows"]) == sorted(s.key for s in plan)
    chains = {(r["budget"], r["seed"], r["world_seed"]): r["generated_tokens"] for r in data["rows"] if r["mode"] == "chain"}
    ratios: dict[str, list[float]] = {}
    for r in data["rows"]:
        assert tuple(r) == TOKEN_ROW_KEYS and r["em_curve"][-1][0] == r["generated_tokens"]
        if r["mode"] == "tree":
            c = chains[(r["budget"], r["seed"], r["world_seed"])]
            ratios.setdefault(spec_of(r).label, []).append(r["generated_tokens"] / c)
    # matched per step against the step's own chains; over a run the two policies drift apart
    # (single runs 0.82-1.23x on rare3), the median of each configuration stays within 10 % (the
    # median: on rare3 one budget-8 tree's policy collapsed and, its trajectories growing, spent
    # 2.2x its paired chain's tokens while matching its own chains step by step)
    assert ratios and all(0.9 < statistics.median(x) < 1.1 for x in ratios.values()), ratios
    assert json.loads(json.dumps(analyse(data["rows"], data["expand_modes"]))) == data["equal_cost"]
