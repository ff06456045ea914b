"""Run plots (viz/plots.py), benchmark re-plots (benchmarks/replot.py) and `treegrpo plot`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from treegrpo.benchmarks.replot import benchmark_name, replot
from treegrpo.cli import app
from treegrpo.errors import ConfigError
from treegrpo.viz.plots import load_run, plot_runs, run_label

REPO = Path(__file__).resolve().parents[2]


def write_run(folder: Path, sampler: str, gap: bool, steps: int = 4) -> Path:
    folder.mkdir(parents=True)
    cfg = {"sampler": sampler, "m": 2, "n": 2, "l": 1, "group_size": 4, "expand_mode": "random", "advantage": "grpo"}
    (folder / "config.json").write_text(json.dumps(cfg))
    rows = [{"step": 0, "eval/success_greedy": 0.1, "eval/success_sampled": 0.08}]
    for s in range(1, steps + 1):
        row = {
            "step": s, "reward/mean": 0.1 * s, "budget/total_generated_tokens": 1000 * s,
            "budget/tool_calls_per_traj": 1.5, "actor/entropy": 1.0 / s, "actor/grad_norm": 0.5,
            "actor/approx_kl": 0.001 * s, "rollout/informative_groups": 0.5,
        }  # fmt: skip
        if gap:
            row["rollout/logprob_diff"] = 0.001 * s
        if s == steps:
            row.update({"eval/success_greedy": 0.3, "eval/success_sampled": 0.25})
        rows.append(row)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 9, "broken')
    return folder


def test_series_against_generated_tokens(tmp_path: Path) -> None:
    run = load_run(write_run(tmp_path / "a", "tree", gap=True))
    assert run.label == "a · tree (2,2,1) random · grpo"
    assert run.xy("eval/success_greedy", "tokens") == ([0.0, 4000.0], [0.1, 0.3])  # the start sits at 0
    assert run.xy("reward/mean", "step")[0] == [1.0, 2.0, 3.0, 4.0]
    assert run.xy("loss/kl", "tokens") == ([], [])


def test_labels() -> None:
    # advantage "auto" (the default) resolves the way the trainer resolves it
    assert run_label(Path("r"), {"sampler": "chain", "group_size": 8}) == "r · chain G=8 · grpo"
    eptree = {"sampler": "eptree", "m": 6, "n": 2, "l": 1, "t": 2, "advantage": "auto"}
    assert run_label(Path("r"), eptree) == "r · eptree (6,2,1,2) · treerl"
    assert run_label(Path("r"), {"sampler": "tree", "m": 1, "n": 2, "l": 1, "advantage": 7}) == "r · tree (1,2,1)"
    assert run_label(Path("r"), {}) == "r"


def test_two_runs_one_figure_and_missing_series_skipped(tmp_path: Path) -> None:
    a = write_run(tmp_path / "tree_run", "tree", gap=True)
    b = write_run(tmp_path / "chain_run", "chain", gap=False)  # an older run: no log-prob gap
    res = plot_runs([a, b], tmp_path / "plots")
    written = res.written
    names = sorted(p.name for p in written)
    assert res.x == "tokens" and res.skipped == [] and res.folder == tmp_path / "plots"
    assert names == sorted(
        ["reward.png", "heldout_em.png", "tool_calls.png", "kl.png", "entropy.png", "grad_norm.png",
         "informative_groups.png", "logprob_gap.png", "overview.png"]
    )  # fmt: skip
    for p in written:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size < 300_000
    assert plot_runs([b], tmp_path / "only_chain").skipped == ["logprob_gap"]
    assert plot_runs([b]).folder == b / "plots"


def test_runs_without_token_totals_fall_back_to_steps(tmp_path: Path) -> None:
    run = tmp_path / "old"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.2}) + "\n")
    res = plot_runs([run], tmp_path / "p")
    assert res.x == "step" and [p.name for p in res.written] == ["reward.png", "overview.png"]
    assert "entropy" in res.skipped
    assert res.line().startswith(f"wrote 2 PNGs to {tmp_path / 'p'} (x axis: step; no data: heldout_em, ")


def test_load_run_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no metrics\.jsonl here"):
        load_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ConfigError, match="no metric rows"):
        load_run(tmp_path)


def test_benchmark_replot(tmp_path: Path) -> None:
    src = REPO / "benchmarks" / "results" / "packing.json"
    if not src.is_file():
        pytest.skip("benchmarks/results/packing.json not in this checkout")
    png = replot(src, tmp_path)
    assert png == tmp_path / "packing.png" and png.read_bytes()[:4] == b"\x89PNG"
    assert benchmark_name({"bench": "learn"}) == "learn" and benchmark_name([1]) is None
    other = tmp_path / "retrieval.json"
    other.write_text(json.dumps({"recall": {}}))
    with pytest.raises(ConfigError, match="no 'bench' field; plots exist for the budget, eptree, learn, learn_gigpo, learn_tokens, packing"):
        replot(other)
    broken = tmp_path / "packing_broken.json"
    broken.write_text(json.dumps({"benchmark": "packing"}))
    with pytest.raises(ConfigError, match="not one its plot can read"):
        replot(broken)


def test_plot_command(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a", "tree", gap=False)
    res = CliRunner().invoke(app, ["plot", str(a)])
    assert res.exit_code == 0, res.output
    assert (a / "plots" / "overview.png").is_file() and "no data: logprob_gap" in res.output
    res = CliRunner().invoke(app, ["plot", str(a), str(tmp_path / "missing")])
    assert res.exit_code == 2 and "missing: cannot read (No such file or directory)" in res.output
    res = CliRunner().invoke(app, ["plot", str(a), "--x", "time"])
    assert res.exit_code == 2 and "error: x axis 'time': choose tokens or step" in res.output
