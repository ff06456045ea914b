"""``bench peers`` end to end on SmolLM2 cut to 2 layers (the multi-turn job on a copy carrying the
``chatml-tools`` template): TRL's GRPOTrainer and treegrpo, 1 step per row, each row in its own
process with the same allocator setting; both sides were given the same prompts (token ids), G,
token cap and lr as each side recorded them; a finished row is reused; the table's medians, the
paired ratios and their refusal when the two sides did not stop alike.

Skipped only where ``trl`` is not installed — and never in CI (``CI=true``), which installs the
``[peers]`` extra (.ci/run)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from test_result_schemas import committed, shape_problems
from typer.testing import CliRunner

from treegrpo.benchmarks.peers import (
    DEFAULT_JOBS,
    LONG_COMPLETION_PROMPT,
    LOSS_PAIRS,
    ROWS,
    SPEC_OWNED,
    PeersSpec,
    job_config,
    run_bench,
)
from treegrpo.benchmarks.peers_figures import REPORTED, TARGETS, checks, steps_median, summarize
from treegrpo.benchmarks.peers_report import (
    DOCS_BEGIN,
    DOCS_END,
    DOCS_LONG_BEGIN,
    DOCS_LONG_END,
    README_PREFIX,
    job_regime,
    markdown,
    readme_row,
)
from treegrpo.cli import app
from treegrpo.errors import ConfigError
from treegrpo.models.loader import load_tokenizer
from treegrpo.rollout.templates import set_chat_template

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
    "malloc_mmap_threshold",
)


def _need_trl() -> None:
    if importlib.util.find_spec("trl") is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("trl is not installed, but CI installs the [peers] extra (.ci/run)")
        pytest.skip("trl not installed (pip install -e '.[peers]')")


def _spec(model: Path, tools_model: Path | None = None) -> PeersSpec:
    return PeersSpec(
        model=str(model), tools_model=str(tools_model) if tools_model else None, steps=1, repeats=1, eval_prompts=1,
        prompts_per_step=1, max_new_tokens=12, threads=1, max_turns=1, max_obs_tokens=200, max_context_tokens=1024,
    )  # fmt: skip


def tools_copy(folder: Path, out: Path) -> Path:
    """``folder`` with the ``chatml-tools`` template (as a ``--protocol tools`` warm-up saves it)."""
    shutil.copytree(folder, out)
    tok = load_tokenizer(out)
    set_chat_template(tok, "chatml-tools")
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def bench(smollm2_2layer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    _need_trl()
    tmp = tmp_path_factory.mktemp("peers")
    tools = tools_copy(smollm2_2layer_dir, tmp / "tools_model")
    spec, said = _spec(smollm2_2layer_dir, tools), []
    res = run_bench(spec, tmp / "work", tmp / "peers.json", said.append)
    return {"spec": spec, "tmp": tmp, "res": res, "rows": {r["name"]: r for r in res["rows"]}}


def test_every_row_runs_and_the_results_hold_the_schema(bench: dict[str, Any]) -> None:
    res, rows, out = bench["res"], bench["rows"], bench["tmp"] / "peers.json"
    assert (
        json.loads(out.read_text()) == json.loads(json.dumps(res))
        and out.with_suffix(".png").stat().st_size > 0
    )
    assert set(rows) == {n for n in ROWS if ROWS[n]["job"] in DEFAULT_JOBS}
    # the keys and nesting of the committed results (rows: as the committed row of the same name)
    new, old = json.loads(out.read_text()), committed("peers.json")
    assert shape_problems({**new, "rows": []}, {**old, "rows": []}) == []
    for r in new["rows"]:
        was = next(o for o in old["rows"] if o["name"] == r["name"])
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
        # per trajectory: 2 turns of <= 12 tokens (multi-turn); TRL's tool loop has no per-turn cap, only its budget
        cap = r["settings"]["max_new_tokens"] if name == "multi_turn/trl" else 24
        assert 0 < r["generated_tokens"][0] <= r["trajectories"][0] * cap
        assert r["trained_tokens"][0] > r["generated_tokens"][0] and r["peak_rss_gb"] > 0.1
        assert (
            r["process_peak_rss_gb"] >= r["peak_rss_gb"] * 0.999
        )  # training's high-water mark <= the process's
        # completion lengths: the model's own tokens per trajectory, consistent with the step's total
        assert 0 < r["completion_len_mean"][0] <= r["completion_len_max"][0] <= cap, name
        assert r["completion_len_mean"][0] * r["trajectories"][0] >= r["generated_tokens"][0] * 0.999 or r["sampler"] == "tree"
        # every phase counted on both sides: prefill and decode in the rollout, positions in the update
        assert all(r[k][0] > 0 for k in ("prefill_positions", "decode_steps", "decode_positions", "update_positions")), name
        assert r["decode_positions"][0] >= r["decode_steps"][0] and r["update_positions"][0] > r["generated_tokens"][0]
        want_model = bench["spec"].tools_model if r["job"] == "multi_turn" else bench["spec"].model
        assert r["settings"]["model_dir"] == str(want_model) and r["settings"]["threads"] == 1
        assert r["settings"]["versions"]["torch"] and r["settings"]["versions"]["transformers"]
        # the same allocator setting in every row's process (glibc reads it at start-up)
        assert r["settings"]["malloc_mmap_threshold"] == str(1 << 20) and r["settings"]["seed"] == 0
    assert rows["single_turn/trl"]["settings"]["versions"]["trl"]
    assert rows["multi_turn/trl"]["tool_calls"][0] >= 0 and rows["multi_turn/chain"]["tool_calls"][0] >= 0
    # the ablations turned off what they say: more prefill without prefix sharing, more update
    # positions without packing (the prompt once per trajectory instead of once per group)
    base = rows["single_turn/chain"]
    assert rows["single_turn/chain_no_sharing"]["prefill_positions"][0] > base["prefill_positions"][0]
    assert rows["single_turn/chain_no_packing"]["update_positions"][0] > base["update_positions"][0]
    # the same starting model, one evaluation for every row of a job
    for name, r in rows.items():
        assert r["em_before"] == res["eval_before"][r["job"]]["eval/success_greedy"], name
    assert rows["single_turn/trl"]["eval_after"].keys() == rows["single_turn/chain"]["eval_after"].keys()
    assert rows["multi_turn/trl"]["eval_after"].keys() == rows["multi_turn/chain"]["eval_after"].keys()
    assert [t["name"] for t in res["table"]] == list(dict.fromkeys(r["name"] for r in res["rows"]))
    assert set(res["checks"]["targets"]) == set(TARGETS) and res["environment"]["MALLOC_MMAP_THRESHOLD_"] == str(1 << 20)
    assert res["provenance"]["model_hash"].startswith("sha256:") and res["settings"]["differences"]
    shared = res["settings"]["shared"]
    assert shared["single_turn"]["group_size"] == 4 and shared["single_turn"]["max_new_tokens"] == 12
    assert shared["single_turn"]["lr"] == 1e-5 and shared["single_turn"]["threads"] == 1
    assert shared["multi_turn"]["group_size"] == {
        "multi_turn/trl": 4, "multi_turn/chain": 4, "multi_turn/tree_2_2_1": 6, "multi_turn/tree_2_2_1_no_sharing": 6,
        "multi_turn/tree_2_2_1_no_packing": 6,
    }  # fmt: skip
    # the single-turn job's warm-up demonstrations: answered in one step, from the job's own prompts
    demos = [json.loads(x) for x in (bench["tmp"] / "work" / "job" / "single_turn_demos.jsonl").read_text().splitlines()]
    assert demos and all(d["steps"] == [f"<answer> {d['answers'][0]} </answer>"] for d in demos)
    assert all(d["answers"][0].lower() in d["question"].lower() for d in demos)


def test_trl_limits_are_probed_on_the_installed_versions(bench: dict[str, Any]) -> None:
    """What the results state about TRL (no stop strings, every position through its LM head on a
    CPU) is probed on the installed versions, not assumed."""
    probes = bench["rows"]["single_turn/trl"]["settings"]["probes"]
    assert (
        probes["stop_strings"]["error"].startswith("ValueError")
        and "tokenizer" in probes["stop_strings"]["error"]
    )
    assert probes["lm_head"]["compact"] is False and probes["lm_head"]["chunk_positions"] >= 1024  # on a CPU


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
    mtrl, mours = rows["multi_turn/trl"]["settings"]["trl_config"], rows["multi_turn/chain"]["settings"]["treegrpo_config"]
    assert mtrl["num_generations"] == mours["group_size"] and mtrl["learning_rate"] == mours["lr"]
    assert mours["protocol"] == "tools" and mtrl["max_tool_calling_iterations"] == mours["max_turns"]
    # the same prompt token ids, in the same order, as each side fed them to its model
    seen = [[(p["id"], p["ids"]) for p in step] for step in trl["prompts_seen"]]
    assert seen == [[(p["id"], p["ids"]) for p in step] for step in ours["prompts_seen"]]
    assert (
        trl["settings"]["prompt_ids"] == ours["settings"]["prompt_ids"] == [[i for i, _ in s] for s in seen]
    )
    # ... which are the recorded chat messages (and tools) through each job's chat template
    for job in ("single_turn", "multi_turn"):
        recorded = res["prompts"][job]
        tok = load_tokenizer(Path(bench["spec"].tools_model if job == "multi_turn" else bench["spec"].model))
        texts = [
            tok.apply_chat_template(p["messages"], tools=p.get("tools"), add_generation_prompt=True, tokenize=False)
            for p in recorded
        ]
        for name in (n for n in rows if rows[n]["job"] == job):
            got = [p for step in rows[name]["prompts_seen"] for p in step]
            assert [p["id"] for p in got] == [p["id"] for p in recorded], name
            assert [p["ids"] for p in got] == [tok.encode(t, add_special_tokens=False) for t in texts], name
    assert "<information>Doc 1(Title:" in res["prompts"]["single_turn"][0]["messages"][0]["content"]
    assert res["prompts"]["multi_turn"][0]["tools"][0]["function"]["name"] == "search"
    assert (
        rows["multi_turn/tree_2_2_1"]["settings"]["group_size"]
        == 6
        == rows["multi_turn/tree_2_2_1"]["trajectories"][0]
    )


def test_a_finished_row_is_reused(bench: dict[str, Any]) -> None:
    said: list[str] = []
    again = run_bench(bench["spec"], bench["tmp"] / "work", bench["tmp"] / "again.json", said.append)
    assert sum("reusing" in s for s in said) == len(bench["rows"]) + 1  # every row and the start evaluation
    assert again["rows"] == bench["res"]["rows"]


def _row(name: str, rep: int, roll: list[float], upd: list[float], gen: list[int], lens: list[float], rss: float,
         em: float = 0.5) -> dict[str, Any]:  # fmt: skip
    system, job = ("trl" if name.endswith("trl") else "treegrpo"), name.split("/")[0]
    return {"name": name, "system": system, "job": job, "sampler": "chain", "steps": 3, "repeat": rep,
            "step_wall_s": [9, 2, 4], "rollout_cpu_s": roll, "update_cpu_s": upd, "generated_tokens": gen,
            "trained_tokens": [10 * g for g in gen], "computed_tokens": gen, "trajectories": [4, 4, 4],
            "completion_len_mean": lens, "completion_len_max": [int(x) + 1 for x in lens],
            "prefill_positions": [100, 100, 100], "decode_steps": [5, 5, 5], "decode_positions": [20, 20, 20],
            "update_positions": [50, 40, 60], "peak_rss_gb": rss, "em_before": 0.0, "em_after": em,
            "settings": {"seed": rep, "threads": 1}}  # fmt: skip


def test_medians_drop_the_first_step_and_repeats_give_median_and_spread() -> None:
    assert steps_median([100.0, 3.0, 1.0, 2.0]) == 2.0 and steps_median([7.0]) == 7.0
    assert steps_median([1.0, None]) is None
    rows = [
        _row("single_turn/trl", 0, [50, 4, 6], [50, 6, 6], [10, 10, 12], [3, 2.5, 3], 4.0),
        _row("single_turn/trl", 1, [50, 8, 8], [50, 8, 8], [10, 16, 16], [3, 4, 4], 5.0),
    ]
    (line,) = summarize(rows)
    # repeat 0: per trajectory (4 a step) steps 2, 3: 10/4, 12/4 -> median 2.75; repeat 1: 16/4 -> 4.0
    assert line["cpu_s_per_trajectory"] == pytest.approx((2.75 + 4.0) / 2)
    assert line["spread"]["cpu_s_per_trajectory"] == pytest.approx([2.75, 4.0])
    assert line["repeats"] == 2 and line["peak_rss_gb"] == 4.5 and line["spread"]["peak_rss_gb"] == [4.0, 5.0]
    # phases: rollout CPU-ms per (prefill + decode) position; update CPU-ms per update position
    # repeat 0: steps 2, 3 -> 4000/120, 6000/120 -> 41.67; repeat 1: 8000/120 -> 66.67
    assert line["rollout_ms_per_position"] == pytest.approx((5000 / 120 + 8000 / 120) / 2)
    # repeat 0: 6000/40, 6000/60 -> median 125; repeat 1: 8000/40, 8000/60 -> 166.67
    assert line["update_ms_per_position"] == pytest.approx((125 + (200 + 8000 / 60) / 2) / 2)
    assert line["completion_len_mean"] == pytest.approx((2.75 + 4.0) / 2) and line["completion_len_max"] == 5
    assert line["em_after_by_seed"] == {"0": 0.5, "1": 0.5}
    # the load: CPU-s per wall-s per thread, steps 2..K: repeat 0: 10/2, 12/4 -> 4.0
    assert line["spread"]["cpu_per_wall"][0] == pytest.approx(4.0)


def test_ratios_are_paired_by_repeat_and_refused_when_the_sides_stopped_differently() -> None:
    trl = [_row("single_turn/trl", 0, [50, 4, 6], [50, 6, 6], [10, 10, 12], [10, 10, 12], 4.0, em=0.5),
           _row("single_turn/trl", 1, [50, 8, 8], [50, 8, 8], [10, 16, 16], [10, 10, 12], 4.0, em=0.25)]  # fmt: skip
    chain = [_row("single_turn/chain", 0, [50, 1, 2], [50, 1, 1], [10, 10, 12], [10, 10, 12], 2.0, em=0.75),
             _row("single_turn/chain", 1, [50, 2, 2], [50, 2, 2], [10, 16, 16], [11, 11, 11], 1.0, em=0.25)]  # fmt: skip
    got = checks(trl + chain)
    cpu = got["targets"]["single_turn_cpu_per_trajectory"]
    # repeat 0: chain (2/4, 3/4) -> 0.625 vs TRL 2.75; repeat 1: chain 4/4 = 1.0 vs TRL 4.0
    assert cpu["per_repeat"] == pytest.approx([0.625 / 2.75, 0.25]) and cpu["refused"] is None
    assert cpu["ratio"] == pytest.approx((0.625 / 2.75 + 0.25) / 2) and cpu["met"] is True
    assert cpu["spread"] == pytest.approx([0.625 / 2.75, 0.25])
    rss = got["targets"]["single_turn_peak_rss"]
    assert rss["per_repeat"] == [0.5, 0.25] and rss["ratio"] == 0.375 and rss["met"] is True
    assert got["targets"]["multi_turn_traj_per_1k"]["met"] is None  # no multi-turn rows
    em = got["em"]["single_turn/chain"]
    assert em["seeds"] == [0, 1] and em["row"] == [0.75, 0.25] and em["trl"] == [0.5, 0.25]
    assert em["diff_mean"] == pytest.approx(0.125) and em["wins"] == 1 and em["ties"] == 1
    # TRL talks past the answer (mean completion 40 tokens vs 11): the ratio is refused, not reported
    long = [{**r, "completion_len_mean": [40, 40, 40]} for r in trl]
    refused = checks(long + chain)["targets"]["single_turn_cpu_per_trajectory"]
    assert refused["ratio"] is None and refused["met"] is None and "differ by" in refused["refused"]
    # within the tolerance (1.3x): reported
    near = [{**r, "completion_len_mean": [13, 13, 13]} for r in trl]
    assert checks(near + chain)["targets"]["single_turn_cpu_per_trajectory"]["ratio"] is not None


def test_job_configs_set_only_what_the_bench_owns(smollm2_2layer_dir: Path, tmp_path: Path) -> None:
    spec = _spec(smollm2_2layer_dir)
    single, multi = job_config(spec, "single_turn", tmp_path), job_config(spec, "multi_turn", tmp_path)
    assert set(single.model_fields_set) | set(multi.model_fields_set) <= {*SPEC_OWNED, "obs_format"}
    assert (single.max_turns, single.prompt_template, multi.max_turns) == (0, "{question}", 1)
    assert (single.protocol, multi.protocol) == ("tags", "tools")
    assert single.kl_coef == multi.kl_coef == 0.0 and single.agg_mode == "token-mean"


def test_a_multi_turn_start_without_a_tool_template_is_one_line(smollm2_2layer_dir: Path, tmp_path: Path) -> None:
    """SmolLM2's own ChatML template renders no tool calls: the bench says which folder and the fix."""
    spec = PeersSpec(model=str(smollm2_2layer_dir), jobs=("multi_turn",), steps=1, repeats=1, eval_prompts=1)
    with pytest.raises(ConfigError, match=r"--model .*tool-calling chat template.*--protocol tools"):
        run_bench(spec, tmp_path / "work", tmp_path / "out.json", lambda _: None)


