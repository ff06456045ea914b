"""Advantage estimators (DESIGN.md §5.1–5.4): hand-derived values, registry, token broadcast,
and loop-vs-vectorised equivalence on random forests."""

from __future__ import annotations

import math
import random
from collections import defaultdict

import pytest
import torch

from treegrpo.algos import (
    ADVANTAGE_ESTIMATORS,
    AdvantageConfig,
    get_advantage_estimator,
    group_normalize,
    register_advantage,
    score_forest,
    token_advantages,
)
from treegrpo.tree import Forest, Node, Tree

EPS = 1e-6
TOL = 1e-6

# A tree spec: list of (id, parent, reward or None); optional tokens/mask via make_node_spec.
Spec = list[tuple[int, int | None, float | None]]


def make_forest(*trees: Spec) -> Forest:
    return Forest("p", [Tree([Node(id=i, parent=p, reward=r) for i, p, r in spec]) for spec in trees])


def chain_forest(rewards: list[float]) -> Forest:
    """One tree whose root has one leaf child per reward (a chain-GRPO group)."""
    return make_forest([(0, None, None)] + [(i + 1, 0, r) for i, r in enumerate(rewards)])


# Tree 0: root 0 ─ 1 ─┬ 2 (r=1)       Tree 1: root 0 ─ 1 ─┬ 2 (r=0)
#                     └ 3 (r=0)                           └ 3 ─┬ 4 (r=0)
#         root 0 ─ 4 (r=1)                                     └ 5 (r=1)
TREE0: Spec = [(0, None, None), (1, 0, None), (2, 1, 1.0), (3, 1, 0.0), (4, 0, 1.0)]
TREE1: Spec = [(0, None, None), (1, 0, None), (2, 1, 0.0), (3, 1, None), (4, 3, 0.0), (5, 3, 1.0)]
# A tree for tree_grpo: tree 1' has two leaves, both 0.
TREE1_FLAT: Spec = [(0, None, None), (1, 0, None), (2, 1, 0.0), (3, 0, 0.0)]


def approx(a: float, b: float) -> bool:
    return abs(a - b) <= TOL


# -- group_normalize ------------------------------------------------------------------------------


def test_group_normalize_one_group() -> None:
    # [1, 0, 0, 1]: mean 0.5; unbiased var = 4 * 0.25 / 3 = 1/3; std = sqrt(1/3)
    r = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    out = group_normalize(r, torch.zeros(4, dtype=torch.long))
    a = 0.5 / (math.sqrt(1 / 3) + EPS)  # 0.866024...
    assert torch.allclose(out, torch.tensor([a, -a, -a, a], dtype=torch.float64), atol=TOL, rtol=0)
    assert out.dtype == torch.float64


def test_group_normalize_groups_singleton_and_constant() -> None:
    # group 7: [2, 4] -> mean 3, std = sqrt((1 + 1) / 1) = sqrt 2 -> ∓1/(sqrt2+eps)
    # group 3: [5] singleton -> mean 0, std 1 -> 5 / (1 + eps)
    # group 9: [1, 1, 1] -> std 0 -> 0 / (0 + eps) = 0
    r = torch.tensor([2.0, 5.0, 4.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    g = torch.tensor([7, 3, 7, 9, 9, 9])
    out = group_normalize(r, g)
    s = math.sqrt(2)
    expected = [-1 / (s + EPS), 5 / (1 + EPS), 1 / (s + EPS), 0.0, 0.0, 0.0]
    assert torch.allclose(out, torch.tensor(expected, dtype=torch.float64), atol=TOL, rtol=0)


def test_group_normalize_scale_none() -> None:
    # Dr. GRPO: mean subtraction only; a singleton keeps r (mean 0).
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.3], dtype=torch.float64)
    g = torch.tensor([0, 0, 0, 0, 1])
    out = group_normalize(r, g, scale="none")
    assert torch.allclose(
        out, torch.tensor([0.5, -0.5, -0.5, 0.5, 0.3], dtype=torch.float64), atol=TOL, rtol=0
    )


