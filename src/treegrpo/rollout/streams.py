"""Per-trajectory sampling streams: a forest that does not depend on tool timing or on which other
trajectories share an engine call (DESIGN.md §3.9; ``AgentConfig.trajectory_streams``).

With the default batch stream, one ``torch.Generator`` is drawn from by every request of every
engine call in turn, so what a trajectory samples depends on which requests came before it in its
call — under the pipelined loop (:mod:`treegrpo.rollout.pipeline`) that is a matter of tool
timing. Here every request instead carries its own seed, a hash of:

* the rollout's *base* seed (one draw from the run's generator per :meth:`StepRunner.run_turns`
  call, so a run stays seeded by ``seed``),
* the trajectory's *place*: its forest's index in the call, its tree's index in the forest and its
  *lineage* in the tree (0: the initial chain; k: the k-th trajectory the sampler started in that
  tree, counted in the sampler's deterministic pick order),
* and its turn.

A sampler's own choices (tree picks) draw from a ``random.Random`` per forest, tree and round
(:func:`pick_rng`), and a tree's nodes are kept in the order of their place ``(lineage, turn)``
(:func:`insert_in_order`; ids made dense in that order at the end, :func:`renumber`), so picks and
node ids do not depend on the order in which trajectories finished either.
"""

from __future__ import annotations

import bisect
import hashlib
import random
import struct
from collections.abc import Sequence

import torch

from treegrpo.tree import Node, Tree

__all__ = ["LINEAGE", "base_seed", "insert_in_order", "node_place", "pick_rng", "renumber", "stream_seed"]

LINEAGE = "lineage"
"""``node.extra`` key of the lineage of the trajectory that generated the node (streams on only)."""

_MASK = (1 << 63) - 1


def stream_seed(base: int, *place: int) -> int:
    """A 63-bit seed for ``place`` (a tuple of ints) under ``base``: the first 8 bytes of
    BLAKE2b over the signed 64-bit big-endian encodings of ``base`` and each int, top bit cleared.
    Distinct places give independent-looking seeds; the same place always the same seed."""
    data = struct.pack(f">{1 + len(place)}q", int(base) & _MASK, *(int(p) for p in place))
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big") & _MASK


def base_seed(generator: torch.Generator | None) -> int:
    """One 62-bit draw from ``generator`` (the global torch RNG when ``None``): a rollout's base."""
    return int(torch.randint(0, 1 << 62, (1,), generator=generator).item())


def pick_rng(base: int, *place: int) -> random.Random:
    """The sampler's ``random.Random`` for ``place`` (e.g. forest, tree, round)."""
    return random.Random(stream_seed(base, *place))


def node_place(node: Node) -> tuple[int, int]:
    """``(lineage, turn)`` of a node (the root, which has neither: ``(-1, 0)``)."""
    if node.parent is None:
        return (-1, 0)
    return (int(node.extra.get(LINEAGE, 0)), int(node.extra.get("turn", 0)))


def insert_in_order(tree: Tree, node: Node) -> Node:
    """Add ``node`` to ``tree`` at its place in ``(lineage, turn)`` order (after equal places)."""
    keys = [node_place(n) for n in tree.nodes]
    tree.nodes.insert(bisect.bisect_right(keys, node_place(node)), node)
    tree.invalidate()
    return node


def renumber(trees: Sequence[Tree]) -> None:
    """Make each tree's node ids its nodes' positions (0, 1, …), parents mapped alike: ids then
    follow the place order of :func:`insert_in_order`, not the order nodes were made."""
    for tree in trees:
        new = {n.id: i for i, n in enumerate(tree.nodes)}
        for n in tree.nodes:
            n.id = new[n.id]
            n.parent = None if n.parent is None else new[n.parent]
        tree.invalidate()
