"""``bench real --table`` end to end on SmolLM2 cut to 2 layers (tiny sizes): the paired runs, the
rows as ``bench learn`` writes them plus the table's keys, the paired differences, the plot, the
resume (a finished run is reused, a changed setting is a new run); ``paired`` on hand-made rows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from treegrpo.benchmarks.equal_cost import analyse
from treegrpo.benchmarks.learn_spec import ROW_KEYS
from treegrpo.benchmarks.real_table import EXTRA_KEYS, TableSpec, paired, run_folder, run_table
from treegrpo.errors import ConfigError
from treegrpo.tree import read_forests

LIMITS = {"max_turns": 1, "max_step_tokens": 16, "max_obs_tokens": 64, "max_context_tokens": 512}


def _forests(run_dir: Path) -> list[list[Any]]:
    return [read_forests(f) for f in sorted((run_dir / "rollouts").glob("step_*.jsonl"))]


def trained_on(run_dir: Path) -> list[str]:
    """Every step's prompt ids, as the trainer logged them (``rollout/prompt_ids``)."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [i for m in rows if "rollout/prompt_ids" in m for i in m["rollout/prompt_ids"]]


def forest_prompts(run_dir: Path) -> list[str]:
    """Every step's forests' prompt ids, in order (the run dumped every step)."""
    return [f.prompt_id for fs in _forests(run_dir) for f in fs]


def informative(run_dir: Path) -> list[float]:
    """Per step, the fraction of its forests whose leaves' rewards are not all equal."""
    return [sum(len({leaf.reward for _, leaf in f.leaves()}) > 1 for f in fs) / len(fs) for fs in _forests(run_dir)]


def test_table_runs_pairs_and_resumes(smollm2_2layer_dir: Path, tmp_path: Path) -> None:
    spec = TableSpec(
        model=str(smollm2_2layer_dir), budgets=(2,), seeds=(0,), steps=2, prompts_per_step=2, eval_prompts=2,
        overrides=LIMITS | {"dump_rollouts_every": 1},
    )  # fmt: skip
    out, said = tmp_path / "table.json", []
    res = run_table(spec, tmp_path / "work", out, said.append)
    assert json.loads(out.read_text()) == json.loads(json.dumps(res)) and out.with_suffix(".png").stat().st_size > 0
    rows = res["rows"]
    assert [(r["mode"], r["seed"], r["M"], r["N"], r["L"]) for r in rows] == [("chain", 0, 2, 0, 0), ("tree", 0, 1, 2, 1)]
    assert all(tuple(r) == ROW_KEYS + EXTRA_KEYS for r in rows)
    assert len(res["eval_ids"]) == 2 and all(r["eval_prompts"] == 2 for r in rows)
    chain, tree = rows  # a pair: the same prompts, the same start
    for r in rows:  # each run's row holds what that run trained on: every step's prompts, in order
        assert r["prompt_ids"] == trained_on(Path(r["run_dir"])) == forest_prompts(Path(r["run_dir"]))
    assert chain["prompt_ids"] == tree["prompt_ids"] and len(chain["prompt_ids"]) == 4
    assert chain["em_start"] == tree["em_start"] == res["eval_start"]["eval/success_sampled"]
    assert chain["trajectories"] == 2 * 2 * 2 and tree["trajectories"] >= 2 * 2 * 2 and chain["generated_tokens"] > 0
    for r in rows:  # one fraction per step: the prompts whose leaves disagree, counted on its forests
        steps = [json.loads(x) for x in (Path(r["run_dir"]) / "metrics.jsonl").read_text().splitlines()][1:]
        assert r["informative_groups"] == [round(m["rollout/informative_groups"], 4) for m in steps]
        assert r["informative_groups"] == [round(x, 4) for x in informative(Path(r["run_dir"]))]
        assert len(r["informative_groups"]) == spec.steps
    pair = res["paired"]["2"]["pairs"][0]
    assert pair["seed"] == 0 and pair["diff_sampled"] == tree["em_end"] - chain["em_end"]
    assert pair["generated_tokens_ratio"] == tree["generated_tokens"] / chain["generated_tokens"]
    assert all(not (Path(r["run_dir"]) / "checkpoint.prev").exists() for r in rows)  # a finished run keeps one
    for r in rows:  # by default only the last step's forests are kept: the order does not need the rest
        (Path(r["run_dir"]) / "rollouts" / "step_00001.jsonl").unlink()
    said.clear()  # resumed: every run and the start evaluation are reused
    again = run_table(spec, tmp_path / "work", out, said.append)
    assert again["rows"] == rows and said[0].startswith("start evaluation: reusing") and len(said) == 2
    assert [Path(r["run_dir"]) for r in rows] == [run_folder(spec, r, tmp_path / "work") for r in spec.runs()]


