"""The agent loop and the samplers against a scripted engine: the DESIGN.md §3 invariants."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from fakes import ScriptedEngine
from treegrpo.envs.base import Task
from treegrpo.envs.search import INVALID_ACTION, SearchEnv
from treegrpo.models.loader import load_tokenizer
from treegrpo.retrieval.base import Doc
from treegrpo.retrieval.bm25 import BM25Retriever
from treegrpo.rollout.agent import AgentConfig, StepRunner
from treegrpo.rollout.samplers import SamplerConfig, pick_nodes, sample_chains, sample_trees
from treegrpo.tree import Forest, read_forests, write_forests

DOCS = [
    Doc("0", "paris\nparis is the capital of france."),
    Doc("1", "rome\nrome is the capital of italy."),
    Doc("2", "oslo\noslo is the capital of norway."),
]
TASKS = [
    Task("q0", "what is the capital of france?", ["paris"]),
    Task("q1", "what is the capital of italy?", ["rome"]),
]


def two_step_policy(context: str, draw: float) -> str:
    """Search first; then answer correctly or wrongly depending on the draw."""
    if "<information>" not in context:
        return "<search> capital france </search>"
    return "<answer> paris </answer>" if draw < 0.5 else "<answer> rome </answer>"


@pytest.fixture()
def tok(tiny_model_dir: Path):
    return load_tokenizer(tiny_model_dir)


def make_runner(tok, policy, **cfg) -> tuple[StepRunner, ScriptedEngine]:
    engine = ScriptedEngine(tok, policy)
    env = SearchEnv(BM25Retriever(DOCS), topk=2, prompt_template="minimal")
    return StepRunner(engine, env, tok, AgentConfig(**cfg)), engine


def test_stop_tags_become_stop_ids_when_single_tokens(tok) -> None:
    runner, _ = make_runner(tok, two_step_policy)
    assert tok.convert_tokens_to_ids("</search>") in runner.params.stop_token_ids
    assert tok.convert_tokens_to_ids("</answer>") in runner.params.stop_token_ids
    # ... and stay stop strings: a multi-id spelling of the tag must stop too (test_stop_tags.py).
    assert runner.params.stop_strings == ("</search>", "</answer>")


def test_chain_tokens_in_tokens_out_and_masks(tok) -> None:
    runner, engine = make_runner(tok, two_step_policy)
    res = sample_chains(
        runner,
        TASKS,
        SamplerConfig("chain", group_size=3),
        random.Random(0),
        torch.Generator().manual_seed(0),
    )
    assert [f.n_trajectories() for f in res.forests] == [3, 3]
    # every generated id is stored exactly, in the order generated, with policy mask 1
    stored = []
    for f in res.forests:
        for tree in f.trees:
            for node in tree.nodes[1:]:
                k = node.n_policy_tokens
                assert node.policy_mask == [1] * k + [0] * (len(node.tokens) - k)
                stored.append(node.tokens[:k])
    assert sorted(map(tuple, stored)) == sorted(map(tuple, engine.generated))
    # observation tokens are exactly the tokenized observation, mask 0
    node = res.forests[0].trees[0].nodes[1]
    obs_ids = tok.encode(node.observation, add_special_tokens=False)
    assert node.tokens[node.n_policy_tokens :] == obs_ids
    assert node.extra["kind"] == "search" and node.extra["query"] == "capital france"
    # the paths the trainer sees are the concatenation of the same ids
    for path in res.forests[0].paths():
        nodes = res.forests[0].trees[path.tree_index].path(path.leaf_id)
        assert path.tokens_T == [t for n in nodes for t in n.tokens]


def test_one_engine_call_per_turn_across_prompts(tok) -> None:
    runner, engine = make_runner(tok, two_step_policy)
    res = sample_chains(
        runner,
        TASKS,
        SamplerConfig("chain", group_size=4),
        random.Random(0),
        torch.Generator().manual_seed(0),
    )
    assert res.engine_calls == 2 == len(engine.calls)  # search turn, answer turn
    assert len(engine.calls[0]) == 8  # both prompts x 4 chains in one call


def test_budget_is_exact(tok) -> None:
    runner, engine = make_runner(tok, two_step_policy)
    res = sample_trees(
        runner,
        TASKS,
        SamplerConfig("tree", m=2, n=2, l=1),
        random.Random(1),
        torch.Generator().manual_seed(1),
    )
    total = res.total()
    assert total.generated_tokens == sum(len(g) for g in engine.generated)
    assert total.prefill_tokens == sum(len(c) for call in engine.calls for c in call)
    assert total.engine_requests == sum(len(call) for call in engine.calls)
    for f, b in zip(res.forests, res.budgets, strict=True):
        nodes = [n for t in f.trees for n in t.nodes if n.parent is not None]
        assert b.generated_tokens == sum(n.n_policy_tokens for n in nodes)
        assert b.tool_calls == sum(n.extra["kind"] == "search" and n.observation is not None for n in nodes)


def test_tree_shares_prefixes_generated_once(tok) -> None:
    runner, engine = make_runner(tok, two_step_policy)
    cfg = SamplerConfig("tree", m=2, n=3, l=2, expand_mode="nonroot")
    res = sample_trees(runner, TASKS, cfg, random.Random(0), torch.Generator().manual_seed(0))
    for f in res.forests:
        assert len(f.trees) == 2
        for tree in f.trees:
            assert len(tree.leaves()) == 1 + 3 * 2
            # nonroot picks only the search step, so every expansion is one answer step below it:
            # the shared search step (and its tool call) exists once per tree
            searches = [n for n in tree.nodes if n.extra.get("kind") == "search"]
            assert len(searches) == 1
            assert len(tree.children[searches[0].id]) == 1 + 3 * 2
    assert res.total().tool_calls == 2 * 2  # one per tree, never repeated by an expansion
    # an expansion's context is the stored path, ids untouched
    expansion_contexts = engine.calls[-1]
    tree = res.forests[0].trees[0]
    search = next(n for n in tree.nodes if n.extra.get("kind") == "search")
    assert [t for n in tree.path(search.id) for t in n.tokens] in expansion_contexts


def test_a_tree_expands_as_soon_as_its_own_chain_ends(tok) -> None:
    """The france prompt answers after one search, the italy prompt searches twice: the france
    tree's expansions run in the same engine call as the italy chain's last turn."""

    def policy(context: str, draw: float) -> str:
        searches = context.count("<information>")
        if "france" in context.split("<information>")[0]:
            return "<search> capital france </search>" if searches == 0 else "<answer> paris </answer>"
        return "<search> capital italy </search>" if searches < 2 else "<answer> rome </answer>"

    runner, engine = make_runner(tok, policy)
    cfg = SamplerConfig("tree", m=1, n=2, l=1, expand_mode="nonroot")
    res = sample_trees(runner, TASKS, cfg, random.Random(0), torch.Generator().manual_seed(0))
    # turns: (1) both search, (2) france answers / italy searches again, (3) france's 2 expansions
    # (answers from after its search) + italy answers, (4…) italy's 2 expansions
    assert [len(c) for c in engine.calls[:3]] == [2, 2, 3]
    third = [tok.decode(ctx) for ctx in engine.calls[2]]
    assert sum("france" in t for t in third) == 2 and sum("italy" in t for t in third) == 1
    assert res.engine_calls == len(engine.calls) < 2 + 3 + 1  # fewer than chains, then expansions
    for f in res.forests:
        assert len(f.trees[0].leaves()) == 3
    # shared steps are generated (and tool-called) once: france 1 search, italy 2 + its expansions'
    assert res.budgets[0].tool_calls == 1


def test_random_picks_include_root(tok) -> None:
    runner, _ = make_runner(tok, two_step_policy)
    res = sample_chains(
        runner,
        TASKS[:1],
        SamplerConfig("chain", group_size=1),
        random.Random(0),
        torch.Generator().manual_seed(0),
    )
    tree = res.forests[0].trees[0]
    picks = pick_nodes(tree, 400, "random", random.Random(0))
    assert {p.id for p in picks} == {0, 1}  # root and the non-leaf search step, never the leaf
    assert 150 < sum(p.id == 0 for p in picks) < 250
    assert {p.id for p in pick_nodes(tree, 50, "nonroot", random.Random(0))} == {1}


def test_expansion_keeps_turn_count(tok) -> None:
    runner, _ = make_runner(tok, two_step_policy)
    res = sample_trees(
        runner, TASKS[:1], SamplerConfig("tree", m=1, n=2, l=1, expand_mode="nonroot"), random.Random(0)
    )
    tree = res.forests[0].trees[0]
    for leaf in tree.leaves():
        assert leaf.extra["turn"] == tree.depth(leaf.id) == 2


@pytest.mark.parametrize(
    ("policy", "kind"),
    [
        (lambda ctx, d: "I think the answer is paris", "invalid"),  # no tags at all
        (lambda ctx, d: "<search></search>", "invalid"),  # empty query
        (lambda ctx, d: "<answer> paris", "invalid"),  # unterminated tag
        (lambda ctx, d: "blah " * 200, "invalid"),  # over-long step
    ],
)
def test_bad_output_is_data_not_a_crash(tok, policy, kind) -> None:
    runner, _ = make_runner(tok, policy, max_turns=2, max_step_tokens=16)
    res = sample_chains(
        runner,
        TASKS,
        SamplerConfig("chain", group_size=2),
        random.Random(0),
        torch.Generator().manual_seed(0),
    )
    for f in res.forests:
        for tree in f.trees:
            path = tree.path(tree.leaves()[0].id)[1:]
            assert len(path) == 3  # two turns with search allowed, then the final turn
            assert all(n.extra["kind"] == kind for n in path)
            assert path[0].observation == INVALID_ACTION
            assert path[-1].reward == 0.0 and path[-1].observation is None
    assert res.total().invalid_actions == 2 * 2 * 3


def test_turn_limit_refuses_final_search(tok) -> None:
    runner, _ = make_runner(tok, lambda ctx, d: "<search> paris </search>", max_turns=2)
    res = sample_chains(runner, TASKS[:1], SamplerConfig("chain", group_size=1), random.Random(0))
    path = res.forests[0].trees[0].path(res.forests[0].trees[0].leaves()[0].id)[1:]
    assert [n.extra["kind"] for n in path] == ["search"] * 3
    assert path[-1].extra.get("refused") is True and path[-1].reward == 0.0
    assert res.total().tool_calls == 2


def test_context_limit_ends_trajectory(tok) -> None:
    runner, _ = make_runner(
        tok,
        lambda ctx, d: "<search> paris </search>",
        max_turns=50,
        max_context_tokens=120,
        max_step_tokens=8,
    )
    res = sample_chains(runner, TASKS[:1], SamplerConfig("chain", group_size=1), random.Random(0))
    tree = res.forests[0].trees[0]
    leaf = tree.leaves()[0]
    assert leaf.reward == 0.0
    assert sum(len(n.tokens) for n in tree.path(leaf.id)) <= 120


def test_forests_round_trip_json(tok, tmp_path: Path) -> None:
    runner, _ = make_runner(tok, two_step_policy)
    res = sample_trees(
        runner,
        TASKS,
        SamplerConfig("tree", m=2, n=2, l=1),
        random.Random(0),
        torch.Generator().manual_seed(0),
    )
    write_forests(res.forests, tmp_path / "f.jsonl")
    back = read_forests(tmp_path / "f.jsonl")
    assert [f.to_json() for f in back] == [f.to_json() for f in res.forests]
    assert isinstance(back[0], Forest) and back[0].paths()[0].tokens_T == res.forests[0].paths()[0].tokens_T


def test_max_turns_zero_is_single_turn(tok) -> None:
    """max_turns=0: the first step is the last — an answer is scored, a search is refused (no tool
    call, reward 0), and nothing is generated after it."""
    policy = {"q0": "<answer> paris </answer>", "q1": "<search> capital italy </search>"}
    runner, engine = make_runner(tok, lambda ctx, draw: policy["q0" if "france" in ctx else "q1"], max_turns=0)
    res = sample_chains(runner, TASKS, SamplerConfig("chain", group_size=2), random.Random(0), torch.Generator())
    assert len(engine.calls) == 1  # one turn for every trajectory
    leaves = [[leaf for _, leaf in f.leaves()] for f in res.forests]
    assert [[leaf.reward for leaf in ls] for ls in leaves] == [[1.0, 1.0], [0.0, 0.0]]
    assert [leaf.extra["kind"] for leaf in leaves[1]] == ["search", "search"]
    assert all(leaf.extra.get("refused") and leaf.observation is None for leaf in leaves[1])
    assert res.total().tool_calls == 0
