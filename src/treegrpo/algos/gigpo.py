"""GiGPO: group-in-group policy optimisation (Feng et al., arXiv 2505.10978), as verl-agent computes
it (``gigpo/core_gigpo.py``: ``compute_gigpo_outcome_advantage`` and its helpers), on forests.

**Rows.** verl-agent trains on one row per agent step. Each row carries its episode's outcome (the
same value on every step of the episode), the discounted return from that step on, the episode
group (the prompt) and the step's *anchor state*. On a forest a row is one (root→leaf path, non-root
node on it) pair: a chain's steps are its nodes, and a node that several trajectories of a tree
share is one row per trajectory through it (as the token-mean loss counts its tokens once per path).
Then, per row::

    E = episode term: (R - mean) [/ (std + eps)] over every row of the prompt group
    S = step term:    (G - mean) [/ (std + eps)] over the rows of the same anchor
    A = E + step_advantage_w * S,        G = sum_k gamma^k r_{t+k} = gamma^(T - d) * R

(``mode="mean_norm"``: no std; ``"mean_std_norm"``: divide; std unbiased). A node's advantage is
the mean of its rows' values (:func:`gigpo_advantage`): on chains, where every node is one row, it
*is* verl-agent's value; on a tree, the tokens of a node shared by k paths then get k times that
mean in a token-mean loss, which is the sum of its k rows' values — the same gradient, as long as
the PPO ratio is inside the clip range (e.g. one optimizer step per rollout).

**Anchors** (:func:`anchor_values`, ``AdvantageConfig.anchor``): a step's group is the rows of its
prompt whose anchor equals its own. Three choices, each a function of the step's parent node:

- ``observation`` (the default: verl-agent's ``anchor_obs``, the observation the agent acts on,
  with no history): the parent's ``observation`` text, and for a first step the prompt (the
  root's ``text``, ``""`` if the file has none; every first step of a forest shares it). So two
  steps that see the same tool reply share a group however they got there. In a forest where some
  of those observations have no text, the same observations as token ids: the parent's tokens
  under ``policy_mask`` 0, the prompt's ids.
- ``context``: the whole context root→parent — its token ids when every root has them, else the
  concatenated texts and observations root→parent. Steps share a group only when their histories
  are identical (on a tree: siblings, and the first steps of a forest).
- ``state``: the parent's ``extra["state_key"]`` where the rollout recorded one (a stateful env's
  state, e.g. the SQL database's content: :func:`treegrpo.envs.state.state_key`), else the
  context (a stateless tool's state is its context).

Similarity grouping (``enable_similarity``) compares the same anchor values, by ``difflib``'s
ratio (characters of a text, or token ids), so at a threshold close enough to 1 it is exact
grouping.

**What we keep from verl-agent and what we change.** Kept, and matched to 1e-6 by
``tests/algos/test_gigpo_parity.py`` against a restatement of verl-agent's functions:

- the episode statistics over *step rows* (its ``compute_mean_std_cross_steps=True`` default: a
  longer episode weighs more in its group's mean and std);
- an episode group of one row: mean 0, std 1 (E = R, or R / (1 + eps)) — verl's GRPO convention;
- a step group of one row: its own value as mean, std 1, so S = 0 in both modes (no peer, no
  step signal), and an all-equal group: S = 0;
- unbiased std, ``eps`` added to it; both terms normalised with the same ``mode``;
- similarity clustering: a step joins the first earlier cluster whose first member's text has a
  ``difflib.SequenceMatcher(None, text, rep).ratio() >= similarity_thresh`` (thresh in (0, 1)),
  in row order (identical texts are clustered once: the same partition, fewer comparisons).

Changed: float64 throughout (verl-agent uses float32: an all-equal group's rounding residue over
std + eps is then up to ~0.1, not 0); outcome rewards only (a non-leaf node's ``reward`` is ignored;
verl-agent also subtracts an invalid-action penalty from the step returns, which we do not have);
a tree's node is the mean of its rows (above); the ``context`` and ``state`` anchors are ours.
``tree_gigpo`` is our combination: Tree-GRPO's leaf advantage (inter + intra, as ``tree_grpo``)
instead of the episode term, plus GiGPO's step term.
"""

from __future__ import annotations

