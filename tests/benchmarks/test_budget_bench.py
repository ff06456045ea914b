"""The budget benchmark's machinery on the fixture model: rows have exactly the documented keys and
every count agrees with the forests (the CLI run on the bootstrapped agent is
``treegrpo bench budget``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from treegrpo.benchmarks.budget import ROW_KEYS, chain_spec, measure_all, summarize, tree_spec
from treegrpo.benchmarks.budget_parts import AgentParts, ExpansionContext
from treegrpo.benchmarks.budget_report import (
    compute_targets,
    expected_fractions,
    forest_counts,
    plot,
    uncached_tokens,
)
from treegrpo.envs.search import SearchEnv
from treegrpo.models.loader import load_model, load_tokenizer
from treegrpo.rollout.agent import AgentConfig
from treegrpo.rollout.engine import Generation
from treegrpo.tasks.world.world import PRESETS, build_world
from treegrpo.tree import Forest, Node, Tree


@pytest.fixture(scope="module")
def agent(tiny_model_dir: Path) -> AgentParts:
    world = build_world(PRESETS["tiny"])
    env = SearchEnv(world.retriever, topk=2, prompt_template="minimal")
    cfg = AgentConfig(max_turns=2, max_step_tokens=10, max_obs_tokens=40, max_context_tokens=400, use_chat_template=False)
    return AgentParts(load_model(tiny_model_dir).eval(), load_tokenizer(tiny_model_dir), env, cfg, world.tasks("train"))


@pytest.fixture(scope="module")
def measured(agent: AgentParts):
    # One intra-op thread: on a busy 2-core machine two OpenMP threads make a tiny matmul ~1000x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tasks = agent.tasks[:2]
    specs = [chain_spec(4), tree_spec(4, (2, 2, 1), "random")]
    logs: list[str] = []
    try:
        ms = measure_all(agent, tasks, specs, seed=0, repeats=2, critical=specs, log=logs.append)
    finally:
        torch.set_num_threads(threads)
    return ms, logs


def test_rows_have_exactly_the_keys_and_match_the_forests(measured) -> None:
    ms, logs = measured
    assert len(ms) == 4 and logs
    assert [(m.spec.mode, m.reuse) for m in ms] == [("chain", True), ("chain", False), ("tree", True), ("tree", False)]
    for m in ms:
        s = summarize(m)
        row, detail = s["row"], s["detail"]
        assert tuple(row) == ROW_KEYS
        json.dumps(s)
        fc = forest_counts(m.forests)
        assert row["prompts"] == 2
        assert row["trajectories"] == fc["trajectories"] == 2 * (4 if m.spec.mode == "chain" else 2 * (1 + 2))
        assert row["generated_tokens"] == fc["generated_tokens"] > 0
        assert row["tool_calls"] == fc["tool_calls"]
        assert all(detail["checks"].values()), detail["checks"]
        assert len(m.walls) == 2 and row["wall_s"] > 0  # the block ran twice; the sweep run was the warm-up
        if m.reuse:
            assert row["prefill_tokens"] == sum(uncached_tokens(m.calls).values()) < fc["context_tokens"]
        else:
            assert row["prefill_tokens"] == fc["context_tokens"]
        if m.spec.mode == "chain":
            assert (row["M"], row["N"], row["L"], row["expand_mode"]) == (4, 0, 0, None)
        else:
            assert (row["M"], row["N"], row["L"], row["expand_mode"]) == (2, 2, 1, "random")
            phases = detail["phases"]
            assert set(phases) == {"init", "expand"}
            assert phases["expand"]["generated_tokens"] + phases["init"]["generated_tokens"] == row["generated_tokens"]
            assert detail["picks"] == 2 * 2 * 2  # prompts * M * N·L
            if m.reuse:  # an expansion's first turn finds its whole context cached: only the last token runs
                assert phases["expand"]["prefill_tokens"] == phases["expand"]["uncached_tokens"]
                assert phases["expand"]["prefill_tokens"] < phases["expand"]["context_tokens"]


def test_targets_and_plot(measured, tmp_path: Path) -> None:
    ms, _ = measured
    sums = [summarize(m) for m in ms]
    targets = compute_targets([s["row"] for s in sums], [s["detail"] for s in sums])
    names = set(targets)
    assert "tree221_random_vs_chain4.traj_per_1k_gen_tokens_ratio" in names
    assert "tree221_random_vs_chain4.tool_calls_per_traj_ratio" in names
    assert "tree221_random_vs_chain4.wall_per_traj_vs_bound_reuse" in names
    assert "tree221_random_vs_chain4.wall_per_traj_vs_bound_no_reuse" in names
    exact = targets["tree_(2,2,1)_random.expansion_prefill_equals_uncached"]
    assert exact["pass"] is True and exact["reuse_off"] > exact["reuse_on"]
    for v in targets.values():
        assert set(v) >= {"measured", "op", "threshold", "pass"}
    png = tmp_path / "budget.png"
    plot([s["row"] for s in sums], png)
    assert png.stat().st_size > 1000


def test_uncached_tokens_by_hand() -> None:
    def g(toks: list[int]) -> Generation:
        return Generation(tokens=toks, logprobs=[0.0] * len(toks), finish_reason="stop", prefill_tokens=0)

    calls = [
        # two copies of a 3-token prompt: 3 new, then only the last token again (1)
        ([[1, 2, 3], [1, 2, 3]], [g([4, 5]), g([6])], ["init", "init"]),
        # next turn: context + step + obs; [1,2,3,4] known (the fed-back 4), 5 and 9 are new; in the
        # same call an expansion from the root (all known: 1)
        ([[1, 2, 3, 4, 5, 9], [1, 2, 3]], [g([7]), g([4, 8])], ["init", "expand"]),
        # an expansion from the first node: everything known -> 1; one from the root's new child
        # [1,2,3,4,8,...]: 4 was fed back, 8 was not (the last sampled token never runs) -> 2 new
        ([[1, 2, 3, 4, 5, 9], [1, 2, 3, 4, 8, 10]], [g([8]), g([11])], ["expand", "expand"]),
    ]
    assert uncached_tokens(calls) == {"init": 3 + 1 + 2, "expand": 1 + 1 + 2}


def test_expansion_context_stays_tagged() -> None:
    c = ExpansionContext([1, 2])
    c = c + [3]  # noqa: RUF005 - the runner extends contexts with +
    assert isinstance(c, ExpansionContext) and c == [1, 2, 3]


def _chain_tree(steps: list[tuple[str, int]]) -> Tree:
    """A tree holding one chain: ``(kind, generated tokens)`` per step, the last one a leaf."""
    tree = Tree([Node(0, None, tokens=[1, 2], policy_mask=[0, 0])])
    for i, (kind, n) in enumerate(steps, start=1):
        last = i == len(steps)
        tree.add(
            Node(i, i - 1, tokens=[5] * n + ([] if last else [9]), policy_mask=[1] * n + ([] if last else [0]),
                 reward=0.0 if last else None, extra={"kind": kind})
        )  # fmt: skip
    return tree


def test_expected_fractions_by_hand() -> None:
    # chain A: search (3 tokens, 1 tool) then answer (2); chain B: answer only (5 tokens)
    forest = Forest("p", [_chain_tree([("search", 3), ("answer", 2)]), _chain_tree([("answer", 5)])])
    # mean chain: 5 tokens, 0.5 tool calls
    # random:  A picks root (5 tok, 0.5 tools) or node 1 (2 tok, 0 tools); B only the root (5, 0.5)
    #          -> tokens (3.5 + 5)/2 = 4.25 -> f = 0.85; tools (0.25 + 0.5)/2 = 0.375 -> 0.75
    r = expected_fractions([forest], "random")
    assert r["f_expected"] == pytest.approx(0.85) and r["tool_fraction_expected"] == pytest.approx(0.75)
    # nonroot: A picks node 1 (2, 0); B falls back to the root (5, 0.5) -> f = 3.5/5, tools 0.25/0.5
    r = expected_fractions([forest], "nonroot")
    assert r["f_expected"] == pytest.approx(0.7) and r["tool_fraction_expected"] == pytest.approx(0.5)
    assert expected_fractions([forest], "entropy") == {"f_expected": None, "tool_fraction_expected": None}
    fc = forest_counts([forest])
    assert fc["trajectories"] == 2 and fc["generated_tokens"] == 10 and fc["tool_calls"] == 1
    assert fc["phases"]["init"]["steps"] == 3 and fc["phases"]["expand"]["steps"] == 0
    # context tokens: A's steps see 2 and 2+4 tokens, B's step 2
    assert fc["context_tokens"] == 2 + 6 + 2
