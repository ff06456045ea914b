"""Reward functions tried before the model loads (envs/reward_check.py, issue 42): the columns a
function names must be in every row, and a trial call on a few rows (training and held out) must
give one number per completion; each failure is one line naming the function, the row and the fix."""

from __future__ import annotations

from typing import Any

import pytest

from treegrpo.envs.base import Task
from treegrpo.envs.reward_check import check_rewards, needed_columns, placeholder_completion, trial_rows
from treegrpo.envs.reward_fns import RewardSet
from treegrpo.errors import ConfigError

TRAIN = [Task(f"t{i}", f"q{i}", [str(i)], meta={"answer": str(i), "level": i}) for i in range(4)]
HELD = [Task("h0", "qh", ["9"], meta={"answer": "9", "level": 9}), Task("h1", "qh1", [], meta={"answer": "", "level": 1})]


def fine(completions, answer, **kwargs):  # type: ignore[no-untyped-def]
    return [float(c[-1]["content"] == a) for c, a in zip(completions, answer, strict=True)]


def one_value(completions, **kwargs):  # type: ignore[no-untyped-def]
    return [1.0]  # right only when one completion is scored at a time (the held-out evaluation's case)


def by_level(completions, level, bonus=0.0):  # type: ignore[no-untyped-def]
    return [float(lv) + bonus for lv in level]


def error(fn: Any, train: list[Task] = TRAIN, held: list[Task] = HELD) -> str:
    with pytest.raises(ConfigError) as e:
        check_rewards(RewardSet.of([fn]), train, held)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_needed_columns_are_the_named_arguments_without_default() -> None:
    assert needed_columns(by_level) == ["level"]
    assert needed_columns(fine) == []  # **kwargs: it reads what it reads
    assert needed_columns(lambda prompts, completions, completion_ids, trainer_state, environments: 0) == []


def test_a_function_that_scores_every_placeholder_passes() -> None:
    seen: list[Any] = []

    def spy(completions, answer, **kwargs):  # type: ignore[no-untyped-def]
        seen.append((completions, answer, kwargs["completion_ids"], kwargs["trainer_state"].max_steps))
        return fine(completions, answer)

    check_rewards(RewardSet.of([spy, by_level]), TRAIN, HELD, max_steps=5)
    rows = trial_rows(TRAIN, HELD)
    assert [t.id for t in rows] == ["t0", "t1", "h0"]
    assert seen == [([placeholder_completion(t) for t in rows], ["0", "1", "9"], [[], [], []], 5)]
    assert placeholder_completion(HELD[1]) == [{"role": "assistant", "content": ""}]


def test_too_few_values_fail_before_the_model_loads() -> None:
    msg = error(one_value)
    assert "reward function one_value returned 1 values for 3 completions" in msg
    assert "before the model loads" in msg and "t0, t1, h0" in msg


def test_a_column_missing_from_one_row_is_named() -> None:
    held = [HELD[0], Task("h1", "qh1", ["1"], meta={"answer": "1"})]
    msg = error(by_level, held=held)
    assert msg.startswith("reward function by_level needs the column 'level', which held-out row 2 (id h1) lacks")
    assert "give the parameter a default (level=None) or take **kwargs" in msg


def test_a_function_that_raises_or_returns_text_is_named_with_its_row() -> None:
    def picky(completions, answer, **kwargs):  # type: ignore[no-untyped-def]
        return [1.0 / int(a) for a in answer]  # the first row's answer is "0"

    assert error(picky).startswith("reward function picky failed on row t0: ZeroDivisionError")
    assert "returned 'yes' for row t0" in error(lambda completions, **kw: ["yes"] * len(completions))


def test_an_async_function_is_tried_too() -> None:
    async def short(completions, **kwargs):  # type: ignore[no-untyped-def]
        return [1.0]

    assert "returned 1 values for 3 completions" in error(short)


class Box:
    def __init__(self) -> None:
        self.row: dict[str, Any] = {}

    def reset(self, **row: Any) -> None:
        self.row = row

    def peek(self) -> str:
        """Look."""
        return "x"


def test_a_function_reading_environments_gets_fresh_reset_instances() -> None:
    def by_env(completions, environments):  # type: ignore[no-untyped-def]
        return [float(e.row["level"]) for e in environments]

    check_rewards(RewardSet.of([by_env]), TRAIN, HELD, environment_factory=Box)
    with pytest.raises(ConfigError, match="by_env failed on row t0: AttributeError"):
        check_rewards(RewardSet.of([by_env]), TRAIN, HELD)  # no tool class: None per completion