import difflib
from collections import defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from treegrpo.algos.advantages import (
    GIGPO_ANCHORS,
    AdvantageConfig,
    GigpoAnchor,
    GigpoMode,
    NodeKey,
    _leaf_reward,
    _tree_grpo,
    register_advantage,
)
from treegrpo.tree import Forest, Node, Tree

RowKey = tuple[int, int, int]
"""(tree index, leaf id, node id): one step of one trajectory."""

ANCHOR_FIELDS = ("anchor_group", "anchor_size")
"""The node fields :func:`anchor_annotations` writes (``extra``; the viewer marks the groups)."""


# -- the array form (verl-agent's interface, restated) ---------------------------------------------


@dataclass(frozen=True)
class GigpoRows:
    """GiGPO's values for R step rows.

    Attributes:
        advantages_R: [R] float64, ``episode_R + step_advantage_w * step_R``.
        episode_R: [R] the episode term.
        step_R: [R] the step term.
        step_group_R: [R] long, the step (anchor) group of each row: 0..K-1 in order of first
            appearance within each episode group, groups of one episode group contiguous.
    """

    advantages_R: torch.Tensor
    episode_R: torch.Tensor
    step_R: torch.Tensor
    step_group_R: torch.Tensor


def discounted_returns(rewards_R: Sequence[float], traj_R: Sequence[Hashable], gamma: float) -> torch.Tensor:
    """Per row, the discounted return ``sum_k gamma^k r_{t+k}`` within its trajectory (verl-agent's
    ``compute_step_discounted_returns``, Eq. 5).

    Args:
        rewards_R: [R] the step's own reward (0 for a step that earns nothing).
        traj_R: [R] trajectory label of each row; a trajectory's rows in step order (they need not
            be contiguous).
        gamma: the discount.

    Returns:
        returns_R: [R] float64.
    """
    if len(rewards_R) != len(traj_R):
        raise ValueError(f"rewards_R has {len(rewards_R)} rows, traj_R {len(traj_R)}")
    rows: dict[Hashable, list[int]] = defaultdict(list)
    for i, t in enumerate(traj_R):
        rows[t].append(i)
    out = torch.zeros(len(rewards_R), dtype=torch.float64)
    for idx in rows.values():
        running = 0.0
        for i in reversed(idx):
            running = float(rewards_R[i]) + gamma * running
            out[i] = running
    return out


def _similar(a: Any, b: Any, thresh: float) -> bool:
    if not isinstance(a, (str, tuple)) or not isinstance(b, (str, tuple)):
        raise ValueError("similarity grouping compares texts or token ids: every anchor must be a str or a tuple")
    return difflib.SequenceMatcher(None, a, b).ratio() >= thresh


def step_groups(
    index_R: Sequence[Hashable],
    anchors_R: Sequence[Hashable],
    enable_similarity: bool = False,
    similarity_thresh: float = 0.95,
) -> torch.Tensor:
    """The anchor-state group of each row (verl-agent's ``build_step_group``, Eq. 6): within each
    episode group (``index_R``), rows with equal anchors — or, with ``enable_similarity``, rows
    whose anchor text is similar to a cluster's first member (module docstring).

    Returns:
        step_group_R: [R] long, contiguous ids (episode groups in order of first appearance).
    """
    if len(index_R) != len(anchors_R):
        raise ValueError(f"index_R has {len(index_R)} rows, anchors_R {len(anchors_R)}")
    if enable_similarity and not 0.0 < similarity_thresh < 1.0:
        raise ValueError(
            f"similarity_thresh must be in (0, 1) with enable_similarity, got {similarity_thresh!r}"
        )
    by_index: dict[Hashable, list[int]] = defaultdict(list)
    for i, g in enumerate(index_R):
        by_index[g].append(i)
    out = torch.empty(len(index_R), dtype=torch.long)
    next_id = 0
    for rows in by_index.values():
        cluster_of: dict[Hashable, int] = {}  # anchor -> group id (identical anchors: one lookup)
        reps: list[tuple[Any, int]] = []  # similarity: (first member's text, group id), in creation order
        for i in rows:
            a = anchors_R[i]
            gid = cluster_of.get(a)
            if gid is None:
                if enable_similarity:
                    gid = next((g for rep, g in reps if _similar(a, rep, similarity_thresh)), None)
                if gid is None:
                    gid = next_id
                    next_id += 1
                    reps.append((a, gid))
                cluster_of[a] = gid
            out[i] = gid
    return out


