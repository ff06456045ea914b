"""The library side of the state protocol (:mod:`treegrpo.envs.state`): which state a trajectory
continued from a node starts in.

One :class:`StateKeeper` lives for one :meth:`~treegrpo.rollout.agent.StepRunner.run_turns` call
(a sampler's whole rollout). After each step that does not end its trajectory the keeper keeps
the node's state (``snapshot`` or ``fork`` mode; nothing in ``replay`` mode); a trajectory that
starts at a node gets :meth:`StateKeeper.state_at`: the kept state of the node restored (or
forked), else — replay mode, or a node whose state was not kept, e.g. from an earlier
``run_turns`` call — the nearest kept ancestor's state (the initial state at the root) with the
recorded steps of the rest of the path replayed on it. Everything is released when the rollout
ends (:meth:`StateKeeper.release`).

An env with worlds (``open_world(task)``, ``world_state(world, task)``, ``close_world(world)``:
:class:`~treegrpo.envs.tool_env.ToolEnv` with a tool class) makes the world a forest's prompt
describes once per forest (:func:`open_world`, when the forest is made); a trajectory that starts
at the root of one of the forest's trees starts from ``world_state`` of it (a copy), not from a new
``initial_state`` — so the prompt and every trajectory's state agree, even with a random ``reset``.
The world lives as long as one of its trees does (then ``close_world``).

When the env can key its states (:func:`treegrpo.envs.state.state_key`), the keeper also writes
each node's key into ``node.extra["state_key"]`` (the root's when a trajectory first starts there),
in every state mode; GiGPO's anchor states are these keys.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from treegrpo.envs.base import Task
from treegrpo.envs.state import ReplayDivergence, StateMode, state_key, state_mode
from treegrpo.tree import Node, Tree


def _short(text: str | None) -> str:
    return repr(text) if text is None or len(text) <= 80 else repr(text[:77] + "...")


_WORLDS: dict[int, Any] = {}  # id(tree) -> the world of its forest (while the tree lives)


def open_world(env: Any, task: Task) -> Any:
    """A new world for a new forest of ``task`` when ``env`` has worlds (module docstring), else ``None``."""
    opener = getattr(env, "open_world", None)
    return opener(task) if callable(opener) else None


def bind_world(env: Any, world: Any, trees: Sequence[Tree]) -> None:
    """Make ``world`` the start of every trajectory from the roots of ``trees``; ``env.close_world``
    it once none of them is left."""
    left = [len(trees)]

    def drop(key: int) -> None:
        _WORLDS.pop(key, None)
        left[0] -= 1
        if left[0] == 0:
            try:
                env.close_world(world)
            except Exception as e:  # a finalizer cannot raise: say it in one line
                print(f"treegrpo: closing a forest's world: {e}", file=sys.stderr)

    for tree in trees:
        _WORLDS[id(tree)] = world
        weakref.finalize(tree, drop, id(tree)).atexit = False  # nothing to close at interpreter exit


def root_state(env: Any, tree: Tree, task: Task) -> Any:
    """A fresh live state for a trajectory starting at ``tree``'s root: a copy of its forest's
    world when it has one, else ``env.initial_state(task)``."""
    world = _WORLDS.get(id(tree))
    return env.initial_state(task) if world is None else env.world_state(world, task)


@dataclass
class StateKeeper:
    """Per-node states of the trees of one rollout, for one stateful env.

    ``kept_observation`` maps an observation the env returns to the text a node keeps of it (the
    agent loop's :meth:`~treegrpo.rollout.agent.StepRunner.observation_ids`: it may shorten it or
    wrap it in a chat turn); ``None``: nodes keep the env's text as it is.
    """

    env: Any
    mode: StateMode
    kept_observation: Callable[[str], str] | None = None
    _kept: dict[int, tuple[Tree, dict[int, Any]]] = field(default_factory=dict, repr=False)

    @classmethod
    def for_env(cls, env: Any, kept_observation: Callable[[str], str] | None = None) -> StateKeeper | None:
        """A keeper for ``env``; ``None`` for a stateless env (nothing to keep)."""
        mode = state_mode(env)
        return None if mode == "stateless" else cls(env, mode, kept_observation)

    def note_key(self, node: Node, state: Any) -> None:
        """Write ``state``'s key (if the env has keys) into ``node.extra["state_key"]``."""
        key = state_key(self.env, state)
        if key is not None:
            node.extra["state_key"] = key

    def record(self, tree: Tree, node_id: int, state: Any) -> None:
        """Keep the state of node ``node_id`` (``state``, the live state right after its step)
        and note its key."""
        self.note_key(tree.node(node_id), state)
        if self.mode == "replay":
            return
        handle = self.env.snapshot(state) if self.mode == "snapshot" else self.env.fork(state)
        kept = self._kept.setdefault(id(tree), (tree, {}))[1]
        if node_id in kept:
            self.env.close_state(kept[node_id])
        kept[node_id] = handle

    def kept(self, tree: Tree, node_id: int) -> bool:
        """Whether the state of node ``node_id`` is kept (a branch from it needs no replay)."""
        return node_id in self._kept.get(id(tree), (tree, {}))[1]

    def state_at(self, tree: Tree, node_id: int, task: Task) -> tuple[Any, int]:
        """A fresh live state equal to the world's state at node ``node_id``, and the tool calls
        replayed to build it (0 when the node's state was kept, or at the root).

        Raises:
            ReplayDivergence: a replayed step ended the trajectory, took another kind of action
                than it did when it was recorded, or got another observation.
        """
        path = tree.path(node_id)
        kept = self._kept.get(id(tree), (tree, {}))[1]
        start, state = 0, None
        for i in range(len(path) - 1, 0, -1):
            handle = kept.get(path[i].id)
            if handle is not None:
                state = self.env.restore(handle) if self.mode == "snapshot" else self.env.fork(handle)
                start = i
                break
        if state is None:
            state = root_state(self.env, tree, task)
        replayed = 0
        history = [(nd.text, nd.observation) for nd in path[1 : start + 1]]
        for nd in path[start + 1 :]:
            kwargs: dict[str, Any] = {"states": [state]}
            if getattr(self.env, "needs_history", False):
                kwargs["histories"] = [list(history)]
            out = self.env.step([task], [nd.text], [True], **kwargs)[0]
            replayed += out.tool_calls
            what = ""
            if out.done or out.kind != nd.extra.get("kind"):
                what = (
                    f"recorded a {nd.extra.get('kind')!r} step that went on, replayed a {out.kind!r} step"
                    + (" that ended the trajectory" if out.done else "")
                )
            else:
                obs = out.observation or ""
                obs = obs if self.kept_observation is None else self.kept_observation(obs)
                if obs != nd.observation:
                    what = f"recorded the observation {_short(nd.observation)}, replayed {_short(obs)}"
            if what:
                self.env.close_state(state)
                raise ReplayDivergence(
                    f"replaying node {nd.id} of task {task.id!r}: {what}; the env must be deterministic for "
                    "state_mode 'replay' (or provide snapshot/restore or fork)"
                )
            history.append((nd.text, nd.observation))
        if "state_key" not in path[-1].extra:  # the root, or a node of an earlier rollout
            self.note_key(path[-1], state)
        return state, replayed

    def close(self, state: Any) -> None:
        """Release a live state (its trajectory ended)."""
        if state is not None:
            self.env.close_state(state)

    def release(self) -> None:
        """Release every kept state (the rollout is over)."""
        for _, kept in self._kept.values():
            for handle in kept.values():
                self.env.close_state(handle)
        self._kept.clear()


__all__ = ["StateKeeper", "bind_world", "open_world", "root_state"]
