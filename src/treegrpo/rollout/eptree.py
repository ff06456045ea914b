"""EPTree: TreeRL's entropy-guided token-level tree rollout (DESIGN.md §5.4), sampler ``eptree``.

Single-turn: a *branch* is one generation from a context up to EOS, the answer's end tag (the
env's stop string) or the length cap (``AgentConfig.max_step_tokens``, the same cap for every
branch of a call).

1. **Initialize**: M chains per prompt (each chain is its own tree), all prompts in one engine call.
2. **Fork**, L rounds: per tree, score every generated token by ``-log p(sampled token)``
   (``fork_score="logp"``), by the full-distribution entropy the engine returns
   (``"entropy"``, ``SamplingParams.return_entropy``), or uniformly at random (``"random"``, the
   ablation). A token is a candidate unless it is the first token of a node (the first token of a
   branch, or a token that was already a fork point) or it comes at or after the answer start
   (the env's ``answer_start`` tag, ``<answer>``). The N best candidates per tree are the fork
   points. From each, T new branches continue the prefix *before* that token; all branches of all
   trees of all prompts go in one engine call per round.

A tree ends with ``1 + N·L·T`` leaves (fewer when a tree has fewer than N candidates, e.g. a chain
that answers at once). Nodes are the token segments between fork points: forking at token ``k`` of
a node splits it into a head (``tokens[:k]``, keeps the node id) and a tail (``tokens[k:]``, a new
node that takes over the old node's children, reward and leaf fields); the T new branches are the
head's children beside the tail. ``tokens`` / ``policy_mask`` / ``logprobs`` / ``entropy`` are split
accordingly, ``text`` is re-decoded per segment (display only). Every generated node records the
round that generated it (``extra["round"]``); each tree records its fork points in
``tree.extra["forks"]``. The forest JSON (``treegrpo.forest/v1``) holds all of it.

Budget (:class:`~treegrpo.rollout.agent.Budget`): generated and prefill tokens as the engine
reports them, one engine request per branch; no tool calls.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from treegrpo.envs.base import Task, check_outcomes
from treegrpo.rollout.agent import Budget, RolloutResult, StepRunner
from treegrpo.rollout.engine import SamplingParams, release_engine_cache
from treegrpo.rollout.sampling import SamplerConfig
from treegrpo.tree import Forest, Node, Tree

ForkScore = Literal["logp", "entropy", "random"]
FORK_SCORES: tuple[str, ...] = ("logp", "entropy", "random")
DEFAULT_ANSWER_START = "<answer>"
# Fields that describe a whole segment (kept on both halves of a split); every other field of a
# node describes how its trajectory ended (kept on the tail only).
_SEGMENT_FIELDS = ("round",)


@dataclass(frozen=True)
class ForkPoint:
    """A token to fork at: branches continue the prefix that ends just before it.

    Attributes:
        node_id: the node holding the token.
        pos: the token's index in ``node.tokens`` (>= 1).
        score: its uncertainty score (higher = forked first).
    """

    node_id: int
    pos: int
    score: float


# -- choosing fork points -----------------------------------------------------------------------


def token_scores(node: Node, fork_score: ForkScore) -> list[float]:
    """Per-token uncertainty of ``node``: ``-log p`` (``"logp"`` and ``"random"``) or the recorded
    full-distribution entropy (``"entropy"``; ``-log p`` where the node has none)."""
    if fork_score == "entropy" and node.entropy is not None and len(node.entropy) == len(node.tokens):
        return [float(x) for x in node.entropy]
    if node.logprobs and len(node.logprobs) == len(node.tokens):
        return [-float(x) for x in node.logprobs]
    return [0.0] * len(node.tokens)


def answer_limits(tree: Tree, answer_ids: Sequence[int]) -> dict[int, int]:
    """Per non-root node: how many of its leading tokens come before the answer starts on its path
    (``len(tokens)`` when it has not started by the node's end; 0 when it started in an ancestor).

    The answer starts at the first occurrence of ``answer_ids`` in the path's generated tokens
    (exact for a one-token tag; a multi-token tag is matched as an id sequence, possibly across a
    node boundary, in which case the node where it completes gets 0). Empty ``answer_ids``: no limit.
    """
    k = len(answer_ids)
    tag = list(answer_ids)
    out: dict[int, int] = {}
    state: dict[int, tuple[bool, list[int]]] = {}
    for node in tree.dfs():  # pre-order: a parent is seen before its children
        if node.parent is None:
            state[node.id] = (False, [])
            continue
        started, carry = state[node.parent]
        if started or k == 0:
            out[node.id] = 0 if started else len(node.tokens)
            state[node.id] = (started, [])
            continue
        window = carry + list(node.tokens)
        hit = next((i for i in range(len(window) - k + 1) if window[i : i + k] == tag), -1)
        if hit < 0:
            out[node.id] = len(node.tokens)
            state[node.id] = (False, window[len(window) - (k - 1) :] if k > 1 else [])
        else:
            out[node.id] = max(0, hit - len(carry))
            state[node.id] = (True, [])
    return out


def fork_candidates(tree: Tree, fork_score: ForkScore, answer_ids: Sequence[int] = ()) -> list[ForkPoint]:
    """Every token of ``tree`` that may be a fork point, with its score, in depth-first order.

    Excluded: the root (the prompt), the first token of every node (a branch's first token, or a
    token that was already a fork point), tokens the policy did not generate, and tokens at or
    after the answer start (:func:`answer_limits`).
    """
    limits = answer_limits(tree, answer_ids)
    out: list[ForkPoint] = []
    for node in tree.dfs():
        if node.parent is None:
            continue
        scores = token_scores(node, fork_score)
        for pos in range(1, limits[node.id]):
            if node.policy_mask[pos]:
                out.append(ForkPoint(node.id, pos, scores[pos]))
    return out


def pick_fork_points(
    tree: Tree, n: int, fork_score: ForkScore, rng: random.Random, answer_ids: Sequence[int] = ()
) -> list[ForkPoint]:
    """The ``n`` fork points of ``tree`` (distinct tokens; fewer when there are fewer candidates):
    the highest scores (ties: depth-first order), or ``n`` uniformly random candidates for
    ``fork_score="random"``."""
    if fork_score not in FORK_SCORES:
        raise ValueError(f"unknown fork_score {fork_score!r}; choose one of {FORK_SCORES}")
    cands = fork_candidates(tree, fork_score, answer_ids)
    if n <= 0 or not cands:
        return []
    if fork_score == "random":
        return rng.sample(cands, min(n, len(cands)))
    order = sorted(range(len(cands)), key=lambda i: (-cands[i].score, i))
    return [cands[i] for i in order[:n]]


# -- growing the tree ---------------------------------------------------------------------------


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False) if tokenizer is not None else ""


def split_node(tree: Tree, node_id: int, pos: int, tokenizer: Any = None) -> Node:
    """Split node ``node_id`` before its token ``pos`` (``0 < pos < len(tokens)``), in place.

    The node keeps its id and ``tokens[:pos]``; a new tail node (returned) gets ``tokens[pos:]``,
    the node's children, its reward and its leaf fields. Per-token lists are split alike.
    """
    node = tree.node(node_id)
    if not 0 < pos < len(node.tokens):
        raise ValueError(f"node {node_id}: cannot split {len(node.tokens)} tokens at {pos}")
    tail = Node(
        id=tree.next_id(),
        parent=node.id,
        text=_decode(tokenizer, node.tokens[pos:]),
        observation=node.observation,
        tokens=node.tokens[pos:],
        policy_mask=node.policy_mask[pos:],
        logprobs=node.logprobs[pos:],
        entropy=None if node.entropy is None else node.entropy[pos:],
        reward=node.reward,
        extra=dict(node.extra),
    )
    for child_id in tree.children[node.id]:
        tree.node(child_id).parent = tail.id
    node.tokens = node.tokens[:pos]
    node.policy_mask = node.policy_mask[:pos]
    node.logprobs = node.logprobs[:pos]
    node.entropy = None if node.entropy is None else node.entropy[:pos]
    node.text = _decode(tokenizer, node.tokens)
    node.observation = None
    node.reward = None
    node.advantage = None
    node.extra = {k: v for k, v in node.extra.items() if k in _SEGMENT_FIELDS}
    tree.add(tail)  # also invalidates the child lists changed above
    return tail


def apply_forks(tree: Tree, points: Sequence[ForkPoint], tokenizer: Any = None) -> list[int]:
    """Split ``tree`` at every fork point; returns, per point, the id of the node that now ends
    just before the point's token (the parent of the point's new branches)."""
    heads: dict[tuple[int, int], int] = {}
    by_node: dict[int, list[int]] = {}
    for p in points:
        by_node.setdefault(p.node_id, []).append(p.pos)
    for node_id, positions in by_node.items():
        cur, offset = node_id, 0
        for pos in sorted(set(positions)):  # ascending: each split cuts the previous tail
            tail = split_node(tree, cur, pos - offset, tokenizer)
            heads[(node_id, pos)] = cur
            cur, offset = tail.id, pos
    return [heads[(p.node_id, p.pos)] for p in points]


def response_ids(tree: Tree, node_id: int) -> list[int]:
    """The generated ids on the root→``node_id`` path (the prompt excluded)."""
    return [tok for nd in tree.path(node_id)[1:] for tok, m in zip(nd.tokens, nd.policy_mask, strict=True) if m]


@dataclass
class _Request:
    forest_index: int
    tree: Tree
    parent_id: int


def _answer_ids(runner: StepRunner) -> tuple[int, ...]:
    tag = getattr(runner.env, "answer_start", DEFAULT_ANSWER_START)
    if not tag:
        return ()
    return tuple(runner.tokenizer.encode(tag, add_special_tokens=False))


def _grow(
    runner: StepRunner,
    tasks: Sequence[Task],
    requests: Sequence[_Request],
    budgets: Sequence[Budget],
    params: SamplingParams,
    generator: torch.Generator | None,
    round_: int,
) -> int:
    """One engine call: a branch per request, each ending in a scored leaf. Returns 1 (calls)."""
    contexts = [r.tree.context(r.parent_id) for r in requests]
    for r, ctx in zip(requests, contexts, strict=True):  # a prompt longer than the context budget
        if not runner.has_room(ctx):
            runner.end_without_room(r.tree, r.parent_id, tasks[r.forest_index], 0, budgets[r.forest_index])
    requests = [r for r, ctx in zip(requests, contexts, strict=True) if runner.has_room(ctx)]
    contexts = [ctx for ctx in contexts if runner.has_room(ctx)]
    if not requests:
        return 0
    gens = runner.engine.generate(contexts, params, generator)
    texts = [
        _decode(runner.tokenizer, response_ids(r.tree, r.parent_id) + list(g.tokens))
        for r, g in zip(requests, gens, strict=True)
    ]
    req_tasks = [tasks[r.forest_index] for r in requests]
    outcomes = check_outcomes(runner.env, runner.env.step(req_tasks, texts, [False] * len(requests)), len(requests))
    for r, g, task, text, out in zip(requests, gens, req_tasks, texts, outcomes, strict=True):
        budgets[r.forest_index].count_step(g, out)
        reward = out.reward if out.done and out.reward is not None else runner.env.score(task, text)
        r.tree.add(
            Node(
                id=r.tree.next_id(),
                parent=r.parent_id,
                text=_decode(runner.tokenizer, g.tokens),
                tokens=list(g.tokens),
                policy_mask=[1] * len(g.tokens),
                logprobs=list(g.logprobs),
                entropy=None if g.entropies is None else list(g.entropies),
                reward=float(reward),
                extra={"round": round_, "kind": out.kind, "turn": 1, "finish_reason": g.finish_reason, **out.info},
            )
        )
    return 1


def sample_eptree(
    runner: StepRunner,
    tasks: Sequence[Task],
    cfg: SamplerConfig,
    rng: random.Random,
    generator: torch.Generator | None = None,
) -> RolloutResult:
    """EPTree (module docstring): M chains per prompt, then L rounds of N fork points per tree with
    T branches each, every round in one engine call. Uses ``cfg.m``, ``cfg.n``, ``cfg.l``,
    ``cfg.t`` and ``cfg.fork_score``."""
    fork_score: ForkScore = getattr(cfg, "fork_score", "logp")
    t_branches: int = getattr(cfg, "t", 2)
    if fork_score not in FORK_SCORES:
        raise ValueError(f"unknown fork_score {fork_score!r}; choose one of {FORK_SCORES}")
    t0 = time.perf_counter()
    params = dataclasses.replace(runner.params, return_entropy=fork_score == "entropy")
    answer_ids = _answer_ids(runner)
    forests: list[Forest] = [runner.new_forest(task, cfg.m) for task in tasks]
    budgets = [Budget() for _ in tasks]
    for f in forests:
        for tree in f.trees:
            tree.extra["forks"] = []
    requests = [_Request(fi, tree, tree.root.id) for fi, f in enumerate(forests) for tree in f.trees]
    calls = _grow(runner, tasks, requests, budgets, params, generator, 0)
    for round_ in range(1, cfg.l + 1):
        requests = []
        for fi, forest in enumerate(forests):
            for tree in forest.trees:
                points = pick_fork_points(tree, cfg.n, fork_score, rng, answer_ids)
                heads = apply_forks(tree, points, runner.tokenizer)
                for p, head in zip(points, heads, strict=True):
                    tree.extra["forks"].append(
                        {"round": round_, "node": head, "offset": len(response_ids(tree, head)), "score": round(p.score, 6)}
                    )
                    requests += [_Request(fi, tree, head) for _ in range(t_branches)]
        calls += _grow(runner, tasks, requests, budgets, params, generator, round_)
    # Released only now: every fork context is a prefix of an earlier branch, whose KV the engine
    # still holds (within its memory cap).
    release_engine_cache(runner.engine)
    return RolloutResult(forests, budgets, calls, time.perf_counter() - t0)


__all__ = [
    "FORK_SCORES",
    "ForkPoint",
    "ForkScore",
    "answer_limits",
    "apply_forks",
    "fork_candidates",
    "pick_fork_points",
    "response_ids",
    "sample_eptree",
    "split_node",
    "token_scores",
]