def _normalise(
    values_R: torch.Tensor, groups_R: torch.Tensor, mode: GigpoMode, eps: float, singleton_mean_zero: bool
) -> torch.Tensor:
    """``(v - mean) [/ (std + eps)]`` per group; a one-member group has std 1 and mean 0
    (``singleton_mean_zero``: the episode term) or its own value (the step term)."""
    if values_R.numel() == 0:
        return values_R.clone()
    _, gid = torch.unique(groups_R, return_inverse=True)
    k = int(gid.max().item()) + 1
    count_K = torch.bincount(gid, minlength=k).to(values_R.dtype)
    mean_K = torch.zeros(k, dtype=values_R.dtype).index_add_(0, gid, values_R) / count_K
    dev_R = values_R - mean_K[gid]
    sq_K = torch.zeros(k, dtype=values_R.dtype).index_add_(0, gid, dev_R * dev_R)
    single_K = count_K <= 1
    std_K = torch.where(single_K, torch.ones_like(mean_K), torch.sqrt(sq_K / torch.clamp(count_K - 1, min=1)))
    if singleton_mean_zero:
        mean_K = torch.where(single_K, torch.zeros_like(mean_K), mean_K)
    centred_R = values_R - mean_K[gid]
    return centred_R if mode == "mean_norm" else centred_R / (std_K[gid] + eps)


def gigpo_rows(
    episode_rewards_R: Sequence[float] | torch.Tensor,
    step_returns_R: Sequence[float] | torch.Tensor,
    index_R: Sequence[Hashable],
    anchors_R: Sequence[Hashable],
    mode: GigpoMode = "mean_norm",
    eps: float = 1e-6,
    step_advantage_w: float = 1.0,
    enable_similarity: bool = False,
    similarity_thresh: float = 0.95,
) -> GigpoRows:
    """GiGPO over R step rows (verl-agent's ``compute_gigpo_outcome_advantage``, Eq. 3-8, with
    the per-token broadcast left out: one value per row).

    Args:
        episode_rewards_R: [R] the outcome of the row's episode (the same on each of its rows).
        step_returns_R: [R] the discounted return from the row's step (:func:`discounted_returns`).
        index_R: [R] episode group (prompt) of each row.
        anchors_R: [R] anchor of each row (any hashable; a ``str`` or ``tuple`` with ``enable_similarity``).
        mode: ``mean_norm`` | ``mean_std_norm``.
        eps: added to the std.
        step_advantage_w: weight of the step term.
        enable_similarity / similarity_thresh: similarity grouping (:func:`step_groups`).
    """
    if mode not in ("mean_norm", "mean_std_norm"):
        raise ValueError(f"mode must be mean_norm or mean_std_norm, got {mode!r}")
    ep = torch.as_tensor(episode_rewards_R, dtype=torch.float64).reshape(-1)
    ret = torch.as_tensor(step_returns_R, dtype=torch.float64).reshape(-1)
    if not (len(ep) == len(ret) == len(index_R) == len(anchors_R)):
        raise ValueError(
            f"rows disagree: {len(ep)} episode rewards, {len(ret)} returns, {len(index_R)} groups, {len(anchors_R)} anchors"
        )
    labels: dict[Hashable, int] = {}
    ep_groups = torch.tensor([labels.setdefault(g, len(labels)) for g in index_R], dtype=torch.long)
    sg = step_groups(index_R, anchors_R, enable_similarity, similarity_thresh)
    e = _normalise(ep, ep_groups, mode, eps, singleton_mean_zero=True)
    s = _normalise(ret, sg, mode, eps, singleton_mean_zero=False)
    return GigpoRows(e + step_advantage_w * s, e, s, sg)


# -- forests ----------------------------------------------------------------------------------------


def _observation_tokens(node: Node) -> tuple[int, ...]:
    return tuple(t for t, m in zip(node.tokens, node.policy_mask, strict=False) if not m)


