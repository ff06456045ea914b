"""The state protocol (treegrpo.envs.state, treegrpo.rollout.state) on the key-value world:
branches see exactly their start node's state, siblings never see each other's writes, snapshot /
fork / replay grow identical trees, replayed tool calls are booked apart, nothing leaks, a replay
that gives another action kind, end or observation is an error, and a stateless env takes
exactly the old path."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treegrpo.benchmarks.stateful_exact import (
    ByteTokenizer,
    RandomActionEngine,
    agent_config,
    chain_of,
    check_exactness,
    grow,
    signature,
)
from treegrpo.envs.base import Task
from treegrpo.envs.state import ReplayDivergence, state_mode
from treegrpo.rollout.agent import StepRunner
from treegrpo.rollout.sampling import SamplerConfig
from treegrpo.rollout.state import StateKeeper
from treegrpo.rollout.trees import sample_trees
from treegrpo.tasks.kv.env import KVEnv, KVState, kv_tasks, random_kv_action

TASKS = kv_tasks(40, seed=1)


@pytest.mark.parametrize("mode", ["snapshot", "fork", "replay"])
def test_siblings_never_see_each_others_writes(mode: str) -> None:
    env = KVEnv(mode)
    task = Task("t", "q", ["0"], meta={"start": {"a": 1}, "expected": {"a": 1}})
    keeper = StateKeeper(env, mode)  # type: ignore[arg-type]
    tree = chain_of(KVEnv(mode), task, ["<kv>set a 5</kv>"])
    s0 = env.initial_state(task)
    env.step([task], ["<kv>set a 5</kv>"], [True], states=[s0])
    keeper.record(tree, 1, s0)
    # two siblings from node 1: one writes, the other reads
    left, _ = keeper.state_at(tree, 1, task)
    right, _ = keeper.state_at(tree, 1, task)
    (w,) = env.step([task], ["<kv>set a 9</kv>"], [True], states=[left])
    (r,) = env.step([task], ["<kv>get a</kv>"], [True], states=[right])
    assert w.observation == "<result>9</result>" and r.observation == "<result>5</result>"
    # and a branch from the root sees the start store
    root, replayed = keeper.state_at(tree, 0, task)
    assert root.data == {"a": 1} and replayed == 0
    for s in (s0, left, right, root):
        env.close_state(s)
    keeper.release()
    assert env.open_states == 0


def test_replay_counts_replayed_tool_calls_and_restore_does_not() -> None:
    task = TASKS[0]
    texts = ["<kv>set a 1</kv>", "<kv>get a</kv>", "nonsense", "<kv>add a 2</kv>"]
    for mode, expected in (("replay", 3), ("snapshot", 0)):
        env = KVEnv(mode)
        keeper = StateKeeper(env, mode)  # type: ignore[arg-type]
        tree = chain_of(KVEnv(mode), task, texts)
        assert tree.node(3).extra["kind"] == "invalid"
        live = env.initial_state(task)
        for i, t in enumerate(texts):
            env.step([task], [t], [True], states=[live])
            keeper.record(tree, i + 1, live)
        state, replayed = keeper.state_at(tree, 4, task)
        assert replayed == expected and state.data == live.data
        keeper.release()


def test_budget_books_replayed_calls_apart() -> None:
    res = {m: grow(KVEnv(m), TASKS[:6], random_kv_action, (2, 3, 2), 3, 4) for m in ("snapshot", "replay")}
    snap, rep = res["snapshot"].total(), res["replay"].total()
    assert snap.replayed_tool_calls == 0 and rep.replayed_tool_calls > 0
    assert snap.tool_calls == rep.tool_calls  # new calls are the same; replays are extra


def test_divergent_replay_is_an_error() -> None:
    class Flaky(KVEnv):
        calls = 0

        def step(self, tasks, steps, search_allowed, states=None):  # type: ignore[no-untyped-def]
            Flaky.calls += 1
            outs = super().step(tasks, steps, search_allowed, states)
            if Flaky.calls > 1:
                outs[0].kind, outs[0].done, outs[0].reward = "answer", True, 0.0
            return outs

    env = Flaky("replay")
    keeper = StateKeeper(env, "replay")
    tree = chain_of(KVEnv("replay"), TASKS[0], ["<kv>set a 1</kv>"])
    env.step([TASKS[0]], ["<kv>set a 1</kv>"], [True], states=[env.initial_state(TASKS[0])])
    with pytest.raises(ReplayDivergence, match="deterministic"):
        keeper.state_at(tree, 1, TASKS[0])


class Ticking(KVEnv):
    """A tool that is not deterministic: the same action, the same kind and end, but every answer
    carries the number of calls made so far."""

    def step(self, tasks, steps, search_allowed, states=None):  # type: ignore[no-untyped-def]
        outs = super().step(tasks, steps, search_allowed, states)
        self.ticks = getattr(self, "ticks", 0) + 1
        return [o if o.done else dataclasses.replace(o, observation=f"{o.observation} t{self.ticks}") for o in outs]


def test_a_replayed_observation_that_differs_is_an_error() -> None:
    env = Ticking("replay")
    tree = chain_of(env, TASKS[0], ["<kv>set a 1</kv>", "<kv>get a</kv>"])
    assert tree.node(2).observation == "<result>1</result> t2"
    with pytest.raises(ReplayDivergence, match=r"observation '<result>1</result> t1', replayed '<result>1</result> t3'"):
        StateKeeper(env, "replay").state_at(tree, 2, TASKS[0])
    assert env.open_states == 0  # the half-replayed state was handed back


def test_the_sampler_refuses_a_nondeterministic_tool_in_replay_mode() -> None:
    """Through the real loop: the kinds and ends replay alike, only the observations differ."""
    with pytest.raises(ReplayDivergence, match="observation"):
        grow(Ticking("replay"), TASKS[:4], random_kv_action, (2, 2, 2), 3, 4)
    grow(Ticking("snapshot"), TASKS[:4], random_kv_action, (2, 2, 2), 3, 4)  # restores, never replays: fine


def test_replay_compares_the_observation_as_the_node_keeps_it() -> None:
    """Observations the loop cuts (``max_obs_tokens``) replay as the same cut text: no divergence,
    and replay grows the trees snapshot grows."""
    cfg = dataclasses.replace(agent_config(4), max_obs_tokens=6)  # bytes here: every "<result>…</result>" is cut

    def trees(mode: str) -> list[list[tuple[object, ...]]]:
        runner = StepRunner(RandomActionEngine(ByteTokenizer(), random_kv_action, 7), KVEnv(mode), ByteTokenizer(), cfg)
        res = sample_trees(runner, TASKS[:6], SamplerConfig("tree", m=2, n=2, l=2, expand_mode="random"), random.Random(7), None)
        return [signature(t) for f in res.forests for t in f.trees]

    snap, rep = trees("snapshot"), trees("replay")
    assert any(obs is not None and len(obs) == 6 for sig in snap for (_, _, _, obs, _, _) in sig)
    assert rep == snap


def test_state_mode_is_checked() -> None:
    assert state_mode(object()) == "stateless"
    assert state_mode(KVEnv("fork")) == "fork"

    class NoRestore:
        state_mode = "snapshot"

        def initial_state(self, task):  # type: ignore[no-untyped-def]
            return {}

        def close_state(self, s):  # type: ignore[no-untyped-def]
            pass

    with pytest.raises(ValueError, match="restore"):
        state_mode(NoRestore())

    class Odd:
        state_mode = "magic"

    with pytest.raises(ValueError, match="magic"):
        state_mode(Odd())


def test_all_or_nothing_statement() -> None:
    env = KVEnv()
    task = Task("t", "q", ["0"], meta={"start": {"a": 1}, "expected": {}})
    s = env.initial_state(task)
    (out,) = env.step([task], ["<kv>mset a=7 b=x</kv>"], [True], states=[s])
    assert "error" in (out.observation or "") and s.data == {"a": 1}


def test_exactness_over_1000_random_trees() -> None:
    r = check_exactness(lambda m: KVEnv(m), TASKS, random_kv_action, 1000, seed=0, modes=("snapshot", "replay"))
    assert r.trees >= 1000 and r.expansions >= 4000
    assert r.mismatches == 0 and r.leaked_states == 0


@given(st.integers(0, 10_000), st.sampled_from([(1, 1, 1), (2, 2, 1), (2, 2, 3), (3, 1, 2)]), st.integers(1, 5))
@settings(max_examples=25, deadline=None)
def test_exactness_property(seed: int, shape: tuple[int, int, int], max_turns: int) -> None:
    r = check_exactness(lambda m: KVEnv(m), TASKS, random_kv_action, 10, seed, shape, max_turns, batch_prompts=5)
    assert r.mismatches == 0 and r.leaked_states == 0


def test_the_check_catches_a_leaky_snapshot() -> None:
    """A snapshot that aliases the live store (branches share writes) is caught."""

    class Aliasing(KVEnv):
        def snapshot(self, state: KVState) -> KVState:
            self.open_states += 1
            return state

        def restore(self, snap: KVState) -> KVState:
            self.open_states += 1
            return snap

    r = check_exactness(lambda m: Aliasing(m), TASKS, random_kv_action, 100, seed=0, modes=("snapshot", "replay"))
    assert r.mismatches > 0 and r.mismatch_replay > 0


def test_a_crash_mid_rollout_leaves_no_state_behind() -> None:
    """An engine that fails mid-rollout: every kept state is handed back, and the next rollout
    grows exactly the trees a clean one grows."""

    class Crashing(KVEnv):
        armed = True

        def step(self, tasks, steps, search_allowed, states=None):  # type: ignore[no-untyped-def]
            if self.armed and states is not None:
                super().step(tasks, steps, search_allowed, states)  # the writes happen ...
                self.armed = False
                raise RuntimeError("tool crashed")  # ... then the step crashes
            return super().step(tasks, steps, search_allowed, states)

    env = Crashing("snapshot")
    with pytest.raises(RuntimeError, match="crashed"):
        grow(env, TASKS[:4], random_kv_action, (2, 2, 1), 5, 4)
    clean = grow(KVEnv("snapshot"), TASKS[:4], random_kv_action, (2, 2, 1), 5, 4)
    again = grow(env, TASKS[:4], random_kv_action, (2, 2, 1), 5, 4)
    assert [signature(t) for f in again.forests for t in f.trees] == [signature(t) for f in clean.forests for t in f.trees]
