"""The SQL agent's environment: one sandboxed SQLite database per trajectory (:mod:`.tool`).

Actions, one per step: ``<sql> statement </sql>`` (the tool answers ``<result>…</result>``: the
rows, ``N rows changed``, ``no rows`` or ``error: …``) or ``<answer> value </answer>`` (the
trajectory ends). Anything else is an invalid action (the model is told how to act and goes on);
on the final turn an ``<sql>`` step is refused and the trajectory ends unanswered (reward 0).

The reward of an answer is 1.0 when the database's final state equals the state the task's
reference solution leaves (every table, every row) *and* the answer equals the gold one, else 0.

State (:mod:`treegrpo.envs.state`): ``state_mode`` is ``snapshot`` (default: ``Connection.backup``
into a fresh in-memory database), ``fork`` (the same copy, used as a fork) or ``replay`` (the
library replays the recorded statements; every statement is deterministic under the sandbox).
Each task's starting database is built once and copied for every trajectory, so no trajectory —
nor a crash in one — can change another's start. Closed databases go to a pool of spare sandboxed
connections (up to ``pool_size``) that later copies are backed up into: a copy then costs one
``backup``, not a new connection and its sandbox.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import ClassVar

from treegrpo.envs.base import StepOutcome, Task
from treegrpo.envs.state import StepEachState
from treegrpo.tasks.sql.problems import db_script
from treegrpo.tasks.sql.tool import SqlDb, SqlLimits

ACTION_RE = re.compile(r"<(sql|answer)>(.*?)</\1>", re.DOTALL)
INVALID = "\nInvalid action: use <sql> one statement </sql> or <answer> value </answer>.\n"
PROMPT = "Table accounts(name, balance). Task: {question}.\n"
STATE_MODES = ("snapshot", "fork", "replay")


def result(text: str) -> str:
    return f"<result>{text}</result>"


@dataclass
class SqlEnv(StepEachState):
    """The SQL environment (module docstring).

    Args:
        state_mode: ``snapshot`` | ``fork`` | ``replay``.
        limits: the sandbox's limits.
        cache_size: starting databases kept (least recently used ones are rebuilt on demand).
        pool_size: spare connections kept for reuse.
    """

    state_mode: str = "snapshot"
    limits: SqlLimits = field(default_factory=SqlLimits)
    cache_size: int = 512
    pool_size: int = 256
    stop_strings: tuple[str, ...] = ("</sql>", "</answer>")
    actions: ClassVar[dict[str, str | None]] = {"sql": "</sql>", "answer": "</answer>"}
    binary_reward: ClassVar[bool] = True
    answer_start: str = "<answer>"
    open_states: int = field(default=0, init=False)
    """Handles obtained and not yet closed (a leak check for tests)."""

    def __post_init__(self) -> None:
        if self.state_mode not in STATE_MODES:
            raise ValueError(f"SqlEnv state_mode must be one of {STATE_MODES}, not {self.state_mode!r}")
        self._start: OrderedDict[str, SqlDb] = OrderedDict()
        self._expected: dict[str, str] = {}
        self._spare: list[SqlDb] = []

    # -- databases ------------------------------------------------------------------------------
    def _template(self, task: Task) -> SqlDb:
        db = self._start.get(task.id)
        if db is None:
            db = SqlDb(self.limits, script=db_script(task.meta["rows"]))
            self._start[task.id] = db
            if len(self._start) > self.cache_size:
                self._start.popitem(last=False)[1].close()
        else:
            self._start.move_to_end(task.id)
        return db

    def expected_state(self, task: Task) -> str:
        """The state the reference solution leaves (:meth:`SqlDb.dump`)."""
        if task.id not in self._expected:
            db = self._template(task).copy()
            for sql in task.meta["solution"]:
                text, ok = db.run(sql)
                if not ok:
                    raise ValueError(f"task {task.id}: reference statement {sql!r} fails: {text}")
            self._expected[task.id] = db.dump()
            db.close()
        return self._expected[task.id]

    # -- the state protocol ---------------------------------------------------------------------
    def _copy(self, db: SqlDb) -> SqlDb:
        self.open_states += 1
        return db.copy(into=self._spare.pop() if self._spare else None)

    def initial_state(self, task: Task) -> SqlDb:
        return self._copy(self._template(task))

    def snapshot(self, state: SqlDb) -> SqlDb:
        return self._copy(state)

    def restore(self, snap: SqlDb) -> SqlDb:
        return self._copy(snap)

    def fork(self, state: SqlDb) -> SqlDb:
        return self._copy(state)

    def close_state(self, state: SqlDb) -> None:
        if any(state is s for s in self._spare):
            raise ValueError("this database was already closed (a state handle is closed once)")
        self.open_states -= 1
        if len(self._spare) < self.pool_size:
            self._spare.append(state)
        else:
            state.close()

    def dump_state(self, state: SqlDb) -> str:
        return state.dump()

    # -- the env --------------------------------------------------------------------------------
    def prompt(self, task: Task) -> str:
        return PROMPT.format(question=task.question)

    def score(self, task: Task, step: str) -> float:
        """A trajectory that ends without an answer scores 0."""
        return 0.0

    def answer_reward(self, task: Task, state: SqlDb, answer: str) -> tuple[float, bool]:
        """The reward of answering ``answer`` in ``state``, and whether the state was right."""
        state_ok = state.dump() == self.expected_state(task)
        return float(state_ok and answer.strip() == task.answers[0]), state_ok

    def step_one(self, task: Task, text: str, allowed: bool, db: SqlDb) -> StepOutcome:
        """One trajectory's step on its database (changed in place). ``step`` runs a batch, each
        step on its trajectory's database (``states[i]``; without ``states`` every step runs on a
        fresh copy of its task's start, :class:`~treegrpo.envs.state.StepEachState`)."""
        m = ACTION_RE.search(text)
        if m is not None and m.group(1) == "answer":
            ans = m.group(2).strip()
            reward, state_ok = self.answer_reward(task, db, ans)
            return StepOutcome("answer", True, reward=reward, info={"answer": ans, "state_ok": state_ok})
        if m is not None and allowed:
            sql = m.group(2).strip()
            text_out, ok = db.run(sql)
            info = {"sql": sql} if ok else {"sql": sql, "sql_error": True}
            return StepOutcome("sql", False, observation=result(text_out), tool_calls=1, info=info)
        if m is not None:
            return StepOutcome("sql", True, reward=self.score(task, text), info={"refused": True})
        if not allowed:
            return StepOutcome("invalid", True, reward=self.score(task, text))
        return StepOutcome("invalid", False, observation=INVALID)


__all__ = ["INVALID", "PROMPT", "SqlEnv", "result"]