def anchor_values(forest: Forest, anchor: GigpoAnchor = "observation") -> dict[NodeKey, Hashable]:
    """The anchor of every non-root node under ``anchor`` (module docstring): a ``str`` (a text, a
    state key) or a ``tuple`` of token ids. Equal values = one step group."""
    if anchor not in GIGPO_ANCHORS:
        raise ValueError(f"anchor must be one of {GIGPO_ANCHORS}, got {anchor!r}")
    parents = [{n.parent for n in t.nodes if n.parent is not None} for t in forest.trees]
    texts = all(  # every observation a later step acts on is there as text
        t.node(p).observation is not None for t, ps in zip(forest.trees, parents, strict=True) for p in ps
        if p != t.root.id
    )  # fmt: skip
    ids = all(t.root.tokens for t in forest.trees)

    def context(tree: Tree, p: int) -> Hashable:
        if ids:
            return tuple(tree.context(p))
        return "".join(n.text + (n.observation or "") for n in tree.path(p))

    def value(tree: Tree, parent: Node) -> Hashable:
        if anchor == "state":
            key = parent.extra.get("state_key")
            return str(key) if key is not None else context(tree, parent.id)
        if anchor == "context":
            return context(tree, parent.id)
        if parent.parent is None:  # a first step acts on the prompt
            return parent.text if texts else tuple(parent.tokens)
        return parent.observation if texts else _observation_tokens(parent)

    out: dict[NodeKey, Hashable] = {}
    for ti, tree in enumerate(forest.trees):
        at: dict[int, Hashable] = {}
        for node in tree.nodes:
            if node.parent is None:
                continue
            if node.parent not in at:
                at[node.parent] = value(tree, tree.node(node.parent))
            out[(ti, node.id)] = at[node.parent]
    return out


@dataclass(frozen=True)
class ForestSteps:
    """GiGPO on one forest: its step rows and their values.

    Attributes:
        rows: R row keys (tree, leaf, node), trajectory by trajectory (``forest.leaves()``
            order), root→leaf within one.
        values: :class:`GigpoRows` of the rows.
        node_group: anchor group of every non-root node, 0..K-1 in node order.
        node_group_size: how many distinct nodes share that node's anchor group.
    """

    rows: list[RowKey]
    values: GigpoRows
    node_group: dict[NodeKey, int]
    node_group_size: dict[NodeKey, int]

    def node_mean(self, values_R: torch.Tensor) -> dict[NodeKey, float]:
        """The mean of ``values_R`` over each node's rows."""
        total: dict[NodeKey, float] = defaultdict(float)
        count: dict[NodeKey, int] = defaultdict(int)
        for (ti, _, nid), v in zip(self.rows, values_R.tolist(), strict=True):
            total[(ti, nid)] += v
            count[(ti, nid)] += 1
        return {k: total[k] / count[k] for k in total}


def forest_steps(forest: Forest, cfg: AdvantageConfig) -> ForestSteps:
    """The rows of ``forest`` (module docstring) and their GiGPO values under ``cfg``."""
    anchor_of = anchor_values(forest, cfg.anchor)
    rows: list[RowKey] = []
    episode: list[float] = []
    step_rewards: list[float] = []
    anchors: list[Hashable] = []
    for ti, leaf in forest.leaves():
        r = _leaf_reward(forest, ti, leaf.id)
        path = forest.trees[ti].path(leaf.id)[1:]
        for d, node in enumerate(path, start=1):
            rows.append((ti, leaf.id, node.id))
            episode.append(r)
            step_rewards.append(r if d == len(path) else 0.0)  # outcome reward on the last step
            anchors.append(anchor_of[(ti, node.id)])
    returns = discounted_returns(step_rewards, [(ti, leaf) for ti, leaf, _ in rows], cfg.gamma)
    values = gigpo_rows(
        episode,
        returns,
        [0] * len(rows),
        anchors,
        mode=cfg.mode,
        eps=cfg.eps,
        step_advantage_w=cfg.step_advantage_w,
        enable_similarity=cfg.enable_similarity,
        similarity_thresh=cfg.similarity_thresh,
    )
    raw = {(ti, nid): int(g) for (ti, _, nid), g in zip(rows, values.step_group_R.tolist(), strict=True)}
    order: dict[int, int] = {}
    group: dict[NodeKey, int] = {}
    for ti, tree in enumerate(forest.trees):  # renumber in node order, for a stable display
        for node in tree.nodes:
            if (ti, node.id) in raw:
                group[(ti, node.id)] = order.setdefault(raw[(ti, node.id)], len(order))
    size: dict[int, int] = defaultdict(int)
    for g in group.values():
        size[g] += 1
    return ForestSteps(rows, values, group, {k: size[g] for k, g in group.items()})