def test_group_normalize_edge_inputs() -> None:
    assert group_normalize(torch.zeros(0), torch.zeros(0, dtype=torch.long)).numel() == 0
    out = group_normalize(torch.tensor([1, 0]), torch.tensor([0, 0]))  # integer rewards promoted
    assert out.is_floating_point()
    with pytest.raises(ValueError, match="scale"):
        group_normalize(torch.ones(2), torch.zeros(2, dtype=torch.long), scale="max")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="same length"):
        group_normalize(torch.ones(2), torch.zeros(3, dtype=torch.long))


def _verl_loop_normalize(scores: list[float], index: list[int], scale: str, eps: float) -> list[float]:
    """Plain-Python copy of verl's compute_grpo_outcome_advantage loop."""
    groups: dict[int, list[float]] = defaultdict(list)
    for s, i in zip(scores, index, strict=True):
        groups[i].append(s)
    mean, std = {}, {}
    for i, vals in groups.items():
        if len(vals) == 1:
            mean[i], std[i] = 0.0, 1.0
        else:
            m = sum(vals) / len(vals)
            mean[i] = m
            std[i] = math.sqrt(sum((v - m) ** 2 for v in vals) / (len(vals) - 1))
    if scale == "none":
        return [s - mean[i] for s, i in zip(scores, index, strict=True)]
    return [(s - mean[i]) / (std[i] + eps) for s, i in zip(scores, index, strict=True)]


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("scale", ["std", "none"])
def test_group_normalize_matches_loop(seed: int, scale: str) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 40)
    scores = [rng.choice([0.0, 1.0, rng.random()]) for _ in range(n)]
    index = [rng.choice([-3, 0, 5, 11, 100 + seed]) for _ in range(n)]
    out = group_normalize(torch.tensor(scores, dtype=torch.float64), torch.tensor(index), scale, EPS)  # type: ignore[arg-type]
    ref = _verl_loop_normalize(scores, index, scale, EPS)
    assert torch.allclose(out, torch.tensor(ref, dtype=torch.float64), atol=TOL, rtol=0)


# -- registry -------------------------------------------------------------------------------------


def test_registry_names_and_levels() -> None:
    levels = {name: est.level for name, est in ADVANTAGE_ESTIMATORS.items()}
    assert levels["grpo"] == "leaf"
    assert levels["tree_grpo"] == "leaf"
    assert levels["intra_only"] == "leaf"
    assert levels["inter_only"] == "leaf"
    assert levels["treerl"] == "node"


def test_unknown_estimator_lists_known_names() -> None:
    with pytest.raises(ValueError, match="unknown advantage estimator 'nope'") as e:
        get_advantage_estimator("nope")
    for name in ("grpo", "tree_grpo", "intra_only", "inter_only", "treerl"):
        assert name in str(e.value)


def test_register_custom_and_duplicate() -> None:
    @register_advantage("_test_const", level="leaf")
    def const(forest: Forest, cfg: AdvantageConfig) -> dict[tuple[int, int], float]:
        return {(ti, leaf.id): 7.0 for ti, leaf in forest.leaves()}

    try:
        f = score_forest(chain_forest([1.0, 0.0]), "_test_const")
        assert [leaf.advantage for _, leaf in f.leaves()] == [7.0, 7.0]
        with pytest.raises(ValueError, match="already registered"):
            register_advantage("_test_const")(const)
    finally:
        del ADVANTAGE_ESTIMATORS["_test_const"]
    with pytest.raises(ValueError, match="level"):
        register_advantage("_bad", level="token")  # type: ignore[arg-type]


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="scale"):
        AdvantageConfig(scale="max")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="components"):
        AdvantageConfig(components="all")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="eps"):
        AdvantageConfig(eps=-1.0)
    with pytest.raises(ValueError, match=r"eps must be a finite number > 0"):
        AdvantageConfig(eps=0)  # an all-equal group would give 0 / 0 = NaN
    with pytest.raises(ValueError, match="eps"):
        AdvantageConfig(eps=float("nan"))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("name", ["grpo", "tree_grpo", "intra_only", "treerl"])
