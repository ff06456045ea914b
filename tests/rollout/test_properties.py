"""Bad model output is data, not a crash (DESIGN.md §3.6), as properties over arbitrary output:
any string, nested or unclosed tags, unicode, over-long steps, EOS in the middle of a tag — the
action parser and the whole step loop always give a well-defined step or leaf with a reward.
Also: a prompt longer than the context budget ends in a counted leaf instead of a crash."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fakes import EOSEngine, ScriptedEngine
from treegrpo.envs.base import Task
from treegrpo.envs.search import INVALID_ACTION, SearchEnv, parse_action
from treegrpo.models.loader import load_tokenizer
from treegrpo.retrieval.base import Doc
from treegrpo.retrieval.bm25 import BM25Retriever
from treegrpo.rollout.agent import AgentConfig, StepRunner
from treegrpo.rollout.samplers import SamplerConfig, get_sampler
from treegrpo.tree import parse_forest, validate_tree

DOCS = [Doc(str(i), f"city{i}\ncity{i} is in country{i % 3}.") for i in range(5)]
TASKS = [Task("q0", "where is city1?", ["country1"]), Task("q1", "where is city2?", ["country2"])]
PIECES = [
    "<search>",
    "</search>",
    "<answer>",
    "</answer>",
    "<information>",
    "</information>",
    "<think>",
    "</think>",
    "<",
    ">",
    "/",
    " city1 ",
    "country1",
    "<|endoftext|>",
    "é漢字🙂",
    "\n",
    "",
]
texts = st.one_of(
    st.text(max_size=80),
    st.lists(st.sampled_from(PIECES), max_size=30).map("".join),
    st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=6)), max_size=20).map("".join),
)
KINDS = {"answer", "search", "invalid"}


@given(texts)
def test_parse_action_never_fails(text: str) -> None:
    kind, content = parse_action(text)
    assert kind in (None, "search", "answer")
    assert content == content.strip()
    if kind is None:
        assert content == ""
    else:
        assert f"<{kind}>" in text and f"</{kind}>" in text


@given(st.lists(texts, min_size=1, max_size=6), st.lists(st.booleans(), min_size=6, max_size=6))
@settings(max_examples=60, deadline=None)
def test_env_step_always_gives_a_defined_outcome(steps: list[str], allowed: list[bool]) -> None:
    env = SearchEnv(BM25Retriever(DOCS), topk=2, prompt_template="minimal")
    tasks = [TASKS[i % 2] for i in range(len(steps))]
    outs = env.step(tasks, steps, allowed[: len(steps)])
    assert len(outs) == len(steps)
    for text, ok, out in zip(steps, allowed, outs, strict=False):
        assert out.kind in KINDS
        if out.done:
            assert out.reward is not None and math.isfinite(out.reward)
        else:
            assert isinstance(out.observation, str) and out.observation
            assert ok  # without search allowed every step ends the trajectory
        if out.kind == "invalid" and not out.done:
            assert out.observation == INVALID_ACTION
        assert out.tool_calls == int(out.kind == "search" and not out.done)
        if out.kind != "invalid":
            assert parse_action(text)[0] == out.kind


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path):
    return load_tokenizer(tiny_model_dir)


def _check_forests(res, runner: StepRunner, n_trees: int, leaves_per_tree: int | None) -> None:
    cfg = runner.cfg
    total_gen = 0
    for forest in res.forests:
        assert len(forest.trees) == n_trees
        parse_forest(forest.to_json())  # the forest JSON validates
        for tree in forest.trees:
            validate_tree(tree, "tree")
            if leaves_per_tree is not None:
                assert len(tree.leaves()) == leaves_per_tree
            for node in tree.nodes[1:]:
                assert len(node.tokens) == len(node.policy_mask) == len(node.logprobs)
                n_pol = sum(node.policy_mask)
                assert node.policy_mask == [1] * n_pol + [0] * (len(node.tokens) - n_pol)  # step, then obs
                assert n_pol <= cfg.max_step_tokens
                assert node.extra["turn"] <= cfg.max_turns + 1
                total_gen += n_pol
                if node.tokens and node.tokens[n_pol - 1 : n_pol] == [runner.tokenizer.eos_token_id]:
                    assert tree.is_leaf(node.id) and n_pol == len(node.tokens)  # nothing after EOS
            for leaf in tree.leaves():
                assert leaf.reward is not None and math.isfinite(leaf.reward)
                assert len(tree.context(leaf.id)) <= cfg.max_context_tokens
    assert res.total().generated_tokens == total_gen  # every generated token counted once


@given(st.lists(texts, min_size=1, max_size=12), st.sampled_from(["chain", "tree"]))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_step_loop_turns_any_output_into_valid_trees(tok, outputs: list[str], sampler: str) -> None:
    calls = iter(range(10**6))

    def policy(context: str, draw: float) -> str:
        return outputs[next(calls) % len(outputs)]

    engine = EOSEngine(tok, policy)
    env = SearchEnv(BM25Retriever(DOCS), topk=2, prompt_template="minimal")
    runner = StepRunner(engine, env, tok, AgentConfig(max_turns=2, max_step_tokens=16, max_obs_tokens=24, max_context_tokens=160))
    cfg = SamplerConfig(sampler, group_size=2, m=2, n=2, l=1)
    res = get_sampler(sampler)(runner, TASKS, cfg, random.Random(0), torch.Generator().manual_seed(0))
    _check_forests(res, runner, 2, 1 if sampler == "chain" else 3)


# -- the context budget ------------------------------------------------------------------------------

LONG = Task("long", "where is " + "city1 " * 300 + "?", ["country1"])


@pytest.mark.parametrize("sampler", ["chain", "tree", "eptree"])
def test_prompt_longer_than_the_context_budget_is_a_counted_leaf(tok, sampler: str) -> None:
    seen: list[str] = []

    def policy(context: str, draw: float) -> str:
        seen.append(context)
        return "<search> city1 </search>" if "<information>" not in context else "<answer> country1 </answer>"

    env = SearchEnv(BM25Retriever(DOCS), topk=1, prompt_template="minimal")
    runner = StepRunner(
        ScriptedEngine(tok, policy), env, tok, AgentConfig(max_turns=2, max_step_tokens=16, max_obs_tokens=24, max_context_tokens=128)
    )
    assert len(runner.prompt_ids(LONG)) > 128
    cfg = SamplerConfig(sampler, group_size=2, m=2, n=1, l=1, t=2)
    res = get_sampler(sampler)(runner, [LONG, TASKS[0]], cfg, random.Random(0), torch.Generator().manual_seed(0))
    long_forest, _ = res.forests
    assert all("city1 city1 city1" not in c for c in seen)  # never sent to the engine
    for tree in long_forest.trees:
        for leaf in tree.leaves():
            assert leaf.tokens == [] and leaf.reward == 0.0
            assert leaf.extra["finish_reason"] == "length" and leaf.extra["kind"] == "overflow"
    n_long = sum(len(t.leaves()) for t in long_forest.trees)
    assert res.budgets[0].context_overflows == n_long >= 2
    assert res.budgets[0].generated_tokens == 0 and res.budgets[0].engine_requests == 0
    assert res.budgets[1].context_overflows == 0 and res.budgets[1].generated_tokens > 0
    parse_forest(long_forest.to_json())


def test_eos_without_an_action_ends_the_trajectory(tok) -> None:
    """An instruct model ends its turn with EOS and no action: a leaf (reward of an unanswered
    end), no invalid-action text after EOS, no further generation from that context."""
    eos = tok.decode([tok.eos_token_id])
    engine = EOSEngine(tok, lambda ctx, draw: f"<think> done </think> paris{eos} <search> x </search>")
    env = SearchEnv(BM25Retriever(DOCS), topk=1, prompt_template="minimal")
    runner = StepRunner(engine, env, tok, AgentConfig(max_turns=3, max_step_tokens=24, max_obs_tokens=24, max_context_tokens=200))
    res = get_sampler("chain")(runner, TASKS[:1], SamplerConfig("chain", group_size=2), random.Random(0), torch.Generator().manual_seed(0))
    assert len(engine.calls) == 1  # one turn: nothing was generated after EOS
    for tree in res.forests[0].trees:
        (leaf,) = tree.leaves()
        assert leaf.parent == 0 and leaf.tokens[-1] == tok.eos_token_id and leaf.observation is None
        assert leaf.extra["finish_reason"] == "eos" and leaf.reward == 0.0 and all(leaf.policy_mask)