def test_jobs_schedule_the_runs_and_change_nothing_else(smollm2_2layer_dir: Path, tmp_path: Path) -> None:
    """``jobs=2``: the runs train in two processes at once; every row is the one the same table
    makes one run after the other (timings and folders aside), and the run folders are the same
    names (``jobs`` is in no digest), so either can resume the other."""
    import dataclasses

    one = TableSpec(model=str(smollm2_2layer_dir), budgets=(2,), seeds=(0,), steps=1, prompts_per_step=2, eval_prompts=2, overrides=LIMITS)
    two = dataclasses.replace(one, jobs=2)
    a = run_table(one, tmp_path / "a", tmp_path / "a.json", lambda _: None)
    b = run_table(two, tmp_path / "b", tmp_path / "b.json", lambda _: None)
    skip = {"wall_s", "rollout_s", "update_s", "run_dir"}
    assert [{k: v for k, v in r.items() if k not in skip} for r in b["rows"]] == [{k: v for k, v in r.items() if k not in skip} for r in a["rows"]]
    assert [Path(r["run_dir"]).name for r in b["rows"]] == [Path(r["run_dir"]).name for r in a["rows"]]
    assert b["spec"]["jobs"] == 2 and b["paired"] == a["paired"]
    with pytest.raises(ConfigError, match="jobs"):
        TableSpec(model="m", jobs=0)


def test_another_setting_is_another_run_folder(tmp_path: Path) -> None:
    spec = TableSpec(model="m", budgets=(2, 4), seeds=(0, 1))
    folders = {run_folder(spec, r, tmp_path) for r in spec.runs()}
    assert len(folders) == 8  # every run of the table has its own folder
    for change in ({"steps": 5}, {"lr": 2e-5}, {"overrides": {"lora_rank": 8}}, {"model": "other"}):
        other = TableSpec(**{**spec.__dict__, **change})
        assert folders.isdisjoint(run_folder(other, r, tmp_path) for r in other.runs()), change
    assert folders == {run_folder(TableSpec(**spec.__dict__), r, tmp_path) for r in spec.runs()}


def _row(mode: str, seed: int, em: float, greedy: float, tokens: int, ids: list[str]) -> dict[str, Any]:
    return {
        "mode": mode, "budget": 2, "seed": seed, "em_end": em, "em_greedy_end": greedy, "generated_tokens": tokens,
        "tool_calls": tokens // 10, "trajectories": 4 if mode == "chain" else 6, "prompt_ids": ids,
    }  # fmt: skip


def test_paired_differences_by_hand() -> None:
    rows = [
        _row("chain", 0, 0.50, 0.60, 1000, ["a"]), _row("tree", 0, 0.75, 0.55, 1200, ["a"]),
        _row("chain", 1, 0.40, 0.50, 800, ["b"]), _row("tree", 1, 0.45, 0.70, 1000, ["b"]),
    ]  # fmt: skip
    p = paired(rows)["2"]
    assert [q["diff_sampled"] for q in p["pairs"]] == pytest.approx([0.25, 0.05], abs=1e-12)
    assert p["diff_sampled"]["mean"] == pytest.approx(0.15, abs=1e-12)
    assert p["diff_sampled"]["sd"] == pytest.approx(0.1414213562373095, abs=1e-12)  # sqrt(2 * 0.1² / 1)
    assert p["diff_greedy"]["min"] == pytest.approx(-0.05, abs=1e-12) and p["diff_greedy"]["max"] == pytest.approx(0.2)
    assert p["generated_tokens_ratio"]["mean"] == pytest.approx((1.2 + 1.25) / 2, abs=1e-12)
    assert p["trajectories_ratio"]["mean"] == pytest.approx(1.5, abs=1e-12) and p["tree_wins_sampled"] == 2
    rows[1]["prompt_ids"] = ["z"]
    with pytest.raises(ValueError, match="different prompts"):
        paired(rows)