def test_non_finite_reward_is_an_error_naming_the_prompt(bad: float, name: str) -> None:
    """One NaN/inf leaf would make every advantage of the forest NaN (group mean and std)."""
    forest = Forest("hotpot-17", make_forest(TREE0, TREE1).trees)
    forest.trees[1].node(4).reward = bad
    with pytest.raises(
        ValueError, match=r"prompt 'hotpot-17' tree 1 node 4: leaf reward is \S+ \(not finite\)"
    ):
        get_advantage_estimator(name)(forest, AdvantageConfig())
    with pytest.raises(ValueError, match="reward function"):
        token_advantages(forest, name)


# -- grpo -----------------------------------------------------------------------------------------


def test_grpo_1001() -> None:
    # mean 0.5, std sqrt(1/3): A = ±0.5 / (0.577350 + 1e-6) = ±0.866024
    vals = get_advantage_estimator("grpo")(chain_forest([1.0, 0.0, 0.0, 1.0]))
    a = 0.5 / (math.sqrt(1 / 3) + EPS)
    assert set(vals) == {(0, 1), (0, 2), (0, 3), (0, 4)}
    for key, exp in zip([(0, 1), (0, 2), (0, 3), (0, 4)], [a, -a, -a, a], strict=True):
        assert approx(vals[key], exp)


def test_grpo_scale_none_and_singleton() -> None:
    vals = get_advantage_estimator("grpo")(chain_forest([1.0, 0.0, 0.0, 1.0]), AdvantageConfig(scale="none"))
    assert [round(vals[(0, i)], 9) for i in range(1, 5)] == [0.5, -0.5, -0.5, 0.5]
    # one leaf: verl convention mean 0, std 1 -> 0.7 / (1 + 1e-6); scale none -> 0.7
    assert approx(get_advantage_estimator("grpo")(chain_forest([0.7]))[(0, 1)], 0.7 / (1 + EPS))
    assert approx(
        get_advantage_estimator("grpo")(chain_forest([0.7]), AdvantageConfig(scale="none"))[(0, 1)], 0.7
    )


def test_grpo_groups_over_the_whole_forest() -> None:
    # grpo ignores tree boundaries: leaves [1, 0, 1 | 0, 0] form one group.
    vals = get_advantage_estimator("grpo")(make_forest(TREE0, TREE1_FLAT))
    s = math.sqrt(0.3)  # mean 0.4; sum sq dev = 2*0.36 + 3*0.16 = 1.2; /4 = 0.3
    assert approx(vals[(0, 2)], 0.6 / (s + EPS))
    assert approx(vals[(0, 3)], -0.4 / (s + EPS))
    assert approx(vals[(1, 3)], -0.4 / (s + EPS))


def test_empty_forest_gives_no_values() -> None:
    f = make_forest([(0, None, None)])
    for name in ADVANTAGE_ESTIMATORS:
        assert ADVANTAGE_ESTIMATORS[name](f) == {}


# -- tree_grpo ------------------------------------------------------------------------------------


def _tree_grpo_expected() -> dict[str, dict[tuple[int, int], float]]:
    # Leaves: tree 0 -> (0,2)=1, (0,3)=0, (0,4)=1; tree 1 -> (1,2)=0, (1,3)=0.
    # inter (all 5): mean 0.4, std sqrt(0.3): r=1 -> 0.6/(s+eps), r=0 -> -0.4/(s+eps)
    s_all = math.sqrt(0.3)
    hi, lo = 0.6 / (s_all + EPS), -0.4 / (s_all + EPS)
    inter = {(0, 2): hi, (0, 3): lo, (0, 4): hi, (1, 2): lo, (1, 3): lo}
    # intra tree 0 [1, 0, 1]: mean 2/3; sum sq dev = 1/9 + 4/9 + 1/9 = 2/3; var = 1/3
    s0 = math.sqrt(1 / 3)
    # intra tree 1 [0, 0]: std 0 -> 0 / (0 + eps) = 0
    intra = {(0, 2): (1 / 3) / (s0 + EPS), (0, 3): (-2 / 3) / (s0 + EPS), (0, 4): (1 / 3) / (s0 + EPS)}
    intra |= {(1, 2): 0.0, (1, 3): 0.0}
    both = {k: inter[k] + intra[k] for k in inter}
    return {"inter": inter, "intra": intra, "both": both}


