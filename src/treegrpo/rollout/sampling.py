"""The sampler contract: the shape of a rollout group (:class:`SamplerConfig`) and the
signature every sampler has (:data:`Sampler`). Samplers live in :mod:`treegrpo.rollout.trees`
(``chain``, ``tree``) and :mod:`treegrpo.rollout.eptree` (``eptree``); the registry that names
them is :mod:`treegrpo.rollout.samplers`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from treegrpo.envs.base import Task
from treegrpo.rollout.agent import RolloutResult, StepRunner

ExpandMode = Literal["random", "nonroot", "entropy"]


@dataclass(frozen=True)
class SamplerConfig:
    """Shape of the rollout group.

    Attributes:
        name: ``chain``, ``tree`` or ``eptree`` (:mod:`treegrpo.rollout.eptree`).
        group_size: chains per prompt for ``chain`` (G).
        m: initial chains per prompt for ``tree`` (M; official name ``ts_m``).
        n: nodes expanded per tree per round (N; ``ts_n``).
        l: expansion rounds (L; ``ts_l``).
        expand_mode: ``random`` picks uniformly with replacement among the root and all non-leaf
            nodes (the official code: a picked root starts a brand-new chain); ``nonroot`` excludes
            the root whenever the tree has another non-leaf node; ``entropy`` prefers the node
            (root included) whose next steps — its children, sampled from its context — had the
            highest mean ``-log p``, so an uncertain step is re-sampled (EPTree's rule: fork
            *before* the uncertain token), down-weighting nodes already expanded.
        t: ``eptree``: branches per fork point (T); ``m``, ``n``, ``l`` are its M, N, L.
        fork_score: ``eptree``: how tokens are ranked as fork points: ``logp`` (``-log p`` of the
            sampled token), ``entropy`` (full-distribution entropy) or ``random``.
        budget_tokens: ``tree``: ``None`` for the nominal shape (L rounds of N picks), or a budget
            of generated tokens per prompt — a number, or ``"chain:G"`` (G chains' measured mean):
            the token-matched tree of :mod:`treegrpo.rollout.token_budget` (``l`` unused).
    """

    name: str = "tree"
    group_size: int = 4
    m: int = 2
    n: int = 2
    l: int = 1
    expand_mode: ExpandMode = "random"
    t: int = 2
    fork_score: Literal["logp", "entropy", "random"] = "logp"
    budget_tokens: int | float | str | None = None

    def trajectories_per_prompt(self) -> int:
        if self.name == "eptree":  # at most: a tree with fewer candidate tokens forks less
            return self.m * (1 + self.n * self.l * self.t)
        return self.group_size if self.name == "chain" else self.m * (1 + self.n * self.l)


Sampler = Callable[
    [StepRunner, Sequence[Task], SamplerConfig, random.Random, "torch.Generator | None"], RolloutResult
]
"""A sampler: ``(runner, tasks, cfg, rng, generator) -> RolloutResult`` with one forest per task,
in task order. ``rng`` draws the sampler's own choices (tree picks, fork points); ``generator``
is the engine's sampling stream."""
