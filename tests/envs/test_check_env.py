"""The env contract checked at start-up and at every step (envs/base.py): each mistake a user
made with an env of their own is one line naming the env and the fix, not a traceback or a
silent misbehaviour."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from treegrpo.envs.base import StepOutcome, Task, check_env, check_outcomes
from treegrpo.envs.search import SearchEnv
from treegrpo.errors import ConfigError
from treegrpo.rollout.agent import AgentConfig, StepRunner
from treegrpo.rollout.engine import Generation


@dataclass
class MyEnv:
    stop_strings: tuple[str, ...] = ("</answer>",)

    def prompt(self, task: Task) -> str:
        return task.question

    def step(self, tasks, steps, allowed):
        return [StepOutcome("answer", True, reward=1.0) for _ in steps]

    def score(self, task: Task, step: str) -> float:
        return 0.0


def one_line(env: object) -> str:
    with pytest.raises(ConfigError) as e:
        check_env(env)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_a_string_for_stop_strings() -> None:
    msg = one_line(MyEnv(stop_strings="</answer>"))  # type: ignore[arg-type]  # ("</answer>") is a str
    assert msg.startswith("env MyEnv.stop_strings is the string '</answer>', not a tuple: write ('</answer>',)")


def test_no_stop_strings_and_missing_methods() -> None:
    class NoStops:
        def prompt(self, task): ...
        def step(self, tasks, steps, allowed): ...
        def score(self, task, step): ...

    assert "env NoStops has no stop_strings" in one_line(NoStops())

    class NoScore:
        stop_strings = ()

        def prompt(self, task): ...
        def step(self, tasks, steps, allowed): ...

    assert "env NoScore has no score() method" in one_line(NoScore())


def test_a_declared_action_whose_end_tag_is_not_a_stop_string() -> None:
    env = MyEnv()
    env.actions = {"lookup": "</lookup>", "answer": "</answer>"}  # type: ignore[attr-defined]
    msg = one_line(env)
    assert "lack '</lookup>', the end tag of its 'lookup' action" in msg and "add '</lookup>' to stop_strings" in msg


def test_outcomes_checked_per_step() -> None:
    env = MyEnv()
    ok = [StepOutcome("answer", True, reward=1.0)]
    assert check_outcomes(env, ok, 1) == ok
    with pytest.raises(ConfigError, match=r"env MyEnv.step returned 1 outcomes for 2 steps"):
        check_outcomes(env, ok, 2)
    with pytest.raises(ConfigError, match=r"returned kind 'lookup': declare it in MyEnv.actions"):
        check_outcomes(env, [StepOutcome("lookup", False, observation="x")], 1)
    with pytest.raises(ConfigError, match=r"ended a trajectory \(answer\) without a reward"):
        check_outcomes(env, [StepOutcome("answer", True)], 1)
    with pytest.raises(ConfigError, match="returned a dict"):
        check_outcomes(env, [{"kind": "answer"}], 1)


def test_the_runner_checks_at_start_up_and_each_step() -> None:
    """A StepRunner refuses a broken env before generating anything, and an env that returns one
    outcome too few stops the run with the env named (it was a raw zip() ValueError)."""

    class Engine:
        def generate(self, contexts, params, generator=None):
            return [Generation(tokens=[5], logprobs=[0.0], finish_reason="stop", prefill_tokens=len(c)) for c in contexts]

    class Tok:
        chat_template = None

        def encode(self, text, add_special_tokens=False):
            return [ord(c) % 50 for c in text]

        def decode(self, ids, skip_special_tokens=False):
            return "x" * len(ids)

    with pytest.raises(ConfigError, match="stop_strings is the string"):
        StepRunner(Engine(), MyEnv(stop_strings="</answer>"), Tok(), AgentConfig())  # type: ignore[arg-type]

    class Short(MyEnv):
        def step(self, tasks, steps, allowed):
            return [StepOutcome("answer", True, reward=1.0)][: len(steps) - 1]

    from treegrpo.rollout.samplers import SamplerConfig, get_sampler

    runner = StepRunner(Engine(), Short(), Tok(), AgentConfig(max_step_tokens=4))  # type: ignore[arg-type]
    import random

    import torch

    with pytest.raises(ConfigError, match=r"env Short\.step returned 1 outcomes for 2 steps"):
        get_sampler("chain")(runner, [Task("q", "q?", ["a"])], SamplerConfig("chain", group_size=2), random.Random(0), torch.Generator())


def test_the_builtin_envs_pass() -> None:
    check_env(SearchEnv(retriever=None))  # type: ignore[arg-type]
    check_env(MyEnv())
