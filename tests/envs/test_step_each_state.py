"""``StepEachState``: a stateful env's batch ``step`` from its per-trajectory ``step_one``."""

from __future__ import annotations

from typing import Any

import pytest

from treegrpo.envs.base import StepOutcome, Task
from treegrpo.envs.state import StepEachState


class Counter(StepEachState):
    """A state is a list of ints; a step appends its text's length and observes the list."""

    def __init__(self) -> None:
        self.log: list[str] = []

    def initial_state(self, task: Task) -> list[int]:
        self.log.append(f"open {task.id}")
        return []

    def close_state(self, state: Any) -> None:
        self.log.append(f"close {state}")

    def step_one(self, task: Task, text: str, allowed: bool, state: list[int]) -> StepOutcome:
        state.append(len(text))
        self.log.append(f"step {task.id} {text}")
        return StepOutcome("tool" if allowed else "answer", not allowed, observation=str(state))


TASKS = [Task("a", "q", ["1"]), Task("b", "q", ["1"])]


def test_steps_run_on_the_given_states_in_place_and_leave_them_open() -> None:
    env, states = Counter(), [[7], []]
    out = env.step(TASKS, ["xy", "xyz"], [True, False], states)
    assert states == [[7, 2], [3]]
    assert [(o.kind, o.done, o.observation) for o in out] == [
        ("tool", False, "[7, 2]"),
        ("answer", True, "[3]"),
    ]
    assert env.log == ["step a xy", "step b xyz"]


def test_without_states_each_step_gets_a_fresh_state_closed_right_after() -> None:
    env = Counter()
    out = env.step(TASKS, ["x", "xyzw"], [True, True])
    assert [o.observation for o in out] == ["[1]", "[4]"]
    assert env.log == ["open a", "step a x", "close [1]", "open b", "step b xyzw", "close [4]"]


def test_batch_lengths_must_match() -> None:
    with pytest.raises(ValueError):
        Counter().step(TASKS, ["x"], [True, True], [[], []])


def test_step_one_is_the_envs_to_say() -> None:
    with pytest.raises(NotImplementedError):
        StepEachState().step(TASKS[:1], ["x"], [True], [[]])
