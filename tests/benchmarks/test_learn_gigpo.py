"""``bench learn --gigpo``: the plan (four configurations per budget, paired seeds), the analysis
by hand, the real loop end to end on the tiny test model (search world and SQL task), and the
command line's one-line errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from treegrpo.benchmarks import learn
from treegrpo.benchmarks.learn import Regime
from treegrpo.benchmarks.learn_report import labels, summarize_gigpo
from treegrpo.benchmarks.learn_spec import GIGPO_ROW_KEYS, plan_gigpo, spec_of


def test_plan_pairs_four_configurations_per_budget() -> None:
    specs = plan_gigpo([2, 4], [0, 1, 2], world_seed=7)
    assert len(specs) == 2 * 4 * 3 and len({s.key for s in specs}) == len(specs)
    got = list(dict.fromkeys(s.label for s in specs))
    assert got == [*labels(2).values(), *labels(4).values()]
    assert got[:4] == ["chain 2", "chain 2 gigpo", "tree (1,2,1) random", "tree (1,2,1) random tree_gigpo"]
    chain_gigpo = next(s for s in specs if s.label == "chain 4 gigpo")
    assert chain_gigpo.overrides() == {"sampler": "chain", "group_size": 4, "advantage": "gigpo", "seed": 0}
    assert next(s for s in specs if s.label == "chain 4").overrides()["advantage"] == "grpo"
    assert all(s.world_seed == 7 for s in specs)
    with pytest.raises(ValueError, match="no paper shape"):
        plan_gigpo([3], [0], 0)


def _row(label: str, seed: int, em: float, shared: float) -> dict[str, Any]:
    spec = next(s for s in plan_gigpo([2], [seed], 0) if s.label == label)
    return {
        "mode": spec.mode, "budget": 2, "M": spec.m, "N": spec.n, "L": spec.l, "expand_mode": spec.expand_mode,
        "advantage": spec.advantage, "seed": seed, "world_seed": 0, "em_start": 0.2, "em_end": em, "em_greedy_end": em,
        "em_curve": [[0, 0.2], [100, em]], "generated_tokens": 100, "tool_calls": 10, "trajectories": 8,
        "tool_calls_per_traj_start": 1.0, "tool_calls_per_traj_end": 1.0, "wall_s": 1.0, "task": "search",
        "em_greedy_start": 0.1, "anchor_steps": 10, "anchor_shared_frac": shared, "anchor_deep_shared_frac": shared / 2,
        "anchor_group_size": 2.0,
    }  # fmt: skip


def test_summary_and_paired_comparisons_by_hand() -> None:
    rows = [
        _row("chain 2", 0, 0.3, 0.5), _row("chain 2", 1, 0.5, 0.7),
        _row("chain 2 gigpo", 0, 0.4, 0.6), _row("chain 2 gigpo", 1, 0.4, 0.8),
        _row("tree (1,2,1) random", 0, 0.6, 0.9),
    ]  # fmt: skip
    out = summarize_gigpo(rows)
    s = out["summary"]["chain 2"]
    assert s["anchor_shared_frac"] == pytest.approx(0.6) and s["anchor_deep_shared_frac"] == pytest.approx(
        0.3
    )
    assert s["em_end"]["mean"] == pytest.approx(0.4) and s["runs"] == 2
    c = out["compare"]["2"]["chain_gigpo_vs_chain"]
    assert (c["first"], c["second"], c["pairs"]) == ("chain 2 gigpo", "chain 2", 2)
    assert c["pair_diffs"] == [0.1, -0.1] and c["ratio"] == pytest.approx(1.0)
    assert out["compare"]["2"]["tree_vs_chain_gigpo"]["pair_diffs"] == [0.2]  # seed 0 only
    assert "tree_gigpo_vs_tree" not in out["compare"]["2"]  # no tree_gigpo rows


@pytest.mark.parametrize("task", ["search", "sql"])
def test_gigpo_bench_end_to_end(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, task: str
) -> None:
    """The real loop (trainer, samplers, dumped rollouts, anchor stats, JSON, plot, resume) on the
    tiny test model, two steps per run, budget 2, one seed."""
    regime = Regime(
        "test", "tiny", steps=2, prompts_per_step=2, lr=1e-4, eval_every=1, eval_prompts=4, about="test"
    )
    monkeypatch.setitem(learn.REGIMES, "test", regime)
    monkeypatch.setattr(learn, "SQL_REGIME", regime)
    monkeypatch.setattr(
        "treegrpo.tasks.world.bootstrap.ensure_bootstrapped",
        lambda preset, world_seed=None, **kw: tiny_model_dir,
    )
    monkeypatch.setattr(
        "treegrpo.tasks.sql.bootstrap.ensure_sql_bootstrapped", lambda *a, **kw: tiny_model_dir
    )
    out = tmp_path / "gigpo.json"
    result = learn.run_gigpo_bench(out, task=task, regime="test", seeds=1, jobs=1, budgets=(2,))
    data = json.loads(out.read_text())
    assert data["complete"] is True and data["task"] == task and out.with_suffix(".png").stat().st_size > 0
    assert [spec_of(r).label for r in data["rows"]] == list(labels(2).values())
    for r in data["rows"]:
        assert tuple(r) == GIGPO_ROW_KEYS and r["task"] == task
        assert r["anchor_steps"] > 0 and 0.0 < r["anchor_shared_frac"] <= 1.0  # first steps share the prompt
        assert r["trajectories"] == 2 * 2 * (2 if r["mode"] == "chain" else 3)
    assert set(data["compare"]["2"]) == {
        "chain_gigpo_vs_chain",
        "tree_vs_chain",
        "tree_vs_chain_gigpo",
        "tree_gigpo_vs_tree",
    }
    again = learn.run_gigpo_bench(
        out, task=task, regime="test", seeds=1, jobs=1, budgets=(2,), resume=True
    )
    assert again["rows"] == result["rows"] and f"--task {task}" in again["command"]
    # the same weights bootstrapped into another folder by changed code: still the same start
    moved = json.loads(out.read_text())
    moved["model"] = {"folder": "/elsewhere", "config_hash": "changed"}
    out.write_text(json.dumps(moved))
    kept = learn.run_gigpo_bench(out, task=task, regime="test", seeds=1, jobs=1, budgets=(2,), resume=True)
    assert kept["rows"] == result["rows"] and "resumed_from" in kept["provenance"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--task", "sql"], "--task sql needs --gigpo"),
        (["--gigpo", "--task", "kv"], "--task 'kv'"),
        (["--gigpo", "--quick"], "drop --quick"),
        (["--eval-prompts", "5"], "--eval-prompts needs --gigpo"),
    ],
)
def test_cli_rejects_bad_gigpo_options(args: list[str], message: str) -> None:
    from typer.testing import CliRunner

    from treegrpo.cli import app

    res = CliRunner().invoke(app, ["bench", "learn", *args])
    assert res.exit_code == 2 and message in res.output and "Traceback" not in res.output


def test_results_replot(tmp_path: Path) -> None:
    """``treegrpo plot`` re-draws the GiGPO table's figure from its JSON."""
    from treegrpo.benchmarks.replot import replot

    rows = [
        _row("chain 2", 0, 0.3, 0.5),
        _row("chain 2 gigpo", 0, 0.4, 0.6),
        _row("tree (1,2,1) random", 0, 0.6, 0.9),
    ]
    doc = {"bench": "learn_gigpo", "task": "search", "budgets": [2], "seeds": [0], "start": {"eval/success_sampled": 0.2},
           "regime": {"steps": 2, "prompts_per_step": 2, "lr": 1e-4}, "rows": rows, **summarize_gigpo(rows)}  # fmt: skip
    src = tmp_path / "learn_gigpo.json"
    src.write_text(json.dumps(doc))
    png = replot(src, tmp_path / "out")
    assert png == tmp_path / "out" / "learn_gigpo.png" and png.read_bytes()[:4] == b"\x89PNG"