@pytest.mark.parametrize(
    ("fields", "want"),
    [({"loss": "seq-mean-token-sum"}, "--loss"), ({"rows": ("single_turn/vllm",)}, "--rows"),
     ({"overrides": {"lr": 1.0}}, "--set lr"), ({"overrides": {"packing": "off"}}, "--set packing"),
     ({"group_size": 1}, "--group-size"), ({"repeats": 0}, "--repeats"),
     ({"malloc_mmap_threshold": -1}, "--malloc-mmap-threshold")],
)  # fmt: skip
def test_bad_settings_are_one_line_errors(fields: dict[str, Any], want: str) -> None:
    with pytest.raises(ConfigError, match=want):
        PeersSpec(model="unused", **fields).check()


def test_cli_bad_loss_is_one_line() -> None:
    res = CliRunner().invoke(app, ["bench", "peers", "--model", "unused", "--loss", "nope"])
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and "--loss" in lines[0] and "Traceback" not in res.output


def test_prepare_only_writes_the_single_turn_files_and_the_warmup_command(smollm2_2layer_dir: Path, tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["bench", "peers", "--model", str(smollm2_2layer_dir), "--work", str(tmp_path / "w"),
                                   "--eval-prompts", "4", "--prepare-only"])  # fmt: skip
    assert res.exit_code == 0, res.output
    job = tmp_path / "w" / "job"
    demos = [json.loads(x) for x in (job / "single_turn_demos.jsonl").read_text().splitlines()]
    train = [json.loads(x) for x in (job / "single_turn_train.jsonl").read_text().splitlines()]
    assert len((job / "single_turn_eval.jsonl").read_text().splitlines()) == 4
    # from the training split's last 400 questions, in order, only those whose passages hold the answer
    window = {r["id"]: r for r in train[-400:]}
    assert 0 < len(demos) <= 96 and all(d["id"] in window for d in demos)
    assert all(d["question"] == window[d["id"]]["question"] and d["answers"][0].lower() in d["question"].lower() for d in demos)
    assert [d["id"] for d in demos] == [i for i in window if i in {d["id"] for d in demos}]
    flat = " ".join(res.output.split())
    assert "treegrpo warmup" in flat and "--demos" in flat and str(job / "single_turn_demos.jsonl") in flat


