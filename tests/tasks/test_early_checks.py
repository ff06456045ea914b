"""Which runs get their reward functions tried before the model loads (tasks/custom.py
``check_rewards_early``): your tools' runs from the CLI (references in the config) and from Python,
the search task scored by your own functions; not your own env, nor the search task's built-in
scores."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from treegrpo.errors import ConfigError
from treegrpo.tasks.custom import UserObjects, check_rewards_early
from treegrpo.training.config import TrainConfig


def add(a: int, b: int) -> int:
    """Add two whole numbers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def too_few(completions, **kwargs) -> list[float]:  # type: ignore[no-untyped-def]
    return [1.0]


def rows_file(tmp_path: Path) -> Path:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"question": f"{i} + {i}?", "answer": str(2 * i)}) + "\n" for i in range(6)))
    return path


def test_a_cli_run_of_your_tools_is_checked(tmp_path: Path) -> None:
    cfg = TrainConfig(data=str(rows_file(tmp_path)), tools=[f"{__name__}:add"], reward=[f"{__name__}:too_few"])
    with pytest.raises(ConfigError, match="reward function too_few returned 1 values for 3 completions"):
        check_rewards_early(cfg)
    check_rewards_early(TrainConfig(data=str(rows_file(tmp_path)), tools=[f"{__name__}:add"]))  # em: fine


def test_the_search_task_is_checked_only_with_your_functions(tmp_path: Path) -> None:
    search = {"data": "wiki-vital-qa", "corpus": "wiki-vital"}
    with pytest.raises(ConfigError, match="too_few returned 1 values for 3 completions"):
        check_rewards_early(TrainConfig(**search, reward=[f"{__name__}:too_few"]))
    with pytest.raises(ConfigError, match="too_few returned 1 values"):
        check_rewards_early(TrainConfig(**search), UserObjects(rewards=[too_few]))
    check_rewards_early(TrainConfig(**search, reward=["format"]))  # Search-R1's own score: nothing to try


def test_your_own_env_or_no_rows_is_not_checked(tmp_path: Path) -> None:
    check_rewards_early(TrainConfig(env=f"{__name__}:add"))  # an env scores itself (never imported here)
    check_rewards_early(TrainConfig(tools=[f"{__name__}:add"], reward=[f"{__name__}:too_few"]))  # no --data