@pytest.mark.parametrize(("field", "value", "message"), [("budgets", (3,), "paper's budgets"), ("seeds", (), "seed")])
def test_table_spec_names_a_bad_setting(field: str, value: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TableSpec(model="m", **{field: value})


@pytest.mark.parametrize(("name", "budgets", "seeds"), [("real_table", {2, 4}, 2), ("real_table_budget2", {2}, 5)])
def test_the_committed_table_is_whole_and_consistent(name: str, budgets: set[int], seeds: int) -> None:
    """benchmarks/results/real_table*.json: every budget × seed × sampler, the rows' keys, pairs that
    saw the same prompts (every step's), and ``paired`` recomputed from the rows."""
    res = json.loads((Path(__file__).parents[2] / "benchmarks" / "results" / f"{name}.json").read_text())
    rows, spec = res["rows"], res["spec"]
    assert all(tuple(r) == ROW_KEYS + EXTRA_KEYS for r in rows)
    cells = {(r["budget"], r["seed"], r["mode"]) for r in rows}
    assert cells == {(b, s, m) for b in spec["budgets"] for s in spec["seeds"] for m in ("chain", "tree")}
    assert len(spec["seeds"]) >= seeds and set(spec["budgets"]) >= budgets and len(res["eval_ids"]) >= 128
    for r in rows:
        assert r["eval_prompts"] == len(res["eval_ids"]) and len(r["informative_groups"]) == spec["steps"]
        assert len(r["prompt_ids"]) == spec["steps"] * spec["prompts_per_step"]
    assert paired(rows) == res["paired"]  # which also checks that each pair saw the same prompts
    c = res["compute_s"]
    assert c["runs"] == round(sum(r["wall_s"] for r in rows), 2) and c["total"] == round(c["start_eval"] + c["runs"], 2)


def test_token_matched_table(smollm2_2layer_dir: Path, tmp_path: Path) -> None:
    """``--matched tokens``: the tree is token-matched, both runs evaluated at token checkpoints,
    the rows carry the token keys, the pair is compared at equal cost, the start probe is kept."""
    from treegrpo.benchmarks.real_table import TOKEN_KEYS

    spec = TableSpec(
        model=str(smollm2_2layer_dir), budgets=(2,), seeds=(0,), steps=2, prompts_per_step=2, eval_prompts=2,
        matched="tokens", eval_every_tokens=8, probe_prompts=2, overrides=LIMITS,
    )  # fmt: skip
    said: list[str] = []
    res = run_table(spec, tmp_path / "work", tmp_path / "t.json", said.append)
    chain, tree = res["rows"]
    assert all(tuple(r) == ROW_KEYS + EXTRA_KEYS + TOKEN_KEYS for r in res["rows"])
    assert tree["budget_tokens"] == "chain:2" and chain["budget_tokens"] is None and tree["eval_every_tokens"] == 8
    assert all(r["em_curve"][-1][0] == r["generated_tokens"] and r["tool_curve"][-1][0] == r["tool_calls"] for r in res["rows"])
    assert res["equal_cost"]["world 0"]["equal_tokens"]["2"]["random"]["pairs"] == 1
    probe = res["start_probe"]
    assert set(probe) >= {"chain 2", "tree (1,2) random tokens=chain 2"} and probe["chain 2"]["prompts"] == 2
    assert probe["chain 2"]["leaves_per_prompt"] == 2 and 0 <= probe["chain 2"]["informative"] <= 1
    said.clear()
    run_table(spec, tmp_path / "work", tmp_path / "t.json", said.append)
    assert any(x.startswith("start probe: reusing") for x in said)


def _fake_rollouts(rewards_of: Any, calls: list[Any]) -> Any:
    """A stand-in for the start's rollouts: ten training questions q0..q9, hand-made rewards."""
    from types import SimpleNamespace

    def fake(spec: TableSpec, work: Path, tasks_of: Any, samplers: list[tuple[str, Any]]) -> dict[str, Any]:
        tasks = tasks_of(SimpleNamespace(train_tasks=[SimpleNamespace(id=f"q{i}") for i in range(10)]))
        calls.append([(label, c.name, c.group_size) for label, c in samplers])
        return {label: {"rewards": {t.id: rewards_of(t.id) for t in tasks}, "generated_tokens": 40 * len(tasks),
                        "prompts": len(tasks)} for label, _ in samplers}  # fmt: skip

    return fake


def test_select_pool_keeps_the_questions_the_start_is_unsure_of(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--select-prompts``: every candidate sampled SELECT_SAMPLES times (a chain group); the pool is
    the candidates whose samples disagree, in the draw's order; kept in the work folder and reused."""
    from treegrpo.benchmarks import real_table

    def rewards(qid: str) -> list[float]:  # q0, q3, q6, q9 always solved; q1, q4, q7 never; q2, q5, q8 once in 4
        i = int(qid[1:])
        return [1.0] * 4 if i % 3 == 0 else [0.0] * 4 if i % 3 == 1 else [1.0, 0.0, 0.0, 0.0]

    calls: list[Any] = []
    monkeypatch.setattr(real_table, "_rollout_from_start", _fake_rollouts(rewards, calls))
    spec, said = TableSpec(model="m", select_prompts=10), []
    sel = real_table.select_pool(spec, tmp_path, said.append)
    assert sel is not None and calls == [[("select", "chain", real_table.SELECT_SAMPLES)]]
    assert sorted(sel["candidates"]) == [f"q{i}" for i in range(10)]  # all ten, in a fixed shuffled order
    assert sel["pool"] == [i for i in sel["candidates"] if i in {"q2", "q5", "q8"}]
    assert sel["success"]["q2"] == 0.25 and sel["kept_fraction"] == pytest.approx(0.3, abs=1e-12)
    assert sel["start_success"] == pytest.approx((4 * 1.0 + 3 * 0.25) / 10, abs=1e-12)
    assert sel["pool_success"] == pytest.approx(0.25, abs=1e-12)
    said.clear()
    assert real_table.select_pool(spec, tmp_path, said.append) == json.loads(json.dumps(sel))  # kept, reused
    assert len(calls) == 1 and said[0].startswith("training pool: reusing")
    assert real_table.select_pool(TableSpec(model="m"), tmp_path, said.append) is None  # 0: no selection
    monkeypatch.setattr(real_table, "_rollout_from_start", _fake_rollouts(lambda q: [0.0] * 4, calls))
    with pytest.raises(ConfigError, match="agree on every candidate"):
        real_table.select_pool(TableSpec(model="other", select_prompts=10), tmp_path, said.append)


def test_the_runs_train_only_on_the_pool(smollm2_2layer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a training pool both runs of a pair draw every step's prompts from it (the trainer's own
    record), the pool is in the results and in the runs' folder names, and the table's cost counts it."""
    from treegrpo.benchmarks import real_table
    from treegrpo.training.config import TrainConfig

    spec = TableSpec(model=str(smollm2_2layer_dir), budgets=(2,), seeds=(0,), steps=2, prompts_per_step=2,
                     eval_prompts=2, select_prompts=40, overrides=LIMITS)  # fmt: skip
    ids = real_table.train_prompt_ids(spec)
    pool = [ids[7], ids[3], ids[11]]
    monkeypatch.setattr(real_table, "select_pool", lambda *a: {"pool": pool, "wall_s": 2.5})
    res = run_table(spec, tmp_path / "work", tmp_path / "t.json", [].append)
    chain, tree = res["rows"]
    assert chain["prompt_ids"] == tree["prompt_ids"] and len(chain["prompt_ids"]) == 4
    assert set(chain["prompt_ids"]) <= set(pool)
    for r in res["rows"]:
        assert r["prompt_ids"] == trained_on(Path(r["run_dir"]))
    assert res["selection"]["pool"] == pool and res["compute_s"]["selection"] == 2.5
    c = res["compute_s"]
    assert c["total"] == pytest.approx(c["start_eval"] + c["selection"] + c["runs"], abs=0.02)
    runs = spec.runs()
    assert [Path(r["run_dir"]) for r in res["rows"]] == [run_folder(spec, r, tmp_path / "work", pool) for r in runs]
    assert all(run_folder(spec, r, tmp_path / "work", pool) != run_folder(spec, r, tmp_path / "work") for r in runs)
    with pytest.raises(ConfigError, match="does not hold"):
        real_table._pooled_parts(TrainConfig(**spec.config(runs[0], str(tmp_path / "x"))), ["nope"])


def test_start_rollouts_go_in_chunks(smollm2_2layer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The selection's rollouts from the start run ROLLOUT_CHUNK questions per sampler call (64
    questions × 4 samples in one batch did not fit in memory on SmolLM2-135M), and still cover
    every candidate with SELECT_SAMPLES leaves, the tokens summed over the calls."""
    from treegrpo.benchmarks import real_table
    from treegrpo.rollout import samplers
    from treegrpo.rollout.sampling import SamplerConfig

    sizes: list[int] = []
    tokens: list[int] = []
    chain = samplers.get_sampler("chain")

    def spy(runner: Any, tasks: list[Any], *rest: Any) -> Any:
        sizes.append(len(tasks))
        res = chain(runner, tasks, *rest)
        tokens.append(res.total().generated_tokens)
        return res

    monkeypatch.setattr(real_table, "ROLLOUT_CHUNK", 2)
    monkeypatch.setattr(samplers, "get_sampler", lambda name: spy)
    spec = TableSpec(model=str(smollm2_2layer_dir), eval_prompts=2, overrides=LIMITS)
    ids: list[str] = []

    def five(parts: Any) -> list[Any]:
        ids.extend(t.id for t in parts.train_tasks[:5])
        return parts.train_tasks[:5]

    out = real_table._rollout_from_start(spec, tmp_path, five, [("select", SamplerConfig("chain", 4))])["select"]
    assert sizes == [2, 2, 1] and out["prompts"] == 5 and out["generated_tokens"] == sum(tokens) > 0
    assert list(out["rewards"]) == ids and all(len(r) == 4 for r in out["rewards"].values())


def test_the_committed_token_table_is_whole_and_consistent() -> None:
    """benchmarks/results/real_table_tokens.json (SmolLM2 at equal tokens, issue 35 item 4): budget 2,
    ≥ 3 seeds, ≥ 128 held-out questions; every run trained only on the selected pool, each pair on
    the same prompts; the pool is the candidates whose start samples disagree; the trees are
    token-matched to chain 2; every curve ends at its run's totals; ``paired`` and ``equal_cost``
    recomputed from the rows; the compute adds up."""
    from treegrpo.benchmarks.real_table import SELECT_SAMPLES, TOKEN_KEYS

    res = json.loads((Path(__file__).parents[2] / "benchmarks" / "results" / "real_table_tokens.json").read_text())
    rows, spec, sel, probe = res["rows"], res["spec"], res["selection"], res["start_probe"]
    assert spec["matched"] == "tokens" and spec["budgets"] == [2] and len(spec["seeds"]) >= 3 and len(res["eval_ids"]) >= 128
    assert all(tuple(r) == ROW_KEYS + EXTRA_KEYS + TOKEN_KEYS for r in rows)
    assert {(r["seed"], r["mode"]) for r in rows} == {(s, m) for s in spec["seeds"] for m in ("chain", "tree")}
    pool = set(sel["pool"])
    assert sel["pool"] == [i for i in sel["candidates"] if 0 < sel["success"][i] < 1]  # the unsure ones, in order
    assert all(v * SELECT_SAMPLES == round(v * SELECT_SAMPLES) for v in sel["success"].values())
    assert sel["kept_fraction"] == pytest.approx(len(pool) / len(sel["candidates"]), abs=1e-12)
    for r in rows:
        assert set(r["prompt_ids"]) <= pool and len(r["prompt_ids"]) == spec["steps"] * spec["prompts_per_step"]
        assert r["em_curve"][0] == [0, r["em_start"]] and r["em_curve"][-1] == [r["generated_tokens"], r["em_end"]]
        assert r["tool_curve"][-1] == [r["tool_calls"], r["em_end"]] and len(r["informative_groups"]) == spec["steps"]
        assert r["budget_tokens"] == ("chain:2" if r["mode"] == "tree" else None)
    assert paired(rows) == res["paired"]
    assert json.loads(json.dumps(analyse(rows, ["random"]))) == res["equal_cost"]
    assert {"chain 2", "tree (1,2) random tokens=chain 2"} <= set(probe)
    assert all(0 <= probe[k]["informative"] <= 1 and probe[k]["prompts"] == spec["probe_prompts"] for k in ("chain 2", "tree (1,2) random tokens=chain 2"))
    c = res["compute_s"]
    assert c["runs"] == round(sum(r["wall_s"] for r in rows), 2)
    assert c["total"] == pytest.approx(c["start_eval"] + c["start_probe"] + c["selection"] + c["runs"], abs=0.02)
