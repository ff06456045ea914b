"""TRL's reward signature (issue 40 item 5): reward functions also get ``completion_ids`` (the
trajectory's ids after the prompt, tool results included), ``trainer_state``, ``log_metric`` /
``log_extra`` and ``environments``; ``async def`` functions are awaited; numpy/torch scalars and
bools are rewards."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fakes import EOSEngine, ScriptedEngine
from treegrpo.envs.base import Task
from treegrpo.envs.reward_fns import RewardLog, RewardSet, TrainerState
from treegrpo.envs.tool_env import ToolEnv
from treegrpo.errors import ConfigError
from treegrpo.models.loader import load_tokenizer
from treegrpo.rollout.agent import AgentConfig, StepRunner
from treegrpo.rollout.samplers import SamplerConfig, get_sampler


def add(a: int, b: int) -> int:
    """Add two whole numbers.

    Args:
        a: the first
        b: the second
    """
    return a + b


TASKS = [Task("a", "q1", ["5"], meta={"level": 1}), Task("b", "q2", ["7"], meta={"level": 2})]
PROMPTS = [[{"role": "user", "content": "q1"}], [{"role": "user", "content": "q2"}]]
COMPLETIONS = [[{"role": "assistant", "content": "5"}], [{"role": "assistant", "content": "8"}]]


def test_trl_arguments_reach_a_function_that_names_them() -> None:
    got: dict[str, Any] = {}

    def trl(prompts, completions, completion_ids, trainer_state, log_metric, log_extra, environments):  # type: ignore[no-untyped-def]
        got.update(ids=completion_ids, step=trainer_state.global_step, epoch=trainer_state.epoch, envs=environments)
        log_metric("my/len", 2.0)
        log_metric("my/len", 4.0)
        log_extra("my/text", [c[-1]["content"] for c in completions])
        return [1.0, 0.0]

    rs = RewardSet.of([trl])
    rs.advance(3, 0.75, 10)
    scored = rs.score(TASKS, PROMPTS, COMPLETIONS, [[1, 2], [3]], ["env-a", "env-b"])
    assert [t for t, _ in scored] == [1.0, 0.0]
    assert got == {"ids": [[1, 2], [3]], "step": 3, "epoch": 0.75, "envs": ["env-a", "env-b"]}
    assert rs.state.max_steps == 10
    assert rs.log.drain("x/") == {"x/my/len": 3.0, "x/my/text": ["5", "8"]}
    assert rs.log.drain() == {}  # drained
    rs.score(TASKS, PROMPTS, COMPLETIONS)  # an env that passes no ids: None per completion
    assert got["ids"] == [None, None] and got["envs"] == [None, None]


def test_an_async_reward_function_is_awaited() -> None:
    async def slow_em(completions, answers, **kwargs):  # type: ignore[no-untyped-def]
        await asyncio.sleep(0.01)
        return [float(c[-1]["content"] == a[0]) for c, a in zip(completions, answers, strict=True)]

    assert [t for t, _ in RewardSet.of([slow_em]).score(TASKS, PROMPTS, COMPLETIONS)] == [1.0, 0.0]


def test_numpy_torch_and_bool_rewards() -> None:
    def mixed(completions, **kwargs):  # type: ignore[no-untyped-def]
        return [np.float32(0.5), torch.tensor(True)]

    def flags(completions, **kwargs):  # type: ignore[no-untyped-def]
        return np.array([True, False])

    (t0, v0), (t1, v1) = RewardSet.of([mixed, flags]).score(TASKS, PROMPTS, COMPLETIONS)
    assert (t0, t1) == (1.5, 1.0) and v0 == {"mixed": 0.5, "flags": 1.0} and v1 == {"mixed": 1.0, "flags": 0.0}


def test_log_metric_refuses_a_non_number() -> None:
    with pytest.raises(ConfigError, match="log_metric\\('x'\\) returned 'a'"):
        RewardLog().log_metric("x", "a")  # type: ignore[arg-type]
    assert TrainerState().global_step == 0


class Counter:
    """A tool class: its instance is the trajectory's environment."""

    def __init__(self) -> None:
        self.n = 0

    def bump(self) -> str:
        """Add one."""
        self.n += 1
        return str(self.n)


