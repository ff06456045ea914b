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
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

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


@dataclass(frozen=True)
class ToolResult:
    """What one call returned: ``content`` (the text the model reads), ``error`` (set when the call
    failed: the content then says why) and ``ran`` (the function was called: counted as a tool call
    in the budget; a call refused before it ran — unknown tool, bad arguments — was not)."""

    name: str
    content: str
    error: str | None = None
    ran: bool = False


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


def _check_type(value: Any, spec: Mapping[str, Any]) -> bool:
    kinds = spec.get("type")
    if kinds is None:
        return True
    kinds = kinds if isinstance(kinds, list) else [kinds]
    for k in kinds:
        types = _JSON_TYPES.get(k, (object,))
        if isinstance(value, bool) and k in ("integer", "number"):
            continue  # JSON true is not a number
        if isinstance(value, types):
            return "enum" not in spec or value in spec["enum"]
    return False


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
        if not isinstance(arguments, dict):
            return f"the arguments of {self.name} must be a JSON object, got {type(arguments).__name__}"
        params = self.schema["function"].get("parameters", {})
        props: dict[str, Any] = params.get("properties", {})
        unknown = sorted(set(arguments) - set(props))
        if unknown:
            return f"{self.name} has no argument {', '.join(unknown)} (its arguments: {', '.join(props) or 'none'})"
        missing = [a for a in params.get("required", []) if a not in arguments]
        if missing:
            return f"{self.name} needs the argument {', '.join(missing)}"
        for k, v in arguments.items():
            if not _check_type(v, props[k]):
                return f"argument {k} of {self.name} must be {props[k].get('type')}, got {json.dumps(v)[:40]}"
        return None

    def call(self, arguments: Any, timeout_s: float | None = None) -> ToolResult:
        """Run the tool on ``arguments``; every failure is a :class:`ToolResult` with ``error``."""
        why = self.check_arguments(arguments)
        if why is not None:
            return ToolResult(self.name, f"Error: {why}.", error=why)
        try:
            value = _run(self.fn, arguments, timeout_s)
        except TimeoutError:
            why = f"{self.name} timed out after {timeout_s:g} s"
            return ToolResult(self.name, f"Error: {why}.", error=why, ran=True)
        except Exception as e:  # the tool's own failure is the model's information
            why = f"{self.name} raised {type(e).__name__}: {e}"
            return ToolResult(self.name, f"Error: {why}", error=why, ran=True)
        return ToolResult(self.name, result_text(value), ran=True)


def result_text(value: Any) -> str:
    """A tool's return value as the text the model reads: a string as it is, anything JSON can
    write as JSON, anything else through ``str``."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


def _run(fn: Callable[..., Any], arguments: dict[str, Any], timeout_s: float | None) -> Any:
    """``fn(**arguments)``; with ``timeout_s`` in a daemon thread that is abandoned when it runs
    past the limit (Python cannot stop a thread: a tool that never returns keeps its thread)."""
    if timeout_s is None:
        return fn(**arguments)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn(**arguments)
        except BaseException as e:  # re-raised in the caller
            box["error"] = e

    t = threading.Thread(target=target, daemon=True, name=f"tool-{getattr(fn, '__name__', 'fn')}")
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise TimeoutError
    if "error" in box:
        raise box["error"]
    return box.get("value")


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
    "function_tools",
    "result_text",
    "tool_method_names",
    "tool_schema",
]
