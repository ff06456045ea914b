"""Token-matched trees: a Tree-GRPO rollout that spends, per prompt, a budget of *generated tokens*
instead of a nominal shape (``SamplerConfig.budget_tokens``; DESIGN.md §5.3 "budget").

The nominal pairs (chain budget 2 ↔ (1,2,1), …) fix the number of expansions, not their cost: an
expansion from the root costs a whole chain, one from a deep node only its last steps, so a tree
spends more or less than the chain it is paired with (measured: (1,2,1) spends 1.13–1.41× chain 2's
tokens). Here the cost is fixed and the shape varies per prompt:

1. **Initialize**: M chains per prompt, all prompts batched (as the nominal tree).
2. **Limit**: ``budget_tokens`` is a number of generated tokens per prompt, or ``"chain:G"``: G
   times the mean generated tokens of one chain, measured on this call's own initial chains (the
   M·P chains just sampled from the current policy: an unbiased estimate of what the chain sampler
   with G chains would spend per prompt now). Every prompt gets the same limit.
3. **Expand** in rounds per prompt: up to N picks per tree per round (trees interleaved); a node is
   eligible only if its *expected cost* — the mean generated tokens after a node of its depth over
   every trajectory of the call ended so far (:func:`tail_costs`) — fits in what is left of the prompt's limit
   after the tokens already spent and the expected cost of the round's earlier picks. Among the
   eligible nodes the pick rule is the nominal one (``random``, ``nonroot``, ``entropy``,
   :func:`pick_within`). The next round starts when the prompt's round has ended, so every
   admission sees every token spent so far. Rounds end when no node fits.

A prompt thus spends its limit up to the cheapest expansion it could not afford (under) and the
amount by which its last expansions ran longer than their depth's measured mean (over); every token
is still booked once through :class:`~treegrpo.rollout.agent.Budget`, exactly as in every sampler.
Each forest records its limit in ``extra["token_limit"]``.

Under the pipelined loop the admissions read every trajectory *ended so far* across prompts, which
depends on tool timing, so a token-matched forest is reproducible only with the sequential loop
(per-trajectory streams or not); its picks and samples draw from per-prompt, per-round streams.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence

import torch

from treegrpo.envs.base import Task
from treegrpo.errors import ConfigError
from treegrpo.rollout.agent import Budget, Cursor, RolloutResult, StepRunner
from treegrpo.rollout.engine import release_engine_cache
from treegrpo.rollout.sampling import ExpandMode, SamplerConfig
from treegrpo.rollout.streams import pick_rng
from treegrpo.rollout.trees import finish_streams, initialize, surprise_scores
from treegrpo.tree import Forest, Node, Tree

BudgetTokens = int | float | str
"""A token budget per prompt: a number of generated tokens, or ``"chain:G"``."""


def parse_budget_tokens(value: BudgetTokens) -> tuple[str, float]:
    """``("tokens", n)`` for a number of tokens per prompt, ``("chain", G)`` for ``"chain:G"``.

    Raises:
        ConfigError: anything else (a non-positive number, an unknown unit).
    """
    if isinstance(value, bool):
        raise ConfigError(f"budget_tokens {value!r}: give generated tokens per prompt (e.g. 64) or chain:G (e.g. chain:2)")
    if isinstance(value, int | float):
        kind, amount = "tokens", float(value)
    else:
        text = str(value).strip()
        kind, _, rest = text.partition(":")
        try:
            kind, amount = (kind, float(rest)) if rest else ("tokens", float(text))
        except ValueError:
            kind, amount = "", 0.0
    if kind not in ("tokens", "chain") or not amount > 0:
        raise ConfigError(f"budget_tokens {value!r}: give generated tokens per prompt (e.g. 64) or chain:G (e.g. chain:2)")
    return kind, amount


def token_limit(budget_tokens: BudgetTokens, chain_tokens: Sequence[int]) -> float:
    """Generated tokens allowed per prompt: the number itself, or ``G`` times the mean of
    ``chain_tokens`` (the generated tokens of each initial chain of the call) for ``chain:G``."""
    kind, amount = parse_budget_tokens(budget_tokens)
    if kind == "tokens":
        return amount
    return amount * sum(chain_tokens) / max(1, len(chain_tokens))


def generated(node: Node) -> int:
    """Tokens the engine generated for ``node`` (its policy tokens)."""
    return node.n_policy_tokens


def tail_costs(forests: Sequence[Forest]) -> dict[int, float]:
    """Expected generated tokens of a trajectory continued from a node at each depth: over every
    ended root→leaf path of ``forests`` (its leaf has a reward) that goes below depth ``d``, the mean tokens generated after its
    depth-``d`` node (depth 0: the mean cost of a whole chain). Pooled over the call's prompts, so
    every node of a depth gets the same estimate and an admission never favours a node whose one
    sampled tail happened to be short (which would overshoot on average)."""
    sums: dict[int, float] = {}
    counts: dict[int, int] = {}
    for forest in forests:
        for tree in forest.trees:
            for leaf in tree.leaves():
                if leaf.reward is None:  # a trajectory still in flight (another prompt's): not a sample yet
                    continue
                gen = [generated(n) for n in tree.path(leaf.id)[1:]]
                tail = float(sum(gen))
                for d, g in enumerate(gen):
                    sums[d] = sums.get(d, 0.0) + tail
                    counts[d] = counts.get(d, 0) + 1
                    tail -= g
    return {d: sums[d] / counts[d] for d in sums}


def remaining_cost(tails: dict[int, float], tree: Tree, node_id: int) -> float:
    """The expected cost of continuing from ``node_id``: its depth's :func:`tail_costs` entry, at
    least 1 (every expansion books something)."""
    return max(1.0, tails.get(tree.depth(node_id), 1.0))


def pick_within(
    tree: Tree, mode: ExpandMode, rng: random.Random, cost: Callable[[Node], float], room: float,
    times: dict[int, int],
) -> Node | None:  # fmt: skip
    """One node of ``tree`` to expand whose ``cost`` fits in ``room``, by the nominal pick rule
    restricted to the nodes that fit (``None``: none fits). ``random``: uniform over the root and
    the non-leaf nodes; ``nonroot``: over the non-root non-leaf nodes (the root only when the tree
    has none); ``entropy``: the highest :func:`~treegrpo.rollout.trees.surprise_scores` score,
    ``times`` counting this round's earlier picks per node (updated here)."""
    nonleaf = [nd for nd in tree.nodes if nd.parent is not None and not tree.is_leaf(nd.id)]
    candidates = nonleaf if mode == "nonroot" and nonleaf else [tree.root, *nonleaf]
    fits = [nd for nd in candidates if cost(nd) <= room + 1e-9]
    if not fits:
        return None
    if mode in ("random", "nonroot"):
        best = rng.choice(fits)
    elif mode == "entropy":
        scores = surprise_scores(tree, fits, times)
        top = max(scores)
        best = rng.choice([nd for nd, sc in zip(fits, scores, strict=True) if sc == top])
    else:
        raise ValueError(f"unknown expand_mode {mode!r}; choose random, nonroot or entropy")
    times[best.id] = times.get(best.id, 0) + 1
    return best