@pytest.mark.parametrize("components", ["both", "intra", "inter"])
def test_tree_grpo_components(components: str) -> None:
    forest = make_forest(TREE0, TREE1_FLAT)
    vals = get_advantage_estimator("tree_grpo")(forest, AdvantageConfig(components=components))  # type: ignore[arg-type]
    exp = _tree_grpo_expected()[components]
    assert set(vals) == set(exp)
    for k in exp:
        assert approx(vals[k], exp[k]), (k, vals[k], exp[k])


def test_intra_only_inter_only_names() -> None:
    forest = make_forest(TREE0, TREE1_FLAT)
    exp = _tree_grpo_expected()
    # the named ablations ignore cfg.components
    cfg = AdvantageConfig(components="both")
    for name, part in (("intra_only", "intra"), ("inter_only", "inter")):
        vals = get_advantage_estimator(name)(forest, cfg)
        for k in exp[part]:
            assert approx(vals[k], exp[part][k])
    # inter_only == grpo
    assert get_advantage_estimator("inter_only")(forest) == get_advantage_estimator("grpo")(forest)


def test_tree_grpo_singleton_tree_and_scale_none() -> None:
    # tree 0 leaves [1, 0]; tree 1 has one leaf r=1 (a singleton intra group).
    forest = make_forest(
        [(0, None, None), (1, 0, 1.0), (2, 0, 0.0)],
        [(0, None, None), (1, 0, 1.0)],
    )
    vals = get_advantage_estimator("tree_grpo")(forest)
    # inter [1, 0, 1]: mean 2/3, std sqrt(1/3)
    s = math.sqrt(1 / 3)
    # intra tree 0 [1, 0]: mean 0.5, std sqrt(0.5); intra tree 1 [1]: 1 / (1 + eps)
    s0 = math.sqrt(0.5)
    assert approx(vals[(0, 1)], (1 / 3) / (s + EPS) + 0.5 / (s0 + EPS))
    assert approx(vals[(0, 2)], (-2 / 3) / (s + EPS) - 0.5 / (s0 + EPS))
    assert approx(vals[(1, 1)], (1 / 3) / (s + EPS) + 1 / (1 + EPS))
    # scale none: inter = r - 2/3; intra = r - 0.5 (tree 0), r - 0 (singleton tree 1)
    vals = get_advantage_estimator("tree_grpo")(forest, AdvantageConfig(scale="none"))
    assert approx(vals[(0, 1)], 1 / 3 + 0.5)
    assert approx(vals[(0, 2)], -2 / 3 - 0.5)
    assert approx(vals[(1, 1)], 1 / 3 + 1.0)


# -- treerl ---------------------------------------------------------------------------------------

# Forest TREE0 + TREE1; all leaves [1, 0, 1 | 0, 0, 1] -> virtual root V = 3/6 = 0.5.
# Tree 0: n1 L={2,3} V=.5, parent vroot .5 -> (0 + 0)/sqrt2 = 0
#         n2 V=1 parent n1 .5 -> (.5 + .5)/1 = 1;  n3 V=0 -> (-.5 - .5) = -1
#         n4 V=1 parent vroot -> (.5 + .5) = 1
# Tree 1: n1 L={2,4,5} V=1/3 parent vroot -> 2(1/3 - 1/2)/sqrt3 = -1/(3 sqrt3)
#         n2 V=0 parent n1 1/3 -> (-1/2 - 1/3) = -5/6
#         n3 L={4,5} V=.5 parent n1 -> (0 + 1/6)/sqrt2
#         n4 V=0 parent n3 .5 -> -1;  n5 V=1 -> 1
S2, S3 = math.sqrt(2), math.sqrt(3)
TREERL_FULL = {
    (0, 1): 0.0, (0, 2): 1.0, (0, 3): -1.0, (0, 4): 1.0,
    (1, 1): -1 / (3 * S3), (1, 2): -5 / 6, (1, 3): (1 / 6) / S2, (1, 4): -1.0, (1, 5): 1.0,
}  # fmt: skip
# sqrt_weighting=False: the same numerators.
TREERL_NO_SQRT = TREERL_FULL | {(1, 1): -1 / 3, (1, 3): 1 / 6}
# local=False: (V(s) - 0.5) / sqrt(|L(s)|)
TREERL_GLOBAL = {
    (0, 1): 0.0, (0, 2): 0.5, (0, 3): -0.5, (0, 4): 0.5,
    (1, 1): (-1 / 6) / S3, (1, 2): -0.5, (1, 3): 0.0, (1, 4): -0.5, (1, 5): 0.5,
}  # fmt: skip
# both off: V(s) - 0.5
TREERL_GLOBAL_NO_SQRT = TREERL_GLOBAL | {(1, 1): -1 / 6}


