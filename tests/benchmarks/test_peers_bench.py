"""``bench peers`` end to end on SmolLM2 cut to 2 layers: TRL's GRPOTrainer and treegrpo, 1 step per
row, each row in its own process; both sides were given the same prompts (token ids), G, token cap
and lr as each side recorded them; a finished row is reused; the table's medians and checks.

Skipped only where ``trl`` is not installed — and never in CI (``CI=true``), which installs the
``[peers]`` extra (.ci/run)."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest
from test_result_schemas import committed, shape_problems
from typer.testing import CliRunner

from treegrpo.benchmarks.peers import LOSS_PAIRS, ROWS, SPEC_OWNED, PeersSpec, job_config, run_bench
from treegrpo.benchmarks.peers_report import checks, steps_median, summarize
from treegrpo.cli import app
from treegrpo.errors import ConfigError
from treegrpo.models.loader import load_tokenizer

SCHEMA = ("system", "job", "sampler", "steps", "step_wall_s", "generated_tokens", "trained_tokens", "rollout_cpu_s",
          "update_cpu_s", "peak_rss_gb", "em_before", "em_after", "settings")  # fmt: skip
SETTINGS = (
    "model_dir",
    "group_size",
    "max_new_tokens",
    "lr",
    "loss",
    "seed",
    "prompt_ids",
    "versions",
    "threads",
)


def _need_trl() -> None:
    if importlib.util.find_spec("trl") is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("trl is not installed, but CI installs the [peers] extra (.ci/run)")
        pytest.skip("trl not installed (pip install -e '.[peers]')")


def _spec(model: Path) -> PeersSpec:
    return PeersSpec(
        model=str(model), steps=1, eval_prompts=1, prompts_per_step=1, max_new_tokens=12, threads=1, max_turns=1,
        max_obs_tokens=200, max_context_tokens=1024,
    )  # fmt: skip


@pytest.fixture(scope="module")
def bench(smollm2_2layer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    _need_trl()
    tmp = tmp_path_factory.mktemp("peers")
    spec, said = _spec(smollm2_2layer_dir), []
    res = run_bench(spec, tmp / "work", tmp / "peers.json", said.append)
    return {"spec": spec, "tmp": tmp, "res": res, "rows": {r["name"]: r for r in res["rows"]}}


def test_every_row_runs_and_the_results_hold_the_schema(bench: dict[str, Any]) -> None:
    res, rows, out = bench["res"], bench["rows"], bench["tmp"] / "peers.json"
    assert (
        json.loads(out.read_text()) == json.loads(json.dumps(res))
        and out.with_suffix(".png").stat().st_size > 0
    )
    assert set(rows) == set(ROWS)
    # the keys and nesting of the committed results (rows: as the committed row of the same system)
    new, old = json.loads(out.read_text()), committed("peers.json")
    assert shape_problems({**new, "rows": []}, {**old, "rows": []}) == []
    for r in new["rows"]:
        was = next(o for o in old["rows"] if o["system"] == r["system"])
        assert list(r) == list(was) and shape_problems(r, was) == [], r["name"]
    for name, r in rows.items():
        assert all(k in r for k in SCHEMA) and all(k in r["settings"] for k in SETTINGS), name
        assert (r["system"], r["job"], r["sampler"]) == (
            ROWS[name]["system"],
            ROWS[name]["job"],
            ROWS[name]["sampler"],
        )
        assert (
            r["steps"] == 1
            and len(r["step_wall_s"]) == len(r["rollout_cpu_s"]) == len(r["update_cpu_s"]) == 1
        )
        assert r["step_wall_s"][0] > 0 and r["rollout_cpu_s"][0] > 0 and r["update_cpu_s"][0] > 0
        assert 0 < r["generated_tokens"][0] <= r["trajectories"][0] * 12 * 2  # multi-turn: 2 turns of <= 12
        assert r["trained_tokens"][0] > r["generated_tokens"][0] and r["peak_rss_gb"] > 0.1
        assert (
            r["process_peak_rss_gb"] >= r["peak_rss_gb"] * 0.999
        )  # training's high-water mark <= the process's
        assert r["settings"]["model_dir"] == str(bench["spec"].model) and r["settings"]["threads"] == 1
        assert r["settings"]["versions"]["torch"] and r["settings"]["versions"]["transformers"]
    assert rows["single_turn/trl"]["settings"]["versions"]["trl"]
    # the same starting model, one evaluation for every row of a job
    for name, r in rows.items():
        assert r["em_before"] == res["eval_before"][r["job"]]["eval/success_greedy"], name
    assert rows["single_turn/trl"]["eval_after"].keys() == rows["single_turn/chain"]["eval_after"].keys()
    assert [t["name"] for t in res["table"]] == [r["name"] for r in res["rows"]]
    assert {"single_turn_cpu_per_token_ratio", "single_turn_peak_rss_ratio"} <= set(res["checks"])
    assert res["provenance"]["model_hash"].startswith("sha256:") and res["settings"]["differences"]
    shared = res["settings"]["shared"]
    assert shared["single_turn"]["group_size"] == 4 and shared["single_turn"]["max_new_tokens"] == 12
    assert shared["single_turn"]["lr"] == 1e-5 and shared["single_turn"]["threads"] == 1
    assert shared["multi_turn"]["group_size"] == {"multi_turn/chain": 4, "multi_turn/tree_2_2_1": 6}


def test_trl_limits_are_probed_on_the_installed_versions(bench: dict[str, Any]) -> None:
    """What the results state about TRL (no stop strings, no tools with this template, every position
    through its LM head on a CPU) is probed on the installed versions, not assumed."""
    probes = bench["rows"]["single_turn/trl"]["settings"]["probes"]
    assert (
        probes["stop_strings"]["error"].startswith("ValueError")
        and "tokenizer" in probes["stop_strings"]["error"]
    )
    assert probes["tools"]["supports_tool_calling"] is False and "tool calling" in probes["tools"]["error"]
    assert probes["lm_head"]["compact"] is False and probes["lm_head"]["chunk_positions"] >= 1024  # on a CPU
    (not_run,) = bench["res"]["not_run"]
    assert (not_run["system"], not_run["job"], not_run["error"]) == (
        "trl",
        "multi_turn",
        probes["tools"]["error"],
    )


def test_both_sides_got_the_same_prompts_group_cap_and_lr(bench: dict[str, Any]) -> None:
    """Read from what each side recorded (TRL's dumped GRPOConfig, treegrpo's config.json and rollouts)."""
    res, rows = bench["res"], bench["rows"]
    trl, ours = rows["single_turn/trl"], rows["single_turn/chain"]
    tc, oc = trl["settings"]["trl_config"], ours["settings"]["treegrpo_config"]
    assert tc["num_generations"] == oc["group_size"] == 4
    assert tc["max_completion_length"] == oc["max_step_tokens"] == 12
    assert tc["learning_rate"] == oc["lr"] and tc["lr_scheduler_type"] == "constant" == oc["lr_schedule"]
    assert tc["loss_type"] == LOSS_PAIRS[oc["agg_mode"]] and tc["beta"] == oc["kl_coef"] == 0.0
    assert tc["seed"] == oc["seed"] and tc["temperature"] == oc["temperature"] == 1.0
    assert tc["bf16"] is False and oc["dtype"] == "float32" and tc["shuffle_dataset"] is False
    assert trl["trajectories"] == ours["trajectories"] == [4] and trl["groups_same_prompt"]
    # the same prompt token ids, in the same order, as each side fed them to its model
    seen = [[(p["id"], p["ids"]) for p in step] for step in trl["prompts_seen"]]
    assert seen == [[(p["id"], p["ids"]) for p in step] for step in ours["prompts_seen"]]
    assert (
        trl["settings"]["prompt_ids"] == ours["settings"]["prompt_ids"] == [[i for i, _ in s] for s in seen]
    )
    # ... which are the recorded chat messages through the chat template
    tok = load_tokenizer(Path(bench["spec"].model))
    for job in ("single_turn", "multi_turn"):
        recorded = res["prompts"][job]
        texts = [
            tok.apply_chat_template(p["messages"], add_generation_prompt=True, tokenize=False)
            for p in recorded
        ]
        for name in (n for n in rows if rows[n]["job"] == job):
            got = [p for step in rows[name]["prompts_seen"] for p in step]
            assert [p["id"] for p in got] == [p["id"] for p in recorded], name
            assert [p["ids"] for p in got] == [tok.encode(t, add_special_tokens=False) for t in texts], name
    assert "<information>Doc 1(Title:" in res["prompts"]["single_turn"][0]["messages"][0]["content"]
    assert (
        rows["multi_turn/tree_2_2_1"]["settings"]["group_size"]
        == 6
        == rows["multi_turn/tree_2_2_1"]["trajectories"][0]
    )


def test_a_finished_row_is_reused(bench: dict[str, Any]) -> None:
    said: list[str] = []
    again = run_bench(bench["spec"], bench["tmp"] / "work", bench["tmp"] / "again.json", said.append)
    assert sum("reusing" in s for s in said) == len(ROWS) + 1  # every row and the start evaluation
    assert again["rows"] == bench["res"]["rows"]


def test_medians_drop_the_first_step_and_checks_compare_the_rows() -> None:
    assert steps_median([100.0, 3.0, 1.0, 2.0]) == 2.0 and steps_median([7.0]) == 7.0
    base = {
        "sampler": "chain",
        "steps": 3,
        "step_wall_s": [9, 2, 4],
        "peak_rss_gb": 2.0,
        "em_before": 0.0,
        "em_after": 0.5,
    }

    def row(name: str, roll: list[float], upd: list[float], gen: list[int], rss: float) -> dict[str, Any]:
        system, job = ("trl" if name.endswith("trl") else "treegrpo"), name.split("/")[0]
        return {**base, "name": name, "system": system, "job": job, "rollout_cpu_s": roll, "update_cpu_s": upd,
                "generated_tokens": gen, "trained_tokens": [10 * g for g in gen], "computed_tokens": gen,
                "trajectories": [4, 4, 4], "peak_rss_gb": rss}  # fmt: skip

    table = summarize([
        row("single_turn/trl", [50, 4, 6], [50, 6, 6], [10, 10, 12], 4.0),
        row("single_turn/chain", [50, 1, 2], [50, 1, 1], [10, 10, 12], 2.0),
    ])  # fmt: skip
    trl, chain = table
    assert trl["cpu_s_per_generated_token"] == pytest.approx((1.0 + 1.0) / 2)  # steps 2, 3: 10/10, 12/12
    assert chain["cpu_s_per_generated_token"] == pytest.approx((0.2 + 0.25) / 2)  # 2/10, 3/12
    assert (
        trl["generated_tokens_per_cpu_s"] == pytest.approx((10 / 4 + 12 / 6) / 2)
        and trl["step_wall_s"] == 3.0
    )
    assert chain["trajectories_per_1k_tokens"] == pytest.approx((400 + 1000 * 4 / 12) / 2)
    got = checks(table)
    assert (
        got["single_turn_cpu_per_token_ratio"] == pytest.approx(0.225)
        and got["single_turn_cpu_per_token_met"]
    )
    assert got["single_turn_peak_rss_ratio"] == 0.5 and got["single_turn_peak_rss_met"]
    # per trajectory (4 a step): chain (2/4, 3/4), TRL (10/4, 12/4): medians 0.625 and 2.75
    assert got["single_turn_cpu_per_trajectory_ratio"] == pytest.approx(0.625 / 2.75)


def test_job_configs_set_only_what_the_bench_owns(smollm2_2layer_dir: Path, tmp_path: Path) -> None:
    spec = _spec(smollm2_2layer_dir)
    single, multi = job_config(spec, "single_turn", tmp_path), job_config(spec, "multi_turn", tmp_path)
    assert set(single.model_fields_set) | set(multi.model_fields_set) <= {*SPEC_OWNED, "obs_format"}
    assert (single.max_turns, single.prompt_template, multi.max_turns) == (0, "{question}", 1)
    assert single.kl_coef == multi.kl_coef == 0.0 and single.agg_mode == "token-mean"


@pytest.mark.parametrize(
    ("fields", "want"),
    [({"loss": "seq-mean-token-sum"}, "--loss"), ({"rows": ("single_turn/vllm",)}, "--rows"),
     ({"overrides": {"lr": 1.0}}, "--set lr"), ({"group_size": 1}, "--group-size")],
)  # fmt: skip
def test_bad_settings_are_one_line_errors(fields: dict[str, Any], want: str) -> None:
    with pytest.raises(ConfigError, match=want):
        PeersSpec(model="unused", **fields).check()


def test_cli_bad_loss_is_one_line() -> None:
    res = CliRunner().invoke(app, ["bench", "peers", "--model", "unused", "--loss", "nope"])
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and "--loss" in lines[0] and "Traceback" not in res.output