def sample_token_matched(
    runner: StepRunner,
    tasks: Sequence[Task],
    cfg: SamplerConfig,
    rng: random.Random,
    generator: torch.Generator | None = None,
) -> RolloutResult:
    """Tree-GRPO at a generated-token budget per prompt (module docstring): ``cfg.m`` initial
    chains, then rounds of up to ``cfg.n`` admitted expansions per tree until nothing fits in
    ``cfg.budget_tokens``; ``cfg.l`` is not used (the budget ends the rounds)."""
    if cfg.budget_tokens is None:
        raise ValueError("sample_token_matched needs cfg.budget_tokens")
    t0 = time.perf_counter()
    forests, cursors = initialize(runner, tasks, cfg.m)
    budgets = [Budget() for _ in tasks]
    calls = runner.run_turns(cursors, budgets, generator)
    chain_tokens = [sum(generated(n) for n in t.nodes) for f in forests for t in f.trees]
    limit = token_limit(cfg.budget_tokens, chain_tokens)
    in_flight = [0] * len(tasks)
    rounds = [0] * len(tasks)  # rounds started per prompt
    started = [[1] * cfg.m for _ in tasks]  # trajectories started per tree (the next lineage)
    pick_base = rng.getrandbits(62) if runner.cfg.streams else None  # per-prompt, per-round pick streams

    def spent(fi: int) -> int:  # every expansion books a token or an overflow, so rounds end
        return budgets[fi].generated_tokens + budgets[fi].context_overflows

    def round_of(fi: int) -> list[Cursor]:
        forest, room = forests[fi], limit - spent(fi)
        tails = tail_costs(forests)  # every trajectory ended so far, all prompts
        times: list[dict[int, int]] = [{} for _ in forest.trees]
        new: list[Cursor] = []
        rounds[fi] += 1
        picks = rng if pick_base is None else pick_rng(pick_base, fi, rounds[fi])
        for _ in range(cfg.n):
            for ti, tree in enumerate(forest.trees):
                node = pick_within(tree, cfg.expand_mode, picks, lambda nd, t=tree: remaining_cost(tails, t, nd.id), room, times[ti])
                if node is None:
                    continue
                room -= remaining_cost(tails, tree, node.id)
                stream = (ti, started[fi][ti])
                started[fi][ti] += 1
                new.append(Cursor(fi, tree, node.id, tree.context(node.id), tree.depth(node.id), tasks[fi], stream=stream))
        in_flight[fi] = len(new)
        return new

    def on_end(c: Cursor) -> list[Cursor]:
        in_flight[c.forest_index] -= 1
        return round_of(c.forest_index) if in_flight[c.forest_index] == 0 else []

    first = [c for fi in range(len(tasks)) for c in round_of(fi)]
    calls += runner.run_turns(first, budgets, generator, on_end=on_end)
    release_engine_cache(runner.engine)
    finish_streams(runner, forests)
    for f in forests:
        f.extra["token_limit"] = round(limit, 3)
    return RolloutResult(forests, budgets, calls, time.perf_counter() - t0)


__all__ = [
    "BudgetTokens", "parse_budget_tokens", "pick_within", "remaining_cost", "sample_token_matched", "tail_costs",
    "token_limit",
]  # fmt: skip