@pytest.mark.parametrize(
    ("sqrt_weighting", "local", "expected"),
    [
        (True, True, TREERL_FULL),
        (False, True, TREERL_NO_SQRT),
        (True, False, TREERL_GLOBAL),
        (False, False, TREERL_GLOBAL_NO_SQRT),
    ],
)
def test_treerl_hand_values(
    sqrt_weighting: bool, local: bool, expected: dict[tuple[int, int], float]
) -> None:
    forest = make_forest(TREE0, TREE1)
    vals = get_advantage_estimator("treerl")(
        forest, AdvantageConfig(sqrt_weighting=sqrt_weighting, local=local)
    )
    assert set(vals) == set(expected)  # every non-root node, no root
    for k, exp in expected.items():
        assert approx(vals[k], exp), (k, vals[k], exp)


def test_treerl_uses_merged_virtual_root() -> None:
    # Alone, tree 1's root has V = 1/3 and its n1 would get (1/3-1/3)*2/sqrt3 = 0; merged with
    # tree 0 the virtual root has V = 0.5 and n1 gets -1/(3 sqrt3).
    alone = get_advantage_estimator("treerl")(make_forest(TREE1))
    assert approx(alone[(0, 1)], 0.0)
    merged = get_advantage_estimator("treerl")(make_forest(TREE0, TREE1))
    assert approx(merged[(1, 1)], -1 / (3 * S3))


def test_treerl_ignores_scale() -> None:
    forest = make_forest(TREE0, TREE1)
    a = get_advantage_estimator("treerl")(forest, AdvantageConfig(scale="std"))
    b = get_advantage_estimator("treerl")(forest, AdvantageConfig(scale="none", eps=0.5))
    assert a == b


# -- score_forest / token_advantages ----------------------------------------------------------------


def test_score_forest_leaf_level_sets_leaves_only() -> None:
    forest = make_forest(TREE0, TREE1)
    forest.trees[0].node(1).advantage = 123.0  # stale value from an earlier scoring
    out = score_forest(forest, "tree_grpo")
    assert out is forest
    vals = get_advantage_estimator("tree_grpo")(forest)
    for ti, tree in enumerate(forest.trees):
        for n in tree.nodes:
            if n.parent is not None and tree.is_leaf(n.id):
                assert n.advantage == vals[(ti, n.id)]
            else:
                assert n.advantage is None


def test_score_forest_node_level_sets_every_non_root() -> None:
    forest = score_forest(make_forest(TREE0, TREE1), "treerl")
    for ti, tree in enumerate(forest.trees):
        assert tree.root.advantage is None
        for n in tree.nodes:
            if n.parent is not None:
                assert n.advantage is not None
                assert approx(n.advantage, TREERL_FULL[(ti, n.id)])


def test_score_forest_unknown_name() -> None:
    with pytest.raises(ValueError, match="known: "):
        score_forest(make_forest(TREE0), "nope")


