"""GiGPO: group-in-group policy optimisation (Feng et al., arXiv 2505.10978), as verl-agent computes
it (``gigpo/core_gigpo.py``: ``compute_gigpo_outcome_advantage`` and its helpers), on forests.

**Rows.** verl-agent trains on one row per agent step. Each row carries its episode's outcome (the
same value on every step of the episode), the discounted return from that step on, the episode
group (the prompt) and the step's *anchor state*. On a forest a row is one (root→leaf path, non-root
node on it) pair: a chain's steps are its nodes, and a node that several trajectories of a tree
share is one row per trajectory through it (as the token-mean loss counts its tokens once per path).
Then, per row::

    E = episode term: (R - mean) [/ (std + eps)] over every row of the prompt group
    S = step term:    (G - mean) [/ (std + eps)] over the rows of the same anchor state
    A = E + step_advantage_w * S,        G = sum_k gamma^k r_{t+k} = gamma^(T - d) * R

(``mode="mean_norm"``: no std; ``"mean_std_norm"``: divide; std unbiased). A node's advantage is
the mean of its rows' values (:func:`gigpo_advantage`): on chains, where every node is one row, it
*is* verl-agent's value; on a tree, the tokens of a node shared by k paths then get k times that
mean in a token-mean loss, which is the sum of its k rows' values — the same gradient, as long as
the PPO ratio is inside the clip range (e.g. one optimizer step per rollout).

**Anchor states** (the state *before* the step, :func:`anchor_keys`): the parent's
``extra["state_key"]`` when the rollout recorded one (a stateful env's state, e.g. the SQL
database's content: :func:`treegrpo.envs.state.state_key`); otherwise the exact token ids of the
context root→parent (a deterministic tool's state is its context; all first steps of a group share
the prompt); in a forest without token ids, the texts and observations root→parent. Similarity
grouping (``enable_similarity``) compares, as verl-agent does, the *current observation* instead:
the parent's observation (the prompt for a first step, the state key where there is one).

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
the anchor is the whole state before the step rather than verl-agent's current observation (the
issue's choice: exact by construction on trees, and the env can supply it); a tree's node is the
mean of its rows (above). ``tree_gigpo`` is our combination: Tree-GRPO's leaf advantage (inter +
intra, as ``tree_grpo``) instead of the episode term, plus GiGPO's step term.
"""

from __future__ import annotations

import difflib
from collections import defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from treegrpo.algos.advantages import (
    AdvantageConfig,
    GigpoMode,
    NodeKey,
    _leaf_reward,
    _tree_grpo,
    register_advantage,
)
from treegrpo.tree import Forest

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
    if not isinstance(a, str) or not isinstance(b, str):
        raise ValueError("similarity grouping compares observation texts: every anchor must be a str")
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
        anchors_R: [R] anchor state of each row (any hashable; ``str`` with ``enable_similarity``).
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


def anchor_keys(forest: Forest) -> dict[NodeKey, Hashable]:
    """The exact anchor state of every non-root node: the state before its step (module
    docstring): ``("state", parent's state_key)``, ``("tokens", context ids root→parent)`` when
    every root has token ids, else ``("text", ((text, observation), ...) root→parent)``."""
    tokens = all(t.root.tokens for t in forest.trees)
    out: dict[NodeKey, Hashable] = {}
    for ti, tree in enumerate(forest.trees):
        at: dict[int, Hashable] = {}
        for node in tree.nodes:
            if node.parent is None:
                continue
            p = node.parent
            if p not in at:
                parent = tree.node(p)
                if "state_key" in parent.extra:
                    at[p] = ("state", str(parent.extra["state_key"]))
                elif tokens:
                    at[p] = ("tokens", tuple(tree.context(p)))
                else:
                    at[p] = ("text", tuple((n.text, n.observation) for n in tree.path(p)))
            out[(ti, node.id)] = at[p]
    return out


def anchor_texts(forest: Forest) -> dict[NodeKey, str]:
    """The text similarity grouping compares for every non-root node: its parent's state key, or
    observation (the prompt text for a first step; the parent's text if it has no observation)."""
    out: dict[NodeKey, str] = {}
    for ti, tree in enumerate(forest.trees):
        for node in tree.nodes:
            if node.parent is None:
                continue
            parent = tree.node(node.parent)
            if "state_key" in parent.extra:
                out[(ti, node.id)] = str(parent.extra["state_key"])
            elif parent.parent is None or parent.observation is None:
                out[(ti, node.id)] = parent.text
            else:
                out[(ti, node.id)] = parent.observation
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
    keys = anchor_keys(forest)
    texts = anchor_texts(forest) if cfg.enable_similarity else None
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
            anchors.append(texts[(ti, node.id)] if texts is not None else keys[(ti, node.id)])
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
    ``enable_similarity``, ``similarity_thresh``; not ``scale``."""
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
    "anchor_keys",
    "anchor_texts",
    "discounted_returns",
    "forest_steps",
    "gigpo_advantage",
    "gigpo_rows",
    "shared_anchor_stats",
    "step_groups",
    "tree_gigpo_advantage",
]
