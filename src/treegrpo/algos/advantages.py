"""Advantage estimators over a forest (DESIGN.md §5.1–5.4).

Every estimator is a pure function ``(forest, cfg) -> {(tree index, node id): advantage}`` kept in
the :data:`ADVANTAGE_ESTIMATORS` registry; the trainer and the CLI dispatch only through
:func:`get_advantage_estimator`. An estimator has a *level*:

- ``"leaf"`` (trajectory level): one value per leaf, broadcast to every policy token of the
  leaf's root→leaf path (``grpo``, ``tree_grpo``, ``intra_only``, ``inter_only``).
- ``"node"`` (step level): one value per non-root node, given to that node's own policy tokens
  (``treerl``, and GiGPO's ``gigpo`` / ``tree_gigpo`` in :mod:`treegrpo.algos.gigpo`).

An estimator may also *annotate* nodes (``annotate(forest, cfg) -> {(tree, node): {field: value}}``,
e.g. GiGPO's ``anchor_group``): :func:`score_forest` writes those fields into ``node.extra`` (the
forest JSON and the viewer show them) and removes every registered annotation field first.

Shape suffixes follow the tinker-cookbook convention: ``rewards_G`` is a 1-D tensor with one entry
per group member (G = leaves being normalised).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from treegrpo.registry import add, lookup
from treegrpo.tree import Forest

Level = Literal["leaf", "node"]
Scale = Literal["std", "none"]
Components = Literal["both", "intra", "inter"]
NodeKey = tuple[int, int]
"""(tree index in ``forest.trees``, node id)."""

EstimatorFn = Callable[[Forest, "AdvantageConfig"], dict[NodeKey, float]]
AnnotateFn = Callable[[Forest, "AdvantageConfig"], dict[NodeKey, dict[str, Any]]]
GigpoMode = Literal["mean_norm", "mean_std_norm"]
GigpoAnchor = Literal["observation", "context", "state"]

_LEVELS = ("leaf", "node")
_SCALES = ("std", "none")
_COMPONENTS = ("both", "intra", "inter")
_GIGPO_MODES = ("mean_norm", "mean_std_norm")
GIGPO_ANCHORS: tuple[GigpoAnchor, ...] = ("observation", "context", "state")


@dataclass(frozen=True)
class AdvantageConfig:
    """Options of the advantage estimators.

    Attributes:
        scale: ``"std"`` divides by the group's unbiased std (+ eps); ``"none"`` only subtracts the
            group mean (Dr. GRPO). Used by the group-relative estimators; ``treerl`` ignores it.
        eps: added to the std before dividing; must be > 0 (a group whose rewards are all equal
            has std 0, and its advantage 0 / (0 + eps) is 0 only with eps > 0).
        components: which parts of ``tree_grpo`` to sum: ``"both"`` (inter + intra, the paper),
            ``"intra"`` or ``"inter"``. The registered ``intra_only`` / ``inter_only`` estimators
            fix this regardless of the value here.
        sqrt_weighting: ``treerl``: divide by sqrt(#leaves below the node) (TreeRL); False drops it.
        local: ``treerl``: add the local term V(s) - V(parent); False keeps the global term only.
        gamma: GiGPO: discount of the step returns (verl-agent's ``algorithm.gamma``). 0.95: the
            value verl-agent's GiGPO example scripts pass (its config's own default is verl's 1.0).
        step_advantage_w: GiGPO: weight of the step-level term (``algorithm.gigpo.step_advantage_w``).
        mode: GiGPO: ``"mean_norm"`` (subtract the group mean) or ``"mean_std_norm"`` (and divide
            by std + eps), for both its terms (``algorithm.gigpo.mode``).
        enable_similarity: GiGPO: group steps whose observations are similar rather than states
            that are identical (``algorithm.gigpo.enable_similarity``).
        similarity_thresh: GiGPO: the ``difflib`` ratio two observations need to share a group,
            in (0, 1) (``algorithm.gigpo.similarity_thresh``).
        anchor: GiGPO: what a step group shares (:func:`treegrpo.algos.gigpo.anchor_values`):
            ``"observation"`` (verl-agent's: the observation the step acts on, no history),
            ``"context"`` (the whole context root→parent) or ``"state"`` (the env's state key
            before the step, else the context).
    """

    scale: Scale = "std"
    eps: float = 1e-6
    components: Components = "both"
    sqrt_weighting: bool = True
    local: bool = True
    gamma: float = 0.95
    step_advantage_w: float = 1.0
    mode: GigpoMode = "mean_norm"
    enable_similarity: bool = False
    similarity_thresh: float = 0.95
    anchor: GigpoAnchor = "observation"

    def __post_init__(self) -> None:
        if self.scale not in _SCALES:
            raise ValueError(f"AdvantageConfig.scale must be one of {_SCALES}, got {self.scale!r}")
        if self.components not in _COMPONENTS:
            raise ValueError(
                f"AdvantageConfig.components must be one of {_COMPONENTS}, got {self.components!r}"
            )
        if not (isinstance(self.eps, (int, float)) and self.eps > 0 and math.isfinite(self.eps)):
            raise ValueError(
                f"AdvantageConfig.eps must be a finite number > 0 (it keeps an all-equal group's "
                f"0 / std finite), got {self.eps!r}"
            )
        if self.mode not in _GIGPO_MODES:
            raise ValueError(f"AdvantageConfig.mode must be one of {_GIGPO_MODES}, got {self.mode!r}")
        if self.anchor not in GIGPO_ANCHORS:
            raise ValueError(f"AdvantageConfig.anchor must be one of {GIGPO_ANCHORS}, got {self.anchor!r}")
        if not (isinstance(self.gamma, (int, float)) and 0.0 <= self.gamma <= 1.0):
            raise ValueError(f"AdvantageConfig.gamma must be a number in [0, 1], got {self.gamma!r}")
        if not (isinstance(self.step_advantage_w, (int, float)) and math.isfinite(self.step_advantage_w)):
            raise ValueError(f"AdvantageConfig.step_advantage_w must be a finite number, got {self.step_advantage_w!r}")
        if not (isinstance(self.similarity_thresh, (int, float)) and 0.0 < self.similarity_thresh < 1.0):
            raise ValueError(
                f"AdvantageConfig.similarity_thresh must be in (0, 1) (verl-agent's range), got {self.similarity_thresh!r}"
            )


@dataclass(frozen=True)
class AdvantageEstimator:
    """A registered estimator: its name, level (``"leaf"`` or ``"node"``), function, and the
    optional node annotations it makes (``annotate``, with the ``extra`` fields it writes)."""

    name: str
    level: Level
    fn: EstimatorFn
    annotate: AnnotateFn | None = None
    annotation_fields: tuple[str, ...] = ()

    def __call__(self, forest: Forest, cfg: AdvantageConfig | None = None) -> dict[NodeKey, float]:
        return self.fn(forest, cfg if cfg is not None else AdvantageConfig())


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}


def register_advantage(
    name: str,
    level: Level = "leaf",
    annotate: AnnotateFn | None = None,
    annotation_fields: tuple[str, ...] = (),
) -> Callable[[EstimatorFn], EstimatorFn]:
    """Decorator: register ``fn(forest, cfg) -> {(tree index, node id): value}`` under ``name``.

    ``annotate(forest, cfg) -> {(tree index, node id): {field: value}}`` (optional) gives the node
    fields :func:`score_forest` writes into ``node.extra``; ``annotation_fields`` names them.
    Returns the function unchanged, so several names can be stacked on one function.
    """
    if level not in _LEVELS:
        raise ValueError(f"advantage level must be one of {_LEVELS}, got {level!r}")

    def deco(fn: EstimatorFn) -> EstimatorFn:
        estimator = AdvantageEstimator(name, level, fn, annotate, tuple(annotation_fields))
        add(ADVANTAGE_ESTIMATORS, name, estimator, "advantage estimator")
        return fn

    return deco


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered as ``name``; ValueError naming the known ones otherwise."""
    return lookup(ADVANTAGE_ESTIMATORS, name, "advantage estimator")


# -- the shared piece ---------------------------------------------------------------------------


def group_normalize(
    rewards_G: torch.Tensor,
    group_ids_G: torch.Tensor,
    scale: Scale = "std",
    eps: float = 1e-6,
) -> torch.Tensor:
    """Group-relative advantage ``(r - mean(group)) / (std(group) + eps)``, vectorised.

    Reproduces verl's ``compute_grpo_outcome_advantage`` exactly: std is **unbiased** (n-1); a
    group of one member gets mean 0 and std 1, so a singleton returns ``r / (1 + eps)`` with
    ``scale="std"`` and ``r`` itself with ``scale="none"``. A group whose members are all equal
    (std 0) returns 0 for each member.

    Args:
        rewards_G: [G] rewards, one per group member (any real dtype; integer input is promoted
            to the default float dtype).
        group_ids_G: [G] integer group label of each member (any integers, not necessarily
            contiguous).
        scale: ``"std"`` divides by (std + eps); ``"none"`` only subtracts the mean (Dr. GRPO).
        eps: added to the std.

    Returns:
        advantages_G: [G], same floating dtype as ``rewards_G``.
    """
    if scale not in _SCALES:
        raise ValueError(f"scale must be one of {_SCALES}, got {scale!r}")
    if rewards_G.dim() != 1 or group_ids_G.shape != rewards_G.shape:
        raise ValueError(
            f"rewards_G and group_ids_G must be 1-D of the same length, got "
            f"{tuple(rewards_G.shape)} and {tuple(group_ids_G.shape)}"
        )
    r = rewards_G if rewards_G.is_floating_point() else rewards_G.to(torch.get_default_dtype())
    if r.numel() == 0:
        return r.clone()
    _, gid = torch.unique(group_ids_G, return_inverse=True)  # [G] contiguous 0..K-1
    k = int(gid.max().item()) + 1
    count_K = torch.bincount(gid, minlength=k).to(r.dtype)
    sum_K = torch.zeros(k, dtype=r.dtype, device=r.device).index_add_(0, gid, r)
    mean_K = sum_K / count_K
    dev_G = r - mean_K[gid]
    sq_K = torch.zeros(k, dtype=r.dtype, device=r.device).index_add_(0, gid, dev_G * dev_G)
    single_K = count_K <= 1
    std_K = torch.sqrt(sq_K / torch.clamp(count_K - 1, min=1))
    mean_K = torch.where(single_K, torch.zeros_like(mean_K), mean_K)
    std_K = torch.where(single_K, torch.ones_like(std_K), std_K)
    centred_G = r - mean_K[gid]
    if scale == "none":
        return centred_G
    return centred_G / (std_K[gid] + eps)


# -- estimators ---------------------------------------------------------------------------------


def _leaf_reward(forest: Forest, ti: int, node_id: int) -> float:
    """The reward of a leaf; a missing or non-finite (NaN/inf) reward is an error naming the
    prompt, tree and leaf — one such leaf would otherwise turn every advantage of its forest
    (group mean and std) into NaN."""
    r = forest.trees[ti].node(node_id).reward
    where = f"prompt {forest.prompt_id!r} tree {ti} node {node_id}"
    if r is None:
        raise ValueError(f"{where}: leaf has no reward")
    r = float(r)
    if not math.isfinite(r):
        raise ValueError(
            f"{where}: leaf reward is {r} (not finite); the reward function must return a finite number"
        )
    return r


def _leaf_table(forest: Forest) -> tuple[list[NodeKey], torch.Tensor, torch.Tensor]:
    """Keys, rewards [G] (float64) and tree index [G] of every leaf of the forest."""
    keys: list[NodeKey] = []
    rewards: list[float] = []
    trees: list[int] = []
    for ti, leaf in forest.leaves():
        keys.append((ti, leaf.id))
        rewards.append(_leaf_reward(forest, ti, leaf.id))
        trees.append(ti)
    return keys, torch.tensor(rewards, dtype=torch.float64), torch.tensor(trees, dtype=torch.long)


def _tree_grpo(forest: Forest, cfg: AdvantageConfig, components: Components) -> dict[NodeKey, float]:
    keys, rewards_G, tree_G = _leaf_table(forest)
    if not keys:
        return {}
    adv_G = torch.zeros_like(rewards_G)
    if components in ("both", "inter"):
        adv_G = adv_G + group_normalize(rewards_G, torch.zeros_like(tree_G), cfg.scale, cfg.eps)
    if components in ("both", "intra"):
        adv_G = adv_G + group_normalize(rewards_G, tree_G, cfg.scale, cfg.eps)
    return dict(zip(keys, adv_G.tolist(), strict=True))


@register_advantage("grpo", level="leaf")
def grpo_advantage(forest: Forest, cfg: AdvantageConfig) -> dict[NodeKey, float]:
    """Chain GRPO (§5.2): each leaf gets ``norm(r, all leaves of the forest)``."""
    return _tree_grpo(forest, cfg, "inter")


@register_advantage("tree_grpo", level="leaf")
def tree_grpo_advantage(forest: Forest, cfg: AdvantageConfig) -> dict[NodeKey, float]:
    """Tree-GRPO (§5.3): ``norm(r, forest leaves) + norm(r, own tree's leaves)``.

    ``cfg.components`` picks ``"both"`` (default, the paper), ``"intra"`` or ``"inter"``.
    """
    return _tree_grpo(forest, cfg, cfg.components)


@register_advantage("intra_only", level="leaf")
def intra_only_advantage(forest: Forest, cfg: AdvantageConfig) -> dict[NodeKey, float]:
    """Tree-GRPO ablation: intra-tree term only, ``norm(r, own tree's leaves)``."""
    return _tree_grpo(forest, cfg, "intra")


@register_advantage("inter_only", level="leaf")
def inter_only_advantage(forest: Forest, cfg: AdvantageConfig) -> dict[NodeKey, float]:
    """Tree-GRPO ablation: inter-tree term only, ``norm(r, forest leaves)`` (equals ``grpo``)."""
    return _tree_grpo(forest, cfg, "inter")


@register_advantage("treerl", level="node")
def treerl_advantage(forest: Forest, cfg: AdvantageConfig) -> dict[NodeKey, float]:
    """TreeRL process reward (§5.4), one value per non-root node.

    ``V(s)`` = mean reward of the leaves below ``s`` (``s`` itself for a leaf). All tree roots
    are merged into one virtual root with ``V(root)`` = mean over every leaf of the forest; the
    parent of a first-level node is that virtual root. Then::

        R(s) = (V(s) - V(root) + V(s) - V(parent(s))) / sqrt(|L(s)|)

    ``cfg.local=False`` drops ``V(s) - V(parent(s))``; ``cfg.sqrt_weighting=False`` drops the
    division. ``cfg.scale`` and ``cfg.eps`` are not used.
    """
    # Leaf sums and counts per node, accumulated bottom-up.
    total: dict[NodeKey, float] = {}
    count: dict[NodeKey, int] = {}
    all_sum, all_n = 0.0, 0
    for ti, tree in enumerate(forest.trees):
        order = list(tree.dfs())
        for node in reversed(order):  # children before parents
            key = (ti, node.id)
            kids = tree.children[node.id]
            if node.parent is not None and not kids:
                r = _leaf_reward(forest, ti, node.id)
                total[key], count[key] = r, 1
                all_sum += r
                all_n += 1
            else:
                total[key] = sum(total[(ti, c)] for c in kids)
                count[key] = sum(count[(ti, c)] for c in kids)
    if all_n == 0:
        return {}
    v_root = all_sum / all_n
    out: dict[NodeKey, float] = {}
    for ti, tree in enumerate(forest.trees):
        root_id = tree.root.id
        for node in tree.nodes:
            if node.parent is None:
                continue
            key = (ti, node.id)
            n = count[key]
            v = total[key] / n
            if node.parent == root_id:
                v_parent = v_root
            else:
                pk = (ti, node.parent)
                v_parent = total[pk] / count[pk]
            r = v - v_root
            if cfg.local:
                r += v - v_parent
            if cfg.sqrt_weighting:
                r /= math.sqrt(n)
            out[key] = r
    return out


# -- applying an estimator ----------------------------------------------------------------------


def score_forest(forest: Forest, name: str, cfg: AdvantageConfig | None = None) -> Forest:
    """Set ``node.advantage`` on every node the estimator ``name`` scores, in place.

    Leaf-level estimators score the leaves, node-level ones every non-root node. Every other
    node's ``advantage`` is reset to ``None``, and every registered annotation field (e.g.
    ``anchor_group``) is removed before the estimator's own annotations are written, so that no
    stale value from an earlier scoring remains. Returns ``forest``.
    """
    est = get_advantage_estimator(name)
    cfg = cfg if cfg is not None else AdvantageConfig()
    values = est(forest, cfg)
    notes = est.annotate(forest, cfg) if est.annotate is not None else {}
    stale = {f for e in ADVANTAGE_ESTIMATORS.values() for f in e.annotation_fields}
    for ti, tree in enumerate(forest.trees):
        for node in tree.nodes:
            node.advantage = values.get((ti, node.id))
            for f in stale:
                node.extra.pop(f, None)
            node.extra.update(notes.get((ti, node.id), {}))
    return forest


def token_advantages(forest: Forest, name: str, cfg: AdvantageConfig | None = None) -> list[list[float]]:
    """Per-token advantages of every root→leaf path, in the order of ``forest.paths()``.

    Each inner list has one entry per token of the flattened path (prompt included): 0.0 where
    the policy mask is 0; elsewhere the leaf's advantage (leaf-level estimators) or the owning
    node's advantage (node-level estimators). Does not modify the forest.
    """
    est = get_advantage_estimator(name)
    values = est(forest, cfg)
    out: list[list[float]] = []
    for ti, leaf in forest.leaves():
        tree = forest.trees[ti]
        row: list[float] = []
        for node in tree.path(leaf.id):
            if len(node.policy_mask) != len(node.tokens):
                raise ValueError(
                    f"tree {ti} node {node.id}: policy_mask has {len(node.policy_mask)} entries for "
                    f"{len(node.tokens)} tokens"
                )
            a = values[(ti, leaf.id)] if est.level == "leaf" else values.get((ti, node.id), 0.0)
            row.extend(float(a) if m else 0.0 for m in node.policy_mask)
        out.append(row)
    return out
