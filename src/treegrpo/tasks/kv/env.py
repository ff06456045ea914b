"""A lightweight stateful world: an in-memory key-value store the agent reads and writes.

Built for fast tests of the state protocol (:mod:`treegrpo.envs.state`); the same env runs in
every state mode (``snapshot``, ``fork``, ``replay``: a constructor argument), so the modes can be
compared on one world. Actions, one per step::

    <kv>set k 5</kv>     <kv>add k -2</kv>     <kv>del k</kv>     <kv>get k</kv>
    <kv>mset a=1 b=2</kv>     <kv>dump</kv>     <answer> 7 </answer>

Observations are ``<result>…</result>`` (the new or read value, ``nil`` for a missing key, the
sorted ``k=v`` pairs for ``dump``, or ``error: …``). A statement either applies whole or not at
all: ``mset`` with one bad pair and ``add`` to a non-number change nothing (the error is the
observation). Values are integers.

A task (:func:`kv_tasks`) gives the start store (``meta["start"]``), the store a correct solution
leaves (``meta["expected"]``) and the gold answer. The reward is graded, so that comparing rewards
is informative even for random actions: ``0.5 ·`` (fraction of keys of start ∪ expected ∪ final
whose final value is the expected one) ``+ 0.5 ·`` (answer correct).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import ClassVar

from treegrpo.envs.base import StepOutcome, Task
from treegrpo.envs.state import STATE_MODES, StepEachState

ACTION_RE = re.compile(r"<(kv|answer)>(.*?)</\1>", re.DOTALL)
INVALID = "\nInvalid action: use <kv> set|add|del|get|mset|dump ... </kv> or <answer> value </answer>.\n"
PROMPT = "Store: {start}. Task: {question}\n"


def result(text: str) -> str:
    return f"<result>{text}</result>"


class KVState:
    """A live store (a dict of int values)."""

    __slots__ = ("data",)

    def __init__(self, data: dict[str, int]) -> None:
        self.data = data


def dump(data: dict[str, int]) -> str:
    """The store as sorted ``k=v`` pairs (``empty`` when there are none)."""
    return " ".join(f"{k}={v}" for k, v in sorted(data.items())) or "empty"


def apply(data: dict[str, int], command: str) -> tuple[str, int]:
    """Run one command on ``data`` in place; the observation text and the tool calls (1, or 0
    for a command that could not be parsed). A failing command leaves ``data`` as it was."""
    words = command.split()
    if not words:
        return "error: empty command", 0
    op, args = words[0].lower(), words[1:]
    try:
        if op == "get" and len(args) == 1:
            return str(data.get(args[0], "nil")), 1
        if op == "dump" and not args:
            return dump(data), 1
        if op == "del" and len(args) == 1:
            return ("deleted" if data.pop(args[0], None) is not None else "nil"), 1
        if op == "set" and len(args) == 2:
            data[args[0]] = int(args[1])
            return str(data[args[0]]), 1
        if op == "add" and len(args) == 2:
            delta = int(args[1])
            if args[0] not in data:
                return f"error: no key {args[0]}", 1
            data[args[0]] += delta
            return str(data[args[0]]), 1
        if op == "mset" and args:
            pairs = {}
            for a in args:  # parse every pair before writing any: all or nothing
                k, sep, v = a.partition("=")
                if not sep or not k:
                    return f"error: bad pair {a!r}", 1
                pairs[k] = int(v)
            data.update(pairs)
            return f"{len(pairs)} set", 1
    except ValueError as e:
        return f"error: {e}", 1
    return f"error: unknown command {command.strip()!r}", 0


@dataclass
class KVEnv(StepEachState):
    """The key-value world as a stateful :class:`~treegrpo.envs.base.AgentEnv` (module docstring).

    Args:
        state_mode: ``snapshot`` | ``fork`` | ``replay`` (how the library branches it).
    """

    state_mode: str = "snapshot"
    stop_strings: tuple[str, ...] = ("</kv>", "</answer>")
    actions: ClassVar[dict[str, str | None]] = {"kv": "</kv>", "answer": "</answer>"}
    answer_start: str = "<answer>"
    open_states: int = field(default=0, init=False)
    """Handles obtained and not yet closed (a leak check for tests)."""

    def __post_init__(self) -> None:
        if self.state_mode not in STATE_MODES or self.state_mode == "stateless":
            raise ValueError(f"KVEnv state_mode must be snapshot, fork or replay, not {self.state_mode!r}")

    # -- the state protocol ---------------------------------------------------------------------
    def _new(self, data: dict[str, int]) -> KVState:
        self.open_states += 1
        return KVState(dict(data))

    def initial_state(self, task: Task) -> KVState:
        return self._new(task.meta["start"])

    def snapshot(self, state: KVState) -> KVState:
        return self._new(state.data)

    def restore(self, snap: KVState) -> KVState:
        return self._new(snap.data)

    def fork(self, state: KVState) -> KVState:
        return self._new(state.data)

    def close_state(self, state: KVState) -> None:
        self.open_states -= 1

    def dump_state(self, state: KVState) -> str:
        """The state as text (for exactness checks)."""
        return dump(state.data)

    # -- the env --------------------------------------------------------------------------------
    def prompt(self, task: Task) -> str:
        return PROMPT.format(start=dump(task.meta["start"]), question=task.question)

    def score(self, task: Task, step: str) -> float:
        """Unanswered: the state half of the reward is not known without the state; 0."""
        return 0.0

    def reward(self, task: Task, data: dict[str, int], answer: str) -> float:
        expected: dict[str, int] = task.meta["expected"]
        keys = set(task.meta["start"]) | set(expected) | set(data)
        state_part = sum(data.get(k) == expected.get(k) for k in keys) / max(1, len(keys))
        return 0.5 * state_part + 0.5 * float(answer.strip() == task.answers[0])

    def step_one(self, task: Task, text: str, allowed: bool, state: KVState) -> StepOutcome:
        """One trajectory's step on its store (``step`` runs a batch, :class:`~treegrpo.envs.state.StepEachState`)."""
        m = ACTION_RE.search(text)
        if m is not None and m.group(1) == "answer":
            ans = m.group(2).strip()
            return StepOutcome("answer", True, reward=self.reward(task, state.data, ans), info={"answer": ans})
        if m is not None and allowed:
            obs, calls = apply(state.data, m.group(2))
            return StepOutcome("kv", False, observation=result(obs), tool_calls=calls, info={"command": m.group(2).strip()})
        if not allowed:
            return StepOutcome("kv" if m else "invalid", True, reward=self.score(task, text))
        return StepOutcome("invalid", False, observation=INVALID)


