r"""Packed rows as tries over node contents: the host-side (plain Python) half of the packed layout.

The paths of a forest share their prompt and every step above a branching point. A :class:`Row`
holds some paths of one forest with each shared node's tokens once:

- the row is a **trie over node contents**: a child is merged with an earlier sibling whose token
  ids are identical, so the identical prompt roots of the trees of one forest become one prompt
  and identical steps are deduplicated (:func:`build_trie`);
- its tokens are in **depth-first order**, so a node's descendants are the contiguous range after
  it: the node's ``span`` ``(s, e, E)`` — its tokens ``[s, e)`` and the end ``E`` of its subtree —
  is all the attention mask needs (:mod:`treegrpo.training.packing.layout` builds it);
- each token has its **position** along its own root→leaf path and its **predecessor** on that
  path (``prev``: the previous token of the same node, or the last token of the nearest ancestor
  node, -1 for a path's first token), where its log-prob is read.

Rows may be split (:func:`split_rows`, by a cost model of dense attention over a row) and short
rows concatenated into one sequence (:func:`fill_rows`); exactness does not depend on either.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from treegrpo.tree import Forest


@dataclass
class Row:
    """One packed row: the selected paths of one forest (or of several, after
    :func:`fill_rows`), as a trie over node contents. ``path_index[i]`` maps path ``i``'s tokens
    to their packed positions; ``path_mask`` / ``path_adv`` / ``path_logp`` are its policy
    mask, per-token advantages and the engine's sampling log-probs, in path order."""

    tokens: list[int]
    positions: list[int]
    prev: list[int]
    spans: list[tuple[int, int, int]]  # per trie node: token start, end, subtree end
    path_ids: list[int]
    path_index: list[torch.Tensor]  # per path: [T_p] packed index of each path token
    path_mask: list[list[int]]
    path_adv: list[list[float]]
    path_logp: list[list[float]]

    def __len__(self) -> int:
        return len(self.tokens)


def path_segments(forest: Forest) -> list[list[list[int]]]:
    """Per path of ``forest.paths()`` order: the token ids of each node on it, root first."""
    out = []
    for ti, leaf in forest.leaves():
        out.append([n.tokens for n in forest.trees[ti].path(leaf.id)])
    return out


@dataclass
class Trie:
    """Paths merged into a trie of node contents: trie node 0 is an empty virtual root; a child is
    keyed by its token ids, so identical siblings (e.g. the prompt roots of the trees of a
    forest) become one node. ``order`` is the DFS pre-order, children in insertion order."""

    seg: list[tuple[int, ...]]
    parent: list[int]
    order: list[int]
    path_nodes: list[list[int]]  # per path: its trie nodes, root first


def build_trie(segments: Sequence[Sequence[Sequence[int]]]) -> Trie:
    """The trie of ``segments`` (per path: the token ids of each node on it, root first)."""
    children: list[dict[tuple[int, ...], int]] = [{}]
    seg: list[tuple[int, ...]] = [()]
    path_nodes: list[list[int]] = []
    for segs in segments:
        cur, nodes = 0, []
        for s in segs:
            key = tuple(s)
            nxt = children[cur].get(key)
            if nxt is None:
                nxt = len(seg)
                children[cur][key] = nxt
                children.append({})
                seg.append(key)
            cur = nxt
            nodes.append(cur)
        path_nodes.append(nodes)
    parent = [-1] * len(seg)
    order: list[int] = []
    stack = [0]
    while stack:
        n = stack.pop()
        order.append(n)
        kids = list(children[n].values())
        for c in kids:
            parent[c] = n
        stack.extend(reversed(kids))
    return Trie(seg, parent, order, path_nodes)


