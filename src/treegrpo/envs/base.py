"""The environment contract for agent-step rollouts.

A rollout alternates: the engine samples a step (thought + action, stopping at the action's end
tag), then the environment reads the step's *text* and answers with an observation (or ends the
trajectory with a reward). Environments never see or produce token ids: the agent loop tokenizes
each observation once and keeps every generated id as it was sampled (DESIGN.md §3.1).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from treegrpo.errors import ConfigError

ActionKind = str
"""What a step did: ``answer``, ``invalid`` (malformed or missing action) or a tool action of the
env's (``search``; ``sql``, ``kv`` for the stateful tools in tasks/sql and tasks/kv; ``tool`` for a
:class:`~treegrpo.envs.tool_env.ToolEnv`). An env names its kinds in ``actions``."""
#: The kinds of the built-in envs, accepted from an env that does not declare ``actions``.
KNOWN_KINDS: tuple[str, ...] = ("search", "answer", "invalid", "sql", "kv", "tool")


@dataclass
class Task:
    """One question with its gold answers.

    Attributes:
        id: stable identifier (becomes the forest's ``prompt_id``).
        question: the question text shown to the model.
        answers: gold answers; any match counts.
        data_source: where it came from (Search-R1's ``data_source``), for per-source metrics.
        meta: anything else (hops, world seed, …).
    """

    id: str
    question: str
    answers: list[str]
    data_source: str = ""
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class StepOutcome:
    """What the environment makes of one step.

    Attributes:
        kind: the action the step took (``invalid`` for malformed or missing tags).
        done: the trajectory ends here (answer given, or the final turn passed).
        reward: the trajectory's reward, set exactly when ``done``.
        observation: text appended after the step when the trajectory goes on.
        tool_calls: tool calls this step made (0 or 1 for search).
        retrieval_error: the tool failed; the observation tells the model so.
        info: anything else worth logging (the parsed query or answer…).
        observation_parts: the observation split into ``(text, control)`` pieces whose texts join
            to ``observation``: ``control`` pieces (a chat template's turn markers) are tokenized
            with the tokenizer's special tokens, the others — what a tool returned — as plain text,
            so a tool result cannot write a control token (DESIGN.md §3.10). ``None``: the whole
            observation is plain text.
    """

    kind: ActionKind
    done: bool
    reward: float | None = None
    observation: str | None = None
    tool_calls: int = 0
    retrieval_error: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    observation_parts: tuple[tuple[str, bool], ...] | None = None


@runtime_checkable
class AgentEnv(Protocol):
    """A multi-turn tool environment (Search-R1 style).

    Optional attributes the loop reads: ``actions`` (``{kind: end tag}``, the action kinds a step
    may take besides ``invalid`` — checked at start-up against ``stop_strings``; the end tag is
    ``None`` for a turn that ends at the model's end-of-turn token), ``binary_reward`` (rewards are
    0/1: held-out figures are called success, not reward), ``needs_history``/``needs_messages``
    (``step`` gets each trajectory's earlier steps), ``score_outcome`` (the reward and node info of
    a trajectory the loop ends itself), ``fit_observation``, and the state contract
    (:mod:`treegrpo.envs.state`).
    """

    stop_strings: tuple[str, ...]
    """Action end tags; the engine stops a step right after one (DESIGN.md §3.2)."""

    def prompt(self, task: Task) -> str:
        """The user message for ``task`` (the agent loop applies the chat template, if any)."""
        ...

    def step(
        self, tasks: Sequence[Task], steps: Sequence[str], search_allowed: Sequence[bool]
    ) -> list[StepOutcome]:
        """Answer a batch of steps at once (tool calls are batched). ``search_allowed[i]`` is False
        on the final turn: a search there is refused and the trajectory ends."""
        ...

    def score(self, task: Task, step: str) -> float:
        """Reward of a trajectory that ended without an answer at this step (turn or length limit)."""
        ...


def env_name(env: Any) -> str:
    return type(env).__name__


def declared_kinds(env: Any) -> tuple[str, ...]:
    """The step kinds ``env`` may return: its ``actions`` and ``invalid``, or, for an env that
    declares none, the built-in kinds (:data:`KNOWN_KINDS`)."""
    actions = getattr(env, "actions", None)
    return (*actions, "invalid") if actions is not None else KNOWN_KINDS


def check_env(env: Any) -> None:
    """Check ``env`` against the contract before anything runs: its methods, ``stop_strings`` a
    tuple of non-empty strings, and every declared action's end tag among them.

    Raises:
        ConfigError: one line naming the env, what is wrong and the fix.
    """
    name = env_name(env)
    for method in ("prompt", "step", "score"):
        if not callable(getattr(env, method, None)):
            raise ConfigError(
                f"env {name} has no {method}() method: an env needs stop_strings, prompt(task), "
                "step(tasks, steps, allowed) and score(task, step) (docs/tools.md)"
            )
    if not hasattr(env, "stop_strings"):
        raise ConfigError(
            f"env {name} has no stop_strings: give the tuple of its actions' end tags, e.g. "
            "('</search>', '</answer>'), or () when a turn ends at the model's end-of-turn token"
        )
    stops = env.stop_strings
    if isinstance(stops, str):
        raise ConfigError(
            f"env {name}.stop_strings is the string {stops!r}, not a tuple: write ({stops!r},) "
            "(a string is a sequence of one-character stop strings)"
        )
    if not isinstance(stops, tuple | list) or any(not isinstance(s, str) or not s for s in stops):
        raise ConfigError(f"env {name}.stop_strings must be a tuple of non-empty strings, got {stops!r}")
    actions = getattr(env, "actions", None)
    if actions is None:
        return
    if not isinstance(actions, Mapping) or not all(isinstance(k, str) for k in actions):
        raise ConfigError(f"env {name}.actions must map each action kind to its end tag, got {actions!r}")
    for kind, tag in actions.items():
        if tag and tag not in stops:
            raise ConfigError(
                f"env {name}: stop_strings {tuple(stops)!r} lack {tag!r}, the end tag of its {kind!r} action, so "
                f"generation would run past that action; add {tag!r} to stop_strings"
            )


def check_outcomes(env: Any, outcomes: Any, n_steps: int) -> list[StepOutcome]:
    """``env.step``'s answer, checked: one :class:`StepOutcome` per step, each of a declared kind
    and with a reward when it ends the trajectory.

    Raises:
        ConfigError: one line naming the env and the fix.
    """
    name = env_name(env)
    if not isinstance(outcomes, Sequence) or len(outcomes) != n_steps:
        got = len(outcomes) if isinstance(outcomes, Sequence) else type(outcomes).__name__
        raise ConfigError(f"env {name}.step returned {got} outcomes for {n_steps} steps: return one StepOutcome per step, in order")
    kinds = declared_kinds(env)
    for o in outcomes:
        if not isinstance(o, StepOutcome):
            raise ConfigError(f"env {name}.step returned a {type(o).__name__}: return treegrpo StepOutcome objects")
        if o.kind not in kinds:
            raise ConfigError(
                f"env {name}.step returned kind {o.kind!r}: declare it in {name}.actions "
                f"(kind -> end tag) or use one of {', '.join(kinds)}"
            )
        if o.done and o.reward is None:
            raise ConfigError(f"env {name}.step ended a trajectory ({o.kind}) without a reward: set StepOutcome.reward when done")
    return list(outcomes)


def step_stream(env: Any, tasks: Sequence[Task], steps: Sequence[str], search_allowed: Sequence[bool],
                **kwargs: Any) -> Iterator[tuple[int, StepOutcome]]:
    """The outcomes of one batch of steps as they become ready: ``(index into the batch, outcome)``,
    every index exactly once, in any order (DESIGN.md §3.9 — a trajectory whose tool results are
    back goes on without waiting for the slowest call of the batch).

    An env with a ``step_stream`` method of the same signature (e.g. :class:`~treegrpo.envs.tool_env.ToolEnv`,
    whose calls run concurrently and finish at their own speed) gives its outcomes one by one; for
    any other env this is ``env.step`` on the whole batch, yielded in order once it returns. Every
    outcome is checked as :func:`check_outcomes` checks ``step``'s (one per step, declared kinds,
    a reward when done).

    Raises:
        ConfigError: one line naming the env and the fix (a missing, repeated or bad outcome).
    """
    own = getattr(env, "step_stream", None)
    if not callable(own):
        yield from enumerate(check_outcomes(env, env.step(tasks, steps, search_allowed, **kwargs), len(steps)))
        return
    seen: set[int] = set()
    for i, outcome in own(tasks, steps, search_allowed, **kwargs):
        if not isinstance(i, int) or not 0 <= i < len(steps) or i in seen:
            raise ConfigError(
                f"env {env_name(env)}.step_stream gave index {i!r} for {len(steps)} steps: give each step's index once"
            )
        seen.add(i)
        [checked] = check_outcomes(env, [outcome], 1)
        yield i, checked
    if len(seen) != len(steps):
        raise ConfigError(
            f"env {env_name(env)}.step_stream gave {len(seen)} outcomes for {len(steps)} steps: give one per step"
        )