def test_docs_tables_are_the_committed_results(tmp_path: Path) -> None:
    """docs/benchmarks.md's tables and the README's row are what ``--write-docs`` makes from the
    committed peers.json and peers_long.json: regenerated from the JSON, never edited by hand; given
    either file as ``--out``, it reads the other from ``benchmarks/results/``."""
    root = Path(__file__).resolve().parents[2]
    results, long = committed("peers.json"), committed("peers_long.json")
    docs, readme = (root / "docs" / "benchmarks.md").read_text(), (root / "README.md").read_text()
    assert f"{DOCS_BEGIN}\n{markdown(results)}{DOCS_END}" in docs
    assert f"{DOCS_LONG_BEGIN}\n{markdown(long, differences=False)}{DOCS_LONG_END}" in docs
    assert readme_row(results, long) + "\n" in readme
    # --write-docs rewrites a copy in place (and a file without the markers is a one-line error)
    (tmp_path / "docs").mkdir()
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "peers.json").write_text(json.dumps(results))
    (tmp_path / "benchmarks" / "results" / "peers_long.json").write_text(json.dumps(long))
    template = f"intro\n{DOCS_BEGIN}\nold\n{DOCS_END}\nmiddle\n{DOCS_LONG_BEGIN}\nold\n{DOCS_LONG_END}\nafter\n"
    want = (f"intro\n{DOCS_BEGIN}\n{markdown(results)}{DOCS_END}\nmiddle\n{DOCS_LONG_BEGIN}\n"
            f"{markdown(long, differences=False)}{DOCS_LONG_END}\nafter\n")  # fmt: skip
    cwd = os.getcwd()
    try:
        os.chdir(tmp_path)
        for out in ("benchmarks/results/peers.json", "benchmarks/results/peers_long.json"):
            (tmp_path / "docs" / "benchmarks.md").write_text(template)
            (tmp_path / "README.md").write_text(f"| a | b |\n{README_PREFIX} old row |\n")
            res = CliRunner().invoke(app, ["bench", "peers", "--write-docs", "--out", out])
            assert res.exit_code == 0, res.output
            assert (tmp_path / "docs" / "benchmarks.md").read_text() == want, out
            assert (tmp_path / "README.md").read_text() == f"| a | b |\n{readme_row(results, long)}\n", out
        (tmp_path / "docs" / "benchmarks.md").write_text(f"intro\n{DOCS_BEGIN}\nold\n{DOCS_END}\n")  # no long markers
        res = CliRunner().invoke(app, ["bench", "peers", "--write-docs", "--out", "benchmarks/results/peers.json"])
        assert res.exit_code == 2 and "markers" in res.output and "Traceback" not in res.output
    finally:
        os.chdir(cwd)


