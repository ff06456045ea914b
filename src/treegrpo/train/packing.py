r"""Tree-packed training: every token shared by several root→leaf paths is computed once.

A forest's paths share their prompt (all trees of a forest start from the same prompt) and, inside
a tree, every step above a branching point. Training path by path (``batching.collate``) runs the
model over each shared token once per path through it. Here the paths of a forest are packed into
one row instead — or into a few rows when one long row's attention would cost more than its
sharing saves (a 4D mask makes the model compute attention over all L² pairs of a row, allowed or
not; see :func:`split_rows`, :func:`attention_pair_cost`):

- **tokens** in depth-first order, each shared node once. The row is a trie over node contents:
  a child is merged with an earlier sibling whose token ids are identical (so the identical prompt
  roots of the trees of one forest become one prompt, and identical steps are deduplicated);
- **position_ids**: each token's index along its own root→leaf path;
- a **4D mask** ``(B, 1, Q, K)`` letting each token attend to its ancestors (and itself) only. In
  DFS order a node's descendants are the contiguous range after it, so the mask is two blocks per
  node ``[s, e)`` whose subtree ends at ``E``: the causal triangle ``[s, e) × [s, e)`` and the
  rectangle ``[e, E) × [s, e)`` (every descendant sees the whole node). It is built once, at pack
  time, as an *additive float* mask (0 allowed, ``finfo.min`` not): eager attention adds the mask
  to the scores, so a bool mask is silently wrong there (DESIGN.md §7); sdpa accepts either, and
  a float mask spares it a bool→float conversion in every layer;
- several forests (rows) per micro-batch up to a token cap on the padded size ``B × L``. Pads
  attend only to themselves (no NaN from empty softmax rows) and carry weight 0.

The log-prob of packed token ``u`` is read from the logits at its *predecessor on its path*
(``prev_B_L``: the previous token of the same node, or the last token of the nearest ancestor
node), not at ``u - 1``.

Exact loss (derivation)
-----------------------
A mini-batch holds paths ``p`` with tokens ``t``, policy mask ``m_pt``, advantages ``A_pt``. The
per-path loss (:func:`treegrpo.algos.losses.compute_loss` on the collated mini-batch, which is what
``update`` computes by summing share-weighted micro-batches) is::

    L = Σ_p Σ_t m_pt w_pt [ ℓ(ρ_pt, A_pt) + β k(π_pt, π^ref_pt) − η H_pt ]

with ``ℓ`` the token-wise policy loss (PPO-clip, dual clip), ``ρ = exp(log π − log π_old)``, ``k``
the KL estimator, ``H`` the entropy and the aggregation weight ``w_pt``:

    token-mean                1 / N            N  = Σ_pt m_pt (policy tokens, counted per path)
    seq-mean-token-sum        1 / P'           P' = paths with at least one policy token
    seq-mean-token-mean       1 / (P' · n_p)   n_p = Σ_t m_pt
    seq-mean-token-sum-norm   1 / T            T  = longest path (the collated width)

Let ``φ(p, t) = u`` map a path token to its packed token. The mask and position ids give ``u``
exactly the causal context of ``(p, t)`` on its own path, so ``log π_pt = log π_u``, ``H_pt = H_u``
and likewise for the reference and old policies (old/ref log-probs are computed packed, one per
``u``). Only ``m``, ``w`` and ``A`` depend on the path. Hence::

    L = Σ_u Σ_{(p,t) ∈ φ⁻¹(u)} m_pt w_pt ℓ(ρ_u, A_pt)  +  β Σ_u W_u k_u  −  η Σ_u W_u H_u,
    W_u = Σ_{(p,t) ∈ φ⁻¹(u)} m_pt w_pt.

KL and entropy are functions of ``u`` alone, so they merge into one weight ``W_u``. The policy term
does not: ``ℓ`` clips on the ratio in a way that depends on the sign of ``A`` (a shared token may be
clipped for one path and not for another), so ``ℓ(ρ, ΣA) ≠ Σ ℓ(ρ, A)``. It is exact to group the
paths through ``u`` by *distinct advantage value* ``a``::

    Σ_{φ⁻¹(u)} m w ℓ(ρ_u, A) = Σ_a W_ua ℓ(ρ_u, a),      W_ua = Σ_{φ⁻¹(u), A_pt = a} m_pt w_pt.

Each ``(u, a, W_ua)`` is one *term*; the packed loss is ``Σ_terms W ℓ(ρ_u, a) + β Σ_u W_u k_u −
η Σ_u W_u H_u``. Gradients are equal too, not only values: θ enters only through ``log π_u`` and
``∂ log π_pt/∂θ = ∂ log π_u/∂θ``, so the chain rule sums the same per-path contributions. The number
of terms of a token is the number of distinct advantages among the paths through it: 1 for
``treerl`` (advantages are per node), at most the number of distinct leaf advantages of its tree
for ``tree_grpo``/``grpo``. (For PPO-clip, ``ℓ(ρ, a) = |a| ℓ(ρ, sign a)``, so two terms per token
would do; grouping by value needs only that ``ℓ`` is token-wise, see
:data:`PACKABLE_POLICY_LOSSES`.) The weights are normalised over the whole mini-batch, so the
packed losses of its micro-batches simply add up to the mini-batch loss.

Metrics returned by :func:`packed_loss` are additive over the micro-batches of one mini-batch
(``actor/ratio_max``: take the max): ``loss/*`` are the micro-batch's share of the mini-batch loss;
``actor/*`` are path-token means (each packed token counted once per path through it, as the
per-path masked means count it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from treegrpo.algos.kl import kl_penalty
from treegrpo.algos.losses import AGG_MODES, LossConfig, get_policy_loss
from treegrpo.train.batching import micro_batches
from treegrpo.tree import Forest

PACKABLE_POLICY_LOSSES = frozenset({"ppo_clip"})
"""Policy losses that are token-wise (the loss of a token depends on that token's ratio and
advantage only), the condition for the exact packed loss. A sequence-level loss (GSPO-style) is
not packable: train it per path."""


@dataclass
class _Row:
    """One packed row: the selected paths of one forest, as a trie over node contents."""

    tokens: list[int]
    positions: list[int]
    prev: list[int]
    spans: list[tuple[int, int, int]]  # per trie node: token start, end, subtree end
    path_ids: list[int]
    path_index: list[torch.Tensor]  # per path: [T_p] packed index of each path token
    path_mask: list[list[int]]
    path_adv: list[list[float]]

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass
class PackedBatch:
    """One packed micro-batch: B rows (one forest each, or the selected paths of one), L = longest.

    Tensors (``B`` rows, ``L`` tokens, ``J`` loss terms, ``P`` paths, ``T`` longest path):

    - ``input_ids_B_L``: token ids in DFS order, ``pad_id`` after a row's end.
    - ``position_ids_B_L``: index of each token along its own root→leaf path (0 on pads).
    - ``mask_B_1_L_L``: float32 additive mask, 0 where query ``q`` may attend to key ``k`` (its
      ancestors and itself; a pad only itself), ``finfo(float32).min`` elsewhere;
      :meth:`attention_mask` casts it to the model's dtype, :attr:`allowed_B_1_L_L` is it as bool.
    - ``prev_B_L``: index (in the row) of the previous token on the token's path, -1 for the first
      token of a path and for pads; the token's log-prob is read from the logits there.
    - ``valid_B_L``: bool, True on real tokens.
    - ``weight_B_L``: ``W_u``, the summed aggregation weight of the paths through the token that
      have it in their policy mask (weight of the KL and entropy terms).
    - ``count_B_L``: number of paths through the token that have it in their policy mask.
    - ``term_row_J``, ``term_col_J``: the packed token of each policy-loss term.
    - ``term_adv_J``, ``term_weight_J``, ``term_count_J``: its advantage value, summed weight and
      number of paths.
    - ``path_ids``: global index (order of ``forest_sequences``) of each path in the batch;
      ``path_row_P``, ``path_index_P_T`` (-1 past the path's end), ``path_len_P`` locate their
      tokens; :meth:`unpack` maps per-packed-token values back to per-path rows.

    Scalars: ``n_path_tokens`` (tokens the per-path layout computes, unpadded),
    ``n_packed_tokens`` (real packed tokens), ``count_total`` (policy path-tokens of the whole
    mini-batch, the denominator of the ``actor/*`` means).
    """

    input_ids_B_L: torch.Tensor
    position_ids_B_L: torch.Tensor
    mask_B_1_L_L: torch.Tensor
    prev_B_L: torch.Tensor
    valid_B_L: torch.Tensor
    weight_B_L: torch.Tensor
    count_B_L: torch.Tensor
    term_row_J: torch.Tensor
    term_col_J: torch.Tensor
    term_adv_J: torch.Tensor
    term_weight_J: torch.Tensor
    term_count_J: torch.Tensor
    path_row_P: torch.Tensor
    path_index_P_T: torch.Tensor
    path_len_P: torch.Tensor
    path_ids: list[int]
    n_path_tokens: int
    n_packed_tokens: int
    count_total: float

    @property
    def shape(self) -> tuple[int, int]:
        """``(B, L)``."""
        return tuple(self.input_ids_B_L.shape)  # type: ignore[return-value]

    @property
    def allowed_B_1_L_L(self) -> torch.Tensor:
        """Bool ``[B, 1, L, L]``: True where query ``q`` may attend to key ``k``."""
        return self.mask_B_1_L_L == 0

    def attention_mask(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The additive 4D mask ``[B, 1, L, L]`` in ``dtype``: 0 where allowed, ``finfo.min`` elsewhere
        (cast once per dtype, then cached).

        Additive float works for both ``eager`` and ``sdpa`` attention (a bool mask would be
        added as 0/1 by eager attention: silently wrong)."""
        if dtype == self.mask_B_1_L_L.dtype:
            return self.mask_B_1_L_L
        cache = self.__dict__.setdefault("_mask_cache", {})
        if dtype not in cache:
            neg = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=self.mask_B_1_L_L.device)
            cache[dtype] = torch.where(self.allowed_B_1_L_L, torch.zeros_like(neg), neg)
        return cache[dtype]

    def to(self, device: str | torch.device) -> PackedBatch:
        return dataclasses.replace(
            self,
            **{
                f.name: getattr(self, f.name).to(device)
                for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)
            },
        )

    def unpack(self, values_B_L: torch.Tensor) -> torch.Tensor:
        """Per-packed-token values ``[B, L]`` → per-path rows ``[P, T]`` (0 past each path's end),
        aligned with ``batching.collate`` of the same paths (in ``path_ids`` order)."""
        idx = self.path_index_P_T.clamp(min=0)
        out = values_B_L[self.path_row_P[:, None].expand_as(idx), idx]
        return torch.where(self.path_index_P_T >= 0, out, torch.zeros_like(out))


# -- packing ------------------------------------------------------------------------------------


def _path_segments(forest: Forest) -> list[list[list[int]]]:
    """Per path of ``forest.paths()`` order: the token ids of each node on it, root first."""
    out = []
    for ti, leaf in forest.leaves():
        out.append([n.tokens for n in forest.trees[ti].path(leaf.id)])
    return out


@dataclass
class _Trie:
    """Paths merged into a trie of node contents: trie node 0 is an empty virtual root; a child is
    keyed by its token ids, so identical siblings (e.g. the prompt roots of the trees of a
    forest) become one node. ``order`` is the DFS pre-order, children in insertion order."""

    seg: list[tuple[int, ...]]
    parent: list[int]
    order: list[int]
    path_nodes: list[list[int]]  # per path: its trie nodes, root first


def _trie(segments: Sequence[Sequence[Sequence[int]]]) -> _Trie:
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
    return _Trie(seg, parent, order, path_nodes)


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
    t = _trie(segments)
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


def _build_row(
    path_ids: Sequence[int],
    segments: Sequence[list[list[int]]],
    masks: Sequence[list[int]],
    advs: Sequence[list[float]],
) -> _Row:
    """Pack paths (given as node token lists) into one DFS-ordered row over a trie of node contents."""
    t = _trie(segments)
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
    return _Row(tokens, positions, prev, spans, list(path_ids), path_index, list(masks), list(advs))


def _concat_rows(rows: Sequence[_Row]) -> _Row:
    """Several packed rows side by side in one sequence; their masks stay block-diagonal (each
    part's spans are its own), positions restart in each part."""
    if len(rows) == 1:
        return rows[0]
    out = _Row([], [], [], [], [], [], [], [])
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
    return out


def _fill_rows(rows: Sequence[_Row]) -> list[_Row]:
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


def _path_weights(n_policy: Sequence[int], lengths: Sequence[int], agg_mode: str) -> list[float]:
    """Aggregation weight ``w_p`` of a policy token of each path (see the module docstring)."""
    if agg_mode not in AGG_MODES:
        raise ValueError(f"unknown agg_mode {agg_mode!r}; known: {', '.join(AGG_MODES)}")
    if agg_mode == "token-mean":
        return [1.0 / max(sum(n_policy), 1)] * len(n_policy)
    if agg_mode == "seq-mean-token-sum-norm":
        return [1.0 / max(max(lengths, default=1), 1)] * len(n_policy)
    n_valid = max(sum(1 for n in n_policy if n > 0), 1)
    if agg_mode == "seq-mean-token-sum":
        return [1.0 / n_valid if n > 0 else 0.0 for n in n_policy]
    return [1.0 / (n_valid * n) if n > 0 else 0.0 for n in n_policy]  # seq-mean-token-mean


def _collate_rows(
    rows: Sequence[_Row], weights: dict[int, float], pad_id: int, count_total: float
) -> PackedBatch:
    B, L = len(rows), max(len(r) for r in rows)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    pos = torch.zeros((B, L), dtype=torch.long)
    prev = torch.full((B, L), -1, dtype=torch.long)
    valid = torch.zeros((B, L), dtype=torch.bool)
    neg = torch.finfo(torch.float32).min
    mask = torch.full((B, 1, L, L), neg, dtype=torch.float32)
    longest = max((e - s for r in rows for s, e, _ in r.spans), default=0)
    tri = torch.full((longest, longest), neg, dtype=torch.float32).triu(1)  # 0 on and below the diagonal
    weight = torch.zeros((B, L), dtype=torch.float64)
    count = torch.zeros((B, L), dtype=torch.float64)
    t_row, t_col, t_adv, t_w, t_n = [], [], [], [], []
    p_row, p_idx, p_len, p_ids = [], [], [], []
    n_path_tokens = 0
    for b, r in enumerate(rows):
        n = len(r)
        ids[b, :n] = torch.tensor(r.tokens, dtype=torch.long)
        pos[b, :n] = torch.tensor(r.positions, dtype=torch.long)
        prev[b, :n] = torch.tensor(r.prev, dtype=torch.long)
        valid[b, :n] = True
        m = mask[b, 0]
        for s, e, sub in r.spans:
            m[s:e, s:e] = tri[: e - s, : e - s]  # causal inside the node
            m[e:sub, s:e] = 0.0  # every descendant sees the whole node
        m.diagonal()[n:] = 0.0  # pads see themselves only
        if r.path_ids:
            idx = torch.cat(r.path_index)
            m = torch.tensor([x for pm in r.path_mask for x in pm], dtype=torch.bool)
            adv = torch.tensor([x for pa in r.path_adv for x in pa], dtype=torch.float64)
            w = torch.cat(
                [
                    torch.full((len(pi),), weights[g], dtype=torch.float64)
                    for g, pi in zip(r.path_ids, r.path_index, strict=True)
                ]
            )
            idx, adv, w = idx[m], adv[m], w[m]
            weight[b].index_add_(0, idx, w)
            count[b].index_add_(0, idx, torch.ones_like(w))
            # one term per (packed token, distinct advantage value)
            keys, inv = torch.unique(
                torch.stack([idx.to(torch.float64), adv], dim=1), dim=0, return_inverse=True
            )
            t_row.append(torch.full((keys.shape[0],), b, dtype=torch.long))
            t_col.append(keys[:, 0].long())
            t_adv.append(keys[:, 1])
            t_w.append(torch.zeros(keys.shape[0], dtype=torch.float64).index_add_(0, inv, w))
            t_n.append(torch.zeros(keys.shape[0], dtype=torch.float64).index_add_(0, inv, torch.ones_like(w)))
        for g, pi in zip(r.path_ids, r.path_index, strict=True):
            p_row.append(b)
            p_idx.append(pi)
            p_len.append(len(pi))
            p_ids.append(g)
            n_path_tokens += len(pi)
    T = max(p_len, default=0)
    path_index = torch.full((len(p_idx), T), -1, dtype=torch.long)
    for i, pi in enumerate(p_idx):
        path_index[i, : len(pi)] = pi

    def cat(xs: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return torch.cat(xs).to(dtype) if xs else torch.zeros(0, dtype=dtype)

    return PackedBatch(
        input_ids_B_L=ids,
        position_ids_B_L=pos,
        mask_B_1_L_L=mask,
        prev_B_L=prev,
        valid_B_L=valid,
        weight_B_L=weight.float(),
        count_B_L=count.float(),
        term_row_J=cat(t_row, torch.long),
        term_col_J=cat(t_col, torch.long),
        term_adv_J=cat(t_adv, torch.float32),
        term_weight_J=cat(t_w, torch.float32),
        term_count_J=cat(t_n, torch.float32),
        path_row_P=torch.tensor(p_row, dtype=torch.long),
        path_index_P_T=path_index,
        path_len_P=torch.tensor(p_len, dtype=torch.long),
        path_ids=p_ids,
        n_path_tokens=n_path_tokens,
        n_packed_tokens=sum(len(r) for r in rows),
        count_total=count_total,
    )


def pack_forests(
    forests: Sequence[Forest],
    advantages: Sequence[Sequence[Sequence[float]]] | None = None,
    *,
    agg_mode: str = "token-mean",
    max_tokens: int = 8192,
    pad_id: int = 0,
    select: Sequence[Sequence[int]] | None = None,
    pair_cost: float = 0.0,
) -> list[PackedBatch]:
    """Pack forests into micro-batches, one row per forest, each shared token once.

    With ``pair_cost > 0`` a forest may be split into several rows (:func:`split_rows`) when one
    row's dense attention would cost more than the sharing saves; :func:`attention_pair_cost`
    estimates it for a model. Exactness does not depend on how paths are grouped into rows.

    The loss weights are normalised over *all* selected paths (one mini-batch), so summing
    :func:`packed_loss` over the returned micro-batches gives the per-path mini-batch loss.

    Args:
        forests: the forests (one per prompt).
        advantages: per forest, per path (``forest.paths()`` order), per token — the output of
            :func:`treegrpo.algos.advantages.token_advantages`. ``None``: all zero (log-probs only).
        agg_mode: loss aggregation the weights implement (see :data:`~treegrpo.algos.losses.AGG_MODES`).
        max_tokens: cap on a micro-batch's padded size ``B × L`` (a longer row goes alone).
        pad_id: id written on padding.
        select: per forest, the indices (into ``forest.paths()``) of the paths to include;
            ``None``: all. Paths are identified in the batches by their global index in the
            flattened order of ``forest_sequences`` (forest by forest, path by path).
        pair_cost: cost of one attention (query, key) pair relative to one token's other work;
            0 (default): one row per forest, the most sharing.

    Returns:
        the micro-batches, rows grouped by similar length.
    """
    if advantages is not None and len(advantages) != len(forests):
        raise ValueError(f"{len(advantages)} advantage lists for {len(forests)} forests")
    if select is not None and len(select) != len(forests):
        raise ValueError(f"{len(select)} path selections for {len(forests)} forests")
    units: list[tuple[list[int], list[list[list[int]]], list[list[int]], list[list[float]]]] = []
    offset = 0
    for fi, forest in enumerate(forests):
        paths = forest.paths()
        segs = _path_segments(forest)
        chosen = range(len(paths)) if select is None else select[fi]
        ids, sg, ms, av = [], [], [], []
        for j in chosen:
            ps = paths[j]
            a = [0.0] * len(ps.tokens_T) if advantages is None else list(advantages[fi][j])
            if len(a) != len(ps.tokens_T):
                raise ValueError(
                    f"forest {forest.prompt_id} path {j}: {len(a)} advantages for {len(ps.tokens_T)} tokens"
                )
            ids.append(offset + j)
            sg.append(segs[j])
            ms.append(list(ps.policy_mask_T))
            av.append(a)
        for row in split_rows(sg, pair_cost):
            units.append(
                ([ids[i] for i in row], [sg[i] for i in row], [ms[i] for i in row], [av[i] for i in row])
            )
        offset += len(paths)
    if not units:
        return []
    all_ids = [g for u in units for g in u[0]]
    n_policy = [sum(m) for u in units for m in u[2]]
    lengths = [len(m) for u in units for m in u[2]]
    weights = dict(zip(all_ids, _path_weights(n_policy, lengths, agg_mode), strict=True))
    rows = _fill_rows([_build_row(*u) for u in units])
    count_total = float(sum(n_policy))
    return [
        _collate_rows([rows[i] for i in mb], weights, pad_id, count_total)
        for mb in micro_batches([len(r) for r in rows], max_tokens)
    ]


def attention_pair_cost(model: torch.nn.Module) -> float:
    """FLOP estimate of one attention (query, key) pair relative to one token's other work, for
    :func:`pack_forests`'s ``pair_cost``: ``layers · (4·heads·head_dim + 5·heads)`` (QK, PV, softmax)
    over ``2·(non-embedding parameters) + 2·hidden·vocab + 5·vocab`` (weights, LM head, log-softmax).
    About 1.6e-3 for the 4-layer tiny agent (rows beyond ~1k tokens get split), ~3e-5 for a 7B model."""
    cfg = getattr(model, "config", None)
    try:
        layers = int(cfg.num_hidden_layers)  # type: ignore[union-attr]
        hidden = int(cfg.hidden_size)  # type: ignore[union-attr]
        heads = int(cfg.num_attention_heads)  # type: ignore[union-attr]
        head_dim = int(getattr(cfg, "head_dim", None) or hidden // heads)
        vocab = int(cfg.vocab_size)  # type: ignore[union-attr]
    except (AttributeError, TypeError, ValueError):
        return 0.0
    emb = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    dense = sum(p.numel() for p in model.parameters() if id(p) not in emb and p.dim() > 1)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_counted = head is not None and id(head.weight) not in emb  # an untied LM head is dense
    per_token = 2 * dense + (0 if head_counted else 2 * hidden * vocab) + 5 * vocab
    return layers * (4 * heads * head_dim + 5 * heads) / max(per_token, 1)


# -- the model over packed rows -----------------------------------------------------------------


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype of the model's first floating-point parameter (float32 if none)."""
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def packed_logprobs(
    model: torch.nn.Module, batch: PackedBatch, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each packed token given its ancestors, from one forward over the packed rows.

    Args:
        model: a causal LM accepting ``attention_mask`` as a 4D additive mask and ``position_ids``.
        batch: a packed micro-batch (on the model's device).
        with_entropy: also return the full-distribution entropy of the prediction of each token.

    Returns:
        ``(logprobs_B_L, entropy_B_L | None)``: 0 on the first token of each path and on pads, as
        ``batching.token_logprobs`` is 0 at t = 0. ``batch.unpack`` maps them to per-path rows.
    """
    out = model(
        input_ids=batch.input_ids_B_L,
        attention_mask=batch.attention_mask(model_dtype(model)),
        position_ids=batch.position_ids_B_L,
        use_cache=False,
    )
    logp_all = torch.log_softmax(out.logits.float(), dim=-1)  # [B, L, V]
    has_prev = batch.prev_B_L >= 0
    prev = batch.prev_B_L.clamp(min=0)
    rows = torch.arange(prev.shape[0], device=prev.device)[:, None].expand_as(prev)
    lp = logp_all[rows, prev, batch.input_ids_B_L]
    lp = torch.where(has_prev, lp, torch.zeros_like(lp))
    ent = None
    if with_entropy:
        e_all = -(logp_all.exp() * logp_all).sum(-1)  # [B, L]
        ent = e_all[rows, prev]
        ent = torch.where(has_prev, ent, torch.zeros_like(ent))
    return lp, ent


@torch.no_grad()
def path_logprobs_packed(
    model: torch.nn.Module,
    forests: Sequence[Forest],
    *,
    pad_id: int = 0,
    max_tokens: int = 8192,
    device: str | torch.device = "cpu",
) -> dict[int, torch.Tensor]:
    """Per-path log-probs (``{global path index: logprobs_T}``, as the per-path trainer's
    precomputed old/reference log-probs) computed packed, each shared token once. Eval mode."""
    was_training = model.training
    model.eval()
    out: dict[int, torch.Tensor] = {}
    try:
        for mb in pack_forests(forests, max_tokens=max_tokens, pad_id=pad_id):
            mb = mb.to(device)
            per_path = mb.unpack(packed_logprobs(model, mb)[0])
            for row, (g, n) in enumerate(zip(mb.path_ids, mb.path_len_P.tolist(), strict=True)):
                out[g] = per_path[row, :n]
    finally:
        model.train(was_training)
    return out


# -- the exact loss -----------------------------------------------------------------------------


def packed_loss(
    logprobs_B_L: torch.Tensor,
    batch: PackedBatch,
    old_logprobs_B_L: torch.Tensor | None = None,
    ref_logprobs_B_L: torch.Tensor | None = None,
    entropy_B_L: torch.Tensor | None = None,
    cfg: LossConfig | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """This micro-batch's share of the mini-batch loss ``policy + kl_coef·kl − entropy_coef·entropy``.

    Summed over the micro-batches of one :func:`pack_forests` call it equals — value and gradient —
    :func:`~treegrpo.algos.losses.compute_loss` on the collated paths (derivation: module
    docstring). The batch's weights already encode ``cfg.agg_mode``: pack with the same mode.

    Args:
        logprobs_B_L: [B, L] from :func:`packed_logprobs` (with gradient).
        batch: the packed micro-batch.
        old_logprobs_B_L: [B, L] sampling-policy log-probs per packed token; ``None`` = on-policy.
        ref_logprobs_B_L: [B, L] reference log-probs per packed token, or ``None`` (no KL term).
        entropy_B_L: [B, L] entropy per packed token, or ``None`` (no entropy term).
        cfg: loss options (``policy_loss`` must be in :data:`PACKABLE_POLICY_LOSSES`).

    Returns:
        ``(loss, metrics)``; metrics add up over the micro-batches (``actor/ratio_max``: max).
    """
    cfg = cfg if cfg is not None else LossConfig()
    if cfg.policy_loss not in PACKABLE_POLICY_LOSSES:
        raise ValueError(f"policy loss {cfg.policy_loss!r} is not token-wise; packing cannot be exact")
    if old_logprobs_B_L is None:
        old_logprobs_B_L = logprobs_B_L.detach()
    policy_fn = get_policy_loss(cfg.policy_loss)
    r, c = batch.term_row_J, batch.term_col_J
    lp_1_J = logprobs_B_L[r, c][None]
    old_1_J = old_logprobs_B_L.detach()[r, c][None]
    adv_1_J = batch.term_adv_J[None].to(lp_1_J.dtype)
    # One row, float mask = weights, "seq-mean-token-sum": exactly Σ_j W_j ℓ(ρ_j, a_j).
    sum_cfg = dataclasses.replace(cfg, agg_mode="seq-mean-token-sum")
    policy, _ = policy_fn(lp_1_J, old_1_J, adv_1_J, batch.term_weight_J[None].to(lp_1_J.dtype), sum_cfg)
    total = policy
    frac = float(batch.term_count_J.sum()) / max(batch.count_total, 1.0)
    with torch.no_grad():  # path-token means of this micro-batch, scaled to add up
        mean_cfg = dataclasses.replace(cfg, agg_mode="token-mean")
        _, m = policy_fn(
            lp_1_J.detach(), old_1_J, adv_1_J, batch.term_count_J[None].to(lp_1_J.dtype), mean_cfg
        )
    metrics = {k: (v if k == "actor/ratio_max" else v * frac) for k, v in m.items()}
    metrics["loss/policy"] = policy.item()
    on = batch.weight_B_L > 0
    w = batch.weight_B_L.to(logprobs_B_L.dtype)
    if ref_logprobs_B_L is not None:
        zero = torch.zeros_like(logprobs_B_L)
        kl_B_L = kl_penalty(
            torch.where(on, logprobs_B_L, zero), torch.where(on, ref_logprobs_B_L.detach(), zero), cfg.kl_kind
        )
        kl = (torch.where(on, kl_B_L, zero) * w).sum()
        total = total + cfg.kl_coef * kl
        metrics["loss/kl"] = kl.item()
    if entropy_B_L is not None:
        ent = (torch.where(on, entropy_B_L, torch.zeros_like(entropy_B_L)) * w).sum()
        total = total - cfg.entropy_coef * ent
        metrics["loss/entropy"] = ent.item()
    metrics["loss/total"] = total.item()
    return total, metrics