def anchor_annotations(forest: Forest, cfg: AdvantageConfig) -> dict[NodeKey, dict[str, Any]]:
    """``anchor_group`` (id within the forest) and ``anchor_size`` (distinct nodes in the group)
    of every non-root node, for the forest JSON and the viewer."""
    fs = forest_steps(forest, cfg)
    return {k: {"anchor_group": g, "anchor_size": fs.node_group_size[k]} for k, g in fs.node_group.items()}


def shared_anchor_stats(forests: Sequence[Forest], cfg: AdvantageConfig | None = None) -> dict[str, float]:
    """GiGPO's own diagnostic over ``forests``: ``steps`` (non-root nodes), ``shared_frac`` (the
    fraction of them whose anchor group holds at least one other node), ``group_size`` (mean
    distinct nodes per anchor group), and the same for the steps after the first
    (``deep_steps``, ``deep_shared_frac``: a first step always shares the prompt with the group's
    other first steps, so this is where chains and trees differ)."""
    cfg = cfg or AdvantageConfig()
    steps = shared = groups = deep = deep_shared = 0
    for f in forests:
        if not f.leaves():
            continue
        fs = forest_steps(f, cfg)
        steps += len(fs.node_group)
        shared += sum(n > 1 for n in fs.node_group_size.values())
        groups += len(set(fs.node_group.values()))
        for (ti, nid), n in fs.node_group_size.items():
            if f.trees[ti].node(nid).parent != f.trees[ti].root.id:
                deep += 1
                deep_shared += n > 1
    return {
        "steps": float(steps),
        "shared_frac": shared / steps if steps else 0.0,
        "group_size": steps / groups if groups else 0.0,
        "deep_steps": float(deep),
        "deep_shared_frac": deep_shared / deep if deep else 0.0,
    }


@register_advantage("gigpo", level="node", annotate=anchor_annotations, annotation_fields=ANCHOR_FIELDS)
def gigpo_advantage(forest: Forest, cfg: AdvantageConfig) -> dict[NodeKey, float]:
    """GiGPO (module docstring): per non-root node, the mean over its rows of
    ``E + step_advantage_w * S``. Uses ``cfg.gamma``, ``step_advantage_w``, ``mode``, ``eps``,
    ``anchor``, ``enable_similarity``, ``similarity_thresh``; not ``scale``."""
    if not forest.leaves():
        return {}
    fs = forest_steps(forest, cfg)
    return fs.node_mean(fs.values.advantages_R)


@register_advantage("tree_gigpo", level="node", annotate=anchor_annotations, annotation_fields=ANCHOR_FIELDS)
def tree_gigpo_advantage(forest: Forest, cfg: AdvantageConfig) -> dict[NodeKey, float]:
    """Tree-GRPO + GiGPO's step term, per non-root node: the mean over the leaves below it of
    their ``tree_grpo`` advantage (``cfg.scale``, ``cfg.components``) plus ``step_advantage_w``
    times the mean over its rows of GiGPO's step term S (``cfg.mode``, ``gamma``, grouping)."""
    if not forest.leaves():
        return {}
    leaf_adv = _tree_grpo(forest, cfg, cfg.components)
    fs = forest_steps(forest, cfg)
    episode = torch.tensor([leaf_adv[(ti, leaf)] for ti, leaf, _ in fs.rows], dtype=torch.float64)
    return fs.node_mean(episode + cfg.step_advantage_w * fs.values.step_R)


__all__ = [
    "ANCHOR_FIELDS",
    "ForestSteps",
    "GigpoRows",
    "anchor_annotations",
    "anchor_values",
    "discounted_returns",
    "forest_steps",
    "gigpo_advantage",
    "gigpo_rows",
    "shared_anchor_stats",
    "step_groups",
    "tree_gigpo_advantage",
]