def _token_forest() -> Forest:
    # root: prompt [1,2,3] mask 0; n1: [4,5 | 6,7] 2 policy + 2 observation tokens;
    # n2 (leaf, r=1): [8,9]; n3 (leaf, r=0): [10]; n4 (leaf under root, r=1): [11, 12 | 13]
    nodes = [
        Node(0, None, tokens=[1, 2, 3], policy_mask=[0, 0, 0]),
        Node(1, 0, tokens=[4, 5, 6, 7], policy_mask=[1, 1, 0, 0]),
        Node(2, 1, tokens=[8, 9], policy_mask=[1, 1], reward=1.0),
        Node(3, 1, tokens=[10], policy_mask=[1], reward=0.0),
        Node(4, 0, tokens=[11, 12, 13], policy_mask=[1, 1, 0], reward=1.0),
    ]
    return Forest("t", [Tree(nodes)])


def test_token_advantages_leaf_level_broadcast() -> None:
    forest = _token_forest()
    rows = token_advantages(forest, "grpo")
    # leaves [1, 0, 1]: mean 2/3, std sqrt(1/3)
    s = math.sqrt(1 / 3)
    hi, lo = (1 / 3) / (s + EPS), (-2 / 3) / (s + EPS)
    expected = [
        [0, 0, 0, hi, hi, 0, 0, hi, hi],  # leaf 2: prompt, n1 (2 policy + 2 obs), n2
        [0, 0, 0, lo, lo, 0, 0, lo],  # leaf 3
        [0, 0, 0, hi, hi, 0],  # leaf 4
    ]
    paths = forest.paths()
    assert [len(r) for r in rows] == [len(p.tokens_T) for p in paths]
    for row, exp, p in zip(rows, expected, paths, strict=True):
        assert all(approx(a, b) for a, b in zip(row, exp, strict=True)), row
        # exactly zero wherever the policy mask is zero
        assert all(a == 0.0 for a, m in zip(row, p.policy_mask_T, strict=True) if m == 0)


def test_token_advantages_node_level() -> None:
    forest = _token_forest()
    rows = token_advantages(forest, "treerl")
    # leaves [1, 0, 1] -> V(root) = 2/3
    # n1: V=.5, parent vroot: 2(.5 - 2/3)/sqrt2 = -1/(3 sqrt2)
    # n2: V=1, parent n1: (1 - 2/3) + (1 - .5) = 5/6;  n3: V=0: -2/3 - 1/2 = -7/6
    # n4: V=1, parent vroot: 2(1 - 2/3) = 2/3
    r1, r2, r3, r4 = -1 / (3 * S2), 5 / 6, -7 / 6, 2 / 3
    expected = [
        [0, 0, 0, r1, r1, 0, 0, r2, r2],
        [0, 0, 0, r1, r1, 0, 0, r3],
        [0, 0, 0, r4, r4, 0],
    ]
    for row, exp in zip(rows, expected, strict=True):
        assert len(row) == len(exp)
        assert all(approx(a, b) for a, b in zip(row, exp, strict=True)), row
    assert all(n.advantage is None for n in forest.trees[0].nodes)  # token_advantages is pure


def test_token_advantages_rejects_bad_mask() -> None:
    forest = _token_forest()
    forest.trees[0].node(2).policy_mask = [1]
    with pytest.raises(ValueError, match="policy_mask"):
        token_advantages(forest, "grpo")


def test_missing_leaf_reward_is_a_clear_error() -> None:
    forest = make_forest([(0, None, None), (1, 0, None)])
    for name in ("grpo", "treerl"):
        with pytest.raises(ValueError, match="no reward"):
            get_advantage_estimator(name)(forest)


# -- loop-vs-vectorised equivalence on random forests -----------------------------------------------


def random_forest(seed: int) -> Forest:
    rng = random.Random(seed)
    trees = []
    for _ in range(rng.randint(1, 5)):
        parents: dict[int, int | None] = {0: None}
        for nid in range(1, rng.randint(2, 12)):
            parents[nid] = rng.choice(list(parents))
        has_kids = {p for p in parents.values() if p is not None}
        binary = rng.random() < 0.5
        spec: Spec = []
        for nid, p in parents.items():
            leaf = p is not None and nid not in has_kids
            reward = (float(rng.random() < 0.5) if binary else round(rng.uniform(-1, 2), 3)) if leaf else None
            spec.append((nid, p, reward))
        trees.append(spec)
    return make_forest(*trees)


