"""The token-matched tree (``budget_tokens``): the budget's forms, the measured cost of a node, the
pick restricted to what fits, and the sampler against a scripted engine — every token booked once,
and a step's generated tokens within one step's cap of the chain's it is matched to."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from fakes import ScriptedEngine
from treegrpo.envs.base import Task
from treegrpo.envs.search import SearchEnv
from treegrpo.errors import ConfigError
from treegrpo.models.loader import load_tokenizer
from treegrpo.retrieval.base import Doc
from treegrpo.retrieval.bm25 import BM25Retriever
from treegrpo.rollout.agent import AgentConfig, StepRunner
from treegrpo.rollout.samplers import SamplerConfig, get_sampler, sample_chains
from treegrpo.rollout.token_budget import (
    parse_budget_tokens,
    pick_within,
    remaining_cost,
    tail_costs,
    token_limit,
)
from treegrpo.tree import Forest, Node, Tree

DOCS = [Doc("0", "paris\nparis is the capital of france."), Doc("1", "rome\nrome is the capital of italy.")]
TASKS = [Task(f"q{i}", f"what is the capital of country{i}?", ["paris"]) for i in range(4)]


def test_budget_forms() -> None:
    assert parse_budget_tokens("chain:2") == ("chain", 2.0)
    assert parse_budget_tokens(" chain:0.5 ") == ("chain", 0.5)
    assert parse_budget_tokens(64) == ("tokens", 64.0)
    assert parse_budget_tokens("64") == ("tokens", 64.0)
    for bad in ("chain:", "chain:x", "chains:2", "tokens", 0, -3, "chain:0", True):
        with pytest.raises(ConfigError, match=r"budget_tokens .* chain:G"):
            parse_budget_tokens(bad)  # type: ignore[arg-type]
    # chain:G is G times the mean chain of the call; a number is itself
    assert token_limit("chain:2", [10, 20, 30]) == pytest.approx(40.0)
    assert token_limit(50, [10, 20, 30]) == 50.0


def _node(i: int, parent: int | None, gen: int, obs: int = 0, reward: float | None = None) -> Node:
    return Node(i, parent, tokens=[7] * (gen + obs), policy_mask=[1] * gen + [0] * obs, logprobs=[-1.0] * (gen + obs), reward=reward)


def hand_tree() -> Tree:
    """root 0 -> 1 (search, 10 generated + 5 observation) -> 2 (answer, 4); 1 -> 3 (answer, 6);
    0 -> 4 (answer, 3)."""
    return Tree([_node(0, None, 0, 5), _node(1, 0, 10, 5), _node(2, 1, 4, reward=1.0), _node(3, 1, 6, reward=0.0),
                 _node(4, 0, 3, reward=0.0)])  # fmt: skip


def test_tail_costs_pool_every_ended_path_by_depth() -> None:
    t = hand_tree()
    other = Tree([_node(0, None, 0, 5), _node(1, 0, 8, 5), _node(2, 1, 2, reward=1.0), _node(3, 0, 9)])  # 3: in flight
    tails = tail_costs([Forest("a", [t]), Forest("b", [other])])
    # depth 0: whole paths 14, 16, 3 and 10 (the in-flight path is no sample yet); depth 1: the tails
    # after a first step that did not end there: 4, 6 and 2
    assert tails == {0: pytest.approx(43 / 4), 1: pytest.approx(4.0)}
    assert remaining_cost(tails, t, 0) == pytest.approx(43 / 4) and remaining_cost(tails, t, 1) == 4.0
    assert remaining_cost({}, t, 1) == 1.0  # at least one


def test_pick_within_only_what_fits() -> None:
    t = hand_tree()
    tails = {0: 11.0, 1: 5.0}

    def cost(nd: Node) -> float:
        return remaining_cost(tails, t, nd.id)

    rng = random.Random(0)
    # room 8: only node 1 (cost 5) fits, never the root (11)
    assert {pick_within(t, "random", rng, cost, 8.0, {}).id for _ in range(50)} == {1}  # type: ignore[union-attr]
    assert {pick_within(t, "random", rng, cost, 11.0, {}).id for _ in range(200)} == {0, 1}  # type: ignore[union-attr]
    assert pick_within(t, "random", rng, cost, 4.9, {}) is None
    assert pick_within(t, "nonroot", rng, cost, 4.9, {}) is None  # nonroot never falls back to the root here
    times: dict[int, int] = {}
    assert pick_within(t, "entropy", rng, cost, 20.0, times) is not None and sum(times.values()) == 1
    only_root = Tree([_node(0, None, 0), _node(1, 0, 8, reward=0.0)])
    assert pick_within(only_root, "nonroot", rng, lambda nd: 8.0, 8.0, {}).id == 0  # type: ignore[union-attr]


def policy(context: str, draw: float) -> str:
    """Search once, then answer (right or wrong by the draw): every step's length is fixed."""
    if "<information>" not in context:
        return "<search> capital </search>"
    return "<answer> paris </answer>" if draw < 0.5 else "<answer> rome </answer>"