def test_the_readme_row_states_each_job_and_what_each_ratio_is_against() -> None:
    """Read off the committed peers.json by hand: Tree-GRPO's trajectories per 1k generated tokens
    are set against our chain (TRL 17.8, chain 17.6: the gain is the tree's, not the library's), and
    the single-turn gain is stated with its regime and its source (packing off, our update costs
    what TRL's does)."""
    row = readme_row(committed("peers.json"))
    assert "TRL 17.8, our chain 17.6, Tree-GRPO (2,2,1) 27.9 (1.59× our chain)" in row
    assert "single-turn, 460-token prompts (3 passages), 8–9-token answers, G = 4: our chain 0.26× TRL's CPU-s" in row
    assert "with packing off our update takes 0.96× TRL's CPU-s" in row
    assert "1.57×" not in row  # the old headline: Tree-GRPO over TRL, read as the library's gain
    assert "its fused LM head scoring every prompt position" in row


def _regime_row(name: str, rep: int, prompts: list[list[int]], compact: bool | None) -> dict[str, Any]:
    probes = {} if compact is None else {"probes": {"lm_head": {"compact": compact}}}
    return {"name": name, "job": "single_turn", "system": name.split("/")[1] if "trl" in name else "treegrpo",
            "repeat": rep, "prompts_seen": [[{"id": "q", "ids": [0] * n} for n in step] for step in prompts],
            "settings": probes}  # fmt: skip


