"""``bench budget --engine``: the engine block's document on the fixture model with the HF engine
(rows with exactly the budget benchmark's keys, figures that agree with them), and the targets'
arithmetic by hand."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from treegrpo.benchmarks.budget import ROW_KEYS, AgentParts
from treegrpo.benchmarks.budget_engines import compare, run_engine_bench, tree_vs_chain
from treegrpo.envs.search import SearchEnv
from treegrpo.models.loader import load_model, load_tokenizer
from treegrpo.rollout.agent import AgentConfig
from treegrpo.tasks.world.world import PRESETS, build_world


@pytest.fixture(scope="module")
def doc(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    world = build_world(PRESETS["tiny"])
    env = SearchEnv(world.retriever, topk=2, prompt_template="minimal")
    cfg = AgentConfig(max_turns=2, max_step_tokens=10, max_obs_tokens=40, max_context_tokens=400, use_chat_template=False)
    agent = AgentParts(load_model(tiny_model_dir).eval(), load_tokenizer(tiny_model_dir), env, cfg, world.tasks("train"), tiny_model_dir)
    out = tmp_path_factory.mktemp("engines") / "budget_hf.json"
    run_engine_bench(out, engine="hf", prompts=2, repeats=1, agent=agent, log=lambda m: None)
    assert out.with_suffix(".png").is_file()
    return json.loads(out.read_text())


def test_rows_and_figures(doc: dict) -> None:
    assert [tuple(r) for r in doc["rows"]] == [ROW_KEYS] * 3
    assert [f["config"] for f in doc["engine_figures"]] == ["chain 4", "tree (2,2,1) random", "tree (2,2,1) nonroot"]
    for row, f, d in zip(doc["rows"], doc["engine_figures"], doc["details"], strict=True):
        assert row["prefix_reuse"] is True and row["prompts"] == 2
        assert f["generated_tokens"] == row["generated_tokens"] and f["prefill_tokens"] == row["prefill_tokens"]
        assert f["trajectories"] == row["trajectories"] == (8 if row["mode"] == "chain" else 2 * 2 * 3)
        assert f["prefix_cache_hit_tokens"] == f["context_tokens"] - f["prefill_tokens"] >= 0
        assert f["prefill_tokens"] == f["uncached_tokens"]  # the HF engine's reuse is exact
        assert len(f["walls"]) == len(f["cpus"]) == 1 and f["repeats_reproduce_counts"]
        assert f["gen_tokens_per_cpu_s"] == pytest.approx(f["generated_tokens"] / f["cpu_s"], rel=1e-3)
        assert d["checks"]["trajectories"] and d["checks"]["generated_tokens"]
    assert set(doc["targets"]) == {f"wall_per_gen_token_tree_{m}_vs_chain" for m in ("random", "nonroot")}


def test_targets_by_hand(doc: dict) -> None:
    figs = [
        {"config": "chain 4", "wall_per_gen_token_ms": 2.0, "gen_tokens_per_cpu_s": 100.0},
        {"config": "tree (2,2,1) random", "wall_per_gen_token_ms": 2.1, "gen_tokens_per_cpu_s": 100.0},
        {"config": "tree (2,2,1) nonroot", "wall_per_gen_token_ms": 2.4, "gen_tokens_per_cpu_s": 80.0},
    ]
    t = tree_vs_chain(figs)
    assert t["wall_per_gen_token_tree_random_vs_chain"] == {"measured": 1.05, "target": "<= 1.1", "met": True}
    assert t["wall_per_gen_token_tree_nonroot_vs_chain"]["measured"] == 1.2
    assert not t["wall_per_gen_token_tree_nonroot_vs_chain"]["met"]
    hf = copy.deepcopy(doc) | {"engine_figures": figs}
    fast = [dict(f, gen_tokens_per_cpu_s=f["gen_tokens_per_cpu_s"] * k) for f, k in zip(figs, (2.0, 1.5, 1.2), strict=True)]
    vllm = copy.deepcopy(doc) | {"engine_figures": fast}
    c = compare(vllm, hf)
    assert c["vllm_vs_hf_gen_tokens_per_cpu_s[chain 4]"] == {"measured": 2.0, "target": None, "met": None}
    assert c["vllm_vs_hf_gen_tokens_per_cpu_s[tree (2,2,1) random]"]["met"] is True
    assert c["vllm_vs_hf_gen_tokens_per_cpu_s[tree (2,2,1) nonroot]"] == {"measured": 1.2, "target": ">= 1.3", "met": False}
    other = copy.deepcopy(hf)
    other["meta"]["task_ids"] = ["x"]
    with pytest.raises(ValueError, match="same model and prompts"):
        compare(vllm, other)