@pytest.fixture()
def runner(tiny_model_dir: Path) -> StepRunner:
    tok = load_tokenizer(tiny_model_dir)
    env = SearchEnv(BM25Retriever(DOCS), topk=1, prompt_template="minimal")
    return StepRunner(ScriptedEngine(tok, policy), env, tok, AgentConfig(max_turns=2, max_step_tokens=16))


@pytest.mark.parametrize("mode", ["random", "nonroot", "entropy"])
@pytest.mark.parametrize(("g", "m", "n"), [(2, 1, 2), (4, 2, 2), (8, 2, 6)])
def test_token_matched_tree_spends_the_chains_tokens(runner: StepRunner, mode: str, g: int, m: int, n: int) -> None:
    engine = runner.engine
    assert isinstance(engine, ScriptedEngine)
    cap = runner.cfg.max_step_tokens
    for step in range(3):  # three steps, each checked on its own
        chains = sample_chains(runner, TASKS, SamplerConfig("chain", group_size=g), random.Random(step),
                               torch.Generator().manual_seed(step))  # fmt: skip
        before = len(engine.generated)
        cfg = SamplerConfig("tree", m=m, n=n, l=1, expand_mode=mode, budget_tokens=f"chain:{g}")  # type: ignore[arg-type]
        res = get_sampler("tree")(runner, TASKS, cfg, random.Random(step), torch.Generator().manual_seed(step))
        # every request booked once: the budgets are the engine's own count
        assert res.total().generated_tokens == sum(len(x) for x in engine.generated[before:])
        for f, b in zip(res.forests, res.budgets, strict=True):
            assert b.generated_tokens == sum(nd.n_policy_tokens for t in f.trees for nd in t.nodes)
            assert len(f.trees) == m
        # per step, the tree's generated tokens are within one step's cap of the chain's
        assert abs(res.total().generated_tokens - chains.total().generated_tokens) <= cap
        limit = res.forests[0].extra["token_limit"]
        chain_mean = sum(b.generated_tokens for b in chains.budgets) / len(TASKS)
        assert limit == pytest.approx(chain_mean, abs=1e-3)  # the same policy: the same mean chain
        for f, b in zip(res.forests, res.budgets, strict=True):  # per prompt: never past the limit (costs
            # are exact here), and short of it by less than the cheapest expansion it could still make
            tails = tail_costs(res.forests)
            cheapest = min(remaining_cost(tails, t, nd.id) for t in f.trees for nd in t.nodes if not t.is_leaf(nd.id))
            assert limit - cheapest < b.generated_tokens <= limit + 1e-9


def test_token_matched_shape_varies_but_not_the_cost(runner: StepRunner) -> None:
    cfg = SamplerConfig("tree", m=1, n=2, l=1, expand_mode="random", budget_tokens="chain:4")
    res = get_sampler("tree")(runner, TASKS * 3, cfg, random.Random(3), torch.Generator().manual_seed(3))
    leaves = [f.n_trajectories() for f in res.forests]
    assert len(set(leaves)) > 1  # root picks cost a whole chain, deep picks an answer
    limit = res.forests[0].extra["token_limit"]
    assert all(limit - runner.cfg.max_step_tokens < b.generated_tokens <= limit for b in res.budgets)


def test_a_budget_below_the_initial_chains_expands_nothing(runner: StepRunner) -> None:
    cfg = SamplerConfig("tree", m=2, n=2, l=1, budget_tokens=1)
    res = get_sampler("tree")(runner, TASKS, cfg, random.Random(0), torch.Generator().manual_seed(0))
    assert [f.n_trajectories() for f in res.forests] == [2] * len(TASKS)
    # the nominal tree is unchanged by the setting's existence
    nominal = get_sampler("tree")(runner, TASKS, SamplerConfig("tree", m=1, n=2, l=1), random.Random(0), None)
    assert [f.n_trajectories() for f in nominal.forests] == [3] * len(TASKS)
