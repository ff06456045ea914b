"""A radix tree of token-id segments holding their KV cache, for prefix reuse in :mod:`hf_engine`.

Every sequence whose keys/values the engine computed can be stored here, keyed by its token ids.
The tree stores each distinct prefix once: the sequences of a rollout tree share their root→node
prefixes, so the store's size is the number of *distinct* tokens, not the sum of the
trajectories' lengths (the same layout as SGLang's RadixAttention, on whole tensors instead of
pages).

A node holds one segment: its token ids and their KV as one tensor of shape
``(layers, 2, kv_heads, segment_len, head_dim)`` (index 0 = keys, 1 = values, positions already
rotary-embedded for positions ``start .. start + segment_len - 1`` of the sequence). Lookups
return the segments' tensors (views, no copy); the engine copies them into its batch cache.

Memory is counted exactly (the bytes of every segment tensor; splits clone both halves so no
evicted half keeps a shared storage alive). :meth:`PrefixCache.evict_to` drops least-recently
used leaves until the store fits a byte budget; the engine calls it at the end of every
``generate`` call, never in the middle of one, so nothing a running call looked up disappears.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence

import torch

__all__ = ["PrefixCache", "common_prefix_len"]

#: Axis of the sequence (token) dimension in a segment tensor ``(L, 2, H, n, D)``.
SEQ_DIM = 3


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences (tuples/lists compare in C)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n - 1  # invariant: a[:lo] == b[:lo], a[:hi + 1] != b[:hi + 1]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class _Node:
    """One segment of the tree. The root has no tokens and no KV."""

    __slots__ = ("children", "kv", "last_use", "parent", "tokens")

    def __init__(self, tokens: tuple[int, ...], kv: torch.Tensor | None, parent: _Node | None) -> None:
        self.tokens = tokens
        self.kv = kv
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.last_use = 0


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class PrefixCache:
    """Token-keyed KV store with longest-prefix lookup, shared-prefix dedup and LRU eviction.

    Args:
        max_bytes: the byte budget :meth:`evict_to` enforces when called without an argument
            (``None`` = unbounded).
    """

    def __init__(self, max_bytes: int | None = None) -> None:
        self.max_bytes = max_bytes
        self._root = _Node((), None, None)
        self._clock = itertools.count(1)
        self.nbytes = 0
        self.n_tokens = 0

    # ------------------------------------------------------------------ queries

    def __len__(self) -> int:
        """Number of cached tokens (distinct prefix positions)."""
        return self.n_tokens

    def _walk(
        self, tokens: Sequence[int], limit: int, touch_partial: bool = True
    ) -> tuple[int, list[tuple[_Node, int]]]:
        """Follow ``tokens[:limit]`` down the tree; returns the matched length and the
        ``(node, tokens used from it)`` path (the last entry may use only part of its node).
        Nodes on the path count as used now (LRU); a partly used last node only if ``touch_partial``."""
        if not isinstance(tokens, tuple):
            tokens = tuple(tokens)
        node, i, path = self._root, 0, []
        tick = next(self._clock)
        while i < limit:
            child = node.children.get(tokens[i])
            if child is None:
                break
            seg = child.tokens
            take = min(len(seg), limit - i)
            piece = tokens[i : i + take]
            c = take if piece == seg[:take] else common_prefix_len(seg[:take], piece)
            if c == len(seg) or touch_partial:
                child.last_use = tick
            path.append((child, c))
            i += c
            if c < len(seg):
                break
            node = child
        return i, path

    def match(self, tokens: Sequence[int], limit: int | None = None) -> int:
        """Length of the longest cached prefix of ``tokens`` (at most ``limit``)."""
        return self._walk(tokens, len(tokens) if limit is None else min(limit, len(tokens)))[0]

    def lookup(self, tokens: Sequence[int], limit: int | None = None) -> tuple[int, list[torch.Tensor]]:
        """The longest cached prefix of ``tokens`` (at most ``limit`` tokens): its length and its
        KV as a list of segment views whose sequence lengths add up to it (no copy is made)."""
        n, path = self._walk(tokens, len(tokens) if limit is None else min(limit, len(tokens)))
        segs = [nd.kv if used == len(nd.tokens) else nd.kv.narrow(SEQ_DIM, 0, used) for nd, used in path]
        return n, segs

    # ------------------------------------------------------------------ updates

    def _split(self, node: _Node, at: int) -> _Node:
        """Split ``node`` after its first ``at`` tokens; returns the new upper node."""
        assert node.kv is not None and node.parent is not None and 0 < at < len(node.tokens)
        upper = _Node(node.tokens[:at], node.kv.narrow(SEQ_DIM, 0, at).clone(), node.parent)
        node.parent.children[node.tokens[0]] = upper
        lower_kv = node.kv.narrow(SEQ_DIM, at, node.kv.shape[SEQ_DIM] - at).clone()
        node.tokens, node.kv, node.parent = node.tokens[at:], lower_kv, upper
        upper.children[node.tokens[0]] = node
        return upper

    def insert(self, tokens: Sequence[int], kv_from: Callable[[int], torch.Tensor]) -> int:
        """Store ``tokens``; only the part not yet cached is added.

        ``kv_from(start)`` must return the KV of ``tokens[start:]`` (shape ``(L, 2, H, len - start, D)``);
        it is called once, and only when ``start < len(tokens)``. Returns the number of new tokens.
        """
        tokens = tuple(tokens)
        n, path = self._walk(tokens, len(tokens), touch_partial=False)
        parent = self._root
        if path:
            last, used = path[-1]
            if used < len(last.tokens):  # the upper part is on this path: used now; the rest keeps its age
                parent = self._split(last, used)
                parent.last_use = next(self._clock)
            else:
                parent = last
        if n == len(tokens):
            return 0
        kv = kv_from(n)
        if kv.shape[SEQ_DIM] != len(tokens) - n:
            raise ValueError(
                f"kv_from({n}) returned {kv.shape[SEQ_DIM]} positions, expected {len(tokens) - n}"
            )
        leaf = _Node(tokens[n:], kv, parent)
        leaf.last_use = next(self._clock)
        parent.children[tokens[n]] = leaf
        self.nbytes += _nbytes(kv)
        self.n_tokens += len(tokens) - n
        return len(tokens) - n

    def evict_to(self, max_bytes: int | None = None) -> int:
        """Drop least-recently-used leaves until at most ``max_bytes`` (default: the cache's
        budget) are held. Returns the number of bytes freed."""
        budget = self.max_bytes if max_bytes is None else max_bytes
        if budget is None or self.nbytes <= budget:
            return 0
        before = self.nbytes
        order = itertools.count()
        heap: list[tuple[int, int, _Node]] = []
        stack = list(self._root.children.values())
        while stack:
            nd = stack.pop()
            if nd.children:
                stack.extend(nd.children.values())
            else:
                heap.append((nd.last_use, next(order), nd))
        heapq.heapify(heap)
        while heap and self.nbytes > budget:
            _, _, nd = heapq.heappop(heap)
            parent = nd.parent
            assert parent is not None
            del parent.children[nd.tokens[0]]
            self.nbytes -= _nbytes(nd.kv)
            self.n_tokens -= len(nd.tokens)
            nd.kv = None
            if parent is not self._root and not parent.children:
                heapq.heappush(heap, (parent.last_use, next(order), parent))
        return before - self.nbytes

    def clear(self) -> None:
        """Drop everything."""
        self._root = _Node((), None, None)
        self.nbytes = 0
        self.n_tokens = 0
