"""``bench real`` end to end on SmolLM2 cut to 2 layers (tiny sizes): every stage runs, the results
hold the measured figures and checks, the plot is written, and a finished stage is reused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_result_schemas import committed, shape_problems

from treegrpo.benchmarks.phase_rss import summary
from treegrpo.benchmarks.real import RealSpec, rl_stage, run_bench, warmup_stage
from treegrpo.benchmarks.real_costs import _generated
from treegrpo.models.loader import load_tokenizer

LIMITS = {"max_turns": 1, "max_step_tokens": 128, "max_obs_tokens": 200, "max_context_tokens": 1024}


def test_bench_real_runs_every_stage_and_reuses_finished_ones(smollm2_2layer_dir: Path, tmp_path: Path) -> None:
    spec = RealSpec(
        model=str(smollm2_2layer_dir), demos=3, sft_batch=2, eval_prompts=1, rl_steps=1, prompts_per_step=1,
        cost_prompts=2, cost_modes=("packed",), overrides=LIMITS,
    )  # fmt: skip
    out = tmp_path / "real.json"
    said: list[str] = []
    res = run_bench(spec, tmp_path / "work", out, said.append)
    assert json.loads(out.read_text()) == json.loads(json.dumps(res)) and out.with_suffix(".png").stat().st_size > 0
    assert shape_problems(json.loads(out.read_text()), committed("real.json")) == []  # the keys and nesting of the committed results
    assert res["warmup"]["demos"] == 3 and res["warmup"]["sft"]["steps"] == 2
    assert set(res["rl"]) == {"tree_2_2_1", "chain_4"}
    tree, chain = res["rl"]["tree_2_2_1"], res["rl"]["chain_4"]
    assert tree["eval_before"] == chain["eval_before"]
    assert tree["eval_before"]["eval/success_greedy"] == res["warmup"]["em_after"]  # paired: one start
    assert chain["trajectories"] == 4 and tree["trajectories"] >= 4  # (2,2,1): 2 chains + 2+ expansions
    gen = res["engine_vs_generate"]
    assert gen["engine"]["generated_tokens"] > 0 and gen["generate"]["generated_tokens"] > 0 and gen["ratio"] > 0
    packed = res["step_costs"]["packed"]
    assert packed["peak_rss_gb"] > 0.1 and packed["packed"] == 1.0 and packed["update_s"] > 0
    phases = [m["phase"] for m in json.loads((tmp_path / "work" / "costs" / "packed" / "phases.json").read_text())["marks"]]
    assert {"load", "rollout", "update_prep", "forward", "loss", "backward", "optimizer_step", "update_end"} <= set(phases)
    assert phases.index("rollout") < phases.index("forward") < phases.index("backward") < phases.index("optimizer_step")
    per_phase = [packed[f"peak_rss_{g}_gb"] for g in ("load", "eval", "rollout", "update", "save")]
    assert min(per_phase) > 0.1 and packed["peak_rss_gb"] == max(per_phase)  # the process's peak is a phase's
    assert set(res["checks"]) >= {"warmup_well_formed", "warmup_em", "engine_vs_generate", "peak_rss_packed"}
    said.clear()  # an interrupted benchmark resumes: finished stages are reused
    assert warmup_stage(spec, tmp_path / "work", said.append)["eval_after"] == tree["eval_before"]
    assert rl_stage(spec, tmp_path / "work", {"eval_after": {}}, said.append) == res["rl"]
    assert said == [f"warm-up: reusing {tmp_path / 'work' / 'warm'}"]


@pytest.mark.parametrize(
    ("ids_text", "want"), [("<answer> x </answer> tail", "<answer> x </answer>"), ("no stop here", "no stop here")]
)
def test_generated_counts_up_to_the_stop_string(smollm2_2layer_dir: Path, ids_text: str, want: str) -> None:
    tok = load_tokenizer(smollm2_2layer_dir)
    ids = tok.encode(ids_text, add_special_tokens=False)
    n = _generated(ids, {tok.eos_token_id}, tok, ("</answer>",))
    assert tok.decode(ids[:n]) == want
    assert _generated([*ids[:2], tok.eos_token_id, *ids[2:]], {tok.eos_token_id}, tok, ("</answer>",)) == 3


def test_phase_summary_takes_each_groups_largest_peak() -> None:
    marks = [
        {"phase": "load", "peak_gb": 0.5},
        {"phase": "before_rollout", "peak_gb": 9.0},  # between phases: not a phase of its own
        {"phase": "rollout", "peak_gb": 1.5},
        {"phase": "forward", "peak_gb": 2.0},
        {"phase": "backward", "peak_gb": 3.0},
        {"phase": "optimizer_step", "peak_gb": 2.5},
        {"phase": "eval", "peak_gb": 1.0},
        {"phase": "before_save", "peak_gb": 1.2},
        {"phase": "save", "peak_gb": 1.7},
    ]
    assert summary(marks) == {
        "peak_rss_gb": 9.0,
        "peak_rss_load_gb": 0.5,
        "peak_rss_rollout_gb": 1.5,
        "peak_rss_update_gb": 3.0,
        "peak_rss_eval_gb": 1.0,
        "peak_rss_save_gb": 1.7,
    }
