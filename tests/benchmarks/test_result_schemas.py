"""Every bench on the shared runner writes results with the keys and nesting of the committed
``benchmarks/results/*.json``: each bench runs on tiny, cheap settings (the fixture model, a few
prompts, one or two steps) and its JSON is held against the committed file of the same bench.

Compared (:func:`shape_problems`), all the way down: the keys of every object — the document's
exactly, a row's exactly and in order, any other object's at least (it may gain keys the committed
file predates: a config field added since) — except the objects keyed by data (:data:`DATA_KEYED`:
budgets, labels, worlds), whose values are each held against the committed ones; the kind of
every value (object, list, number, string, boolean); *every* element of a list, each against the committed element it matches best
(a list may mix kinds of entries: chain and tree phases); ``null`` only where the committed file
has ``null`` too (a figure it did not measure) or where a tiny run cannot measure it
(:data:`NULLABLE`); and no empty list where the committed one has entries (``rows: []`` is a
failure), but where a tiny run has none to write (:data:`MAY_BE_EMPTY`); a key missing only where a
tiny run does not measure it (:data:`MAY_LACK`). ``provenance`` is left to
``test_provenance.py`` (a committed file made before a field was recorded lacks it)."""

from __future__ import annotations

import io
import json
import re
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
#: Objects whose keys are data, not schema: labels, budgets, worlds (path patterns: ``*`` is any
#: text within one key, ``[*]`` any list index). A tiny run has fewer of them.
DATA_KEYED: tuple[str, ...] = (
    "/summary", "/compare", "/models", "/start", "/checks/reuse_on_off_same_forests", "/targets/world *",
    "/targets/world */tool_calls_per_traj_start_end", "/step_costs", "/equal_cost", "/equal_cost/*/equal_tokens",
    "/equal_cost/*/equal_tokens/*", "/equal_cost/*/equal_tool_calls", "/equal_cost/*/equal_tool_calls/*",
    "/equal_cost/*/headline", "/equal_cost/*/headline/*", "/equal_cost/*/targets", "/table[*]/em_after_by_seed",
)  # fmt: skip
#: Where a tiny run may write ``null`` though the committed file has a value: a config field left
#: unset, the fixture model is no bootstrapped agent (no config hash, no bootstrap record), and it calls no tool (no
#: tool-call fractions or ratios); `bench peers` refuses a ratio when the untrained fixture does not stop alike on both sides.
NULLABLE: tuple[str, ...] = (
    "/config/*", "/settings/treegrpo_config/*", "/model/config_hash", "/models/*/config_hash",
    "/models/*/code_fingerprint", "/models/*/bootstrap", "/models/*/demos", "/models/*/warmup_eval",
    "/phases[*]/tool_fraction_expected",
    "/phases[*]/tool_fraction_measured", "/phases[*]/tool_calls_per_traj_ratio_expected",
    "/targets/*.tool_calls_per_traj_ratio/measured", "/targets/*.tool_calls_per_traj_ratio/pass",
    "/checks/targets/*/ratio", "/checks/targets/*/spread", "/checks/targets/*/met", "/checks/reported/*/ratio",
    "/checks/reported/*/spread",
)  # fmt: skip
#: Where a tiny run may write an empty list though the committed one has entries.
MAY_BE_EMPTY: tuple[str, ...] = ()
#: Keys a tiny run may lack: ``bench real``'s per-mode step costs (the test measures one mode); the
#: equal-cost ablation and paper headline (a tiny run has budget 2 only); the record of a committed
#: nominal table restated at equal cost after it was made (``restate_at_equal_cost``).
MAY_LACK: tuple[str, ...] = (
    "/checks/peak_rss_*", "/equal_cost/*/ablation", "/equal_cost/*/paper_headline", "/equal_cost_restated",
)  # fmt: skip
#: Config fields whose kind changed since a committed file was written: ``reward`` became a list of
#: reward names (several reward functions, issue 31); a committed file may hold the one name.
RETYPED: dict[str, tuple[str, str]] = {"/config/reward": ("list", "str"), "/settings/treegrpo_config/reward": ("list", "str")}


