"""Your own demonstrations for a warm-up (``treegrpo warmup --demos demos.jsonl``), for any env or tools.

One demonstration per JSON line (or per dict, from Python), in either form:

- **a message list** (TRL's / OpenAI's conversational form, for tools)::

    {"messages": [{"role": "user", "content": "What is 17 * 23?"},
                  {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
                     "function": {"name": "calculator", "arguments": {"expression": "17 * 23"}}}]},
                  {"role": "tool", "content": "391"},
                  {"role": "assistant", "content": "391"}],
     "answer": "391"}

  The first user message is the question; each assistant message with ``tool_calls`` is one step
  per call, the last assistant message the final answer (its ``content``). Tool messages may be
  left out: the results are always recomputed by running your tools.

- **question and steps**, for tools or any env::

    {"question": "What is 17 * 23?", "answer": "391",
     "steps": [{"tool": "calculator", "arguments": {"expression": "17 * 23"}},
               {"answer": "391"}]}

  A step is ``{"tool": name, "arguments": {…}}``, ``{"answer": text}`` (both may add
  ``"thought": text``, written before the action), or a string: the step's exact text in the
  env's protocol (e.g. ``"<search> Paris </search>"`` for the search env).

Every other field is the question's dataset row (``answer``/``answers``, columns the reward
functions read). Each demonstration is *run*: its steps go through the env in order — so every
observation is the env's own — and it must end with the step that answers; one that does not, or
that fails to run, is a one-line error naming its line.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from treegrpo.envs.base import AgentEnv, Task, check_outcomes
from treegrpo.envs.state import state_mode
from treegrpo.tasks.custom import read_rows, rows_to_tasks
from treegrpo.tasks.datafile import DataError
from treegrpo.training.warmup import Demo


def demo_rows(demos: Path | Sequence[Mapping[str, Any]]) -> tuple[list[Mapping[str, Any]], str]:
    """The demonstration records and the name errors use for them."""
    if isinstance(demos, str | Path):
        return list(read_rows(demos)), str(demos)
    return list(demos), "demos"


def step_text(env: AgentEnv, step: Any, where: str) -> str:
    """A demo step as the env's protocol spells it (a string is taken as it is)."""
    if isinstance(step, str):
        return step
    if not isinstance(step, Mapping):
        raise DataError(f"{where}: a step must be a string or an object with 'tool' or 'answer', got {type(step).__name__}")
    spell = getattr(env, "demo_step", None)
    if spell is None:
        raise DataError(f"{where}: {type(env).__name__} takes steps as strings (the step's text in its protocol)")
    thought = step.get("thought", "")
    if "answer" in step:
        return spell(answer=str(step["answer"]), thought=thought)
    if "tool" in step:
        return spell(tool=str(step["tool"]), arguments=step.get("arguments", {}), thought=thought)
    raise DataError(f"{where}: a step object needs 'tool' (with 'arguments') or 'answer'")


def _message_steps(messages: Any, where: str) -> tuple[str, list[Any]]:
    """The question and the steps of a message-list demonstration."""
    if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
        raise DataError(f"{where}: 'messages' must be a list of chat messages")
    users = [m for m in messages if m.get("role") == "user"]
    if not users or not isinstance(users[0].get("content"), str):
        raise DataError(f"{where}: 'messages' needs a user message with the question")
    steps: list[Any] = []
    assistants = [m for m in messages if m.get("role") == "assistant"]
    for k, m in enumerate(assistants):
        thought = m.get("content") or ""
        calls = m.get("tool_calls") or []
        if not calls:
            if k != len(assistants) - 1:
                raise DataError(f"{where}: assistant message {k + 1} has no tool_calls but is not the last one")
            steps.append({"answer": thought})
        for call in calls:
            fn = call.get("function", call) if isinstance(call, Mapping) else None
            if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
                raise DataError(f"{where}: a tool call needs function.name and function.arguments")
            args = fn.get("arguments", {})
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    raise DataError(f"{where}: the arguments of {fn['name']} are not JSON") from None
            steps.append({"tool": fn["name"], "arguments": args, "thought": thought})
            thought = ""
    return users[0]["content"], steps


def run_demo(env: AgentEnv, task: Task, texts: Sequence[str], max_turns: int, where: str) -> Demo:
    """Run ``texts`` through ``env`` as one trajectory of ``task``: the steps with the env's own
    observations, ending at the answer."""
    mode = state_mode(env)
    state = env.initial_state(task) if mode != "stateless" else None  # type: ignore[attr-defined]
    steps: list[tuple[str, str | None]] = []
    messages: list[dict[str, Any]] = []
    reward = None
    try:
        for j, text in enumerate(texts):
            kwargs: dict[str, Any] = {}
            if getattr(env, "needs_history", False):
                kwargs["histories"] = [list(steps)]
            if getattr(env, "needs_messages", False):
                kwargs["messages"] = [list(messages)]
            if state is not None:
                kwargs["states"] = [state]
            (out,) = check_outcomes(env, env.step([task], [text], [j < max_turns], **kwargs), 1)
            messages += out.info.get("messages", [])
            if out.done:
                if j != len(texts) - 1:
                    raise DataError(f"{where}: step {j + 1} ends the trajectory ({out.kind}) but {len(texts) - j - 1} more follow")
                if out.kind != "answer":
                    raise DataError(f"{where}: step {j + 1} ends the trajectory as {out.kind}, not as an answer")
                steps.append((text, None))
                reward = out.reward
            else:
                if out.kind == "invalid":
                    why = out.info.get("tool_error") or "the env calls it an invalid action"
                    raise DataError(f"{where}: step {j + 1} is not a valid action: {why}")
                steps.append((text, out.observation))
    finally:
        if state is not None:
            env.close_state(state)  # type: ignore[attr-defined]
    if reward is None:
        raise DataError(f"{where}: the demonstration does not end with an answer")
    return Demo(task, steps, "demo", float(reward))


def read_demos(env: AgentEnv, demos: Path | Sequence[Mapping[str, Any]], max_turns: int) -> list[Demo]:
    """Every demonstration of ``demos`` (module docstring) run through ``env``."""
    rows, name = demo_rows(demos)
    if not rows:
        raise DataError(f"{name}: holds no demonstrations")
    out = []
    for i, row in enumerate(rows, 1):
        where = f"{name}: demo {i}"
        if not isinstance(row, Mapping):
            raise DataError(f"{where}: a demonstration must be an object")
        record = dict(row)
        if "messages" in record:
            question, steps = _message_steps(record.pop("messages"), where)
            record.setdefault("question", question)
        elif "steps" in record:
            steps = record.pop("steps")
            if not isinstance(steps, list) or not steps:
                raise DataError(f"{where}: 'steps' must be a non-empty list")
        else:
            raise DataError(f"{where}: give 'messages' (a chat) or 'question' and 'steps'")
        record.setdefault("id", f"demo-{i - 1}")
        (task,) = rows_to_tasks([record], where)
        texts = [step_text(env, s, f"{where}, step {k + 1}") for k, s in enumerate(steps)]
        out.append(run_demo(env, task, texts, max_turns, where))
    return out


__all__ = ["read_demos", "run_demo", "step_text"]
