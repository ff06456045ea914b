"""The state protocol: how an environment whose tool calls change the world lets a tree branch.

A stateless environment (search: a branch is a copied context plus re-sent queries) needs nothing
here. An environment whose actions *write* (a database, a file system, a key-value store) declares
``state_mode`` and keeps one opaque *state handle* per trajectory; the agent loop
(:class:`~treegrpo.rollout.agent.StepRunner`) carries the handle on the trajectory's
:class:`~treegrpo.rollout.agent.Cursor` and passes it to :meth:`StatefulEnv.step`, which applies
the trajectory's action to it (in place). When a sampler continues a new trajectory from a node,
the loop gives it exactly the state the world had at that node (:mod:`treegrpo.rollout.state`):

- ``"snapshot"``: after every step that does not end the trajectory, the loop keeps
  ``env.snapshot(state)``; a branch from the node gets ``env.restore(snapshot)`` (a fresh live
  state; the snapshot stays valid for further branches).
- ``"fork"``: the same with ``env.fork(state)`` (an independent copy) for both: the kept copy is
  never stepped, each branch steps its own fork of it.
- ``"replay"``: the env can neither; a branch starts from ``env.initial_state(task)`` and the loop
  replays the recorded step texts of the path root → node through :meth:`StatefulEnv.step`. The env
  must be deterministic (same actions from the same start, same observations); the tool calls a
  replay makes are booked apart, in ``Budget.replayed_tool_calls``. A replayed step that ends the
  trajectory, takes another kind of action than it did when recorded or gets another observation
  (compared as the node keeps it) raises :class:`ReplayDivergence`.
- ``"stateless"`` (the default when an env has no ``state_mode``): no handle; nothing changes.

Every handle the loop obtains (``initial_state``, ``restore``, ``fork``, ``snapshot``) is handed
back through ``env.close_state(handle)`` once it is no longer needed (the trajectory ended, or the
sampler's rollout is over). A handle is never ``None``.

An env that is called without ``states`` (a single-turn sampler such as ``eptree``, which never
continues a trajectory after a tool call) starts every step from ``initial_state(task)``.

**State keys** (optional, :func:`state_key`): an env may say which states are *the same*, through
``state_key(state) -> str`` (equal strings exactly for equal states: a canonical text of the state,
or a hash of one), or, lacking it, ``dump_state(state) -> str`` (a canonical text; the SQL and
key-value envs have it). The loop records the key of each node's state — the state *after* its
step, the initial state on the root — as ``node.extra["state_key"]``; GiGPO
(:mod:`treegrpo.algos.gigpo`) groups the steps that start from the same key. Its similarity
grouping compares the keys as texts, so a short canonical text is more useful than a hash.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Protocol, runtime_checkable

from treegrpo.envs.base import AgentEnv, StepOutcome, Task

StateMode = Literal["stateless", "snapshot", "fork", "replay"]
STATE_MODES: tuple[str, ...] = ("stateless", "snapshot", "fork", "replay")


class ReplayDivergence(RuntimeError):
    """Replaying a path's recorded actions gave another outcome than recording them: the env is
    not deterministic, so ``state_mode="replay"`` cannot branch it exactly."""


@runtime_checkable
class StatefulEnv(AgentEnv, Protocol):
    """An :class:`~treegrpo.envs.base.AgentEnv` whose steps read and write a per-trajectory state.

    ``snapshot``/``restore`` are needed for ``state_mode="snapshot"``, ``fork`` for ``"fork"``;
    ``"replay"`` needs neither.
    """

    state_mode: StateMode

    def initial_state(self, task: Task) -> Any:
        """A fresh live state for ``task`` (the world before the first action)."""
        ...

    def step(  # type: ignore[override]
        self, tasks: Sequence[Task], steps: Sequence[str], search_allowed: Sequence[bool], states: Sequence[Any] | None = None
    ) -> list[StepOutcome]:
        """Like :meth:`AgentEnv.step`; ``states[i]`` is trajectory ``i``'s live state, changed in
        place by its action (``None``: each step starts from ``initial_state``)."""
        ...

    def close_state(self, state: Any) -> None:
        """Release a handle (a live state, a snapshot or a fork)."""
        ...


class StepEachState:
    """The ``step`` of a :class:`StatefulEnv` whose trajectories act one at a time: the env says
    what one action does to one live state (``step_one``), this runs a batch.

    ``step`` hands ``step_one(task, text, allowed, state)`` each trajectory's task, step text,
    whether a tool call is still allowed, and its live state ``states[i]`` (changed in place); a
    call without ``states`` (a single-turn sampler) gives each step a fresh ``initial_state(task)``,
    closed (``close_state``) right after it."""

    def step(
        self, tasks: Sequence[Task], steps: Sequence[str], search_allowed: Sequence[bool], states: Sequence[Any] | None = None
    ) -> list[StepOutcome]:
        """Each trajectory's :meth:`step_one` on its live state (class docstring)."""
        env: Any = self  # the env that mixes this in has initial_state and close_state
        out = []
        for i, (task, text, allowed) in enumerate(zip(tasks, steps, search_allowed, strict=True)):
            state = env.initial_state(task) if states is None else states[i]
            out.append(self.step_one(task, text, allowed, state))
            if states is None:
                env.close_state(state)
        return out

    def step_one(self, task: Task, text: str, allowed: bool, state: Any) -> StepOutcome:
        """The outcome of ``text`` (trajectory ``task``'s step) on ``state`` (changed in place)."""
        raise NotImplementedError


def state_key(env: Any, state: Any) -> str | None:
    """The key of ``state`` (module docstring): ``env.state_key(state)``, else
    ``env.dump_state(state)``, else ``None`` (the env does not say when two states are equal)."""
    for name in ("state_key", "dump_state"):
        fn = getattr(env, name, None)
        if callable(fn):
            key = fn(state)
            if not isinstance(key, str):
                raise TypeError(f"{type(env).__name__}.{name}() must return a str, got {type(key).__name__}")
            return key
    return None


def state_mode(env: Any) -> StateMode:
    """``env``'s declared state mode (``"stateless"`` when it declares none).

    Raises:
        ValueError: an unknown mode, or a mode whose methods the env lacks.
    """
    mode = getattr(env, "state_mode", "stateless")
    if mode not in STATE_MODES:
        raise ValueError(f"{type(env).__name__}.state_mode is {mode!r}; choose one of {list(STATE_MODES)}")
    needed = {"stateless": (), "replay": (), "snapshot": ("snapshot", "restore"), "fork": ("fork",)}[mode]
    if mode != "stateless":
        needed = ("initial_state", "close_state", *needed)
    missing = [m for m in needed if not callable(getattr(env, m, None))]
    if missing:
        raise ValueError(f"{type(env).__name__} declares state_mode {mode!r} but has no {', '.join(missing)}()")
    return mode  # type: ignore[return-value]


__all__ = ["STATE_MODES", "ReplayDivergence", "StateMode", "StatefulEnv", "StepEachState", "state_key", "state_mode"]
