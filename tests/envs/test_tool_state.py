"""A tool class's instances (envs/tool_state.py): each lives on the thread that made it (a sqlite3
connection works), one reset world per forest that the prompt shows and every trajectory starts
from (a random reset), a call past its time-out leaves no late write in any state read again, and
the user's class mistakes are one ConfigError line each."""

from __future__ import annotations

import json
import random
import sqlite3
import threading
import time
from typing import Any

import pytest

from treegrpo import ToolEnv
from treegrpo.benchmarks.stateful_exact import grow
from treegrpo.envs.base import Task
from treegrpo.envs.state import ReplayDivergence, state_mode
from treegrpo.envs.tool_env import tool_response
from treegrpo.errors import ConfigError

TASKS = [Task(f"t{i}", f"Task {i}", ["x"], meta={"start": f"s{i}"}) for i in range(4)]


def call(name: str, **arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


class Db:
    """A sqlite3 in-memory database per trajectory (thread-bound: sqlite refuses other threads)."""

    def __init__(self) -> None:
        self.db = sqlite3.connect(":memory:", isolation_level=None)
        self.db.execute("create table w (i integer primary key, word text)")

    def reset(self, **row: Any) -> None:
        self.db.execute("insert into w (word) values (?)", (row["start"],))

    def add(self, word: str) -> str:
        """Add a word.

        Args:
            word: the word
        """
        self.db.execute("insert into w (word) values (?)", (word,))
        return self.show()

    def show(self) -> str:
        """The words so far."""
        return " ".join(r[0] for r in self.db.execute("select word from w order by i"))

    def fork(self) -> Db:
        twin = Db.__new__(Db)
        twin.db = sqlite3.connect(":memory:", isolation_level=None)
        self.db.backup(twin.db)
        return twin

    def close(self) -> None:
        self.db.close()


def words_policy(rng: random.Random) -> str:
    r = rng.random()
    return "<answer> x </answer>" if r < 0.12 else call("show") if r < 0.3 else call("add", word=f"w{rng.randrange(99)}")


def expected(tree: Any, node_id: int, start: str) -> str:
    words = [start]
    for nd in tree.path(node_id)[1:]:
        if nd.observation is not None and '"add"' in nd.text:
            words.append(json.loads(nd.text.removeprefix("<tool_call>").removesuffix("</tool_call>"))["arguments"]["word"])
    return " ".join(words)


def test_a_class_holding_a_sqlite_connection_works_in_trees() -> None:
    """Every call, fork and close runs on the thread that made the connection (every call once
    returned sqlite's "objects created in a thread can only be used in that same thread")."""
    env = ToolEnv(environment_factory=Db, rewards=["em"])
    assert state_mode(env) == "fork"
    res = grow(env, TASKS, words_policy, (2, 2, 1), 0, max_turns=4)
    seen = 0
    for task, forest in zip(TASKS, res.forests, strict=True):
        for tree in forest.trees:
            for nd in tree.nodes[1:]:
                if nd.observation is not None:
                    assert nd.observation == tool_response(expected(tree, nd.id, task.meta["start"]))
                    seen += 1
    assert seen > 10


class Secret:
    """A random world: ``reset`` draws a secret and says it; ``peek`` reads it."""

    def reset(self, **row: Any) -> str:
        self.secret = random.randrange(10**9)
        return f"secret {self.secret}"

    def peek(self) -> str:
        """The secret."""
        return f"secret {self.secret}"


class ForkSecret(Secret):
    def fork(self) -> ForkSecret:
        twin = ForkSecret()
        twin.secret = self.secret
        return twin


class SnapSecret(Secret):
    def snapshot(self) -> int:
        return self.secret

    def restore(self, snap: int) -> None:
        self.secret = snap


@pytest.mark.parametrize("cls", [ForkSecret, SnapSecret])
def test_the_prompt_shows_the_world_every_trajectory_acts_on(cls: type) -> None:
    """With a random reset, every trajectory of a forest sees the secret its prompt shows (the prompt
    came from a throwaway instance, each trajectory's own instance was reset again)."""
    env = ToolEnv(environment_factory=cls, rewards=["em"])
    res = grow(env, TASKS, lambda rng: call("peek") if rng.random() < 0.7 else "<answer> x </answer>", (2, 2, 1), 1, 3)
    peeks = 0
    for forest in res.forests:
        prompt = forest.trees[0].root.text
        assert all(t.root.text == prompt for t in forest.trees)
        for tree in forest.trees:
            for nd in tree.nodes[1:]:
                if nd.observation is not None:
                    assert nd.observation.strip().removeprefix("<tool_response>\n").removesuffix("\n</tool_response>") in prompt
                    peeks += 1
    assert peeks > 5


def test_replay_refuses_a_random_reset_in_one_line() -> None:
    """Replay mode resets a new instance per trajectory: a reset that draws another world is a
    ReplayDivergence naming the fix, never a silent mismatch."""
    env = ToolEnv(environment_factory=Secret, rewards=["em"])
    with pytest.raises(ReplayDivergence, match=r"reset\(\*\*row\) of task 't0' gave another world.*fork\(\)") as e:
        grow(env, TASKS, lambda rng: call("peek"), (1, 1, 1), 0, 2)
    assert "\n" not in str(e.value)


class Slow:
    """A write that lands after a delay."""

    def __init__(self) -> None:
        self.words: list[str] = []

    def add(self, word: str, delay: float = 0.0) -> str:
        """Add a word after a delay.

        Args:
            word: the word
            delay: seconds before it is written
        """
        time.sleep(delay)
        self.words.append(word)
        return " ".join(self.words)

    def snapshot(self) -> list[str]:
        return list(self.words)

    def restore(self, snap: list[str]) -> None:
        self.words = list(snap)


def test_a_call_past_its_time_out_leaves_no_late_write_anywhere_read() -> None:
    """A stateful call that timed out ends its trajectory and its instance is never called again:
    the write it makes later reaches no state a trajectory reads (it once did, in 3 of 5 reads)."""
    env = ToolEnv(environment_factory=Slow, rewards=["em"], timeout_s=0.2)
    live = env.initial_state(TASKS[0])
    (first,) = env.step(TASKS[:1], [call("add", word="a")], [True], states=[live])
    kept = env.snapshot(live)
    (late,) = env.step(TASKS[:1], [call("add", word="late", delay=0.6)], [True], states=[live])
    assert late.done and late.observation is None and "timed out" in late.info["tool_error"]
    assert late.info["state_lost"] and late.reward == 0.0
    time.sleep(0.8)  # the abandoned write has landed (in the lost instance)
    (again,) = env.step(TASKS[:1], [call("add", word="b")], [True], states=[live])
    assert again.done and "the state of this trajectory was lost" in again.info["tool_error"]
    branch = env.restore(kept)
    (read,) = env.step(TASKS[:1], [call("add", word="b")], [True], states=[branch])
    assert first.observation == tool_response("a") and read.observation == tool_response("a b")
    for h in (live, kept, branch):
        env.close_state(h)


class SelfFork:
    def look(self) -> str:
        """Look."""
        return "here"

    def fork(self) -> SelfFork:
        return self


def test_fork_returning_self_is_refused() -> None:
    env = ToolEnv(environment_factory=SelfFork)
    with pytest.raises(ConfigError, match=r"SelfFork.fork\(\) returned the instance itself"):
        grow(env, TASKS, lambda rng: call("look"), (1, 1, 1), 0, 2)


class Raises:
    where = ""

    def __init__(self) -> None:
        if Raises.where == "init":
            raise RuntimeError("no database")

    def reset(self, **row: Any) -> None:
        if Raises.where == "reset":
            raise ValueError("bad row")

    def look(self) -> str:
        """Look."""
        return "here"

    def get_reward(self) -> Any:
        return {"reward": "high", "none": None}.get(Raises.where, 1.0)

    def close(self) -> None:
        if Raises.where == "close":
            raise OSError("busy")


class NeedsArgs:
    def __init__(self, url: str) -> None:
        self.url = url

    def look(self) -> str:
        """Look."""
        return self.url


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ("init", r"Raises.__init__\(\) raised RuntimeError: no database"),
        ("reset", r"Raises.reset\(\*\*row\) raised ValueError: bad row"),
        ("close", r"Raises.close\(\) raised OSError: busy"),
        ("reward", r"Raises.get_reward\(\) returned 'high'"),
    ],
)
def test_a_tool_class_that_raises_is_one_line(where: str, message: str) -> None:
    Raises.where = ""
    env = ToolEnv(environment_factory=Raises)
    Raises.where = where
    with pytest.raises(ConfigError, match=message) as e:
        env.step(TASKS[:1], ["<answer> x </answer>"], [True])
    assert "\n" not in str(e.value)
    Raises.where = "none"  # get_reward() -> None: does not apply (only the reward functions score)
    (out,) = env.step(TASKS[:1], ["<answer> x </answer>"], [True])
    assert out.info["rewards"] == {"em": 1.0}
    Raises.where = ""


