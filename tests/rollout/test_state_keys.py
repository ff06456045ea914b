"""State keys (treegrpo.envs.state.state_key): the loop records each node's state key — the state
after its step, the initial state on the root — in every state mode; the keys are the states a
fresh replay of the path reaches; GiGPO groups the steps that start from one key; a stateless
env records none."""

from __future__ import annotations

from typing import Any

import pytest

from treegrpo.algos import AdvantageConfig, shared_anchor_stats
from treegrpo.algos.gigpo import anchor_values
from treegrpo.benchmarks.stateful_exact import grow, random_sql_action
from treegrpo.envs.state import state_key
from treegrpo.tasks.sql.env import SqlEnv
from treegrpo.tasks.sql.problems import SqlConfig, build_problems

TASKS = build_problems(SqlConfig(n_warmup=1, n_train=6, n_eval=1)).tasks("train")

STATE = AdvantageConfig(anchor="state")


def _replayed_key(env: SqlEnv, task: Any, texts: list[str]) -> str:
    state = env.initial_state(task)
    for t in texts:
        env.step([task], [t], [True], states=[state])
    key = env.dump_state(state)
    env.close_state(state)
    return key


@pytest.mark.parametrize("mode", ["snapshot", "fork", "replay"])
def test_nodes_carry_the_key_of_their_state(mode: str) -> None:
    env = SqlEnv(mode)
    res = grow(env, TASKS, random_sql_action, (2, 2, 1), seed=3, max_turns=4)
    checked = 0
    for forest, task in zip(res.forests, TASKS, strict=True):
        for tree in forest.trees:
            assert tree.root.extra["state_key"] == _replayed_key(env, task, [])
            for node in tree.nodes:
                if node.parent is None or tree.is_leaf(node.id):
                    assert node.parent is None or "state_key" not in node.extra  # a leaf's step ended
                    continue
                texts = [n.text for n in tree.path(node.id)[1:]]
                assert node.extra["state_key"] == _replayed_key(env, task, texts)
                checked += 1
    assert checked > 10 and env.open_states == 0


def test_keys_are_the_same_in_every_mode_and_group_steps() -> None:
    keys = {}
    for mode in ("snapshot", "replay"):
        res = grow(SqlEnv(mode), TASKS, random_sql_action, (2, 2, 1), seed=5, max_turns=4)
        keys[mode] = [anchor_values(f, "state") for f in res.forests]
        stats = shared_anchor_stats(res.forests, STATE)
        assert stats["shared_frac"] > 0.5  # first steps share the start; siblings their parent's state
    assert keys["snapshot"] == keys["replay"]
    assert all(isinstance(k, str) for ks in keys["snapshot"] for k in ks.values())  # every one a state key
    # reads change nothing: steps after different statements can share a database state
    res = grow(SqlEnv("snapshot"), TASKS, random_sql_action, (4, 0, 0), seed=1, max_turns=4)
    by_state = shared_anchor_stats(res.forests, STATE)
    by_context = shared_anchor_stats(res.forests, AdvantageConfig(anchor="context"))
    assert by_state["shared_frac"] >= by_context["shared_frac"]
    for f in res.forests:  # without the keys, the state anchor is the context
        for t in f.trees:
            for n in t.nodes:
                n.extra.pop("state_key", None)
    assert shared_anchor_stats(res.forests, STATE) == by_context


def test_state_key_hook() -> None:
    class Keyed:
        def state_key(self, state: Any) -> str:
            return f"k{state}"

    class Dumped:
        def dump_state(self, state: Any) -> str:
            return f"d{state}"

    class BadKey:
        def state_key(self, state: Any) -> int:
            return 3

    assert state_key(Keyed(), 1) == "k1" and state_key(Dumped(), 2) == "d2" and state_key(object(), 3) is None
    with pytest.raises(TypeError, match="must return a str"):
        state_key(BadKey(), 0)