def _ref_leaf_tables(forest: Forest) -> list[tuple[int, int, float]]:
    out = []
    for ti, tree in enumerate(forest.trees):
        parents = {n.id: n.parent for n in tree.nodes}
        has_kids = {p for p in parents.values() if p is not None}
        for n in tree.nodes:
            if n.parent is not None and n.id not in has_kids:
                assert n.reward is not None
                out.append((ti, n.id, n.reward))
    return out


def _ref_norm(r: float, group: list[float], scale: str) -> float:
    if len(group) == 1:
        mean, std = 0.0, 1.0
    else:
        mean = sum(group) / len(group)
        std = math.sqrt(sum((g - mean) ** 2 for g in group) / (len(group) - 1))
    return r - mean if scale == "none" else (r - mean) / (std + EPS)


def ref_tree_grpo(forest: Forest, components: str, scale: str) -> dict[tuple[int, int], float]:
    leaves = _ref_leaf_tables(forest)
    everyone = [r for _, _, r in leaves]
    out = {}
    for ti, nid, r in leaves:
        own = [r2 for t2, _, r2 in leaves if t2 == ti]
        a = 0.0
        if components in ("both", "inter"):
            a += _ref_norm(r, everyone, scale)
        if components in ("both", "intra"):
            a += _ref_norm(r, own, scale)
        out[(ti, nid)] = a
    return out


def ref_treerl(forest: Forest, sqrt_weighting: bool, local: bool) -> dict[tuple[int, int], float]:
    leaves = _ref_leaf_tables(forest)
    v_root = sum(r for _, _, r in leaves) / len(leaves)
    out = {}
    for ti, tree in enumerate(forest.trees):
        parents = {n.id: n.parent for n in tree.nodes}

        def ancestors(nid: int, parents: dict[int, int | None] = parents) -> set[int]:
            seen = set()
            cur: int | None = nid
            while cur is not None:
                seen.add(cur)
                cur = parents[cur]
            return seen

        below: dict[int, list[float]] = defaultdict(list)
        for t2, leaf_id, r in leaves:
            if t2 == ti:
                for a in ancestors(leaf_id):
                    below[a].append(r)

        def value(
            nid: int, below: dict[int, list[float]] = below, parents: dict[int, int | None] = parents
        ) -> float:
            return v_root if parents[nid] is None else sum(below[nid]) / len(below[nid])

        for n in tree.nodes:
            if n.parent is None:
                continue
            v = value(n.id)
            r = v - v_root + ((v - value(n.parent)) if local else 0.0)
            out[(ti, n.id)] = r / math.sqrt(len(below[n.id])) if sqrt_weighting else r
    return out


@pytest.mark.parametrize("seed", range(12))
def test_estimators_match_reference(seed: int) -> None:
    forest = random_forest(seed)
    for scale in ("std", "none"):
        for comp in ("both", "intra", "inter"):
            cfg = AdvantageConfig(scale=scale, components=comp)  # type: ignore[arg-type]
            got = get_advantage_estimator("tree_grpo")(forest, cfg)
            ref = ref_tree_grpo(forest, comp, scale)
            assert set(got) == set(ref)
            assert all(abs(got[k] - ref[k]) <= TOL for k in ref)
        cfg = AdvantageConfig(scale=scale)  # type: ignore[arg-type]
        for name, comp in (("grpo", "inter"), ("intra_only", "intra"), ("inter_only", "inter")):
            got = get_advantage_estimator(name)(forest, cfg)
            ref = ref_tree_grpo(forest, comp, scale)
            assert all(abs(got[k] - ref[k]) <= TOL for k in ref)
    for sw in (True, False):
        for local in (True, False):
            got = get_advantage_estimator("treerl")(forest, AdvantageConfig(sqrt_weighting=sw, local=local))
            ref = ref_treerl(forest, sw, local)
            assert set(got) == set(ref)
            assert all(abs(got[k] - ref[k]) <= TOL for k in ref), (sw, local)
