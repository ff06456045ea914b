r"""The packed layout: forests → token-capped micro-batches of packed rows (:class:`PackedBatch`).

Each forest (or the part of it a mini-batch selects) becomes one row — or a few rows when one long
row's attention would cost more than its sharing saves (:func:`~treegrpo.training.packing.rows.split_rows`)
— holding every shared token once (:mod:`treegrpo.training.packing.rows`). A micro-batch is ``B`` such
rows padded to the longest, ``L`` tokens, with:

- **tokens** in depth-first order, each shared node once;
- **position_ids**: each token's index along its own root→leaf path;
- a **4D mask** ``(B, 1, Q, K)`` letting each token attend to its ancestors (and itself) only. In
  DFS order a node's descendants are the contiguous range after it, so the mask is two blocks per
  node ``[s, e)`` whose subtree ends at ``E``: the causal triangle ``[s, e) × [s, e)`` and the
  rectangle ``[e, E) × [s, e)`` (every descendant sees the whole node). It is built once, at pack
  time, as an *additive float* mask (0 allowed, ``finfo.min`` not): eager attention adds the mask
  to the scores, so a bool mask is silently wrong there (DESIGN.md §7); sdpa accepts either, and
  a float mask spares it a bool→float conversion in every layer;
- **prev**: the token's predecessor on its own path, where its log-prob is read (not ``u - 1``);
- the **loss weights** of the exact packed loss (:mod:`treegrpo.training.packing.loss`): per packed
  token, the summed aggregation weight of the paths through it, and one *term* per (token,
  distinct advantage value).

Several rows share a micro-batch up to a token cap on the padded size ``B × L``. Pads attend only
to themselves (no NaN from empty softmax rows) and carry weight 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from treegrpo.algos.losses import AGG_MODES, LossNormalizers
from treegrpo.training.batching import micro_batches
from treegrpo.training.packing.rows import Row, build_row, fill_rows, path_segments, split_rows
from treegrpo.tree import Forest


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
    - ``sample_logprobs_B_L``: the engine's log-prob of each token when it was sampled (the
      nodes' ``logprobs``; 0 where a node has none, on prompt/observation tokens and on pads).
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
    sample_logprobs_B_L: torch.Tensor
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


def _path_weights(n_policy: Sequence[int], agg_mode: str, norm: LossNormalizers) -> list[float]:
    """Aggregation weight ``w_p`` of a policy token of each path (the table in
    :mod:`treegrpo.training.packing.loss`), with the mini-batch's denominators ``norm``."""
    if agg_mode not in AGG_MODES:
        raise ValueError(f"unknown agg_mode {agg_mode!r}; known: {', '.join(AGG_MODES)}")
    if agg_mode == "token-mean":
        return [1.0 / max(norm.n_tokens, 1)] * len(n_policy)
    horizon = max(norm.horizon, 1)
    if agg_mode == "seq-mean-token-sum-norm-legacy":
        return [1.0 / horizon] * len(n_policy)
    n_valid = max(norm.n_seqs, 1)
    if agg_mode == "seq-mean-token-sum-norm":
        return [1.0 / (n_valid * horizon)] * len(n_policy)
    if agg_mode == "seq-mean-token-sum":
        return [1.0 / n_valid if n > 0 else 0.0 for n in n_policy]
    return [1.0 / (n_valid * n) if n > 0 else 0.0 for n in n_policy]  # seq-mean-token-mean


