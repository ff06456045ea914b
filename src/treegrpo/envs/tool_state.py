"""A tool class's instances as the state handles of a :class:`~treegrpo.envs.tool_env.ToolEnv`
(docs/stateful-tools.md).

Every instance lives on the :class:`~treegrpo.envs.tool_runner.Lane` (one thread) that made it,
and everything done to it — its constructor, ``reset``, tool calls, ``fork``, ``snapshot``,
``get_reward``, ``state_key``, ``close`` — runs there, in order: a fork is made on its parent's
lane and stays there (so a forest's forks share one thread), a restored or replayed instance gets
a new lane of its own. A class holding a thread-bound object (a ``sqlite3`` connection) works.

A *world* is the instance a forest's prompt describes: made and ``reset(**row)`` once per forest
(:meth:`ClassTools.open_world`), its reset text appended to the question; every trajectory of the
forest starts from a copy of it (:meth:`ClassTools.world_state`: its ``fork()``, or
``restore(snapshot())`` on a new instance, or — replay mode — a new instance reset again, which
must give the same reset text and state key, else :class:`~treegrpo.envs.state.ReplayDivergence`).

A handle whose lane died (a call on it ran past its time-out: :mod:`treegrpo.envs.tool_runner`)
is *lost*: it is never called again; its forks and snapshots are lost too, and its ``get_reward``
counts 0.0.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from treegrpo import aio
from treegrpo.envs.base import Task
from treegrpo.envs.reward_fns import reward_value
from treegrpo.envs.state import ReplayDivergence
from treegrpo.envs.tool_runner import Lane, StateLost
from treegrpo.envs.tools import bound_tools
from treegrpo.errors import ConfigError


@dataclass(eq=False)
class ToolState:
    """A live instance on its lane, with the reset text of the world it was copied from.
    ``lost``: why it can no longer be called (``None`` while it can)."""

    obj: Any
    lane: Lane | None
    reset_text: str
    lost: str | None = None

    def why_lost(self) -> str | None:
        if self.lost is None and self.lane is not None and self.lane.dead:
            self.lost = "a call on its thread ran past its time-out"
        return self.lost


@dataclass(eq=False)
class Snapshot:
    """What an instance's ``snapshot()`` returned (plain data: restored on another thread)."""

    value: Any
    reset_text: str
    lost: str | None = None


def _lost(reset_text: str, why: str) -> ToolState:
    return ToolState(None, None, reset_text, why)


