"""The environment contract for agent-step rollouts.

A rollout alternates: the engine samples a step (thought + action, stopping at the action's end
tag), then the environment reads the step's *text* and answers with an observation (or ends the
trajectory with a reward). Environments never see or produce token ids: the agent loop tokenizes
each observation once and keeps every generated id as it was sampled (DESIGN.md §3.1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

ActionKind = Literal["search", "answer", "invalid", "sql", "kv"]  # sql, kv: the stateful tools (tasks/sql, tasks/kv)


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
    """

    kind: ActionKind
    done: bool
    reward: float | None = None
    observation: str | None = None
    tool_calls: int = 0
    retrieval_error: bool = False
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class AgentEnv(Protocol):
    """A multi-turn tool environment (Search-R1 style)."""

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
