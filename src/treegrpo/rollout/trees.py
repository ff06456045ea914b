"""Agent-step samplers (DESIGN.md §5.3). All return forests.

- ``chain``: G independent chains per prompt (each chain is its own tree).
- ``tree``: Tree-GRPO's initialize-then-expand: M chains per prompt, then L rounds in which N
  nodes of every tree are picked and one new trajectory is continued from each picked node's full
  context. A tree ends with 1 + N·L leaves.

Both go through the same :class:`~treegrpo.rollout.agent.StepRunner`, batched across every
prompt and tree per turn, so their costs are measured by the same counters. With per-trajectory
streams (``AgentConfig.streams``: ``trajectory_streams`` or ``rollout_pipeline``) a tree's picks
draw from their own ``random.Random`` per forest, tree and round and every trajectory carries its
place (tree, lineage), so the forest does not depend on the order trajectories end
(:mod:`treegrpo.rollout.streams`); node ids are made dense in place order when the rollout ends.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Sequence

import torch

from treegrpo.envs.base import Task
from treegrpo.rollout.agent import Budget, Cursor, RolloutResult, StepRunner
from treegrpo.rollout.engine import release_engine_cache
from treegrpo.rollout.sampling import ExpandMode, SamplerConfig
from treegrpo.rollout.streams import pick_rng, renumber
from treegrpo.tree import Forest, Node, Tree


def initialize(runner: StepRunner, tasks: Sequence[Task], n_trees: int) -> tuple[list[Forest], list[Cursor]]:
    """One forest of ``n_trees`` root-only trees per task, and a cursor at each root (its
    ``stream``: the tree's index in its forest, lineage 0)."""
    forests = [runner.new_forest(t, n_trees) for t in tasks]
    cursors = [
        Cursor(fi, tree, tree.root.id, list(tree.root.tokens), 0, task, stream=(ti, 0))
        for fi, (f, task) in enumerate(zip(forests, tasks, strict=True))
        for ti, tree in enumerate(f.trees)
    ]
    return forests, cursors


def finish_streams(runner: StepRunner, forests: Sequence[Forest]) -> None:
    """With per-trajectory streams, make every tree's node ids dense in place order
    (:func:`~treegrpo.rollout.streams.renumber`); nothing otherwise."""
    if runner.cfg.streams:
        renumber([t for f in forests for t in f.trees])


def sample_chains(
    runner: StepRunner,
    tasks: Sequence[Task],
    cfg: SamplerConfig,
    rng: random.Random,
    generator: torch.Generator | None = None,
) -> RolloutResult:
    """G independent chains per prompt, all prompts batched per turn: the tree sampler with
    M = G and no expansion round, so both modes share one code path and one set of counters."""
    return sample_trees(runner, tasks, dataclasses.replace(cfg, m=cfg.group_size, l=0, budget_tokens=None), rng, generator)


def _mean_surprise(node: Node) -> float:
    lps = [lp for lp, m in zip(node.logprobs, node.policy_mask, strict=False) if m]
    return -sum(lps) / len(lps) if lps else 0.0


def surprise_scores(tree: Tree, candidates: Sequence[Node], times: dict[int, int]) -> list[float]:
    """The ``entropy`` pick rule's score of each candidate. Expanding a node re-samples the step
    taken from its context, so a node is scored by the steps already sampled there (its children):
    their mean -log p, averaged over children, divided by 1 + how often the node was already
    expanded (children beyond the first continuation, plus ``times``: picks made this round)."""
    out = []
    for nd in candidates:
        kids = tree.children[nd.id]
        surprise = sum(_mean_surprise(tree.node(c)) for c in kids) / max(1, len(kids))
        out.append(surprise / (1 + max(0, len(kids) - 1) + times.get(nd.id, 0)))
    return out


def pick_nodes(tree: Tree, n: int, mode: ExpandMode, rng: random.Random) -> list[Node]:
    """Choose ``n`` nodes of ``tree`` to expand (with replacement), per ``mode``."""
    nonleaf = [nd for nd in tree.nodes if nd.parent is not None and not tree.is_leaf(nd.id)]
    if mode == "random" or (mode == "nonroot" and not nonleaf):
        candidates = [tree.root, *nonleaf]
        return [rng.choice(candidates) for _ in range(n)]
    if mode == "nonroot":
        return [rng.choice(nonleaf) for _ in range(n)]
    if mode == "entropy":
        candidates = [tree.root, *nonleaf]
        picks: list[Node] = []
        times: dict[int, int] = {}
        for _ in range(n):
            scores = surprise_scores(tree, candidates, times)
            top = max(scores)
            best = rng.choice([nd for nd, sc in zip(candidates, scores, strict=True) if sc == top])
            times[best.id] = times.get(best.id, 0) + 1
            picks.append(best)
        return picks
    raise ValueError(f"unknown expand_mode {mode!r}; choose random, nonroot or entropy")


def sample_trees(
    runner: StepRunner,
    tasks: Sequence[Task],
    cfg: SamplerConfig,
    rng: random.Random,
    generator: torch.Generator | None = None,
) -> RolloutResult:
    """Initialize-then-expand: M chains per prompt, then L rounds of N expansions per tree.

    A tree's next round starts as soon as its own trajectories of the round have ended (picks
    only look at that tree), so its expansions share engine calls with other trees' unfinished
    chains instead of waiting for the slowest trajectory of the batch: one pass, no second tail.
    """
    t0 = time.perf_counter()
    forests, cursors = initialize(runner, tasks, cfg.m)
    budgets = [Budget() for _ in tasks]
    in_flight = {id(c.tree): 1 for c in cursors}  # trajectories of the tree's current round
    rounds = {id(c.tree): 0 for c in cursors}  # expansion rounds started per tree
    started = {id(c.tree): 1 for c in cursors}  # trajectories started per tree (the next lineage)
    pick_base = rng.getrandbits(62) if runner.cfg.streams else None  # per-tree pick streams

    def on_end(c: Cursor) -> list[Cursor]:
        key = id(c.tree)
        in_flight[key] -= 1
        if in_flight[key] > 0 or rounds[key] >= cfg.l:
            return []
        rounds[key] += 1
        tree_index = c.stream[0] if c.stream is not None else -1
        picks = rng if pick_base is None else pick_rng(pick_base, c.forest_index, tree_index, rounds[key])
        new = []
        for node in pick_nodes(c.tree, cfg.n, cfg.expand_mode, picks):
            context = c.tree.context(node.id)
            stream = (tree_index, started[key])
            started[key] += 1
            new.append(Cursor(c.forest_index, c.tree, node.id, context, c.tree.depth(node.id), c.task, stream=stream))
        in_flight[key] = len(new)
        return new

    calls = runner.run_turns(cursors, budgets, generator, on_end=on_end)
    # Released only now: every expansion context is a prefix of a trajectory of an earlier round,
    # whose KV the engine still holds (within its memory cap).
    release_engine_cache(runner.engine)
    finish_streams(runner, forests)
    return RolloutResult(forests, budgets, calls, time.perf_counter() - t0)
