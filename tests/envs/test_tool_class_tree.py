"""A tool class (TRL's ``environment_factory`` shape: public methods are tools, an instance is one
trajectory's state) grown into TREES by the real ``tree`` sampler, in every branching mode the
library supports for it (docs/stateful-tools.md, envs/tool_env.py): ``fork`` and ``snapshot`` when the
class declares them, else ``replay``. Every node's tool result shows the whole state, so a branch that
started from the wrong state, or saw a sibling's calls, is caught; a replay that diverges is an error."""

from __future__ import annotations

import asyncio
import gc
import json
import random
import time
from typing import Any

import pytest

from treegrpo import ToolEnv
from treegrpo.benchmarks.stateful_exact import grow, signature
from treegrpo.envs.base import Task
from treegrpo.envs.state import ReplayDivergence, state_mode
from treegrpo.envs.tool_env import tool_response
from treegrpo.tree import Tree

OPEN: list[int] = [0]  # live instances (made minus closed): every one is handed back


class Words:
    """A word list, one per trajectory; every result is the whole list (the state, visible)."""

    def __init__(self) -> None:
        self.words: list[str] = []
        OPEN[0] += 1

    def reset(self, **row: Any) -> None:
        self.words = [str(row["start"])]

    def add(self, word: str) -> str:
        """Append a word.

        Args:
            word: the word
        """
        self.words.append(word)
        return " ".join(self.words)

    def show(self) -> str:
        """The words so far."""
        return " ".join(self.words)

    def close(self) -> None:
        OPEN[0] -= 1


class ForkWords(Words):
    def fork(self) -> ForkWords:
        twin = ForkWords()
        twin.words = list(self.words)
        return twin


class SnapWords(Words):
    def snapshot(self) -> tuple[str, ...]:
        return tuple(self.words)

    def restore(self, snap: tuple[str, ...]) -> None:
        self.words = list(snap)


CLASSES = {"fork": ForkWords, "snapshot": SnapWords, "replay": Words}
TASKS = [Task(f"t{i}", f"Collect words {i}", ["x"], meta={"start": f"s{i}"}) for i in range(6)]


