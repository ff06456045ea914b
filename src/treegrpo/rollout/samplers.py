"""The sampler registry: ``chain`` and ``tree`` (:mod:`treegrpo.rollout.trees`), ``eptree``
(:mod:`treegrpo.rollout.eptree`), and any a user registers with :func:`register_sampler`.
The trainer looks samplers up here by name, never by import.
"""

from __future__ import annotations

from collections.abc import Callable

from treegrpo.registry import lookup
from treegrpo.rollout.eptree import sample_eptree
from treegrpo.rollout.sampling import ExpandMode, Sampler, SamplerConfig
from treegrpo.rollout.trees import pick_nodes, sample_chains, sample_trees

SAMPLERS: dict[str, Sampler] = {"chain": sample_chains, "tree": sample_trees, "eptree": sample_eptree}


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
    "sample_trees",
]
