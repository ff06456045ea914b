"""Every bench on the shared runner writes results with the keys and nesting of the committed
``benchmarks/results/*.json``: each bench runs on tiny, cheap settings (the fixture model, a few
prompts, one or two steps) and its JSON is held against the committed file of the same bench.

Compared: the top-level keys (a committed file made before provenance was recorded may lack
``provenance``), the keys of every row (and their order), and for every key both documents have,
the kind of value (object, list, number, string, boolean) all the way down; ``null`` matches
anything (a figure that was not measured)."""

from __future__ import annotations

import io
import json
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def _kind(x: Any) -> str:
    if isinstance(x, bool):
        return "bool"
    if isinstance(x, int | float):
        return "number"
    return next((k.__name__ for k in (str, dict, list) if isinstance(x, k)), type(x).__name__)


def shape_problems(new: Any, old: Any, path: str = "") -> list[str]:
    """Where ``new`` differs from ``old`` in keys or kinds of value (module docstring)."""
    if new is None or old is None:
        return []
    if _kind(new) != _kind(old):
        return [f"{path or '/'}: {_kind(new)} where the committed file has {_kind(old)}"]
    out: list[str] = []
    if isinstance(old, dict):
        if path == "":
            missing, extra = set(old) - set(new), set(new) - set(old) - {"provenance"}
            out += [f"/: key {k!r} missing" for k in sorted(missing)] + [
                f"/: new key {k!r}" for k in sorted(extra)
            ]
        for k in old.keys() & new.keys():
            out += shape_problems(new[k], old[k], f"{path}/{k}")
    elif isinstance(old, list) and old and new:
        if path.endswith("/rows") and all(isinstance(r, dict) for r in (*old, *new)):
            keys = list(old[0])
            out += [f"{path}[{i}]: keys {list(r)} != {keys}" for i, r in enumerate(new) if list(r) != keys]
        out += shape_problems(new[0], old[0], f"{path}[0]")
    return out


def committed(name: str) -> dict[str, Any]:
    return json.loads((RESULTS / name).read_text())


def test_shape_problems_finds_a_renamed_key_and_a_changed_kind() -> None:
    old = {"rows": [{"a": 1, "b": "x"}], "meta": {"n": 1, "t": [1.0]}}
    assert (
        shape_problems({"rows": [{"a": 2, "b": "y"}], "meta": {"n": 2, "t": []}, "provenance": {}}, old) == []
    )
    assert shape_problems({"rows": [{"a": 2, "c": "y"}], "meta": {"n": 1, "t": [1]}}, old) == [
        "/rows[0]: keys ['a', 'c'] != ['a', 'b']"
    ]
    assert shape_problems({"rows": [], "meta": {"n": "1"}}, old) == [
        "/meta/n: str where the committed file has number"
    ]
    assert shape_problems({"meta": {}}, old) == ["/: key 'rows' missing"]