class ClassTools:
    """The instances of one tool class (module docstring).

    Args:
        factory: makes one instance (the class, or a callable returning one).
        cls: the class of what it makes.
        mode: ``fork`` | ``snapshot`` | ``replay``.
        timeout_s: the limit on each state-contract call (past it the run stops: one line).
    """

    def __init__(self, factory: Callable[[], Any], cls: type, mode: str, timeout_s: float | None) -> None:
        self.factory, self.cls, self.mode, self.timeout_s = factory, cls, mode, timeout_s
        self.name = cls.__name__
        self._current: dict[str, ToolState] = {}
        self._lock = threading.Lock()

    # -- contract calls, on an instance's lane ------------------------------------------------------
    def _on(self, lane: Lane, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` (awaited when it is a coroutine) on ``lane``; a failure is one ConfigError line."""
        try:
            return lane.call(lambda: aio.resolve(fn(), self.timeout_s), self.timeout_s)
        except StateLost:
            raise
        except ConfigError:
            raise
        except TimeoutError:
            raise ConfigError(
                f"{self.name}.{what} ran past tool_timeout_s={self.timeout_s:g} s: the state contract's methods must "
                "return in time"
            ) from None
        except BaseException as e:  # the user's class: one line, not a traceback
            raise ConfigError(f"{self.name}.{what} raised {type(e).__name__}: {e} — fix the tool class") from None

    def _retain(self, lane: Lane) -> Lane:
        with self._lock:
            lane.refs += 1
        return lane

    def _release(self, lane: Lane | None) -> None:
        if lane is None:
            return
        with self._lock:
            lane.refs -= 1
            last = lane.refs <= 0
        if last:
            lane.stop()

    def _make(self, lane: Lane) -> Any:
        obj = self._on(lane, "__init__()", self.factory)
        if obj is None:
            raise ConfigError(f"environment_factory {self.name} returned None: it must make one tool-class instance")
        return obj

    def new(self, task: Task) -> ToolState:
        """A new instance on a new lane, ``reset(**row)`` (when the class has ``reset``)."""
        lane = self._retain(Lane(f"tool-{self.name}"))
        obj = self._make(lane)
        text = ""
        reset = getattr(obj, "reset", None)
        if callable(reset):
            out = self._on(lane, "reset(**row)", lambda: reset(**task.meta))
            text = "" if out is None else "\n" + str(out)
        return ToolState(obj, lane, text)

    # -- worlds --------------------------------------------------------------------------------------
    def open_world(self, task: Task) -> ToolState:
        """A new world for ``task`` (reset once); also the task's current world (:meth:`current`)."""
        world = self.new(task)
        with self._lock:
            self._current[task.id] = world
        return world

    def current(self, task: Task) -> ToolState:
        """The task's current world: the latest opened for it (one is opened when there is none)."""
        with self._lock:
            world = self._current.get(task.id)
        return world if world is not None else self.open_world(task)

    def close_world(self, world: ToolState) -> None:
        """Close ``world`` on its lane without waiting (its forest is gone; a failure is one line
        on stderr: nothing waits to be told)."""
        with self._lock:
            for k, w in list(self._current.items()):
                if w is world:
                    del self._current[k]

        def close() -> None:
            try:
                self.close(world)
            except ConfigError as e:
                print(f"treegrpo: {e}", file=sys.stderr)

        if world.lane is None or world.why_lost() is not None:
            self._release(world.lane)
        else:
            world.lane.submit(close)

    def world_state(self, world: ToolState, task: Task) -> ToolState:
        """A live state equal to ``world``'s (module docstring).

        Raises:
            ReplayDivergence: replay mode, and resetting a new instance gave another reset text or
                state key than the world's (a random ``reset``: give the class fork or snapshot).
        """
        if self.mode == "fork":
            return self.fork(world)
        if self.mode == "snapshot":
            return self.restore(self.snapshot(world))
        fresh = self.new(task)
        keys = (self.key(world), self.key(fresh)) if callable(getattr(self.cls, "state_key", None)) else ("", "")
        if fresh.reset_text != world.reset_text or keys[0] != keys[1]:
            self.close(fresh)
            raise ReplayDivergence(
                f"{self.name}.reset(**row) of task {task.id!r} gave another world the second time (reset text "
                f"{world.reset_text.strip()[:60]!r}, then {fresh.reset_text.strip()[:60]!r}): replay mode needs a "
                "deterministic reset — give the class fork() or snapshot()/restore()"
            )
        return fresh

    # -- the state protocol ----------------------------------------------------------------------------
    def fork(self, state: ToolState) -> ToolState:
        """``state.obj.fork()``, on its lane.

        Raises:
            ConfigError: ``fork()`` returned the instance itself (branches would share one state).
        """
        if state.why_lost() is not None or state.lane is None:
            return _lost(state.reset_text, state.lost or "lost")
        try:
            twin = self._on(state.lane, "fork()", state.obj.fork)
        except StateLost:
            return _lost(state.reset_text, "a call on its thread ran past its time-out")
        if twin is state.obj:
            raise ConfigError(
                f"{self.name}.fork() returned the instance itself: branches would share one state — return an "
                "independent copy (a new instance)"
            )
        return ToolState(twin, self._retain(state.lane), state.reset_text)

    def snapshot(self, state: ToolState) -> Snapshot:
        if state.why_lost() is not None or state.lane is None:
            return Snapshot(None, state.reset_text, state.lost or "lost")
        try:
            return Snapshot(self._on(state.lane, "snapshot()", state.obj.snapshot), state.reset_text)
        except StateLost:
            return Snapshot(None, state.reset_text, "a call on its thread ran past its time-out")

    def restore(self, snap: Snapshot) -> ToolState:
        """A new instance, on a new lane, ``restore(snapshot)``."""
        if snap.lost is not None:
            return _lost(snap.reset_text, snap.lost)
        lane = self._retain(Lane(f"tool-{self.name}"))
        obj = self._make(lane)
        self._on(lane, "restore(snapshot)", lambda: obj.restore(snap.value))
        return ToolState(obj, lane, snap.reset_text)

    def close(self, handle: Any) -> None:
        """Release a handle: ``close()`` on its lane (never on a lost one), then the lane."""
        if isinstance(handle, Snapshot):
            close = getattr(handle.value, "close", None)
            if handle.lost is None and callable(close):
                aio.resolve(close())
            return
        if handle.why_lost() is None and handle.lane is not None:
            close = getattr(handle.obj, "close", None)
            if callable(close):
                with contextlib.suppress(StateLost):
                    self._on(handle.lane, "close()", close)
        self._release(handle.lane)

    def reward(self, state: ToolState) -> float | None:
        """``get_reward()`` of ``state`` (0.0 when lost; ``None``: does not apply)."""
        if state.why_lost() is not None or state.lane is None:
            return 0.0
        try:
            value = self._on(state.lane, "get_reward()", state.obj.get_reward)
        except StateLost:
            return 0.0
        return reward_value(value, f"{self.name}.get_reward()")

    def key(self, state: ToolState) -> str:
        if state.why_lost() is not None or state.lane is None:
            return f"lost: {state.lost}"
        try:
            return str(self._on(state.lane, "state_key()", state.obj.state_key))
        except StateLost:
            return "lost"


def class_mode(cls: type | None) -> str:
    """How a tool class's states branch: ``fork`` when it has ``fork()``, ``snapshot`` when it has
    ``snapshot()`` and ``restore()``, else ``replay``; ``stateless`` without a class."""
    if cls is None:
        return "stateless"
    if callable(getattr(cls, "fork", None)):
        return "fork"
    if callable(getattr(cls, "snapshot", None)) and callable(getattr(cls, "restore", None)):
        return "snapshot"
    return "replay"


def probe_class(factory: Any, timeout_s: float | None) -> tuple[type, list[dict[str, Any]]]:
    """The class ``factory`` makes and its tools' schemas, from one probe instance (made on its
    own lane, then closed).

    Raises:
        ConfigError: ``factory`` is an instance, cannot be called without arguments, or its
            constructor or ``close()`` raised (one line each).
    """
    what = getattr(factory, "__name__", type(factory).__name__)
    if not callable(factory):
        raise ConfigError(
            f"environment_factory is an instance of {what}, not a class: pass the class itself (one instance is made "
            "per trajectory)"
        )
    probe = ClassTools(factory, factory if isinstance(factory, type) else object, "replay", timeout_s)
    probe.name = what
    lane = probe._retain(Lane(f"tool-{what}"))
    try:
        obj = probe._make(lane)
    except ConfigError as e:
        if "TypeError" in str(e) and "argument" in str(e):
            raise ConfigError(
                f"environment_factory {what}() cannot be made without arguments ({str(e).split(': ', 1)[-1]}): give "
                "its arguments defaults, or pass functools.partial(Class, ...) — one instance is made per trajectory"
            ) from None
        raise
    schemas = [t.schema for t in bound_tools(obj).values()]
    probe.name = type(obj).__name__
    probe.close(ToolState(obj, lane, ""))
    return type(obj), schemas


__all__ = ["ClassTools", "Snapshot", "ToolState", "class_mode", "probe_class"]