def call(name: str, **arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def policy(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.12:
        return "<answer> x </answer>"
    if r < 0.3:
        return call("show")
    return call("add", word=f"w{rng.randrange(1000)}")


def expected_state(tree: Tree, node_id: int, start: str) -> list[str]:
    """The words a node's own path added, in order (the state it must have seen), from its texts alone."""
    words = [start]
    for nd in tree.path(node_id)[1:]:
        if nd.observation is not None and '"add"' in nd.text:
            words.append(json.loads(nd.text.removeprefix("<tool_call>").removesuffix("</tool_call>"))["arguments"]["word"])
    return words


def settled(n: int) -> bool:
    """Whether the live instances come to ``n`` (a gone forest's world is closed on its own thread,
    without waiting)."""
    for _ in range(200):
        if OPEN[0] == n:
            return True
        time.sleep(0.01)
    return False


def grow_trees(mode: str, seed: int) -> tuple[Any, list[Tree]]:
    env = ToolEnv(environment_factory=CLASSES[mode], rewards=["em"])
    assert state_mode(env) == mode
    res = grow(env, TASKS, policy, (1, 2, 1), seed, max_turns=4)
    return res, [t for f in res.forests for t in f.trees]


@pytest.mark.parametrize("mode", sorted(CLASSES))
def test_each_branch_sees_only_its_own_paths_calls(mode: str) -> None:
    OPEN[0] = 0
    branched_inside = 0
    for seed in range(3):
        res, trees = grow_trees(mode, seed)
        for task, tree in zip(TASKS, trees, strict=True):
            assert len(tree.leaves()) == 3  # (M,N,L) = (1,2,1): the chain and two branches
            for nd in tree.nodes[1:]:
                if nd.observation is not None:  # a tool result: the state after this node's own path
                    assert nd.observation == tool_response(" ".join(expected_state(tree, nd.id, task.meta["start"]))), (mode, nd.id)
            branched_inside += sum(1 for nd in tree.nodes[1:] if len(tree.children[nd.id]) > 1 and nd.observation is not None)
        replayed = res.total().replayed_tool_calls
        assert (replayed > 0) if mode == "replay" else (replayed == 0)  # restored or forked, never replayed
    assert branched_inside > 0  # some branch started mid-trajectory, from a state a tool call had changed
    gc.collect()
    assert settled(len(TASKS))  # each live forest keeps its world (a tree can still branch from its root)
    del res, trees, tree
    gc.collect()
    assert settled(0), f"{OPEN[0]} instances never closed"


def test_every_mode_grows_the_same_trees() -> None:
    sigs = {mode: [signature(t) for t in grow_trees(mode, 5)[1]] for mode in CLASSES}
    assert sigs["fork"] == sigs["snapshot"] == sigs["replay"]


class Ticket:
    """Not deterministic: every call returns a fresh ticket number (shared over instances)."""

    issued = 0

    def take(self) -> str:
        """Take a ticket."""
        Ticket.issued += 1
        return f"ticket {Ticket.issued}"


def take_policy(rng: random.Random) -> str:
    return "<answer> x </answer>" if rng.random() < 0.1 else call("take")


def test_a_replay_that_diverges_is_an_error_and_snapshot_needs_none() -> None:
    """Replay re-runs a path's calls on a fresh instance: a tool that answers otherwise the second time
    stops the rollout with ReplayDivergence naming both results (docs/stateful-tools.md)."""
    env = ToolEnv(environment_factory=Ticket, rewards=["em"])
    assert state_mode(env) == "replay"
    with pytest.raises(ReplayDivergence, match=r"observation .*ticket \d+.*, replayed .*ticket \d+"):
        grow(env, TASKS, take_policy, (1, 2, 1), 0, max_turns=4)

    class SnapTicket(Ticket):
        def snapshot(self) -> int:
            return 0

        def restore(self, snap: int) -> None:
            pass

    res = grow(ToolEnv(environment_factory=SnapTicket, rewards=["em"]), TASKS, take_policy, (1, 2, 1), 0, max_turns=4)
    assert res.total().replayed_tool_calls == 0


class KeyedWords(SnapWords):
    def state_key(self) -> str:
        return "|".join(self.words)


def test_a_class_with_state_key_keys_every_node_and_one_without_keys_none() -> None:
    """``state_key()`` on the class keys each node's state (GiGPO's state anchors); a class without
    it keys nothing (it once made every tree raise AttributeError)."""
    keyed = ToolEnv(environment_factory=KeyedWords, rewards=["em"])
    res = grow(keyed, TASKS[:2], policy, (1, 2, 1), 0, max_turns=4)
    for task, tree in zip(TASKS[:2], [t for f in res.forests for t in f.trees], strict=True):
        assert tree.nodes[0].extra["state_key"] == task.meta["start"]
        for nd in tree.nodes[1:]:
            if nd.observation is not None:
                assert nd.extra["state_key"] == "|".join(expected_state(tree, nd.id, task.meta["start"]))
    assert ToolEnv(environment_factory=SnapWords, rewards=["em"]).state_key is None
    res = grow(ToolEnv(environment_factory=SnapWords, rewards=["em"]), TASKS[:2], policy, (1, 2, 1), 0, max_turns=4)
    assert all("state_key" not in nd.extra for f in res.forests for t in f.trees for nd in t.nodes)


class AsyncWords:
    """Words with ``async def`` tools, reset and get_reward (awaited on the run's loop)."""

    def __init__(self) -> None:
        self.words: list[str] = []

    async def reset(self, **row: Any) -> str:
        await asyncio.sleep(0)
        self.words = [str(row["start"])]
        return f"start {row['start']}"

    async def add(self, word: str) -> str:
        """Append a word.

        Args:
            word: the word
        """
        await asyncio.sleep(0.001)
        self.words.append(word)
        return " ".join(self.words)

    async def show(self) -> str:
        """The words so far."""
        return " ".join(self.words)

    async def get_reward(self) -> float:
        return float(len(self.words))


class SyncWords(AsyncWords):
    """The same class, every method sync."""

    def reset(self, **row: Any) -> str:  # type: ignore[override]
        self.words = [str(row["start"])]
        return f"start {row['start']}"

    def add(self, word: str) -> str:  # type: ignore[override]
        """Append a word.

        Args:
            word: the word
        """
        self.words.append(word)
        return " ".join(self.words)

    def show(self) -> str:  # type: ignore[override]
        """The words so far."""
        return " ".join(self.words)

    def get_reward(self) -> float:  # type: ignore[override]
        return float(len(self.words))


def test_a_sync_and_an_async_tool_class_grow_the_same_forest() -> None:
    """``async def`` tools, ``reset`` and ``get_reward`` are awaited: the same forest as the sync class
    (an async tool's result was the text "<coroutine object …>", an async get_reward a TypeError)."""
    res = {cls: grow(ToolEnv(environment_factory=cls, rewards=["em"]), TASKS, policy, (2, 2, 1), 4, max_turns=4)
           for cls in (SyncWords, AsyncWords)}  # fmt: skip
    sync, asy = ([signature(t) for f in r.forests for t in f.trees] for r in res.values())
    assert sync == asy
    roots = [f.trees[0].root.text for f in res[AsyncWords].forests]
    assert roots[0].startswith("Collect words 0\nstart s0")
    assert any(nd.reward is not None and nd.reward > 1 for f in res[AsyncWords].forests for t in f.trees for nd in t.nodes)


def add(word: str) -> str:
    """Echo a word.

    Args:
        word: the word
    """
    return word.upper()


async def add_async(word: str) -> str:
    """Echo a word.

    Args:
        word: the word
    """
    await asyncio.sleep(0.001)
    return word.upper()


def test_a_sync_and_an_async_function_tool_grow_the_same_forest() -> None:
    add_async.__name__ = "add"  # the same tool name, so the same prompt and calls
    envs = [ToolEnv([fn], rewards=["em"]) for fn in (add, add_async)]
    sync, asy = ([signature(t) for f in grow(env, TASKS, policy, (2, 2, 1), 2, 4).forests for t in f.trees] for env in envs)
    assert sync == asy and any("W" in str(s[3]) for tree in sync for s in tree)


def test_sync_and_async_tool_classes_give_the_same_forest_with_the_tiny_model(tiny_model_dir: Any) -> None:
    """Through the real agent loop and HF engine (the tiny model, a fixed seed): the async class's
    prompt carries its awaited reset text and its leaves the awaited get_reward, so both forests are
    the same, token for token (an async reset once put "<coroutine object …>" in the prompt, an async
    get_reward raised TypeError)."""
    import torch

    from treegrpo.models.loader import load_model, load_tokenizer
    from treegrpo.rollout.agent import AgentConfig, StepRunner
    from treegrpo.rollout.hf_engine import HFEngine
    from treegrpo.rollout.sampling import SamplerConfig
    from treegrpo.rollout.trees import sample_trees

    tok = load_tokenizer(tiny_model_dir)
    model = load_model(tiny_model_dir)
    cfg = AgentConfig(max_turns=2, max_step_tokens=12, max_context_tokens=400, use_chat_template=False)
    forests = {}
    for cls in (SyncWords, AsyncWords):
        runner = StepRunner(HFEngine(model, tok), ToolEnv(environment_factory=cls, rewards=["em"], prompt_template="minimal"), tok, cfg)
        res = sample_trees(runner, TASKS[:2], SamplerConfig("tree", m=2, n=1, l=1), random.Random(0), torch.Generator().manual_seed(0))
        forests[cls] = [
            [(nd.tokens, nd.reward, {k.removeprefix("Sync").removeprefix("Async"): v for k, v in nd.extra.get("rewards", {}).items()})
             for nd in t.nodes] for f in res.forests for t in f.trees
        ]  # fmt: skip
        assert res.forests[0].trees[0].root.text == "Question: Collect words 0\nstart s0\n"
    assert forests[SyncWords] == forests[AsyncWords]
    leaves = [r for tree in forests[AsyncWords] for _, reward, r in tree if reward is not None]
    assert leaves and all(r["Words"] >= 1.0 for r in leaves)  # get_reward: the words so far, awaited