def _kind(x: Any) -> str:
    if isinstance(x, bool):
        return "bool"
    if isinstance(x, int | float):
        return "number"
    return next((k.__name__ for k in (str, dict, list) if isinstance(x, k)), type(x).__name__)


def _at(path: str, patterns: tuple[str, ...]) -> bool:
    """Whether ``path`` matches one of ``patterns`` (:data:`DATA_KEYED`)."""
    generic = re.sub(r"\[\d+\]", "[*]", path)
    for p in patterns:
        parts = [re.escape(x).replace(r"\*", "[^/]*") for x in p.split("[*]")]
        if re.fullmatch(re.escape("[*]").join(parts), generic):
            return True
    return False


def _best(new: Any, olds: list[Any], path: str, entry: bool = False) -> list[str]:
    """The problems of ``new`` against the committed element it matches best: for an object, one
    with the most keys in common, then the fewest problems."""

    def rank(o: Any) -> tuple[int, int]:
        apart = len(set(new) ^ set(o)) if isinstance(new, dict) and isinstance(o, dict) else 0
        return apart, len(shape_problems(new, o, path, entry))

    return shape_problems(new, min(olds, key=rank), path, entry)


def shape_problems(new: Any, old: Any, path: str = "", entry: bool = False) -> list[str]:
    """Where ``new`` differs from ``old`` in keys, kinds of value, nulls or empty lists (module
    docstring). ``entry``: ``new`` is an element of a list, whose keys must be exactly the
    committed element's."""
    where = path or "/"
    if old is None:  # the committed file did not measure it
        return []
    if new is None:
        return [] if _at(path, NULLABLE) else [f"{where}: null where the committed file has {_kind(old)}"]
    if _kind(new) != _kind(old) and RETYPED.get(path) != (_kind(new), _kind(old)):
        return [f"{where}: {_kind(new)} where the committed file has {_kind(old)}"]
    out: list[str] = []
    if isinstance(old, dict):
        if _at(path, DATA_KEYED):
            for k, v in new.items():  # the committed value of the same key, else the best match
                if k in old:
                    out += shape_problems(v, old[k], f"{path}/{k}")
                elif old:
                    out += _best(v, list(old.values()), f"{path}/{k}")
            return out
        keys = set(old) | set(new) if path else (set(old) | set(new)) - {"provenance"}
        out += [f"{where}: key {k!r} missing" for k in sorted(keys - set(new)) if not _at(f"{path}/{k}", MAY_LACK)]
        if not path or entry:  # any other object may gain keys the committed file predates, never lose one
            out += [f"{where}: new key {k!r}" for k in sorted(keys - set(old))]
        for k in sorted(keys & set(old) & set(new)):
            out += shape_problems(new[k], old[k], f"{path}/{k}")
    elif isinstance(old, list):
        if not new and old and not _at(path, MAY_BE_EMPTY):
            out.append(f"{where}: empty where the committed file has {len(old)} entries")
        if path.endswith("/rows") and old and all(isinstance(r, dict) for r in (*old, *new)):
            keys = list(old[0])  # a table's rows: the same keys, in the same order
            out += [f"{path}[{i}]: keys {list(r)} != {keys}" for i, r in enumerate(new) if list(r) != keys]
        if old:
            for i, e in enumerate(new):
                out += _best(e, old, f"{path}[{i}]", entry=True)
    return out


#: The committed token-matched tables (``bench learn --matched tokens``).
TOKENS_RESULTS = ("learn_tokens_rare3.json", "learn_tokens_default.json")


def committed(name: str) -> dict[str, Any]:
    return json.loads((RESULTS / name).read_text())


def test_shape_problems_finds_a_renamed_key_and_a_changed_kind() -> None:
    old = {"rows": [{"a": 1, "b": "x"}], "meta": {"n": 1, "t": [1.0]}}
    assert (
        shape_problems({"rows": [{"a": 2, "b": "y"}], "meta": {"n": 2, "t": [2.0, 3]}, "provenance": {}}, old) == []
    )
    assert shape_problems({"rows": [{"a": 2, "c": "y"}], "meta": {"n": 1, "t": [1]}}, old) == [
        "/rows[0]: keys ['a', 'c'] != ['a', 'b']",
        "/rows[0]: key 'b' missing",
        "/rows[0]: new key 'c'",
    ]
    assert shape_problems({"rows": [{"a": 2, "b": "y"}], "meta": {"n": "1", "t": [1]}}, old) == [
        "/meta/n: str where the committed file has number"
    ]
    assert shape_problems({"meta": {"n": 1, "t": [1]}}, old) == ["/: key 'rows' missing"]