@pytest.fixture(scope="module")
def agent_folder(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fixture model with a bootstrap record (the tiny world), as ``bench budget`` and
    ``bench packing`` read one."""
    from treegrpo.rollout.agent import AgentConfig
    from treegrpo.tasks.world.world import PRESETS

    folder = Path(shutil.copytree(tiny_model_dir, tmp_path_factory.mktemp("agent") / "agent"))
    agent = AgentConfig(
        max_turns=2, max_step_tokens=8, max_obs_tokens=32, max_context_tokens=400, use_chat_template=False
    )
    record = {"tokenizer": "PreTrainedTokenizerFast", "world": PRESETS["tiny"].to_dict(),
              "env": {"topk": 2, "prompt_template": "minimal"}, "agent": asdict(agent)}  # fmt: skip
    (folder / "treegrpo_tiny.json").write_text(json.dumps(record))
    return folder


def _tiny_regime(monkeypatch: pytest.MonkeyPatch, model: Path) -> None:
    from treegrpo.benchmarks import learn

    regime = learn.Regime(
        "test", "tiny", steps=1, prompts_per_step=2, lr=1e-4, eval_every=1, eval_prompts=2, about="t"
    )
    monkeypatch.setitem(learn.REGIMES, "test", regime)
    monkeypatch.setattr(learn, "SQL_REGIME", regime)
    monkeypatch.setattr(
        "treegrpo.tasks.world.bootstrap.ensure_bootstrapped", lambda preset, world_seed=None, **kw: model
    )
    monkeypatch.setattr("treegrpo.tasks.sql.bootstrap.ensure_sql_bootstrapped", lambda *a, **kw: model)


def test_learn_schema(tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from treegrpo.benchmarks import learn

    _tiny_regime(monkeypatch, tiny_model_dir)
    doc = learn.run_bench(
        tmp_path / "learn.json", regime="test", seeds=1, jobs=1, expand_modes=("random",), budgets=(2,)
    )
    assert json.loads((tmp_path / "learn.json").read_text()) == doc
    assert shape_problems(doc, committed("learn.json")) == []


@pytest.mark.parametrize("task", ["search", "sql"])
def test_learn_gigpo_schema(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, task: str
) -> None:
    from treegrpo.benchmarks import learn

    _tiny_regime(monkeypatch, tiny_model_dir)
    doc = learn.run_gigpo_bench(tmp_path / "g.json", task=task, regime="test", seeds=1, jobs=1, budgets=(2,))
    name = "learn_gigpo.json" if task == "search" else "learn_gigpo_sql.json"
    assert shape_problems(doc, committed(name)) == []


def test_budget_schema(agent_folder: Path, tmp_path: Path) -> None:
    from rich.console import Console

    from treegrpo.benchmarks.budget import chain_spec, run_bench, tree_spec

    specs = [chain_spec(4), tree_spec(4, (2, 2, 1), "random"), tree_spec(4, (2, 2, 1), "nonroot")]
    doc = run_bench(tmp_path / "budget.json", prompts=2, repeats=1, model_dir=agent_folder, specs=specs,
                    console=Console(file=io.StringIO()), log=lambda m: None)  # fmt: skip
    assert json.loads((tmp_path / "budget.json").read_text()) == doc
    assert shape_problems(doc, committed("budget.json")) == []


def test_budget_engine_schema(agent_folder: Path, tmp_path: Path) -> None:
    from treegrpo.benchmarks.budget_engines import run_engine_bench

    doc = run_engine_bench(tmp_path / "budget_hf.json", engine="hf", model=str(agent_folder), prompts=2, repeats=1,
                           log=lambda m: None)  # fmt: skip
    assert shape_problems(doc, committed("budget_hf.json")) == []


def test_packing_schema(agent_folder: Path, tmp_path: Path) -> None:
    from treegrpo.benchmarks.packing import run_bench

    doc = run_bench(tmp_path / "packing.json", shapes=((2, 2, 1),), prompts=2, repeats=1, model_dir=agent_folder,
                    log=lambda m: None)  # fmt: skip
    assert json.loads((tmp_path / "packing.json").read_text()) == doc
    assert shape_problems(doc, committed("packing.json")) == []


def test_stateful_schema(tiny_model_dir: Path, tmp_path: Path) -> None:
    from treegrpo.benchmarks.stateful import run_bench

    doc = run_bench(tmp_path / "stateful.json", quick=True, model_dir=tiny_model_dir, log=lambda m: None)
    assert shape_problems(doc, committed("stateful.json")) == []


def test_eptree_schema(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    from treegrpo.benchmarks.eptree import run_bench
    from treegrpo.tasks.arith.bootstrap import ArithBootstrapConfig, bootstrap_arith
    from treegrpo.tasks.arith.problems import ArithConfig

    problems = ArithConfig(min_steps=2, max_steps=2, max_start=40, n_train=40, n_eval=8)
    boot = ArithBootstrapConfig(problems=problems, n_demos=300, max_new_tokens=24, hidden_size=32, layers=1, heads=2,
                                kv_heads=1, intermediate_size=64, max_positions=128, epochs=1, n_eval=8)  # fmt: skip
    model = bootstrap_arith(tmp_path_factory.mktemp("arith") / "model", boot, progress=False)
    doc = run_bench(tmp_path / "eptree.json", prompts=2, seeds=(0,), rl_steps=1, rl_seeds=(0,), rl_prompts_per_step=2,
                    eval_prompts=2, threads=None, model_dir=model, shape=(2, 1, 1, 2), log=lambda m: None)  # fmt: skip
    assert json.loads((tmp_path / "eptree.json").read_text()) == doc
    assert shape_problems(doc, committed("eptree.json")) == []


def test_scale_schema(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The document around the measured runs (each run itself is a ``treegrpo train`` process,
    replaced here by its medians)."""
    from treegrpo.benchmarks import scale

    def fake(world: int, steps: int, *args: Any) -> dict[str, float]:
        return {k: float(world + i) for i, k in enumerate(scale.KEYS)}

    monkeypatch.setattr(scale, "measure", fake)
    out = tmp_path / "scale.json"
    doc = scale.run_bench(out, steps=2, worlds=(1, 2), log=lambda m: None)
    assert out.read_text() == json.dumps(doc, indent=2) + "\n" and out.with_suffix(".png").is_file()
    assert doc["worlds"]["2"]["efficiency"]["rollout"] == 1 / (2 * 2)  # T_1 / (K T_K): rollout CPU 1 vs 2
    assert shape_problems(doc, committed("scale.json")) == []
