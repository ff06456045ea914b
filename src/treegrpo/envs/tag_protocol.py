"""The tag protocol of :class:`~treegrpo.envs.tool_env.ToolEnv`: treegrpo's own text protocol for
any model (a tiny one trained from scratch included) — its prompt, its one call per step written as
``<tool_call>{"name": …, "arguments": {…}}</tool_call>``, the result inline in ``<tool_response>``
tags (Search-R1's way), the final answer in ``<answer>`` tags, and the invalid-action text.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from treegrpo.envs.reward_fns import Message
from treegrpo.rollout.tool_parsers import safe_json

#: The tag protocol's default prompt: the question, then the tools and how to call them.
TOOLS_PROMPT = (
    "{question}\n\nYou can call these tools, one per step, as <tool_call>{{\"name\": ..., \"arguments\": {{...}}}}"
    "</tool_call>; each result comes back inside <tool_response> and </tool_response>. Give the final answer "
    "inside <answer> and </answer>.\nTools:\n{tools}\n"
)
MINIMAL_TOOLS_PROMPT = "Question: {question}\n"
TOOL_PROMPTS = {"tools": TOOLS_PROMPT, "minimal": MINIMAL_TOOLS_PROMPT}
INVALID_TOOL_ACTION = (
    "\nMy previous action is invalid. To call a tool, I should write <tool_call>{\"name\": ..., \"arguments\": "
    "{...}}</tool_call>. To give the final answer, I should write <answer> ... </answer>. Let me try again.\n"
)
_ACTION = re.compile(r"<(tool_call|answer)>(.*?)</\1>", re.DOTALL)


def tool_response(content: str) -> str:
    """The tag protocol's observation: a tool's result inline, in ``<tool_response>`` tags."""
    return f"\n<tool_response>\n{content}\n</tool_response>\n"


def parse_call(payload: str) -> tuple[str, Any] | str:
    """``(name, arguments)`` of a ``{"name": …, "arguments": {…}}`` call (``parameters`` accepted for
    ``arguments``, Llama's spelling), or why it is not one (a sentence for the model). Never raises:
    decoded by :func:`~treegrpo.rollout.tool_parsers.safe_json` (depth, length and integer limits)."""
    call, why = safe_json(payload)
    if why is not None:
        return f"the tool call is not valid JSON ({why})"
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return 'a tool call must be a JSON object with a "name" and "arguments"'
    args = call.get("arguments", call.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string (OpenAI's wire form)
        args, why = safe_json(args)
        if why is not None:
            return f"the arguments of {call['name']} are not a JSON object"
    return call["name"], args


def call_message(content: str, calls: Sequence[tuple[str, Any]]) -> Message:
    """An assistant message with OpenAI-style ``tool_calls`` (for transcripts and rewards)."""
    msg: Message = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]
    return msg


__all__ = ["INVALID_TOOL_ACTION", "MINIMAL_TOOLS_PROMPT", "TOOLS_PROMPT", "TOOL_PROMPTS", "call_message", "parse_call", "tool_response"]
