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

A batch's calls run at once, each trajectory's in order (:mod:`treegrpo.envs.tool_runner`); a
result is cut to ``max_result_chars`` first. A step that reached the tools records in its node's
``extra`` its ``messages`` (the assistant turn with its ``tool_calls``, then one ``role: "tool"``
result per call), ``tool_calls_ran`` (an unknown tool or arguments that do not fit its schema never
run; a tool that raised or timed out did) and ``tool_latency_s`` (seconds per call, 0.0 for one
refused); the viewer labels and counts tool calls from them.

A tool class makes the env stateful: one instance per trajectory, a copy of its forest's world
(reset once; the prompt shows its reset text), branched by its ``fork()`` or
``snapshot()``/``restore()`` when it has them, else by replaying the path's steps
(:mod:`treegrpo.envs.tool_state`, :mod:`treegrpo.envs.state`); a ``get_reward()`` method is one more
reward, named after the class (TRL's convention).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from treegrpo.envs.base import StepOutcome, Task
from treegrpo.envs.reward_fns import Message, RewardSet, given_prompt
from treegrpo.envs.tag_protocol import (
    _ACTION,
    INVALID_TOOL_ACTION,
    TOOL_PROMPTS,
    TOOLS_PROMPT,
    call_message,
    parse_call,
    tool_response,
)
from treegrpo.envs.tool_runner import Job, ToolRunner
from treegrpo.envs.tool_state import ClassTools, ToolState, class_mode, probe_class
from treegrpo.envs.tools import Tool, ToolResult, bound_tools, function_tools, refused, tool_method_names
from treegrpo.errors import ConfigError
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
        tool_concurrency: tool calls running at once over a batch (:mod:`treegrpo.envs.tool_runner`;
            1: one after another).
        max_result_chars: a tool result longer than this many characters is cut before anything
            else reads it, in both protocols (``None``: 8 × ``max_result_tokens``).
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
    tool_concurrency: int = 32
    max_result_chars: int | None = None
    needs_messages: bool = field(default=True, init=False)
    """The agent loop passes each trajectory's earlier messages to :meth:`step` (the rewards read them)."""

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ConfigError(f"protocol {self.protocol!r}: choose tags or tools")
        self.rewards = self.rewards if isinstance(self.rewards, RewardSet) else RewardSet.of(self.rewards, self.reward_weights)
        self._tools: dict[str, Tool] = function_tools(list(self.tools))
        chars = self.max_result_chars if self.max_result_chars is not None else 8 * self.max_result_tokens
        self._runner = ToolRunner(self.tool_concurrency, self.timeout_s, chars)
        self.tool_stats = self._runner.stats
        """Cumulative tool counters (:class:`~treegrpo.envs.tool_runner.ToolStats`: ``take()``)."""
        self._class: type | None = None
        self._states: ClassTools | None = None
        self._method_names: list[str] = []
        self._schemas_of_class: list[dict[str, Any]] = []
        if self.environment_factory is not None:
            self._class, self._schemas_of_class = probe_class(self.environment_factory, self.timeout_s)
            self._method_names = tool_method_names(self._class)
            clash = set(self._method_names) & set(self._tools)
            if clash:
                raise ConfigError(f"tool {sorted(clash)[0]} is both a function and a method of {self._class.__name__}")
        if not self._tools and not self._method_names:
            raise ConfigError("no tools: pass tools=[functions] or environment_factory=a class with public tool methods")
        template = TOOL_PROMPTS.get(self.prompt_template, self.prompt_template)
        if "{question}" not in template:
            raise ConfigError(
                f"prompt_template {self.prompt_template!r} is neither tools nor minimal nor a format string with {{question}}"
            )
        self._template = template
        self.state_mode = class_mode(self._class)
        if self._class is not None:
            self._states = ClassTools(self.environment_factory, self._class, self.state_mode, self.timeout_s)  # type: ignore[arg-type]
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
        """The prompt as one text (a model without a chat template): the question with the reset
        text of ``task``'s current world (the one the latest forest of ``task`` branches from:
        :meth:`open_world`), in the tag protocol inside ``prompt_template``; a row's own prompt
        messages (:meth:`prompt_messages`) joined by blank lines."""
        if given_prompt(task) is not None:
            return "\n\n".join(str(m.get("content") or "") for m in self.prompt_messages(task))
        return self._prompt_text(task.question, self._reset_text(task))

    def prompt_messages(self, task: Task, reset_text: str | None = None) -> list[Message]:
        """The prompt as chat messages, for the chat template: a row's ``prompt`` messages as given
        (:func:`~treegrpo.envs.reward_fns.given_prompt`: system message, earlier turns, context),
        the last user message's content standing for the question — followed by the world's reset
        text (``reset_text``, else that of ``task``'s current world) and, in the tag protocol, set
        inside ``prompt_template`` with the tools; else the one user message :meth:`prompt`."""
        reset = self._reset_text(task) if reset_text is None else reset_text
        given = given_prompt(task)
        if given is None:
            return [{"role": "user", "content": self._prompt_text(task.question, reset)}]
        last = max((i for i, m in enumerate(given) if m.get("role") == "user"), default=len(given) - 1)
        given[last] = {**given[last], "content": self._prompt_text(str(given[last].get("content") or ""), reset)}
        return given

    def _prompt_text(self, question: str, reset_text: str) -> str:
        question = question.strip() + reset_text
        if self.protocol == "tools":
            return question
        tools = "\n".join(json.dumps(s["function"], ensure_ascii=False) for s in self.tool_schemas)
        return self._template.format(question=question, tools=tools)

    def score(self, task: Task, step: str) -> float:
        """The reward of a trajectory the loop ended without an answer, seen alone (no history)."""
        return self.score_outcome(task, step, [])[0]

    def score_outcome(
        self, task: Task, step: str, messages: Sequence[Message], state: Any = None, completion_ids: Sequence[int] | None = None
    ) -> tuple[float, dict[str, Any]]:
        """The reward (and per-function values, as node info) of a trajectory the agent loop ends
        itself (turn or context limit) after ``step``: the reward functions see it as it stands."""
        [(reward, info)] = self._rewards([task], [[*messages, *self._step_messages(step)]], [state], [completion_ids])
        return reward, info

    @property
    def needs_completion_ids(self) -> bool:
        """A reward function reads ``completion_ids``: the loop passes each trajectory's ids to :meth:`step`."""
        return self.rewards.wants("completion_ids")  # type: ignore[union-attr]

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

    def step(self, tasks: Sequence[Task], steps: Sequence[str], search_allowed: Sequence[bool],
             messages: Sequence[Sequence[Message]] | None = None, states: Sequence[Any] | None = None,
             completion_ids: Sequence[Sequence[int]] | None = None) -> list[StepOutcome]:  # fmt: skip
        """:meth:`step_stream`'s outcomes, in step order."""
        out: list[StepOutcome | None] = [None] * len(steps)
        for i, o in self.step_stream(tasks, steps, search_allowed, messages, states, completion_ids):
            out[i] = o
        return out  # type: ignore[return-value]

    def step_stream(
        self,
        tasks: Sequence[Task],
        steps: Sequence[str],
        allowed: Sequence[bool],
        messages: Sequence[Sequence[Message]] | None = None,
        states: Sequence[Any] | None = None,
        completion_ids: Sequence[Sequence[int]] | None = None,
    ) -> Iterator[tuple[int, StepOutcome]]:
        """One step per trajectory (module docstring), yielded as ``(index, outcome)`` when ready:
        first every step that calls no tool (answers and refusals, their rewards scored together in
        one batch), then each trajectory as its calls finish (all of the batch's calls run at once:
        :mod:`treegrpo.envs.tool_runner`). The outcomes do not depend on timing. A tool-class call
        that ran past its time-out ends its trajectory (its instance is lost: never called again).
        ``completion_ids``: each trajectory's ids after the prompt, this step's generated ids last,
        for the reward functions."""
        if self._class is not None and states is None:  # a single-turn caller: each step on its own instance
            fresh = [self.initial_state(t) for t in tasks]
            try:
                yield from self.step_stream(tasks, steps, allowed, messages, fresh, completion_ids)
            finally:
                for inst in fresh:
                    self.close_state(inst)
            return
        now: dict[int, StepOutcome] = {}
        jobs: list[Job] = []
        finish: dict[int, Callable[[Job], StepOutcome]] = {}
        for i, (text, ok) in enumerate(zip(steps, allowed, strict=True)):
            state = states[i] if states is not None else None
            plan = self._plan_native(text, ok, state) if self.protocol == "tools" else self._plan_tags(text, ok, state)
            if isinstance(plan, StepOutcome):
                now[i] = plan
                continue
            calls, finish[i] = plan
            lane = state.lane if isinstance(state, ToolState) else None
            jobs.append(Job(i, calls, lane, lost=state.why_lost() if isinstance(state, ToolState) else None))
        ready = [j for j in jobs if j.lost is not None]
        for j in ready:
            self._runner._fill_lost(j)
        batch = self._runner.start([j for j in jobs if j.lane is None and j.lost is None])
        self._score([i for i, o in now.items() if o.done], now, tasks, messages, states, completion_ids)  # get_reward: on lanes
        self._runner.start([j for j in jobs if j.lane is not None and j.lost is None], batch)  # then their calls
        yield from sorted(now.items())
        for job in [*ready, *self._runner.wait(batch)]:
            out = finish[job.index](job)
            out.info["tool_latency_s"] = [round(x, 6) for x in job.latency_s]
            if job.lost is not None:  # the trajectory's instance is lost: it ends here
                out.done, out.observation, out.info["state_lost"] = True, None, job.lost
                self._score([job.index], {job.index: out}, tasks, messages, states, completion_ids)
            yield job.index, out

    def _score(self, ending: Sequence[int], out: dict[int, StepOutcome], tasks: Sequence[Task],
               messages: Sequence[Sequence[Message]] | None, states: Sequence[Any] | None,
               completion_ids: Sequence[Sequence[int]] | None = None) -> None:  # fmt: skip
        """Score the trajectories ``ending`` here together (rewards into their outcomes)."""
        if not ending:
            return
        history = [list(messages[i]) if messages is not None else [] for i in ending]
        completions = [h + out[i].info["messages"] for h, i in zip(history, ending, strict=True)]
        st = [states[i] if states is not None else None for i in ending]
        ids = [completion_ids[i] if completion_ids is not None else None for i in ending]
        for i, (reward, info) in zip(ending, self._rewards([tasks[i] for i in ending], completions, st, ids), strict=True):
            out[i].reward = reward
            out[i].info.update(info)

    # -- state (a tool class: :mod:`treegrpo.envs.tool_state`) ---------------------------------------
    def open_world(self, task: Task) -> ToolState | None:
        """A new instance for a new forest of ``task``, reset once: the prompt shows its reset text
        and every trajectory of the forest starts from a copy of it (:meth:`world_state`);
        ``None`` without a tool class."""
        return None if self._states is None else self._states.open_world(task)

    def world_state(self, world: ToolState, task: Task) -> ToolState:
        return self._states.world_state(world, task)  # type: ignore[union-attr]
    def close_world(self, world: ToolState) -> None:
        self._states.close_world(world)  # type: ignore[union-attr]

    def initial_state(self, task: Task) -> Any:
        """A live state for ``task``: a copy of its current world (the one :meth:`prompt` shows)."""
        return self.world_state(self._states.current(task), task)  # type: ignore[union-attr]

    def close_state(self, state: Any) -> None:
        self._states.close(state)  # type: ignore[union-attr]

    def fork(self, state: Any) -> Any:
        return self._states.fork(state)  # type: ignore[union-attr]
    def snapshot(self, state: Any) -> Any:
        return self._states.snapshot(state)  # type: ignore[union-attr]
    def restore(self, snapshot: Any) -> Any:
        return self._states.restore(snapshot)  # type: ignore[union-attr]

    @property
    def state_key(self) -> Callable[[Any], str] | None:
        """The tool class's own ``state_key()`` (which states are equal: GiGPO's state anchors), or
        ``None`` when it has none — the env then keys no states (:func:`treegrpo.envs.state.state_key`);
        an always-present method once called ``state_key()`` on every class and broke every tree."""
        if self._class is None or not callable(getattr(self._class, "state_key", None)):
            return None
        return self._states.key  # type: ignore[union-attr]

    # -- helpers -------------------------------------------------------------------------------------
    def _reset_text(self, task: Task) -> str:
        """The reset text of ``task``'s current world ("" when the class has no ``reset``)."""
        if self._class is None or not callable(getattr(self._class, "reset", None)):
            return ""
        return self._states.current(task).reset_text  # type: ignore[union-attr]

    def _tools_of(self, state: Any) -> dict[str, Tool]:
        if not isinstance(state, ToolState) or state.obj is None:
            return self._tools
        return {**self._tools, **bound_tools(state.obj)}

    def _call(self, name: str, args: Any, tools: dict[str, Tool]) -> ToolResult | tuple[Tool, dict[str, Any]]:
        """A call to run (the tool and its checked arguments), or its refusal."""
        tool = tools.get(name)
        if tool is None:
            return refused(name, f"there is no tool {name!r} (tools: {', '.join(tools) or 'none'})")
        checked, why = tool.prepare(args)
        return refused(name, why) if why is not None else (tool, checked)

    def _plan_tags(self, text: str, allowed: bool, state: Any) -> StepOutcome | tuple[list[Any], Callable[[Job], StepOutcome]]:
        """A tag-protocol step: its outcome when it calls no tool, else its call and how to finish it."""
        m = _ACTION.search(text)
        kind = m.group(1) if m else None
        if kind == "answer":
            answer = m.group(2).strip()  # type: ignore[union-attr]
            return StepOutcome("answer", True, info={"answer": answer, "messages": [{"role": "assistant", "content": answer}]})
        if not allowed:  # the final turn: a tool call is refused, anything else ends too
            msgs = self._step_messages(text)
            return StepOutcome("tool" if kind else "invalid", True, info={"refused": bool(kind), "messages": msgs})
        if kind != "tool_call":
            msgs = [{"role": "assistant", "content": text}, {"role": "user", "content": INVALID_TOOL_ACTION.strip()}]
            return StepOutcome("invalid", False, observation=INVALID_TOOL_ACTION, info={"messages": msgs})
        payload = m.group(2)  # type: ignore[union-attr]
        parsed = parse_call(payload)
        call = refused("", parsed) if isinstance(parsed, str) else self._call(parsed[0], parsed[1], self._tools_of(state))
        return [call], lambda job: self._tool_step(text, parsed, job.results[0])

    def _tool_step(self, text: str, parsed: tuple[str, Any] | str, result: ToolResult) -> StepOutcome:
        thought = text[: text.find("<tool_call>")].strip()
        calls: list[tuple[str, Any]] = [] if isinstance(parsed, str) else [parsed]
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

    def _plan_native(self, text: str, allowed: bool, state: Any) -> StepOutcome | tuple[list[Any], Callable[[Job], StepOutcome]]:
        """One assistant turn in the model's own protocol (module docstring): its outcome when it
        calls no tool, else its calls and how to finish it."""
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
        plan = [refused("", c.message) if isinstance(c, ToolCallError) else self._call(c.name, c.arguments, tools) for c in parsed]
        return plan, lambda job: self._native_step(content, parsed, calls, job.results)

    def _native_step(self, content: str, parsed: Sequence[Any], calls: list[ToolCall], done: list[ToolResult]) -> StepOutcome:
        """One assistant turn's outcome from its calls' results, in call order."""
        tok = self.tokenizer
        results: list[Message] = []
        errors, ran = [], 0
        for c, r in zip(parsed, done, strict=True):
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
        self,
        tasks: Sequence[Task],
        completions: Sequence[Sequence[Message]],
        states: Sequence[Any],
        completion_ids: Sequence[Sequence[int] | None] | None = None,
    ) -> list[tuple[float, dict[str, Any]]]:
        """The rewards of ending trajectories; the prompt each reward function sees carries the
        reset text of the trajectory's own world; ``environments`` are the trajectories' tool-class
        instances (TRL's name)."""
        prompts = [
            self.prompt_messages(t, s.reset_text if isinstance(s, ToolState) else None)
            for t, s in zip(tasks, states, strict=True)
        ]
        environments = [s.obj if isinstance(s, ToolState) else s for s in states] if self._class is not None else None
        scored = self.rewards.score(tasks, prompts, completions, completion_ids, environments)  # type: ignore[union-attr]
        out = []
        for (total, values), state in zip(scored, states, strict=True):
            if self._has_env_reward and isinstance(state, ToolState):
                own = self._states.reward(state)  # type: ignore[union-attr]
                if own is not None:
                    values = {**values, self._class.__name__: own}  # type: ignore[union-attr]
                    total += own
            out.append((total, {"rewards": values}))
        return out


__all__ = ["INVALID_TOOL_ACTION", "PROTOCOLS", "TOOLS_PROMPT", "ToolEnv", "call_message", "parse_call", "tool_response"]
