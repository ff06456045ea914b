"""The SQL agent end to end: imperfect demos, a (tiny) bootstrap through the real loop, a training
run on ``task: sql`` from it, and ``bench stateful --quick`` (cost, exactness, chain vs tree)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from rich.console import Console

from treegrpo.benchmarks.stateful import run_bench
from treegrpo.models.loader import tiny_info
from treegrpo.tasks.registry import task_family
from treegrpo.tasks.sql.bootstrap import SqlBootstrapConfig, bootstrap_sql, is_sql_bootstrapped
from treegrpo.tasks.sql.demos import make_demos
from treegrpo.tasks.sql.env import SqlEnv
from treegrpo.tasks.sql.problems import SqlConfig, build_problems
from treegrpo.training.config import make_config
from treegrpo.training.trainer import train

TINY = SqlBootstrapConfig(
    problems=SqlConfig(n_warmup=100, n_train=40, n_eval=8),
    n_demos=200,
    hidden_size=32,
    layers=1,
    intermediate_size=64,
    epochs=1,
    n_eval=8,
)


def test_demos_have_their_imperfections_and_rewards() -> None:
    env = SqlEnv()
    demos = make_demos(env, build_problems(TINY.problems).tasks("warmup"), TINY, random.Random(0))
    kinds = {d.kind for d in demos}
    assert kinds == {"correct", "stale", "guess", "one_leg"}
    for d in demos:
        assert d.reward == (1.0 if d.kind == "correct" else 0.0)
        assert d.steps[-1][1] is None and d.steps[-1][0].startswith("<answer>")
        assert all(s.startswith("<sql>") and o.startswith("<result>") for s, o in d.steps[:-1] if o)
    assert env.open_states == 0


@pytest.fixture(scope="module")
def sql_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return bootstrap_sql(tmp_path_factory.mktemp("sql") / "model", TINY, progress=False)


def test_bootstrap_records_and_train_runs(sql_model: Path, tmp_path: Path) -> None:
    info = tiny_info(sql_model)
    assert is_sql_bootstrapped(sql_model) and info["task"] == "sql"
    assert 0.0 <= info["warmup_eval"]["sampled"]["success"] <= 1.0
    cfg = make_config(
        {"task": "sql", "model": str(sql_model), "steps": 2, "prompts_per_step": 2, "eval_prompts": 4,
         "eval_every": 2, "out_dir": str(tmp_path / "run"), "save_every": 0, "tensorboard": False}
    )  # fmt: skip
    assert task_family(cfg).name == "sql"
    s = train(cfg, console=Console(quiet=True))
    assert s.steps == 2 and s.trajectories > 0 and s.generated_tokens > 0
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) >= 2


def test_bench_stateful_quick(sql_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "stateful.json"
    r = run_bench(out, quick=True, model_dir=sql_model, log=lambda m: None)
    saved = json.loads(out.read_text())
    assert out.with_suffix(".png").is_file()
    assert saved["mismatches"] == 0 and saved["exactness"]["leaked_states"] == 0
    assert saved["command"].startswith("treegrpo bench stateful --quick") and "commit" in saved
    depths = [d["depth"] for d in saved["cost"]["depths"]]
    assert depths == [1, 3, 5, 8]
    for d in saved["cost"]["depths"]:
        assert d["replay"]["tool_calls"] == d["depth"] and d["snapshot"]["tool_calls"] == 0
    assert saved["cost"]["rollout"]["snapshot"]["replayed_tool_calls"] == 0
    assert saved["cost"]["rollout"]["replay"]["replayed_tool_calls"] > 0
    assert set(saved["learn"]["compare"]) == {"2", "4"} and len(r["learn"]["rows"]) == 4
