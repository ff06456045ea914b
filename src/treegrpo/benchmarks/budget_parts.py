"""What the budget benchmark rolls out with: the agent (:class:`AgentParts`, :func:`load_agent`)
and the instrumentation. The runner tags expansion cursors (:class:`PhaseRunner`)
and the engine records every request (:class:`RecordingEngine`), so the cost of the initial chains
(``init``) and of the expansions (``expand``) is kept apart even when one engine call serves both;
a forward pre-hook counts the model's work (:func:`count_forwards`). Recording keeps references
only, so it does not disturb timing."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from treegrpo.benchmarks.budget_report import Call
from treegrpo.envs.base import AgentEnv, Task
from treegrpo.rollout.agent import AgentConfig, Budget, Cursor, StepRunner
from treegrpo.rollout.engine import Generation, SamplingParams, release_engine_cache


@dataclass
class AgentParts:
    """A model with its tokenizer, environment, agent settings and question pool."""

    model: torch.nn.Module
    tokenizer: Any
    env: AgentEnv
    agent_cfg: AgentConfig
    tasks: list[Task]
    model_dir: Path | None = None


def load_agent(model_dir: str | Path | None = None) -> AgentParts:
    """The bootstrapped agent in ``model_dir`` (default: ``ensure_bootstrapped("default")``), with
    the env and agent settings it was trained with and its world's ``train`` questions."""
    from treegrpo.models.loader import load_model, load_tokenizer
    from treegrpo.tasks.world.bootstrap import ensure_bootstrapped, load_setup

    folder = Path(model_dir) if model_dir is not None else ensure_bootstrapped("default")
    setup = load_setup(folder)
    model = load_model(folder).eval()
    return AgentParts(
        model, load_tokenizer(folder), setup.env, setup.agent, setup.world.tasks("train"), folder
    )


class ExpansionContext(list):
    """A context list tagged as an expansion's. It stays tagged as the runner extends it
    (``context + node.tokens``), so the engine can tell an expansion's requests from an initial
    chain's in the same call."""

    def __add__(self, other: list) -> ExpansionContext:  # type: ignore[override]
        return ExpansionContext(list.__add__(self, other))


class RecordingEngine:
    """Wraps an engine and records every call: ``(contexts, generations, phases)``, the phase of a
    request being ``expand`` when its context is an :class:`ExpansionContext`, else ``init``.

    Recording keeps references only (no copies, no computation) so it does not disturb timing.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[Call] = []

    @property
    def eos_token_id(self) -> int | None:
        return getattr(self.inner, "eos_token_id", None)

    def generate(  # the engine interface (rollout/engine.py), passed through
        self, contexts: Sequence[Sequence[int]], params: SamplingParams, generator: torch.Generator | None = None
    ) -> list[Generation]:  # fmt: skip
        gens = self.inner.generate(contexts, params, generator)
        phases = ["expand" if isinstance(c, ExpansionContext) else "init" for c in contexts]
        self.calls.append((list(contexts), gens, phases))
        return gens

    def load_weights(self, model: torch.nn.Module) -> None:
        self.inner.load_weights(model)

    def release_cache(self) -> None:
        release_engine_cache(self.inner)


class PhaseRunner(StepRunner):
    """A :class:`StepRunner` that tags expansion cursors (:class:`ExpansionContext`): the cursors
    of every ``run_turns`` call after the first (a sampler that runs its rounds one after the
    other), and those an ``on_end`` hook adds (a sampler that starts a prompt's expansions as soon
    as its own trajectories end)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.turn_calls = 0

    def run_turns(
        self, cursors: Sequence[Cursor], budgets: Sequence[Budget], generator: torch.Generator | None = None,
        params: SamplingParams | None = None, **kwargs: Any,
    ) -> int:  # fmt: skip
        if self.turn_calls:
            for c in cursors:
                c.context = ExpansionContext(c.context)
        self.turn_calls += 1
        on_end = kwargs.get("on_end")
        if on_end is not None:

            def tagged(c: Cursor) -> Sequence[Cursor]:
                new = list(on_end(c))
                for n in new:
                    n.context = ExpansionContext(n.context)
                return new

            kwargs["on_end"] = tagged
        return super().run_turns(cursors, budgets, generator, params, **kwargs)


@contextlib.contextmanager
def count_forwards(model: torch.nn.Module | None) -> Iterator[dict[str, int]]:
    """Meanwhile count ``model``'s forwards, the positions they ran and those of prefill forwards
    (more than one position per row); an empty dict for no model."""
    if model is None:
        yield {}
        return
    work = dict.fromkeys(("forwards", "positions", "prefill_forward_positions"), 0)

    def count(_module: torch.nn.Module, _args: tuple, kwargs: dict[str, Any]) -> None:
        b, q = kwargs["input_ids"].shape
        work["forwards"] += 1
        work["positions"] += b * q
        if q > 1:
            work["prefill_forward_positions"] += b * q

    handle = model.register_forward_pre_hook(count, with_kwargs=True)
    try:
        yield work
    finally:
        handle.remove()


__all__ = ["AgentParts", "ExpansionContext", "PhaseRunner", "RecordingEngine", "count_forwards", "load_agent"]