def split_rows(segments: Sequence[Sequence[Sequence[int]]], pair_cost: float) -> list[list[int]]:
    """Group the paths of one forest into rows (indices into ``segments``) by a cost model.

    A row of ``L`` tokens costs ``L + pair_cost · L²``: per-token work plus dense attention over
    every (query, key) pair, which a 4D mask makes the model compute whether allowed or not. Paths
    are visited in DFS order of their leaves (neighbours share the most); a path joins the current
    row when that adds less cost — ``ΔL + pair_cost · ((L + ΔL)² − L²)``, ``ΔL`` its tokens not yet
    in the row — than opening a new row for it, ``T + pair_cost · T²``. ``pair_cost = 0``: one row.
    """
    n = len(segments)
    if pair_cost <= 0 or n <= 1:
        return [list(range(n))] if n else []
    t = build_trie(segments)
    rank = {node: i for i, node in enumerate(t.order)}
    lens = [len(x) for x in t.seg]
    rows: list[list[int]] = []
    cur: list[int] = []
    have: set[int] = set()
    L = 0
    for p in sorted(range(n), key=lambda i: rank[t.path_nodes[i][-1]] if t.path_nodes[i] else -1):
        nodes = t.path_nodes[p]
        new = sum(lens[x] for x in nodes if x not in have)
        full = sum(lens[x] for x in nodes)
        if cur and new + pair_cost * ((L + new) ** 2 - L**2) > full + pair_cost * full**2:
            rows.append(cur)
            cur, have, L, new = [], set(), 0, full
        cur.append(p)
        have.update(nodes)
        L += new
    rows.append(cur)
    return rows


def build_row(
    path_ids: Sequence[int],
    segments: Sequence[list[list[int]]],
    masks: Sequence[list[int]],
    advs: Sequence[list[float]],
    logps: Sequence[list[float]],
) -> Row:
    """Pack paths (given as node token lists) into one DFS-ordered row over a trie of node contents."""
    t = build_trie(segments)
    seg, parent, order, path_nodes = t.seg, t.parent, t.order, t.path_nodes
    # Token offsets, positions and predecessors, in DFS pre-order.
    n_nodes = len(seg)
    start = [0] * n_nodes
    pos0 = [0] * n_nodes
    last = [-1] * n_nodes  # last token of the node or, if it has none, of its nearest ancestor
    tokens: list[int] = []
    positions: list[int] = []
    prev: list[int] = []
    for n in order:
        p = parent[n]
        start[n] = len(tokens)
        pos0[n] = 0 if p < 0 else pos0[p] + len(seg[p])
        k = len(seg[n])
        tokens.extend(seg[n])
        positions.extend(range(pos0[n], pos0[n] + k))
        before = -1 if p < 0 else last[p]
        prev.extend([before, *range(start[n], start[n] + k - 1)][:k])
        last[n] = start[n] + k - 1 if k else before
    # end of each node's subtree (tokens), accumulated bottom-up
    sub_end = [start[n] + len(seg[n]) for n in range(n_nodes)]
    for n in reversed(order):
        p = parent[n]
        if p >= 0:
            sub_end[p] = max(sub_end[p], sub_end[n])
    spans = [(start[n], start[n] + len(seg[n]), sub_end[n]) for n in order if seg[n]]
    path_index = [
        torch.cat([torch.arange(start[n], start[n] + len(seg[n])) for n in nodes])
        if nodes
        else torch.zeros(0, dtype=torch.long)
        for nodes in path_nodes
    ]
    return Row(
        tokens, positions, prev, spans, list(path_ids), path_index, list(masks), list(advs), list(logps)
    )


def _concat_rows(rows: Sequence[Row]) -> Row:
    """Several packed rows side by side in one sequence; their masks stay block-diagonal (each
    part's spans are its own), positions restart in each part."""
    if len(rows) == 1:
        return rows[0]
    out = Row([], [], [], [], [], [], [], [], [])
    for r in rows:
        off = len(out.tokens)
        out.tokens.extend(r.tokens)
        out.positions.extend(r.positions)
        out.prev.extend(p + off if p >= 0 else -1 for p in r.prev)
        out.spans.extend((s + off, e + off, sub + off) for s, e, sub in r.spans)
        out.path_ids.extend(r.path_ids)
        out.path_index.extend(pi + off for pi in r.path_index)
        out.path_mask.extend(r.path_mask)
        out.path_adv.extend(r.path_adv)
        out.path_logp.extend(r.path_logp)
    return out


def fill_rows(rows: Sequence[Row]) -> list[Row]:
    """First-fit decreasing of rows into sequences as long as the longest row, so short rows
    (small forests, split parts) share a sequence instead of being padded to the longest one:
    padding costs a row's full per-token work and its dense attention alike."""
    if not rows:
        return []
    cap = max(len(r) for r in rows)
    bins: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(rows)), key=lambda i: -len(rows[i])):
        for b, room in enumerate(free):
            if len(rows[i]) <= room:
                bins[b].append(i)
                free[b] -= len(rows[i])
                break
        else:
            bins.append([i])
            free.append(cap - len(rows[i]))
    return [_concat_rows([rows[i] for i in sorted(b)]) for b in bins]
