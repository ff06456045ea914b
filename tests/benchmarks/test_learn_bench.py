"""``treegrpo bench learn``: the run plan, the pure analysis (hand-derived values), and a real
end-to-end run of the benchmark on the tiny test model and the tiny world (two steps per run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from treegrpo.benchmarks import learn
from treegrpo.benchmarks.learn import ROW_KEYS, Regime, RunSpec, plan_runs
from treegrpo.benchmarks.learn_report import compare, em_at, summarize, targets


def test_plan_covers_the_table_with_paired_seeds() -> None:
    specs = plan_runs((2, 4), seeds=(0, 1), world_seeds=(7,))
    labels = list(dict.fromkeys(s.label for s in specs))
    assert labels == [
        "chain 2",
        "tree (1,2,1) random",
        "tree (1,2,1) nonroot",
        "tree (1,2,1) entropy",
        "chain 4",
        "tree (2,2,1) random",
        "tree (2,2,1) nonroot",
        "tree (2,2,1) entropy",
        "tree (2,2,1) random intra_only",
        "tree (2,2,1) random inter_only",
    ]
    assert len(specs) == 2 * len(labels) and {s.world_seed for s in specs} == {7}
    # every configuration runs every seed
    for lab in labels:
        assert sorted(s.seed for s in specs if s.label == lab) == [0, 1]
    assert RunSpec("chain", 4, 4, 0, 0, None, "grpo", 3, 0).overrides() == {
        "sampler": "chain",
        "group_size": 4,
        "advantage": "grpo",
        "seed": 3,
    }
    o = RunSpec("tree", 8, 2, 6, 1, "nonroot", "tree_grpo", 1, 0).overrides()
    assert (o["m"], o["n"], o["l"], o["expand_mode"], o["advantage"]) == (2, 6, 1, "nonroot", "tree_grpo")
    with pytest.raises(ValueError, match="no paper shape"):
        plan_runs((3,), seeds=(0,), world_seeds=(0,))


def test_em_at_interpolates_linearly_and_refuses_to_extrapolate() -> None:
    curve = [[0, 0.2], [100, 0.4], [300, 0.8]]
    assert em_at(curve, 0) == pytest.approx(0.2)
    assert em_at(curve, 50) == pytest.approx(0.3)
    assert em_at(curve, 200) == pytest.approx(0.6)
    assert em_at(curve, 300) == pytest.approx(0.8)
    assert em_at(curve, 301) is None
    assert em_at([], 0) is None


def _row(mode: str, budget: int, seed: int, em_end: float, curve: list[list[float]], **kw: object) -> dict:
    m, n, l = {2: (1, 2, 1), 4: (2, 2, 1)}[budget] if mode == "tree" else (budget, 0, 0)
    row = {
        "mode": mode,
        "budget": budget,
        "M": m,
        "N": n,
        "L": l,
        "expand_mode": kw.get("expand_mode", "random" if mode == "tree" else None),
        "advantage": kw.get("advantage", "tree_grpo" if mode == "tree" else "grpo"),
        "seed": seed,
        "world_seed": 0,
        "em_start": 0.2,
        "em_end": em_end,
        "em_greedy_end": em_end,
        "em_curve": curve,
        "generated_tokens": int(curve[-1][0]),
        "tool_calls": 10,
        "trajectories": 30,
        "tool_calls_per_traj_start": 1.0,
        "tool_calls_per_traj_end": float(kw.get("tools_end", 1.5)),
        "wall_s": 1.0,
    }
    assert tuple(row) == ROW_KEYS
    return row


def test_compare_and_targets_by_hand() -> None:
    rows = [
        # seed 0: tree 0.6 vs chain 0.5; the tree spent 300 tokens, the chain 200
        _row("tree", 2, 0, 0.6, [[0, 0.2], [300, 0.6]]),
        _row("chain", 2, 0, 0.5, [[0, 0.2], [200, 0.5]]),
        # seed 1: tree 0.4 vs chain 0.5, equal tokens
        _row("tree", 2, 1, 0.4, [[0, 0.2], [200, 0.4]]),
        _row("chain", 2, 1, 0.5, [[0, 0.2], [200, 0.5]]),
    ]
    c = compare(rows, "tree (1,2,1) random", "chain 2")
    assert c is not None
    assert c["pairs"] == 2 and c["tree_wins"] == 1
    assert c["tree_em_end"] == pytest.approx(0.5) and c["chain_em_end"] == pytest.approx(0.5)
    assert c["ratio"] == pytest.approx(1.0)
    assert c["pair_ratios"] == [1.2, 0.8]
    # EM averaged over the evaluations after the start: tree (0.6 + 0.4) / 2, chain 0.5
    assert c["curve_mean_ratio"] == pytest.approx(1.0)
    # at 200 tokens the seed-0 tree is at 0.2 + 0.4 * 200/300 = 0.4667; seed 1 at 0.4
    assert c["equal_tokens_tree_em"] == pytest.approx((0.2 + 0.4 * 2 / 3 + 0.4) / 2)
    assert c["equal_tokens_chain_em"] == pytest.approx(0.5)
    t = targets(rows)["world 0"]
    assert t["budget2_tree_vs_chain_em"]["pass"] is False and t["budget2_tree_vs_chain_em"]["threshold"] == 1.15
    assert t["budget2_random_equal_tokens"]["pass"] is False
    assert compare(rows, "tree (1,2,1) nonroot", "chain 2") is None


def test_ablation_order_and_tool_calls() -> None:
    curve = [[0, 0.2], [100, 0.3]]
    rows = [
        _row("chain", 4, 0, 0.3, curve, tools_end=1.4),
        _row("tree", 4, 0, 0.5, curve, tools_end=2.0),
        _row("tree", 4, 0, 0.4, curve, advantage="inter_only"),
        _row("tree", 4, 0, 0.4, curve, advantage="intra_only"),
    ]
    t = targets(rows)["world 0"]
    assert t["ablation_order"] == {
        "both": 0.5,
        "inter_only": 0.4,
        "intra_only": 0.4,
        "op": "both > inter_only >= intra_only",
        "pass": True,
    }
    assert t["tool_calls_per_traj_start_end"]["tree (2,2,1) random"] == [1.0, 2.0]
    assert t["tool_calls_per_traj_start_end"]["chain 4"] == [1.0, 1.4]
    s = summarize(rows)
    assert s["tree (2,2,1) random"]["em_end"]["mean"] == pytest.approx(0.5)
    assert s["chain 4"]["runs"] == 1


def test_bench_learn_end_to_end(tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real benchmark loop (trainer, samplers, evaluation, JSON, plot, resume) on the tiny
    test model and the tiny world, two steps per run, one worker, one seed."""
    regime = Regime("test", "tiny", steps=2, prompts_per_step=2, lr=1e-4, eval_every=1, eval_prompts=4, about="test")
    monkeypatch.setitem(learn.REGIMES, "test", regime)
    monkeypatch.setattr(
        "treegrpo.tasks.world.bootstrap.ensure_bootstrapped", lambda preset, world_seed=None, **kw: tiny_model_dir
    )
    out = tmp_path / "learn.json"
    result = learn.run_bench(out, regime="test", quick=True, seeds=1, jobs=1, expand_modes=("random",))
    data = json.loads(out.read_text())
    assert data["complete"] is True and out.with_suffix(".png").stat().st_size > 0
    labels = [learn.spec_of(r).label for r in data["rows"]]
    assert labels == [
        "chain 2",
        "tree (1,2,1) random",
        "chain 4",
        "tree (2,2,1) random",
        "tree (2,2,1) random intra_only",
        "tree (2,2,1) random inter_only",
    ]
    for r in data["rows"]:
        assert tuple(r) == ROW_KEYS
        assert len(r["em_curve"]) == 3 and r["em_curve"][0] == [0, r["em_start"]]
        assert r["em_curve"][-1][0] == r["generated_tokens"] > 0
        assert r["em_start"] == data["start"]["0"]["eval/success_sampled"]
    per_prompt = {lab: r["trajectories"] / (2 * 2) for lab, r in zip(labels, data["rows"], strict=True)}
    assert per_prompt["chain 2"] == 2 and per_prompt["chain 4"] == 4
    assert per_prompt["tree (1,2,1) random"] == 3 and per_prompt["tree (2,2,1) random"] == 6
    assert "world 0" in result["targets"]
    # resume: nothing left to run, the rows are kept as they are
    again = learn.run_bench(out, regime="test", quick=True, seeds=1, jobs=1, expand_modes=("random",), resume=True)
    assert again["rows"] == result["rows"]
    assert again["wall_s"] >= result["wall_s"]  # the time of the kept runs is carried over
    # overrides of the regime are part of the recorded command
    tuned = learn.run_bench(out, regime="test", quick=True, seeds=1, jobs=1, expand_modes=("random",), lr=2e-4,
                            budgets=(2,), resume=True)
    assert "--lr 0.0002" in tuned["command"] and "--budgets 2" in tuned["command"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--regime", "nope"], "--regime 'nope'"),
        (["--budgets", "3"], "--budgets '3'"),
        (["--expand-modes", "random,best"], "unknown best"),
        (["--seeds", "0"], "must be >= 1"),
        (["--lr", "0"], "--lr must be > 0"),
        (["--world-seed", "a"], "--world-seed 'a'"),
    ],
)
def test_cli_rejects_bad_options_with_one_line(args: list[str], message: str) -> None:
    from typer.testing import CliRunner

    from treegrpo.cli import app

    res = CliRunner().invoke(app, ["bench", "learn", *args])
    assert res.exit_code == 2
    assert message in res.output and "Traceback" not in res.output
