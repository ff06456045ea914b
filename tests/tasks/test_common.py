"""A generated family's problem set and config reader (``tasks/common.py``)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from treegrpo.envs.base import Task
from treegrpo.tasks.common import ProblemSet, Settings


@dataclass(frozen=True)
class _Cfg(Settings):
    n: int = 1
    kinds: tuple[str, ...] = ("a",)
    names: list[str] | None = None


def test_from_dict_drops_unknown_keys_and_restores_tuples() -> None:
    recorded = json.loads(json.dumps({**_Cfg(3, ("a", "b"), ["x"]).to_dict(), "gone": 1}))
    assert recorded == {"n": 3, "kinds": ["a", "b"], "names": ["x"], "gone": 1}
    cfg = _Cfg.from_dict(recorded)
    assert cfg == _Cfg(3, ("a", "b"), ["x"]) and isinstance(cfg.kinds, tuple) and isinstance(cfg.names, list)


def test_problem_set_names_a_missing_split() -> None:
    t = Task("q1", "question?", ["a"])
    problems = ProblemSet(_Cfg(), {"train": [t]})
    assert problems.tasks("train") == [t]
    with pytest.raises(ValueError, match="unknown split 'eval'"):
        problems.tasks("eval")
