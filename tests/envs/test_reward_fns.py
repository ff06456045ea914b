"""Reward functions with TRL's convention (envs/reward_fns.py): hand-derived weighted sums, None
left out, the columns as keyword arguments, and a failing function named with its row."""

from __future__ import annotations

import pytest

from treegrpo.envs.base import Task
from treegrpo.envs.reward_fns import BUILTIN_REWARDS, RewardSet, exact_match, final_text
from treegrpo.errors import ConfigError

TASKS = [Task("a", "q1", ["Paris"], meta={"level": 1}), Task("b", "q2", ["7"], meta={"level": 2})]
PROMPTS = [[{"role": "user", "content": "q1"}], [{"role": "user", "content": "q2"}]]
COMPLETIONS = [
    [{"role": "assistant", "content": "", "tool_calls": []}, {"role": "tool", "content": "x"}, {"role": "assistant", "content": "paris"}],
    [{"role": "assistant", "content": "8"}],
]


def by_level(completions, level, **kwargs):
    return [0.5 * lv for lv in level]


def only_first(prompts, completions):  # takes no **kwargs: gets only what it names
    return [1.0, None]


def test_builtin_rewards_read_the_final_message() -> None:
    assert final_text(COMPLETIONS[0]) == "paris" and final_text("plain") == "plain" and final_text([]) == ""
    assert exact_match(COMPLETIONS, [["Paris"], ["7"]]) == [1.0, 0.0]
    assert set(BUILTIN_REWARDS) == {"em", "sub_em", "f1"}


def test_weighted_sum_by_hand() -> None:
    rs = RewardSet.of(["em", by_level, only_first], [2.0, 1.0, 0.5])
    (t0, v0), (t1, v1) = rs.score(TASKS, PROMPTS, COMPLETIONS)
    # row a: em 1 (x2) + level 1 -> 0.5 (x1) + only_first 1.0 (x0.5) = 2 + 0.5 + 0.5
    assert t0 == pytest.approx(3.0) and v0 == {"em": 1.0, "by_level": 0.5, "only_first": 1.0}
    # row b: em 0 + level 2 -> 1.0 + only_first None (left out) = 1.0
    assert t1 == pytest.approx(1.0) and v1 == {"em": 0.0, "by_level": 1.0}
    assert not rs.binary and RewardSet.of("em").binary and not RewardSet.of("f1").binary


def test_a_failing_reward_names_itself_and_the_row() -> None:
    def picky(completions, answers, **kw):
        return [1.0 / (len(a[0]) - 1) for a in answers]  # row b: "7" -> division by zero

    with pytest.raises(ConfigError, match=r"^reward function picky failed on row b: ZeroDivisionError") as e:
        RewardSet.of([picky]).score(TASKS, PROMPTS, COMPLETIONS)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("fn", "match"),
    [
        (lambda completions, **k: [1.0], "returned 1 values for 2 completions"),
        (lambda completions, **k: 1.0, "returned float: it must return a list of 2 numbers"),
        (lambda completions, **k: [1.0, "x"], r"returned 'x' for row b"),
        (lambda completions, **k: [1.0, float("nan")], r"returned nan for row b"),
        (lambda completions, **k: [None, None], "no reward function scored row a"),
    ],
)
def test_bad_reward_values_are_one_line(fn, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        RewardSet.of([fn]).score(TASKS, PROMPTS, COMPLETIONS)


def test_names_and_weights_are_checked() -> None:
    with pytest.raises(ConfigError, match="2 values for 1"):
        RewardSet.of(["em"], [1.0, 2.0])
    with pytest.raises(ConfigError, match="named em"):
        RewardSet.of(["em", "em"])
    with pytest.raises(ConfigError, match="not a built-in reward"):
        RewardSet.of(["exact"])
    with pytest.raises(ConfigError, match="no module"):
        RewardSet.of(["no_such_module_here:fn"])
