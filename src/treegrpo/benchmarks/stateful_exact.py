"""Branch-state exactness and expansion cost of the state protocol, measured on the real sampler.

A random-action engine (:class:`RandomActionEngine`: every step is a random mutating or reading
action of the env's tool, drawn from the engine's own seeded stream, so the same seed grows the
same trees whatever the env answers) drives :func:`~treegrpo.rollout.trees.sample_trees` through
the real :class:`~treegrpo.rollout.agent.StepRunner` over a byte-level tokenizer
(:class:`ByteTokenizer`: no model, no truncation surprises). :func:`check_exactness` then checks,
for every tree:

- every node's recorded outcome (action kind, observation, reward) equals the outcome of replaying
  its root→node path on a fresh initial state, one step at a time, outside the library (so a
  branch saw exactly its start node's state, and never a sibling's writes);
- the trees grown in every state mode (``snapshot``, ``fork``, ``replay``) are identical, node for
  node (so snapshot and replay give identical observations and rewards).

A tree with any difference is one mismatch. :func:`expansion_cost` times getting a node's state
by restore vs by replay, side by side, on chains of mutating actions of a given depth.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from treegrpo.envs.base import StepOutcome, Task
from treegrpo.rollout.agent import AgentConfig, RolloutResult, StepRunner
from treegrpo.rollout.engine import Generation, SamplingParams
from treegrpo.rollout.sampling import SamplerConfig
from treegrpo.rollout.state import StateKeeper
from treegrpo.rollout.trees import sample_trees
from treegrpo.tree import Node, Tree

Policy = Callable[[random.Random], str]
MODES: tuple[str, ...] = ("snapshot", "fork", "replay")


class ByteTokenizer:
    """UTF-8 bytes as token ids (no special tokens, no chat template)."""

    chat_template = None
    eos_token_id = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class RandomActionEngine:
    """An engine whose every step is ``policy(rng)`` (the context is ignored; the draws come from
    the engine's own ``random.Random(seed)``, in request order)."""

    eos_token_id: int | None = None

    def __init__(self, tokenizer: Any, policy: Policy, seed: int) -> None:
        self.tok = tokenizer
        self.policy = policy
        self.rng = random.Random(seed)

    def generate(
        self, contexts: Sequence[Sequence[int]], params: SamplingParams, generator: torch.Generator | None = None
    ) -> list[Generation]:
        out = []
        for ctx in contexts:
            ids = self.tok.encode(self.policy(self.rng))[: params.max_new_tokens]
            out.append(Generation(ids, [-0.5] * len(ids), "stop", prefill_tokens=len(ctx)))
        return out

    def load_weights(self, model: torch.nn.Module) -> None:
        pass


def agent_config(max_turns: int) -> AgentConfig:
    """Loop limits that never cut a step or an observation (bytes are tokens here)."""
    return AgentConfig(
        max_turns=max_turns, max_step_tokens=512, max_obs_tokens=1 << 16, max_context_tokens=1 << 22, use_chat_template=False
    )


def grow(env: Any, tasks: Sequence[Task], policy: Policy, shape: tuple[int, int, int], seed: int, max_turns: int) -> RolloutResult:
    """One forest per task grown by the ``tree`` sampler (``shape`` = (M, N, L), random picks)."""
    m, n, l = shape
    runner = StepRunner(RandomActionEngine(ByteTokenizer(), policy, seed), env, ByteTokenizer(), agent_config(max_turns))
    cfg = SamplerConfig("tree", m=m, n=n, l=l, expand_mode="random")
    return sample_trees(runner, tasks, cfg, random.Random(seed), None)


def signature(tree: Tree) -> list[tuple[Any, ...]]:
    """A tree node for node: what each step did and what the env answered."""
    return [(nd.id, nd.parent, nd.text, nd.observation, nd.reward, nd.extra.get("kind")) for nd in tree.nodes]


def replay_path(env: Any, task: Task, path: Sequence[Node], max_turns: int) -> list[StepOutcome]:
    """The outcomes of stepping ``path``'s step texts (root excluded) one by one from a fresh
    initial state, outside the library."""
    state = env.initial_state(task)
    outs = []
    for nd in path[1:]:
        allowed = int(nd.extra.get("turn", 1)) <= max_turns
        outs.append(env.step([task], [nd.text], [allowed], states=[state])[0])
    env.close_state(state)
    return outs


def node_matches(node: Node, out: StepOutcome) -> bool:
    """Whether the recorded ``node`` is what the env answers ``out`` when replayed."""
    if out.kind != node.extra.get("kind"):
        return False
    if out.done:
        return node.observation is None and node.reward == out.reward
    return node.reward is None and node.observation == out.observation


def tree_matches_replay(env: Any, task: Task, tree: Tree, max_turns: int) -> bool:
    """Every node of ``tree`` equals the outcome of replaying its own root→node path."""
    for nd in tree.nodes:
        if nd.parent is None:
            continue
        path = tree.path(nd.id)
        if not node_matches(nd, replay_path(env, task, path, max_turns)[-1]):
            return False
    return True


@dataclass
class ExactnessResult:
    trees: int
    nodes: int
    expansions: int
    mismatches: int
    mismatch_replay: int
    mismatch_modes: int
    leaked_states: int
    wall_s: float

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def check_exactness(
    make_env: Callable[[str], Any],
    tasks: Sequence[Task],
    policy: Policy,
    n_trees: int,
    seed: int = 0,
    shape: tuple[int, int, int] = (2, 2, 2),
    max_turns: int = 4,
    batch_prompts: int = 25,
    modes: Sequence[str] = MODES,
) -> ExactnessResult:
    """Grow at least ``n_trees`` random trees (``batch_prompts`` prompts per rollout, ``shape[0]``
    trees per prompt) in every mode of ``modes`` and count mismatching trees (module docstring).
    ``leaked_states``: handles the envs report open after all rollouts (``open_states``; 0 when
    every handle was given back)."""
    t0 = time.perf_counter()
    envs = {mode: make_env(mode) for mode in modes}
    reference = make_env("replay")
    trees = nodes = expansions = bad_replay = bad_modes = bad = 0
    rollout = 0
    while trees < n_trees:
        rng = random.Random(f"{seed}-{rollout}")
        batch = [tasks[rng.randrange(len(tasks))] for _ in range(batch_prompts)]
        results = {mode: grow(envs[mode], batch, policy, shape, seed * 100_003 + rollout, max_turns) for mode in modes}
        first = results[modes[0]]
        for fi, task in enumerate(batch):
            for ti, tree in enumerate(first.forests[fi].trees):
                trees += 1
                nodes += len(tree.nodes) - 1
                expansions += shape[1] * shape[2]
                ok_replay = tree_matches_replay(reference, task, tree, max_turns)
                sig = signature(tree)
                ok_modes = all(signature(results[m].forests[fi].trees[ti]) == sig for m in modes[1:])
                bad_replay += not ok_replay
                bad_modes += not ok_modes
                bad += not (ok_replay and ok_modes)
        rollout += 1
    leaked = sum(int(getattr(e, "open_states", 0)) for e in [*envs.values(), reference])
    return ExactnessResult(trees, nodes, expansions, bad, bad_replay, bad_modes, leaked, time.perf_counter() - t0)


def chain_of(env: Any, task: Task, actions: Sequence[str]) -> Tree:
    """A recorded chain: the root, then one node per action stepped in order (no model)."""
    tree = Tree([Node(0, None, text="", tokens=[], policy_mask=[])])
    state = env.initial_state(task)
    for i, text in enumerate(actions):
        out = env.step([task], [text], [True], states=[state])[0]
        if out.done:
            raise ValueError(f"action {i} ({text!r}) ended the chain; use actions that go on")
        tree.add(Node(i + 1, i, text=text, observation=out.observation, tokens=[], policy_mask=[], extra={"kind": out.kind}))
    env.close_state(state)
    return tree


def expansion_cost(env_for: Callable[[str], Any], task: Task, actions: Sequence[str], repeats: int = 50) -> dict[str, Any]:
    """Time one expansion from the deepest node of a chain of ``actions`` (depth = ``len(actions)``)
    by restore (``snapshot`` mode: the node's snapshot kept while the chain was grown, restored)
    and by replay (``replay`` mode: a fresh initial state and the recorded actions replayed), side
    by side, interleaved ``repeats`` times. Also times taking the snapshot (paid once per node
    while trajectories run, whether or not the node is ever expanded).

    Returns per mode ``ms`` (median per expansion), ``tool_calls`` (replayed per expansion), and
    ``snapshot_ms`` (median to snapshot one node)."""
    depth = len(actions)
    keepers, trees, node = {}, {}, depth
    for mode in ("snapshot", "replay"):
        env = env_for(mode)
        trees[mode] = chain_of(env, task, actions)
        keepers[mode] = StateKeeper(env, mode)  # type: ignore[arg-type]
    snap_env = keepers["snapshot"].env
    live = snap_env.initial_state(task)
    for text in actions:
        snap_env.step([task], [text], [True], states=[live])
    snap_times = []
    for _ in range(repeats):
        t = time.perf_counter()
        keepers["snapshot"].record(trees["snapshot"], node, live)
        snap_times.append(time.perf_counter() - t)
    snap_env.close_state(live)
    times: dict[str, list[float]] = {"snapshot": [], "replay": []}
    calls: dict[str, int] = {}
    for _ in range(repeats):
        for mode in ("snapshot", "replay"):
            t = time.perf_counter()
            state, replayed = keepers[mode].state_at(trees[mode], node, task)
            times[mode].append(time.perf_counter() - t)
            calls[mode] = replayed
            keepers[mode].env.close_state(state)
    for k in keepers.values():
        k.release()

    def median_ms(xs: list[float]) -> float:
        return round(1000 * sorted(xs)[len(xs) // 2], 4)

    out: dict[str, Any] = {"depth": depth, "repeats": repeats}
    for mode in ("snapshot", "replay"):
        out[mode] = {"ms": median_ms(times[mode]), "tool_calls": calls[mode]}
    out["snapshot"]["snapshot_ms"] = median_ms(snap_times)
    out["speedup"] = round(out["replay"]["ms"] / max(out["snapshot"]["ms"], 1e-9), 2)
    return out




def random_sql_action(rng: random.Random, p_answer: float = 0.15) -> str:
    """A random SQL step on the ``accounts`` table: writes that apply, match nothing, violate the
    balance check half-way (rolled back) or run into the step limit (rolled back), reads of the
    whole table, denied and malformed statements, now and then an answer."""
    if rng.random() < p_answer:
        return f"<answer>{rng.randint(0, 120)}</answer>"
    n, x = rng.randint(20, 90), rng.randint(1, 30)
    sql = rng.choice(
        [
            f"UPDATE accounts SET balance = balance + {x} WHERE balance > {n}",
            f"UPDATE accounts SET balance = balance - {x} WHERE balance < {n}",
            f"UPDATE accounts SET balance = balance - {n}",
            f"DELETE FROM accounts WHERE balance < {n // 2}",
            f"INSERT INTO accounts VALUES ('n{x % 7}', {x})",
            "SELECT name, balance FROM accounts ORDER BY name",
            "SELECT count(*), sum(balance) FROM accounts",
            "INSERT INTO accounts SELECT 'r' || x, 1 FROM (WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT x FROM c)",
            "SELECT random()",
            "DROP TABLE accounts",
            "UPDATE acounts SET balance = 0",
            "-- only a comment",
            "",
        ]
    )
    return f"<sql>{sql}</sql>" if rng.random() > 0.05 else f"<sq>{sql}"


__all__ = [
    "MODES",
    "ByteTokenizer",
    "ExactnessResult",
    "RandomActionEngine",
    "chain_of",
    "check_exactness",
    "expansion_cost",
    "grow",
    "random_sql_action",
    "replay_path",
    "signature",
    "tree_matches_replay",
]
