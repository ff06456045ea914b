"""What one tool call returned (:class:`ToolResult`) and how each outcome is written for the
model: a value as text, a result cut to its cap, a failure, a time-out, a refusal."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolResult:
    """What one call returned: ``content`` (the text the model reads), ``error`` (set when the call
    failed: the content then says why) and ``ran`` (the function was called: counted as a tool call
    in the budget; a call refused before it ran — unknown tool, bad arguments — was not)."""

    name: str
    content: str
    error: str | None = None
    ran: bool = False


def failure(name: str, error: BaseException) -> ToolResult:
    """The result of a call that raised ``error`` (any ``BaseException``: ``SystemExit`` and
    ``GeneratorExit`` too, so a tool cannot end the run): the model reads what was raised."""
    why = f"{name} raised {type(error).__name__}: {error}"
    return ToolResult(name, f"Error: {why}", error=why, ran=True)


def timed_out(name: str, timeout_s: float | None) -> ToolResult:
    """The result of a call abandoned after ``timeout_s``."""
    why = f"{name} timed out after {timeout_s:g} s"
    return ToolResult(name, f"Error: {why}.", error=why, ran=True)


def refused(name: str, why: str) -> ToolResult:
    """The result of a call refused before it ran (an unknown tool, arguments that do not fit)."""
    return ToolResult(name, f"Error: {why}.", error=why)


def cut_result(content: str, max_chars: int | None) -> str:
    """``content`` cut to ``max_chars`` characters (marked with `` …``); as it is when it fits or
    there is no limit. The character cut comes first, so a huge result is never tokenized whole."""
    if max_chars is None or len(content) <= max_chars:
        return content
    return content[:max_chars] + " …"


def result_text(value: Any) -> str:
    """A tool's return value as the text the model reads: a string as it is, anything JSON can
    write as JSON, anything else through ``str``."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        try:
            return str(value)
        except Exception as e:  # a value that cannot even be written: say so
            return f"Error: the result ({type(value).__name__}) cannot be written as text: {e}"


__all__ = ["ToolResult", "cut_result", "failure", "refused", "result_text", "timed_out"]