def test_shape_problems_is_strict_where_it_used_to_match_anything(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every element of a list, not the first; no null for a value; no empty list for entries; a
    nested object's keys too; an object keyed by data compared value by value."""
    old = {"rows": [{"a": 1, "b": "x"}], "meta": {"n": 1, "t": [1.0]}, "by_budget": {"2": {"em": 0.5}}}
    ok = {"rows": [{"a": 2, "b": "y"}], "meta": {"n": 2, "t": [2.0]}, "by_budget": {"2": {"em": 0.1}}}
    monkeypatch.setattr(f"{__name__}.DATA_KEYED", ("/by_budget",))
    assert shape_problems(ok, old) == []
    assert _at("/targets/world 0", ("/targets/world *",)) and not _at("/targets/world 0/x", ("/targets/world *",))
    assert _at("/phases[3]/f", ("/phases[*]/f",)) and not _at("/phases/f", ("/phases[*]/f",))
    assert shape_problems({**ok, "rows": [{"a": 2, "b": "y"}, {"a": "2", "b": "y"}]}, old) == [
        "/rows[1]/a: str where the committed file has number"  # the second row is checked too
    ]
    assert shape_problems({**ok, "meta": {"n": None, "t": [2.0, None]}}, old) == [
        "/meta/n: null where the committed file has number",
        "/meta/t[1]: null where the committed file has number",
    ]
    assert shape_problems({**ok, "rows": []}, old) == ["/rows: empty where the committed file has 1 entries"]
    assert shape_problems({**ok, "meta": {"t": [2.0]}}, old) == ["/meta: key 'n' missing"]
    assert shape_problems({**ok, "meta": {"n": 2, "t": [2.0], "extra": 1}}, old) == []  # a field added since
    assert shape_problems({**ok, "extra": 1}, old) == ["/: new key 'extra'"]
    assert shape_problems({**ok, "by_budget": {"4": {"em": 0.2}, "8": {"em": "x"}}}, old) == [
        "/by_budget/8/em: str where the committed file has number"  # other budgets: each value checked
    ]
    # a list may mix kinds of entries: each is held against the committed entry it matches best
    mixed = {"phases": [{"mode": "chain"}, {"mode": "tree", "picks": 3}]}
    assert shape_problems({"phases": [{"mode": "tree", "picks": 1}, {"mode": "chain"}]}, mixed) == []
    assert shape_problems({"phases": [{"mode": "tree", "pick": 1}]}, mixed) == ["/phases[0]: new key 'pick'"]
    assert shape_problems({"phases": [{"mode": "tree", "picks": "3"}]}, mixed) == [
        "/phases[0]/picks: str where the committed file has number"  # held against the tree entry
    ]
    # where a tiny run cannot measure a figure or has no entries, the patterns allow it
    monkeypatch.setattr(f"{__name__}.NULLABLE", ("/meta/t[*]",))
    monkeypatch.setattr(f"{__name__}.MAY_BE_EMPTY", ("/rows",))
    assert shape_problems({**ok, "rows": [], "meta": {"n": 2, "t": [None]}}, old) == []
    assert shape_problems({**ok, "meta": {"n": None, "t": [1.0]}}, old) == ["/meta/n: null where the committed file has number"]


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


@pytest.mark.parametrize("name", TOKENS_RESULTS)
def test_learn_tokens_schema(tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    from treegrpo.benchmarks import learn

    _tiny_regime(monkeypatch, tiny_model_dir)
    monkeypatch.setattr("treegrpo.benchmarks.learn_spec.TOKEN_EVAL_PER_BUDGET", 20)
    doc = learn.run_bench(
        tmp_path / "t.json", regime="test", seeds=1, jobs=1, expand_modes=("random",), budgets=(2,), matched="tokens"
    )
    assert shape_problems(doc, committed(name)) == []


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