def test_job_regime_is_read_off_the_rows() -> None:
    """Per run, the median over steps 2..K of a step's mean prompt length; the median over repeats."""
    rows = [
        _regime_row("single_turn/trl", 0, [[3, 5], [10, 10], [2, 4]], compact=False),  # steps 2, 3: 10, 3 -> 6.5
        _regime_row("single_turn/trl", 1, [[1, 1], [8, 8], [2, 2]], compact=False),  # 8, 2 -> 5.0
        _regime_row("single_turn/chain", 0, [[3, 5], [10, 10], [2, 4]], compact=None),
    ]
    table = [{"name": "single_turn/trl", "job": "single_turn", "completion_len_mean": 9.0, "ablation": None},
             {"name": "single_turn/chain", "job": "single_turn", "completion_len_mean": 8.0, "ablation": None},
             {"name": "single_turn/chain_no_packing", "job": "single_turn", "completion_len_mean": 8.0,
              "ablation": "packing off"}]  # fmt: skip
    got = job_regime({"rows": rows, "table": table, "spec": {"group_size": 4, "max_turns": 4}}, "single_turn")
    assert got["prompt_tokens"] == pytest.approx(5.75) and got["prompt_range"] == [1, 10]
    assert got["completion"] == {"single_turn/trl": 9.0, "single_turn/chain": 8.0}
    assert got["group_size"] == 4 and got["turns"] == "one turn" and got["trl_scores_prompt"] is True


