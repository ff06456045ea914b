"""Held-out evaluation: one chain per question, greedy and sampled at T=1, drawn from a fixed
evaluation stream so that evaluating never moves the training RNG (runs from one model can
share their start evaluation)."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from typing import Any

import torch

from treegrpo.envs.base import Task, declared_kinds
from treegrpo.rollout.agent import StepRunner
from treegrpo.rollout.samplers import SamplerConfig, get_sampler
from treegrpo.tree import Tree

EVAL_SEED = 12345  # evaluation draws from its own stream, never from the training RNG


def evaluate(runner: StepRunner, tasks: Sequence[Task], sampled: bool = True, greedy: bool = True) -> dict[str, float]:
    """Held-out success: greedy, and (optionally) sampled at T=1 — one chain per question, drawn
    from a fixed evaluation stream so evaluating never moves the training RNG. ``greedy=False``
    (with ``sampled``) skips the greedy half: a cheaper point on an EM curve."""
    out: dict[str, float] = {}
    modes = ([("greedy", 0.0)] if greedy or not sampled else []) + ([("sampled", 1.0)] if sampled else [])
    chains = get_sampler("chain")
    for name, temp in modes:
        r = StepRunner(
            runner.engine,
            runner.env,
            runner.tokenizer,
            dataclasses.replace(runner.cfg, temperature=temp, top_p=1.0),
        )
        result = chains(
            r,
            tasks,
            SamplerConfig("chain", group_size=1),
            random.Random(EVAL_SEED),
            torch.Generator().manual_seed(EVAL_SEED),
        )
        leaves = [leaf for f in result.forests for _, leaf in f.leaves()]
        kinds = action_kinds(runner.env)
        out[f"eval/well_formed_{name}"] = sum(
            well_formed(f.trees[ti], leaf.id, kinds) for f in result.forests for ti, leaf in f.leaves()
        ) / max(1, len(leaves))
        out[f"eval/success_{name}"] = sum(float(leaf.reward or 0.0) for leaf in leaves) / max(1, len(leaves))
        out[f"eval/tool_calls_{name}"] = result.total().tool_calls / max(1, len(leaves))
        out[f"eval/turns_ended_{name}"] = turns_ended(result.forests)
    return out


def turns_ended(forests: Sequence[Any]) -> float:
    """The fraction of the model's turns that ended by themselves — at the end-of-turn token or a
    stop string (finish reason ``eos`` or ``stop``) — rather than being cut at the per-turn token cap
    (``length``); a model that talks past its answer scores low. 0.0 with no turns."""
    reasons = [
        n.extra.get("finish_reason")
        for f in forests
        for t in f.trees
        for n in t.nodes
        if n.parent is not None and n.extra.get("kind") != "overflow"
    ]
    return sum(r in ("eos", "stop") for r in reasons) / max(1, len(reasons))


def action_kinds(env: Any) -> tuple[str, ...]:
    """The valid action kinds of ``env``: its declared ``actions`` (every kind but ``invalid``)."""
    return tuple(k for k in declared_kinds(env) if k != "invalid")


def well_formed(tree: Tree, leaf_id: int, kinds: Sequence[str] = ("search", "answer")) -> bool:
    """A trajectory that followed the protocol: every step one of the env's valid action ``kinds``
    (:func:`action_kinds`), ending in an answer."""
    steps = tree.path(leaf_id)[1:]
    return bool(steps) and steps[-1].extra.get("kind") == "answer" and all(n.extra.get("kind") in kinds for n in steps)


def headline(ev: dict[str, float]) -> float:
    """The headline held-out figure: sampled success when measured, else greedy."""
    return ev["eval/success_sampled"] if "eval/success_sampled" in ev else ev["eval/success_greedy"]


__all__ = ["EVAL_SEED", "action_kinds", "evaluate", "headline", "turns_ended", "well_formed"]