def policy(context: str, draw: float) -> str:
    if context.count("tool_response>") >= 4:  # the prompt names the tag twice; one result: answer
        return "<answer> 5 </answer>"
    return '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


def class_policy(context: str, draw: float) -> str:
    if context.count("tool_response>") >= 4:
        return "<answer> 1 </answer>"
    return '<tool_call>{"name": "bump", "arguments": {}}</tool_call>'


@pytest.mark.parametrize("sampler", ["chain", "tree"])
def test_completion_ids_are_each_paths_ids_after_the_prompt(tiny_model_dir: Path, sampler: str) -> None:
    """Each leaf's reward function got exactly the ids of its path after the prompt: the generated
    ids and the tool results' ids between them (policy_mask tells them apart)."""
    tok = load_tokenizer(tiny_model_dir)
    calls: list[list[int]] = []

    def ids_len(completions, completion_ids):  # type: ignore[no-untyped-def]
        calls.extend(completion_ids)
        return [float(len(c)) for c in completion_ids]

    env = ToolEnv([add], rewards=[ids_len])
    runner = StepRunner(ScriptedEngine(tok, policy), env, tok, AgentConfig(max_turns=2, max_step_tokens=64))  # type: ignore[arg-type]
    cfg = SamplerConfig("chain", group_size=2) if sampler == "chain" else SamplerConfig("tree", m=1, n=1, l=1)
    res = get_sampler(sampler)(runner, [Task("q", "What is 2 + 3?", ["5"])], cfg, random.Random(0), torch.Generator().manual_seed(0))
    paths = [[t for n in f.trees[ti].path(leaf.id)[1:] for t in n.tokens] for f in res.forests for ti, leaf in f.leaves()]
    leaves = [leaf for f in res.forests for _, leaf in f.leaves()]
    assert sorted(map(tuple, calls)) == sorted(map(tuple, paths))
    assert all(leaf.reward == float(len(p)) for leaf, p in zip(leaves, paths, strict=True))
    assert any(0 in n.policy_mask for f in res.forests for t in f.trees for n in t.nodes[1:])  # tool ids included


def test_completion_ids_when_the_loop_ends_a_trajectory(tiny_model_dir: Path) -> None:
    """A trajectory the loop ends (an action-less turn at EOS) is scored with its ids too."""
    tok = load_tokenizer(tiny_model_dir)
    got: list[list[int]] = []

    def ids(completion_ids, **kwargs):  # type: ignore[no-untyped-def]
        got.extend(completion_ids)
        return [0.0] * len(completion_ids)

    env = ToolEnv([add], rewards=[ids])
    engine = EOSEngine(tok, lambda c, d: "I give up." + tok.eos_token)
    runner = StepRunner(engine, env, tok, AgentConfig(max_turns=1, max_step_tokens=32))  # type: ignore[arg-type]
    res = get_sampler("chain")(runner, [Task("q", "Q?", ["5"])], SamplerConfig("chain", group_size=1), random.Random(0), torch.Generator())
    (leaf,) = [leaf for _, leaf in res.forests[0].leaves()]
    assert got == [leaf.tokens] and leaf.tokens[-1] == tok.eos_token_id


def test_environments_are_the_trajectories_instances(tiny_model_dir: Path) -> None:
    tok = load_tokenizer(tiny_model_dir)
    seen: list[Any] = []

    def by_state(completions, environments):  # type: ignore[no-untyped-def]
        seen.extend(environments)
        return [float(e.n) for e in environments]

    env = ToolEnv(environment_factory=Counter, rewards=[by_state])
    runner = StepRunner(ScriptedEngine(tok, class_policy), env, tok, AgentConfig(max_turns=2, max_step_tokens=64))  # type: ignore[arg-type]
    res = get_sampler("chain")(runner, [Task("q", "Count.", ["1"])], SamplerConfig("chain", group_size=2), random.Random(0), torch.Generator())
    assert len(seen) == 2 and all(isinstance(e, Counter) for e in seen) and seen[0] is not seen[1]
    assert [leaf.reward for _, leaf in res.forests[0].leaves()] == [1.0, 1.0]
