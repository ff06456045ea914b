"""An environment made of a user's tools and reward functions (:class:`ToolEnv`).

The tools are plain functions and/or one tool class (:mod:`treegrpo.envs.tools`); the rewards
are TRL-style functions (:mod:`treegrpo.envs.reward_fns`). ``protocol`` says how the model calls
them:

``tags`` — the library's own text protocol, for any model (a tiny one trained from scratch
included). The prompt lists the tools' schemas; a step is free text that ends with one action::

    <tool_call>{"name": "calculator", "arguments": {"expression": "17 * 23"}}</tool_call>
    <answer> 391 </answer>

and a tool's result comes back inline, in the same assistant turn (Search-R1's way)::

    <tool_response>
    391
    </tool_response>

Generation stops at ``</tool_call>`` / ``</answer>``. One call per step; anything else is an
invalid action (the model is told the protocol and goes on).

``tools`` — the model's own protocol: the prompt is the chat template's rendering with
``tools=`` the schemas; a turn ends at the model's end-of-turn token; its calls are parsed in the
model's syntax (:func:`~treegrpo.rollout.toolcall.parse_tool_calls`: the tokenizer's response
parser, Hermes/Qwen ``<tool_call>`` JSON, Llama 3.1 JSON) and run in order; the results are
``role: "tool"`` messages rendered by the template (:func:`~treegrpo.rollout.toolcall.tool_turn_text`),
each cut to ``max_result_tokens``. A turn without a call is the final answer (its content); a turn
cut off before its end-of-turn token ends the trajectory.

A step that reached the tools records its ``messages`` (the assistant turn with its
``tool_calls``, then one ``role: "tool"`` result per call) and ``tool_calls_ran``, the calls that
ran (an unknown tool or arguments that do not fit its schema never run; a tool that raised or
timed out did), in its node's ``extra``: the viewer labels and counts tool calls from them.

A tool class makes the env stateful: one instance per trajectory (:meth:`ToolEnv.initial_state`,
``reset(**row)`` called on it), branched by its ``fork()`` or ``snapshot()``/``restore()`` when it
has them, else by replaying the path's steps (:mod:`treegrpo.envs.state`); a ``get_reward()``
method is one more reward, named after the class (TRL's convention).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from treegrpo.envs.base import StepOutcome, Task
from treegrpo.envs.reward_fns import Message, RewardSet
from treegrpo.envs.tools import Tool, ToolResult, bound_tools, function_tools, tool_method_names
from treegrpo.errors import ConfigError
from treegrpo.rollout.tool_parsers import safe_json
from treegrpo.rollout.toolcall import (
    ToolCall,
    ToolCallError,
    assistant_message,
    assistant_turn_text,
    end_of_turn_tokens,
    parse_tool_calls,
    tool_turn_parts,
)

Protocol = Literal["tags", "tools"]
PROTOCOLS: tuple[str, ...] = ("tags", "tools")

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


@dataclass
class ToolEnv:
    """Tools and reward functions as an :class:`~treegrpo.envs.base.AgentEnv` (module docstring).

    Args:
        tools: plain function tools (type hints and an ``Args:`` docstring each).
        environment_factory: a tool class (or a callable that makes one instance): its public
            methods are tools acting on the instance, one instance per trajectory.
        rewards: the reward functions (a :class:`RewardSet`, or what :meth:`RewardSet.of` takes).
        reward_weights: their weights (default 1 each).
        protocol: ``tags`` | ``tools`` (module docstring).
        prompt_template: the tag protocol's prompt, a format string with ``{question}`` (and
            ``{tools}``, the schemas one JSON per line) or ``tools`` | ``minimal``.
        timeout_s: a tool call running longer gets a time-out error as its result (``None``: no limit).
        tokenizer: the model's tokenizer (the ``tools`` protocol renders and parses through it).
        max_result_tokens: ``tools`` protocol: a tool result longer than this many tokens is cut.
    """

    tools: Sequence[Callable[..., Any]] = ()
    environment_factory: Callable[[], Any] | None = None
    rewards: RewardSet | Sequence[Any] | Any = "em"
    reward_weights: Sequence[float] | None = None
    protocol: Protocol = "tags"
    prompt_template: str = "tools"
    timeout_s: float | None = 30.0
    tokenizer: Any = None
    max_result_tokens: int = 600
    needs_messages: bool = field(default=True, init=False)
    """The agent loop passes each trajectory's earlier messages to :meth:`step` (the rewards read them)."""

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ConfigError(f"protocol {self.protocol!r}: choose tags or tools")
        self.rewards = self.rewards if isinstance(self.rewards, RewardSet) else RewardSet.of(self.rewards, self.reward_weights)
        self._tools: dict[str, Tool] = function_tools(list(self.tools))
        self._class: type | None = None
        self._method_names: list[str] = []
        if self.environment_factory is not None:
            probe = self.environment_factory()
            self._class = type(probe)
            self._method_names = tool_method_names(self._class)
            clash = set(self._method_names) & set(self._tools)
            if clash:
                raise ConfigError(f"tool {sorted(clash)[0]} is both a function and a method of {self._class.__name__}")
            self._schemas_of_class = [t.schema for t in bound_tools(probe).values()]
            self._close(probe)
        else:
            self._schemas_of_class = []
        if not self._tools and not self._method_names:
            raise ConfigError("no tools: pass tools=[functions] or environment_factory=a class with public tool methods")
        template = TOOL_PROMPTS.get(self.prompt_template, self.prompt_template)
        if "{question}" not in template:
            raise ConfigError(
                f"prompt_template {self.prompt_template!r} is neither tools nor minimal nor a format string with {{question}}"
            )
        self._template = template
        self._reset_text: dict[str, str] = {}
        self.state_mode = self._state_mode()
        if self.protocol == "tools" and self.tokenizer is None:
            raise ConfigError("protocol tools renders through the model's chat template: give ToolEnv its tokenizer")

    # -- the contract ------------------------------------------------------------------------------
    @property
    def stop_strings(self) -> tuple[str, ...]:
        """Action end tags (tag protocol); the native protocol's turns end at the end-of-turn token."""
        return ("</tool_call>", "</answer>") if self.protocol == "tags" else ()

    @property
    def actions(self) -> dict[str, str | None]:
        """The action kinds a step may take and the tag that ends each (``None``: the turn's end)."""
        if self.protocol == "tags":
            return {"tool": "</tool_call>", "answer": "</answer>"}
        return {"tool": None, "answer": None}

    @property
    def turns_end_at_eos(self) -> bool:
        """``tools`` protocol: a turn ends at the model's end-of-turn token, and this env decides
        whether the trajectory goes on (a turn with calls) or ends (a turn without)."""
        return self.protocol == "tools"

    @property
    def chat_tools(self) -> list[dict[str, Any]] | None:
        """The schemas the agent loop renders into the prompt with the chat template (``tools=``)."""
        return self.tool_schemas if self.protocol == "tools" else None

    @property
    def binary_reward(self) -> bool:
        """Rewards are 0/1 (held-out figures are a success rate, not a mean reward)."""
        return self.rewards.binary and not self._has_env_reward  # type: ignore[union-attr]

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        """Every tool's JSON schema (the functions', then the class's methods')."""
        return [t.schema for t in self._tools.values()] + self._schemas_of_class

    @property
    def _has_env_reward(self) -> bool:
        return self._class is not None and callable(getattr(self._class, "get_reward", None))

    def prompt(self, task: Task) -> str:
        question = task.question.strip() + self._reset_observation(task)
        if self.protocol == "tools":
            return question
        tools = "\n".join(json.dumps(s["function"], ensure_ascii=False) for s in self.tool_schemas)
        return self._template.format(question=question, tools=tools)

    def score(self, task: Task, step: str) -> float:
        """The reward of a trajectory the loop ended without an answer, seen alone (no history)."""
        return self.score_outcome(task, step, [])[0]

    def score_outcome(
        self, task: Task, step: str, messages: Sequence[Message], state: Any = None
    ) -> tuple[float, dict[str, Any]]:
        """The reward (and per-function values, as node info) of a trajectory the agent loop ends
        itself (turn or context limit) after ``step``: the reward functions see it as it stands."""
        [(reward, info)] = self._rewards([task], [[*messages, *self._step_messages(step)]], [state])
        return reward, info

    def demo_steps(self, calls: Sequence[tuple[str, Any]] = (), answer: str | None = None, thought: str = "") -> list[str]:
        """The text of one demonstrated turn in this env's protocol: its tool ``calls`` or its final
        ``answer`` (:mod:`treegrpo.training.demo_file`). The tag protocol takes one call per step;
        the native protocol renders the turn with the chat template, as the model would write it."""
        if self.protocol == "tools":
            msg = assistant_message(thought.strip(), [ToolCall(n, a) for n, a in calls]) if calls else {
                "role": "assistant", "content": (answer or "").strip()}
            return [assistant_turn_text(self.tokenizer, msg, self.tool_schemas)]
        head = f"{thought.strip()}\n" if thought.strip() else ""
        if not calls:
            return [f"{head}<answer> {(answer or '').strip()} </answer>"]
        texts = []
        for n, a in calls:
            call = json.dumps({"name": n, "arguments": a if a is not None else {}}, ensure_ascii=False)
            texts.append(f"{head}<tool_call>{call}</tool_call>")
            head = ""
        return texts

    def step(
        self,
        tasks: Sequence[Task],
        steps: Sequence[str],
        search_allowed: Sequence[bool],
        messages: Sequence[Sequence[Message]] | None = None,
        states: Sequence[Any] | None = None,
    ) -> list[StepOutcome]:
        """One step per trajectory (see the module docstring); the answers of the batch are scored
        together by the reward functions."""
        if self._class is not None and states is None:  # a single-turn caller: each step on a fresh instance
            fresh = [self.initial_state(t) for t in tasks]
            try:
                return self.step(tasks, steps, search_allowed, messages, fresh)
            finally:
                for inst in fresh:
                    self._close(inst)
        out: list[StepOutcome | None] = [None] * len(steps)
        ending: list[int] = []
        for i, (text, allowed) in enumerate(zip(steps, search_allowed, strict=True)):
            state = states[i] if states is not None else None
            if self.protocol == "tools":
                out[i] = self._native_step(text, allowed, state)
                if out[i].done:  # type: ignore[union-attr]
                    ending.append(i)
                continue
            m = _ACTION.search(text)
            kind = m.group(1) if m else None
            if kind == "answer":
                answer = m.group(2).strip()  # type: ignore[union-attr]
                msgs = [{"role": "assistant", "content": answer}]
                out[i] = StepOutcome("answer", True, info={"answer": answer, "messages": msgs})
                ending.append(i)
            elif not allowed:  # the final turn: a tool call is refused, anything else ends too
                msgs = self._step_messages(text)
                out[i] = StepOutcome("tool" if kind else "invalid", True, info={"refused": bool(kind), "messages": msgs})
                ending.append(i)
            elif kind == "tool_call":
                out[i] = self._tool_step(text, m.group(2), state)  # type: ignore[union-attr]
            else:
                msgs = [{"role": "assistant", "content": text}, {"role": "user", "content": INVALID_TOOL_ACTION.strip()}]
                out[i] = StepOutcome("invalid", False, observation=INVALID_TOOL_ACTION, info={"messages": msgs})
        if ending:
            history = [list(messages[i]) if messages is not None else [] for i in ending]
            completions = [h + out[i].info["messages"] for h, i in zip(history, ending, strict=True)]  # type: ignore[union-attr]
            st = [states[i] if states is not None else None for i in ending]
            for i, (reward, info) in zip(ending, self._rewards([tasks[i] for i in ending], completions, st), strict=True):
                out[i].reward = reward  # type: ignore[union-attr]
                out[i].info.update(info)  # type: ignore[union-attr]
        return [o for o in out if o is not None]

    # -- state (a tool class) ------------------------------------------------------------------------
    def initial_state(self, task: Task) -> Any:
        inst = self.environment_factory()  # type: ignore[misc]
        reset = getattr(inst, "reset", None)
        if callable(reset):
            reset(**task.meta)
        return inst

    def close_state(self, state: Any) -> None:
        self._close(state)

    def fork(self, state: Any) -> Any:
        return state.fork()

    def snapshot(self, state: Any) -> Any:
        return state.snapshot()

    def restore(self, snapshot: Any) -> Any:
        inst = self.environment_factory()  # type: ignore[misc]
        inst.restore(snapshot)
        return inst

    @property
    def state_key(self) -> Callable[[Any], str] | None:
        """The tool class's own ``state_key()`` (which states are equal: GiGPO's state anchors), or
        ``None`` when it has none — the env then keys no states (:func:`treegrpo.envs.state.state_key`);
        an always-present method once called ``state_key()`` on every class and broke every tree."""
        if self._class is None or not callable(getattr(self._class, "state_key", None)):
            return None
        return lambda state: str(state.state_key())

    # -- helpers -------------------------------------------------------------------------------------
    def _state_mode(self) -> str:
        cls = self._class
        if cls is None:
            return "stateless"
        if callable(getattr(cls, "fork", None)):
            return "fork"
        if callable(getattr(cls, "snapshot", None)) and callable(getattr(cls, "restore", None)):
            return "snapshot"
        return "replay"

    def _close(self, inst: Any) -> None:
        close = getattr(inst, "close", None)
        if callable(close):
            close()

    def _reset_observation(self, task: Task) -> str:
        """What a tool class's ``reset(**row)`` returns for ``task`` (appended to the question)."""
        if self._class is None or not callable(getattr(self._class, "reset", None)):
            return ""
        if task.id not in self._reset_text:
            inst = self.environment_factory()  # type: ignore[misc]
            text = inst.reset(**task.meta)
            self._close(inst)
            self._reset_text[task.id] = "" if text is None else "\n" + str(text)
        return self._reset_text[task.id]

    def _tools_of(self, state: Any) -> dict[str, Tool]:
        if state is None or self._class is None:
            return self._tools
        return {**self._tools, **bound_tools(state)}

    def _tool_step(self, text: str, payload: str, state: Any) -> StepOutcome:
        parsed = parse_call(payload)
        thought = text[: text.find("<tool_call>")].strip()
        if isinstance(parsed, str):
            result = ToolResult("", f"Error: {parsed}.", error=parsed)
            calls: list[tuple[str, Any]] = []
        else:
            name, args = parsed
            calls = [parsed]
            tool = self._tools_of(state).get(name)
            if tool is None:
                why = f"there is no tool {name!r} (tools: {', '.join(self._tools_of(state)) or 'none'})"
                result = ToolResult(name, f"Error: {why}.", error=why)
            else:
                result = tool.call(args, self.timeout_s)
        msgs = [call_message(thought, calls), {"role": "tool", "name": result.name, "content": result.content}]
        info: dict[str, Any] = {"messages": msgs, "tool_calls_ran": int(result.ran)}
        if calls:
            info["tool"] = calls[0][0]
        if result.error:
            info["tool_error"] = result.error
        obs = tool_response(result.content)  # the result is plain text between the tags (DESIGN §3.10)
        parts = (("\n<tool_response>\n", True), (result.content, False), ("\n</tool_response>\n", True))
        return StepOutcome(
            "invalid" if result.error else "tool",
            False,
            observation=obs,
            tool_calls=int(result.ran),
            info=info,
            observation_parts=parts,
        )

    def _native_step(self, text: str, allowed: bool, state: Any) -> StepOutcome:
        """One assistant turn in the model's own protocol (module docstring)."""
        tok = self.tokenizer
        content, parsed = parse_tool_calls(text, tok, schemas=self.tool_schemas)
        calls = [c for c in parsed if isinstance(c, ToolCall)]
        if not any(text.rstrip().endswith(t) for t in end_of_turn_tokens(tok)):  # cut at max_step_tokens
            return StepOutcome("invalid", True, info={"cut": True, "messages": [{"role": "assistant", "content": content}]})
        if not parsed:  # no call: the final answer
            msgs = [{"role": "assistant", "content": content}]
            return StepOutcome("answer", True, info={"answer": content, "messages": msgs})
        if not allowed:
            return StepOutcome("tool", True, info={"refused": True, "messages": [assistant_message(content, calls)]})
        tools = self._tools_of(state)
        results: list[Message] = []
        errors, ran = [], 0
        for c in parsed:
            if isinstance(c, ToolCallError):
                r = ToolResult("", f"Error: {c.message}.", error=c.message)
            elif c.name not in tools:
                why = f"there is no tool {c.name!r} (tools: {', '.join(tools) or 'none'})"
                r = ToolResult(c.name, f"Error: {why}.", error=why)
            else:
                r = tools[c.name].call(c.arguments, self.timeout_s)
            ran += int(r.ran)
            if r.error:
                errors.append(r.error)
            res: Message = {"role": "tool", "name": r.name or "tool", "content": self._fit(r.content)}
            if isinstance(c, ToolCall) and c.id is not None:
                res["tool_call_id"] = c.id
            results.append(res)
        info: dict[str, Any] = {"messages": [assistant_message(content, calls), *results], "tool_calls_ran": ran}
        if calls:
            info["tool"] = calls[0].name
        if errors:
            info["tool_error"] = "; ".join(errors)
        parts = tool_turn_parts(tok, results, self.tool_schemas)
        obs = "".join(t for t, _ in parts)
        return StepOutcome(
            "invalid" if errors else "tool", False, observation=obs, tool_calls=ran, info=info, observation_parts=parts
        )

    def _fit(self, content: str) -> str:
        """A tool result cut to ``max_result_tokens`` (marked with `` …``)."""
        ids = self.tokenizer.encode(content, add_special_tokens=False)
        if len(ids) <= self.max_result_tokens:
            return content
        return self.tokenizer.decode(ids[: self.max_result_tokens], skip_special_tokens=True) + " …"

    def _step_messages(self, text: str) -> list[Message]:
        """The messages of a step the env did not answer (it ended the trajectory): always an
        assistant message, empty when the model wrote nothing (a context overflow before the first
        step, an end-of-turn at once), so a completion's last message is always its final turn, as
        in TRL (a reward reading ``completion[-1]["content"]`` gets ``""``, not an IndexError)."""
        return [{"role": "assistant", "content": text}]

    def _rewards(
        self, tasks: Sequence[Task], completions: Sequence[Sequence[Message]], states: Sequence[Any]
    ) -> list[tuple[float, dict[str, Any]]]:
        prompts = [[{"role": "user", "content": self.prompt(t)}] for t in tasks]
        scored = self.rewards.score(tasks, prompts, completions)  # type: ignore[union-attr]
        out = []
        for (total, values), state in zip(scored, states, strict=True):
            if self._has_env_reward and state is not None:
                own = float(state.get_reward())
                values = {**values, self._class.__name__: own}  # type: ignore[union-attr]
                total += own
            out.append((total, {"rewards": values}))
        return out


__all__ = ["INVALID_TOOL_ACTION", "PROTOCOLS", "TOOLS_PROMPT", "ToolEnv", "call_message", "parse_call", "tool_response"]