KEYS = ("a", "b", "c", "d", "e")


def kv_tasks(n: int, seed: int = 0) -> list[Task]:
    """``n`` tasks: a start store of 2-4 keys; add to one key, move a value between two, report one."""
    rng = random.Random(f"treegrpo-kv-{seed}")
    tasks = []
    for i in range(n):
        keys = rng.sample(KEYS, rng.randint(2, 4))
        start = {k: rng.randint(0, 9) for k in keys}
        src, dst = rng.sample(keys, 2)
        amount = rng.randint(1, 5)
        expected = dict(start)
        expected[src] -= amount
        expected[dst] += amount
        question = f"move {amount} from {src} to {dst}, then report {dst}"
        tasks.append(Task(f"kv-{seed}-{i}", question, [str(expected[dst])], "kv", {"start": start, "expected": expected}))
    return tasks


def random_kv_action(rng: random.Random, p_answer: float = 0.2) -> str:
    """A random step: mostly writes and reads over a few keys (some malformed or failing), now and
    then a ``dump`` (the whole state becomes an observation) or an answer."""
    k = rng.choice(KEYS)
    r = rng.random()
    if r < p_answer:
        return f"<answer>{rng.randint(0, 9)}</answer>"
    cmd = rng.choice(
        [
            f"set {k} {rng.randint(-3, 9)}",
            f"add {k} {rng.randint(-3, 3)}",
            f"del {k}",
            f"get {k}",
            "dump",
            f"mset {k}={rng.randint(0, 9)} {rng.choice(KEYS)}={rng.choice(['1', '2', 'x'])}",
            f"add {k} y",
            "frobnicate",
        ]
    )
    return f"<kv>{cmd}</kv>" if rng.random() > 0.05 else f"oops {cmd}"


__all__ = ["KVEnv", "KVState", "apply", "dump", "kv_tasks", "random_kv_action"]