def test_a_factory_mistake_is_one_line() -> None:
    with pytest.raises(ConfigError, match="environment_factory is an instance of SelfFork, not a class"):
        ToolEnv(environment_factory=SelfFork())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"NeedsArgs\(\) cannot be made without arguments.*functools.partial"):
        ToolEnv(environment_factory=NeedsArgs)
    import functools

    env = ToolEnv(environment_factory=functools.partial(NeedsArgs, "db://x"))
    (out,) = env.step(TASKS[:1], [call("look")], [True])
    assert out.observation == tool_response("db://x")


class Owned:
    """Records the thread of every call on it: all must be the thread that made it."""

    def __init__(self) -> None:
        self.owner = threading.get_ident()
        self.strangers = 0

    def look(self) -> str:
        """Look."""
        self.strangers += threading.get_ident() != self.owner
        return str(self.strangers)

    def fork(self) -> Owned:
        twin = Owned()
        twin.strangers = self.strangers + (threading.get_ident() != self.owner)
        return twin

    def get_reward(self) -> float:
        return float(self.strangers + (threading.get_ident() != self.owner))


def test_every_call_on_an_instance_runs_on_the_thread_that_made_it() -> None:
    env = ToolEnv(environment_factory=Owned, rewards=["em"])
    res = grow(env, TASKS, lambda rng: call("look") if rng.random() < 0.7 else "<answer> x </answer>", (2, 2, 1), 3, 3)
    nodes = [nd for f in res.forests for t in f.trees for nd in t.nodes[1:]]
    assert all(nd.observation == tool_response("0") for nd in nodes if nd.observation is not None)
    assert all(nd.extra["rewards"]["Owned"] == 0.0 for nd in nodes if nd.reward is not None)
