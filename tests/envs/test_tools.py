"""Tools as plain Python (envs/tools.py): schemas from type hints and docstrings, argument checks,
and every failure as the model's information, never an exception."""

from __future__ import annotations

import time

import pytest

from treegrpo.envs.tools import Tool, bound_tools, function_tools, result_text, tool_method_names
from treegrpo.errors import ConfigError


def add(a: int, b: int = 1) -> int:
    """Add two whole numbers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def fail(x: str) -> str:
    """Always fails.

    Args:
        x: anything
    """
    raise KeyError(x)


def slow(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "done"


def test_schema_from_hints_and_docstring() -> None:
    t = Tool.of(add)
    assert t.name == "add"
    fn = t.schema["function"]
    assert fn["description"] == "Add two whole numbers."
    assert fn["parameters"]["properties"] == {
        "a": {"type": "integer", "description": "the first"},
        "b": {"type": "integer", "description": "the second"},
    }
    assert fn["parameters"]["required"] == ["a"]


def test_a_tool_without_docstring_is_one_line() -> None:
    def bare(x: int) -> int:
        return x

    with pytest.raises(ConfigError, match=r"tool bare: .*docstring.*Args:") as e:
        Tool.of(bare)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("args", "why"),
    [
        ({"a": 2, "c": 1}, "add has no argument c"),
        ({"b": 2}, "add needs the argument a"),
        ({"a": "2"}, "argument a of add must be integer"),
        ({"a": True}, "argument a of add must be integer"),  # JSON true is not a number
        ([1, 2], "must be a JSON object"),
    ],
)
def test_bad_arguments_are_the_models_information(args: object, why: str) -> None:
    r = Tool.of(add).call(args)
    assert not r.ran and r.error is not None and why in r.error and r.content.startswith("Error: ")


def test_a_call_runs_and_its_result_is_text() -> None:
    r = Tool.of(add).call({"a": 2, "b": 40})
    assert (r.content, r.error, r.ran) == ("42", None, True)
    assert result_text({"x": [1, "é"]}) == '{"x": [1, "é"]}' and result_text(object).startswith("<class")


def test_an_exception_in_the_tool_is_its_result() -> None:
    r = Tool.of(fail).call({"x": "k"})
    assert r.ran and r.error == "fail raised KeyError: 'k'" and r.content == "Error: fail raised KeyError: 'k'"


def test_a_call_past_the_time_limit_is_a_timeout_result() -> None:
    t0 = time.perf_counter()
    r = Tool.of(slow).call({"seconds": 5.0}, timeout_s=0.2)
    assert time.perf_counter() - t0 < 2.0
    assert r.ran and r.error == "slow timed out after 0.2 s"
    assert Tool.of(slow).call({"seconds": 0.0}, timeout_s=2.0).content == "done"


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def reset(self, **row: object) -> None:
        self.n = 0

    def bump(self, by: int) -> str:
        """Add to the counter.

        Args:
            by: how much
        """
        self.n += by
        return str(self.n)

    def fork(self) -> Counter:
        c = Counter()
        c.n = self.n
        return c

    def _private(self) -> None: ...


def test_a_tool_class_methods_are_tools_but_not_its_state_contract() -> None:
    assert tool_method_names(Counter) == ["bump"]
    a, b = Counter(), Counter()
    ta, tb = bound_tools(a)["bump"], bound_tools(b)["bump"]
    assert ta.call({"by": 2}).content == "2" and ta.call({"by": 3}).content == "5"
    assert tb.call({"by": 1}).content == "1" and a.n == 5  # each instance its own state


def test_function_tools_refuse_a_class_and_repeated_names() -> None:
    with pytest.raises(ConfigError, match="environment_factory"):
        function_tools([Counter])
    with pytest.raises(ConfigError, match="two tools are named add"):
        function_tools([add, add])


def pick(n: int, limit: int | None = None) -> str:
    """Echo the arguments and their types.

    Args:
        n: a whole number
        limit: an optional whole number
    """
    return f"{n!r} {limit!r}"


def test_arguments_follow_transformers_schema_conventions() -> None:
    """``Optional[int] = None`` accepts null (``nullable``); a whole-number float is an integer,
    passed as an int; other floats are refused (both were refused: 3.0 for an integer, null)."""
    t = Tool.of(pick)
    assert t.schema["function"]["parameters"]["properties"]["limit"]["nullable"] is True
    assert t.call({"n": 3.0, "limit": None}).content == "3 None"
    assert t.call({"n": 2, "limit": 4.0}).content == "2 4"
    assert t.call({"n": 3.5}).error == "argument n of pick must be integer, got 3.5"
    assert t.call({"n": None}).error == "argument n of pick must be integer, got null"


def huge(n: int) -> str:
    """A result of n megabytes.

    Args:
        n: megabytes
    """
    return "x" * (n << 20)


def test_a_huge_result_is_cut_by_characters_in_both_protocols() -> None:
    """A 5 MB result is cut to ``max_result_chars`` (marked) before anything reads it — in the tag
    protocol it was kept whole (20 MB of rollouts for one step)."""
    import json

    from treegrpo.envs.base import Task
    from treegrpo.envs.tool_env import ToolEnv

    env = ToolEnv([huge], max_result_tokens=100)
    call = "<tool_call>" + json.dumps({"name": "huge", "arguments": {"n": 5}}) + "</tool_call>"
    (out,) = env.step([Task("q", "q", ["x"])], [call], [True])
    content = out.info["messages"][-1]["content"]
    assert content == "x" * 800 + " …" and len(out.observation) < 900  # 8 characters a token
    assert ToolEnv([huge], max_result_chars=10).step([Task("q", "q", ["x"])], [call], [True])[0].info["messages"][-1][
        "content"
    ] == "x" * 10 + " …"