def _collate_rows(
    rows: Sequence[Row], weights: dict[int, float], pad_id: int, count_total: float
) -> PackedBatch:
    B, L = len(rows), max(len(r) for r in rows)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    pos = torch.zeros((B, L), dtype=torch.long)
    prev = torch.full((B, L), -1, dtype=torch.long)
    valid = torch.zeros((B, L), dtype=torch.bool)
    sample_lp = torch.zeros((B, L), dtype=torch.float32)
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
            sample_lp[b, idx] = torch.tensor([x for pl in r.path_logp for x in pl], dtype=torch.float32)
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
        sample_logprobs_B_L=sample_lp,
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
    norm: LossNormalizers | None = None,
) -> list[PackedBatch]:
    """Pack forests into micro-batches, one row per forest, each shared token once.

    With ``pair_cost > 0`` a forest may be split into several rows
    (:func:`~treegrpo.training.packing.rows.split_rows`) when one row's dense attention would cost
    more than the sharing saves; :func:`~treegrpo.training.packing.forward.attention_pair_cost`
    estimates it for a model. Exactness does not depend on how paths are grouped into rows.

    The loss weights are normalised over *all* selected paths (one mini-batch; or by ``norm``,
    the figures of a larger whole these paths are a part of, e.g. one rank's share), so summing
    :func:`~treegrpo.training.packing.loss.packed_loss` over the returned micro-batches gives the
    per-path mini-batch loss.

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
        norm: the mini-batch's aggregation denominators; ``None``: those of the selected paths
            (:meth:`LossNormalizers.of <treegrpo.algos.losses.LossNormalizers.of>`).

    Returns:
        the micro-batches, rows grouped by similar length.
    """
    if advantages is not None and len(advantages) != len(forests):
        raise ValueError(f"{len(advantages)} advantage lists for {len(forests)} forests")
    if select is not None and len(select) != len(forests):
        raise ValueError(f"{len(select)} path selections for {len(forests)} forests")
    units: list[
        tuple[list[int], list[list[list[int]]], list[list[int]], list[list[float]], list[list[float]]]
    ] = []
    offset = 0
    for fi, forest in enumerate(forests):
        paths = forest.paths()
        segs = path_segments(forest)
        chosen = range(len(paths)) if select is None else select[fi]
        ids, sg, ms, av, lps = [], [], [], [], []
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
            lps.append(list(ps.logprobs_T))
        for row in split_rows(sg, pair_cost):
            units.append(
                (
                    [ids[i] for i in row],
                    [sg[i] for i in row],
                    [ms[i] for i in row],
                    [av[i] for i in row],
                    [lps[i] for i in row],
                )
            )
        offset += len(paths)
    if not units:
        return []
    all_ids = [g for u in units for g in u[0]]
    n_policy = [sum(m) for u in units for m in u[2]]
    if norm is None:
        norm = LossNormalizers.of(m for u in units for m in u[2])
    weights = dict(zip(all_ids, _path_weights(n_policy, agg_mode, norm), strict=True))
    rows = fill_rows([build_row(*u) for u in units])
    count_total = norm.n_tokens
    return [
        _collate_rows([rows[i] for i in mb], weights, pad_id, count_total)
        for mb in micro_batches([len(r) for r in rows], max_tokens)
    ]


def empty_batch(pad_id: int = 0, count_total: float = 0.0) -> PackedBatch:
    """A micro-batch with no path: one row of two pad tokens (the second read at the first, so the
    forward reaches the LM head), weight 0 and no loss term. Its loss is 0 with a zero gradient on
    every parameter — what a data-parallel rank with fewer micro-batches runs so that every rank
    takes part in the same collectives."""
    zero = torch.zeros((1, 2), dtype=torch.float32)
    none_f, none_l = torch.zeros(0, dtype=torch.float32), torch.zeros(0, dtype=torch.long)
    return PackedBatch(
        input_ids_B_L=torch.full((1, 2), pad_id, dtype=torch.long),
        position_ids_B_L=torch.tensor([[0, 1]], dtype=torch.long),
        mask_B_1_L_L=torch.tensor([[[[0.0, torch.finfo(torch.float32).min], [0.0, 0.0]]]]),
        prev_B_L=torch.tensor([[-1, 0]], dtype=torch.long),
        valid_B_L=torch.ones((1, 2), dtype=torch.bool),
        sample_logprobs_B_L=zero.clone(),
        weight_B_L=zero.clone(),
        count_B_L=zero.clone(),
        term_row_J=none_l,
        term_col_J=none_l.clone(),
        term_adv_J=none_f,
        term_weight_J=none_f.clone(),
        term_count_J=none_f.clone(),
        path_row_P=none_l.clone(),
        path_index_P_T=torch.zeros((0, 0), dtype=torch.long),
        path_len_P=none_l.clone(),
        path_ids=[],
        n_path_tokens=0,
        n_packed_tokens=0,
        count_total=count_total,
    )