def test_long_completion_job_runs_both_sides_on_the_same_short_prompts(smollm2_2layer_dir: Path, tmp_path: Path) -> None:
    """The opt-in job: the question alone with the long-reasoning instruction (no passages), one
    turn, TRL and our chain on the same prompt ids and cap; its results hold peers_long.json's shape."""
    _need_trl()
    assert PeersSpec(model="unused").jobs == DEFAULT_JOBS == ("single_turn", "multi_turn")
    spec = replace(_spec(smollm2_2layer_dir), jobs=("long_completion",))
    res = run_bench(spec, tmp_path / "work", tmp_path / "long.json", lambda _: None)
    rows = {r["name"]: r for r in res["rows"]}
    assert set(rows) == {"long_completion/trl", "long_completion/chain"}
    texts = [p["messages"][0]["content"] for p in res["prompts"]["long_completion"]]
    assert all(t.startswith(LONG_COMPLETION_PROMPT.split("{", 1)[0]) and "<information>" not in t for t in texts)
    trl, ours = rows["long_completion/trl"], rows["long_completion/chain"]
    assert [[p["ids"] for p in s] for s in trl["prompts_seen"]] == [[p["ids"] for p in s] for s in ours["prompts_seen"]]
    tc, oc = trl["settings"]["trl_config"], ours["settings"]["treegrpo_config"]
    assert tc["max_completion_length"] == oc["max_step_tokens"] == 12 and oc["max_turns"] == 0
    assert set(res["checks"]["reported"]) <= {k for k in REPORTED if k.startswith("long_completion")}
    assert job_regime(res, "long_completion")["turns"] == "one turn"
    new, old = json.loads((tmp_path / "long.json").read_text()), committed("peers_long.json")
    assert shape_problems({**new, "rows": []}, {**old, "rows": []}) == []
    for r in new["rows"]:
        was = next(o for o in old["rows"] if o["name"] == r["name"])
        assert list(r) == list(was) and shape_problems(r, was) == [], r["name"]


def test_more_repeats_reuse_the_finished_ones(smollm2_2layer_dir: Path, tmp_path: Path) -> None:
    """Repeat r runs every row with seed + r, and raising --repeats reruns none of the finished."""
    one = replace(_spec(smollm2_2layer_dir), jobs=("single_turn",), rows=("single_turn/chain",))
    first = run_bench(one, tmp_path / "w", tmp_path / "one.json", lambda _: None)
    said: list[str] = []
    two = run_bench(replace(one, repeats=2), tmp_path / "w", tmp_path / "two.json", said.append)
    assert sum("reusing" in s for s in said) == 2  # the start evaluation and repeat 0
    assert two["rows"][0] == first["rows"][0] and [r["repeat"] for r in two["rows"]] == [0, 1]
    assert [r["settings"]["seed"] for r in two["rows"]] == [0, 1] and two["environment"]["seeds"] == [0, 1]
    assert two["rows"][1]["settings"]["prompt_ids"] != two["rows"][0]["settings"]["prompt_ids"]
    (line,) = two["table"]
    assert line["repeats"] == 2 and line["spread"]["cpu_s_per_trajectory"] is not None
