"""Tools as plain Python: a function with type hints and a docstring, or a class whose public
methods are tools and whose instance is one trajectory's state (TRL's ``environment_factory``).

A tool's JSON schema comes from transformers' ``get_json_schema`` (as TRL builds it): the
function's name, the first docstring paragraph as its description, and one entry per argument
from its type hint and its ``Args:`` line. :class:`Tool` validates a call's arguments against that
schema and runs it; whatever goes wrong — an unknown tool, a missing or wrongly typed argument, an
exception inside the tool, a time-out — becomes the error text the model gets back as the tool's
result (:class:`ToolResult` with ``error`` set), never an exception in the run (DESIGN.md §3.6).

A tool class (:func:`class_tools`) is instantiated once per trajectory; before its first step the
loop calls ``reset(**row)`` with the question's dataset row when the class has one (its return
value, a string or ``None``, is appended to the question, as TRL does). Methods named ``reset``,
``get_reward``, ``fork``, ``snapshot``, ``restore``, ``close``, ``state_key`` and those starting
with ``_`` are not tools: they are the state contract (:mod:`treegrpo.envs.state`).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from treegrpo.envs.tool_result import ToolResult, cut_result, failure, refused, result_text, timed_out
from treegrpo.envs.tool_runner import Job, ToolRunner
from treegrpo.errors import ConfigError

#: Method names of a tool class that are its state contract, not tools.
CONTRACT_METHODS = frozenset({"reset", "get_reward", "fork", "snapshot", "restore", "close", "state_key"})
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list, tuple),
    "object": (dict,),
    "null": (type(None),),
}


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The OpenAI-style JSON schema of ``fn`` (transformers' ``get_json_schema``).

    Raises:
        ConfigError: ``fn`` has no docstring, an argument without a type hint or without an
            ``Args:`` description (one line naming the tool and the fix).
    """
    from transformers.utils import get_json_schema

    name = getattr(fn, "__name__", repr(fn))
    try:
        return get_json_schema(fn)
    except Exception as e:  # DocstringParsingException, TypeHintParsingException
        raise ConfigError(
            f"tool {name}: {e} — a tool needs a type hint on every argument and a docstring whose Args: section "
            "describes each one (transformers' get_json_schema, as TRL reads tools)"
        ) from None


def _fit_type(value: Any, spec: Mapping[str, Any]) -> tuple[bool, Any]:
    """Whether ``value`` fits ``spec`` (transformers' schema conventions: ``nullable`` accepts
    ``null``; a whole-number float such as ``3.0`` is an ``integer``), and the value to pass (the
    float as an int)."""
    if value is None and spec.get("nullable"):
        return True, None
    kinds = spec.get("type")
    if kinds is None:
        return True, value
    kinds = kinds if isinstance(kinds, list) else [kinds]
    for k in kinds:
        types = _JSON_TYPES.get(k, (object,))
        if isinstance(value, bool) and k in ("integer", "number"):
            continue  # JSON true is not a number
        v = value
        if k == "integer" and isinstance(value, float) and value.is_integer():
            v = int(value)
        if isinstance(v, types) and ("enum" not in spec or v in spec["enum"]):
            return True, v
    return False, value


@dataclass
class Tool:
    """One callable tool and its schema (:func:`tool_schema`)."""

    fn: Callable[..., Any]
    schema: dict[str, Any]

    @classmethod
    def of(cls, fn: Callable[..., Any]) -> Tool:
        if not callable(fn):
            raise ConfigError(f"tool {fn!r} is not callable: give a function (or a class of tool methods)")
        return cls(fn, tool_schema(fn))

    @property
    def name(self) -> str:
        return str(self.schema["function"]["name"])

    def check_arguments(self, arguments: Any) -> str | None:
        """Why ``arguments`` do not fit the schema (one sentence for the model), or ``None``."""
        return self.prepare(arguments)[1]

    def prepare(self, arguments: Any) -> tuple[dict[str, Any], str | None]:
        """``arguments`` as the tool gets them (whole-number floats of integer arguments as ints),
        and why they do not fit the schema (one sentence for the model), or ``None``."""
        if not isinstance(arguments, dict):
            return {}, f"the arguments of {self.name} must be a JSON object, got {type(arguments).__name__}"
        params = self.schema["function"].get("parameters", {})
        props: dict[str, Any] = params.get("properties", {})
        unknown = sorted(set(arguments) - set(props))
        if unknown:
            why = f"{self.name} has no argument {', '.join(unknown)} (its arguments: {', '.join(props) or 'none'})"
            return {}, why
        missing = [a for a in params.get("required", []) if a not in arguments]
        if missing:
            return {}, f"{self.name} needs the argument {', '.join(missing)}"
        out: dict[str, Any] = {}
        for k, v in arguments.items():
            ok, out[k] = _fit_type(v, props[k])
            if not ok:
                return {}, f"argument {k} of {self.name} must be {props[k].get('type')}, got {_short_json(v)}"
        return out, None

    def call(self, arguments: Any, timeout_s: float | None = None) -> ToolResult:
        """Run the tool on ``arguments`` alone (checked, run on a :class:`ToolRunner`, time-limited);
        every failure is a :class:`ToolResult` with ``error``."""
        args, why = self.prepare(arguments)
        if why is not None:
            return refused(self.name, why)
        runner = ToolRunner(1, timeout_s)
        try:
            [job] = runner.run([Job(0, [(self, args)])])
        finally:
            runner.close()
        return job.results[0]


def _short_json(v: Any) -> str:
    try:
        return json.dumps(v)[:40]
    except (TypeError, ValueError, RecursionError):
        return type(v).__name__


def tool_method_names(cls: type) -> list[str]:
    """The public methods of a tool class that are tools (not its state contract): the class's own
    in definition order, then those it inherits."""
    names: list[str] = []
    for klass in cls.__mro__[:-1]:  # the class first, then its bases (object excluded)
        for name, member in vars(klass).items():
            public = inspect.isfunction(member) and not name.startswith("_") and name not in CONTRACT_METHODS
            if public and name not in names:
                names.append(name)
    return names


def bound_tools(instance: Any) -> dict[str, Tool]:
    """The tools of one instance of a tool class, by name (bound methods: they act on its state)."""
    return {t.name: t for t in (Tool.of(getattr(instance, n)) for n in tool_method_names(type(instance)))}


def function_tools(fns: Sequence[Callable[..., Any]]) -> dict[str, Tool]:
    """Plain function tools by name; a repeated name is a ConfigError."""
    out: dict[str, Tool] = {}
    for fn in fns:
        if inspect.isclass(fn):
            raise ConfigError(
                f"tool {fn.__name__} is a class: pass a tool class as environment_factory= (--tools accepts one "
                "class, whose instance is a trajectory's state)"
            )
        t = Tool.of(fn)
        if t.name in out:
            raise ConfigError(f"two tools are named {t.name}: tool names must be unique")
        out[t.name] = t
    return out


__all__ = [
    "CONTRACT_METHODS",
    "Tool",
    "ToolResult",
    "bound_tools",
    "cut_result",
    "failure",
    "function_tools",
    "refused",
    "result_text",
    "timed_out",
    "tool_method_names",
    "tool_schema",
]
