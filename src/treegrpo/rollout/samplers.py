"""The sampler registry: ``chain`` and ``tree`` (:mod:`treegrpo.rollout.trees`; ``tree`` with a
``budget_tokens`` is the token-matched tree of :mod:`treegrpo.rollout.token_budget`), ``eptree``
(:mod:`treegrpo.rollout.eptree`), and any a user registers with :func:`register_sampler`.
The trainer looks samplers up here by name, never by import.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch

from treegrpo.envs.base import Task
from treegrpo.registry import lookup
from treegrpo.rollout.agent import RolloutResult, StepRunner
from treegrpo.rollout.eptree import sample_eptree
from treegrpo.rollout.sampling import ExpandMode, Sampler, SamplerConfig
from treegrpo.rollout.token_budget import sample_token_matched
from treegrpo.rollout.trees import pick_nodes, sample_chains, sample_trees


def sample_tree(
    runner: StepRunner,
    tasks: Sequence[Task],
    cfg: SamplerConfig,
    rng: random.Random,
    generator: torch.Generator | None = None,
) -> RolloutResult:
    """The ``tree`` sampler: the nominal shape (:func:`sample_trees`), or the token-matched tree
    (:func:`sample_token_matched`) when ``cfg.budget_tokens`` is set."""
    fn = sample_trees if cfg.budget_tokens is None else sample_token_matched
    return fn(runner, tasks, cfg, rng, generator)


SAMPLERS: dict[str, Sampler] = {"chain": sample_chains, "tree": sample_tree, "eptree": sample_eptree}


def register_sampler(name: str) -> Callable[[Sampler], Sampler]:
    """Decorator: make ``fn`` available as sampler ``name``."""

    def deco(fn: Sampler) -> Sampler:
        SAMPLERS[name] = fn
        return fn

    return deco


def get_sampler(name: str) -> Sampler:
    return lookup(SAMPLERS, name, "sampler")


__all__ = [
    "SAMPLERS",
    "ExpandMode",
    "Sampler",
    "SamplerConfig",
    "get_sampler",
    "pick_nodes",
    "register_sampler",
    "sample_chains",
    "sample_eptree",
    "sample_token_matched",
    "sample_tree",
    "sample_trees",
]
