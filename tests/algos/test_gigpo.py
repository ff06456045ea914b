"""GiGPO (``gigpo``, ``tree_gigpo``): hand-derived values on a small chain group and a small tree,
the three anchors (the observation, the context, a stateful env's state; with and without token
ids and texts), similarity grouping, the annotations the viewer shows, the shared-anchor
diagnostic, and that the other estimators are unchanged."""

from __future__ import annotations

import math

import pytest

from treegrpo.algos import (
    ADVANTAGE_ESTIMATORS,
    AdvantageConfig,
    score_forest,
    shared_anchor_stats,
    token_advantages,
)
from treegrpo.algos.gigpo import anchor_values, gigpo_rows
from treegrpo.tree import Forest, Node, Tree

TOL = 1e-9
EPS = 1e-6
PROMPT = [1, 2]


def step(
    nid: int, parent: int, tok: int, obs: int | None, reward: float | None = None, **extra: object
) -> Node:
    tokens = [tok] + ([obs] if obs is not None else [])
    return Node(
        nid, parent, text=f"t{tok}", observation=None if obs is None else f"o{obs}", tokens=tokens,
        policy_mask=[1] + [0] * (len(tokens) - 1), reward=reward, extra=dict(extra),
    )  # fmt: skip


def root(**extra: object) -> Node:
    return Node(0, None, text="Q", tokens=list(PROMPT), policy_mask=[0, 0], extra=dict(extra))


def chain_group() -> Forest:
    """Four chains (one tree each) of one prompt:

    A: a1 (5 → obs 6), a2 answer r=1     B: b1 (5 → obs 6), b2 answer r=0
    C: c1 answer r=1                     D: d1 (7 → obs 8), d2 answer r=0

    a1, b1, c1, d1 share the prompt; a2 and b2 share prompt+[5,6]; d2 is alone."""
    return Forest(
        "p",
        [
            Tree([root(), step(1, 0, 5, 6), step(2, 1, 3, None, 1.0)]),
            Tree([root(), step(1, 0, 5, 6), step(2, 1, 4, None, 0.0)]),
            Tree([root(), step(1, 0, 3, None, 1.0)]),
            Tree([root(), step(1, 0, 7, 8), step(2, 1, 4, None, 0.0)]),
        ],
    )


def test_chain_group_mean_norm_by_hand() -> None:
    # rows (R, G) with gamma 0.5: a1 (1, .5) a2 (1, 1) b1 (0, 0) b2 (0, 0) c1 (1, 1) d1 (0, 0) d2 (0, 0)
    # episode mean over the 7 rows = 3/7: E = 4/7 (A, C), -3/7 (B, D)
    # prompt group {a1 .5, b1 0, c1 1, d1 0}: mean .375; {a2 1, b2 0}: mean .5; {d2}: S = 0
    adv = ADVANTAGE_ESTIMATORS["gigpo"](chain_group(), AdvantageConfig(gamma=0.5))
    hi, lo = 4 / 7, -3 / 7
    expected = {
        (0, 1): hi + 0.125, (0, 2): hi + 0.5, (1, 1): lo - 0.375, (1, 2): lo - 0.5,
        (2, 1): hi + 0.625, (3, 1): lo - 0.375, (3, 2): lo,
    }  # fmt: skip
    assert adv.keys() == expected.keys()
    for k, v in expected.items():
        assert abs(adv[k] - v) < TOL, k


def test_chain_group_mean_std_norm_and_weight_by_hand() -> None:
    # episode: 7 rows, 3 ones: mean 3/7, unbiased var (3 (4/7)^2 + 4 (3/7)^2) / 6 = 2/7
    # prompt group G = [.5, 0, 1, 0]: mean .375, var (.125^2 + 2 .375^2 + .625^2) / 3 = .6875 / 3
    # {a2, b2}: G = [1, 0]: std sqrt(.5); {d2}: 0
    cfg = AdvantageConfig(gamma=0.5, mode="mean_std_norm", step_advantage_w=2.0)
    adv = ADVANTAGE_ESTIMATORS["gigpo"](chain_group(), cfg)
    se, s1, s2 = math.sqrt(2 / 7), math.sqrt(0.6875 / 3), math.sqrt(0.5)
    e_hi, e_lo = (4 / 7) / (se + EPS), (-3 / 7) / (se + EPS)
    expected = {
        (0, 1): e_hi + 2 * 0.125 / (s1 + EPS), (0, 2): e_hi + 2 * 0.5 / (s2 + EPS),
        (1, 1): e_lo - 2 * 0.375 / (s1 + EPS), (1, 2): e_lo - 2 * 0.5 / (s2 + EPS),
        (2, 1): e_hi + 2 * 0.625 / (s1 + EPS), (3, 1): e_lo - 2 * 0.375 / (s1 + EPS), (3, 2): e_lo,
    }  # fmt: skip
    for k, v in expected.items():
        assert abs(adv[k] - v) < TOL, k


def small_tree() -> Forest:
    """One Tree-GRPO tree: root ─ 1 (5 → obs 6) ─┬ 2 answer r=1
                       └ 3 answer r=0
    root ─ 4 answer r=1 (a root expansion)"""
    t = Tree(
        [
            root(),
            step(1, 0, 5, 6),
            step(2, 1, 3, None, 1.0),
            step(3, 1, 4, None, 0.0),
            step(4, 0, 3, None, 1.0),
        ]
    )
    return Forest("p", [t])


def test_small_tree_by_hand() -> None:
    # rows: (l2, 1) R=1 G=.5 · (l2, 2) R=1 G=1 · (l3, 1) R=0 G=0 · (l3, 3) R=0 G=0 · (l4, 4) R=1 G=1
    # E (mean .6): .4 on l2 and l4 rows, -.6 on l3 rows
    # prompt group: (l2,1) .5, (l3,1) 0, (l4,4) 1 -> mean .5: S = 0, -.5, .5; siblings 2, 3: S = .5, -.5
    # node 1 = mean of its two rows: (.4 + 0 + -.6 - .5) / 2 = -.35
    fs = small_tree()
    adv = ADVANTAGE_ESTIMATORS["gigpo"](fs, AdvantageConfig(gamma=0.5))
    expected = {(0, 1): -0.35, (0, 2): 0.9, (0, 3): -1.1, (0, 4): 0.9}
    for k, v in expected.items():
        assert abs(adv[k] - v) < TOL, k
    # the tokens of node 1 (two paths) get -.35 on each path: the sum of its two rows' values
    toks = token_advantages(fs, "gigpo", AdvantageConfig(gamma=0.5))
    assert toks[0] == pytest.approx([0.0, 0.0, -0.35, 0.0, 0.9], abs=TOL)
    assert toks[1] == pytest.approx([0.0, 0.0, -0.35, 0.0, -1.1], abs=TOL)
    assert toks[2] == pytest.approx([0.0, 0.0, 0.9], abs=TOL)


def test_tree_gigpo_by_hand() -> None:
    # tree_grpo on leaves [1, 0, 1] (one tree: inter = intra): mean 2/3, std sqrt(1/3)
    # leaf advantage 2 (r - 2/3) / (s + eps); plus the step term of the test above (w = 1)
    s = math.sqrt(1 / 3)
    tg = {2: 2 * (1 / 3) / (s + EPS), 3: 2 * (-2 / 3) / (s + EPS), 4: 2 * (1 / 3) / (s + EPS)}
    adv = ADVANTAGE_ESTIMATORS["tree_gigpo"](small_tree(), AdvantageConfig(gamma=0.5))
    expected = {
        (0, 1): (tg[2] + tg[3]) / 2 - 0.25,
        (0, 2): tg[2] + 0.5,
        (0, 3): tg[3] - 0.5,
        (0, 4): tg[4] + 0.5,
    }
    for k, v in expected.items():
        assert abs(adv[k] - v) < TOL, k


def test_annotations_and_diagnostic() -> None:
    f = score_forest(chain_group(), "gigpo")
    groups = {
        (ti, n.id): n.extra["anchor_group"]
        for ti, t in enumerate(f.trees)
        for n in t.nodes
        if n.parent is not None
    }
    assert groups == {(0, 1): 0, (0, 2): 1, (1, 1): 0, (1, 2): 1, (2, 1): 0, (3, 1): 0, (3, 2): 2}
    assert f.trees[3].node(2).extra["anchor_size"] == 1 and f.trees[0].node(1).extra["anchor_size"] == 4
    assert all("anchor_group" not in t.root.extra for t in f.trees)
    stats = shared_anchor_stats([chain_group(), small_tree()])
    # deep steps: a2, b2 (shared), d2 (alone); tree nodes 2, 3 (siblings)
    assert stats == {
        "steps": 11.0,
        "shared_frac": 10 / 11,
        "group_size": 11 / 5,
        "deep_steps": 5.0,
        "deep_shared_frac": 4 / 5,
    }
    # scoring again with another estimator removes the stale groups
    score_forest(f, "grpo")
    assert not any("anchor_group" in n.extra or "anchor_size" in n.extra for t in f.trees for n in t.nodes)


def two_paths_one_observation(**extra: object) -> Forest:
    """A: a1 (5 → obs 6), a2 answer r=1 · B: b1 (7 → obs 6), b2 answer r=0: the second steps see
    the same observation "o6" after different actions (different contexts)."""
    return Forest(
        "p",
        [
            Tree([root(), step(1, 0, 5, 6, **extra), step(2, 1, 3, None, 1.0)]),
            Tree([root(), step(1, 0, 7, 6, **extra), step(2, 1, 4, None, 0.0)]),
        ],
    )


def test_the_observation_anchor_groups_different_paths_to_one_observation() -> None:
    # rows (R, G), gamma .5: a1 (1, .5) a2 (1, 1) b1 (0, 0) b2 (0, 0); E: mean .5, so ±.5
    # first steps share the prompt: G [.5, 0], S = ±.25; observation o6: G [1, 0], S = ±.5
    f = two_paths_one_observation()
    adv = ADVANTAGE_ESTIMATORS["gigpo"](f, AdvantageConfig(gamma=0.5))
    expected = {(0, 1): 0.75, (0, 2): 1.0, (1, 1): -0.75, (1, 2): -1.0}
    assert adv.keys() == expected.keys() and all(abs(adv[k] - v) < TOL for k, v in expected.items())
    # the context anchor: the second steps' histories differ, each alone (S = 0)
    adv = ADVANTAGE_ESTIMATORS["gigpo"](f, AdvantageConfig(gamma=0.5, anchor="context"))
    expected = {(0, 1): 0.75, (0, 2): 0.5, (1, 1): -0.75, (1, 2): -0.5}
    assert all(abs(adv[k] - v) < TOL for k, v in expected.items())


def test_anchor_values_by_hand() -> None:
    f = two_paths_one_observation()
    obs, ctx, state = (anchor_values(f, a) for a in ("observation", "context", "state"))
    assert obs == {(0, 1): "Q", (0, 2): "o6", (1, 1): "Q", (1, 2): "o6"}
    assert ctx == {(0, 1): (1, 2), (0, 2): (1, 2, 5, 6), (1, 1): (1, 2), (1, 2): (1, 2, 7, 6)}
    assert state == ctx  # no state keys recorded: the context
    # without texts: the same observations as token ids (the parent's observation ids, the prompt's)
    for t in f.trees:
        for n in t.nodes:
            n.text, n.observation = "", None
    assert anchor_values(f, "observation") == {(0, 1): (1, 2), (0, 2): (6,), (1, 1): (1, 2), (1, 2): (6,)}
    # without token ids: the context as text, the observations as they were
    g = two_paths_one_observation()
    for t in g.trees:
        for n in t.nodes:
            n.tokens, n.policy_mask = [], []
    assert anchor_values(g, "context") == {(0, 1): "Q", (0, 2): "Qt5o6", (1, 1): "Q", (1, 2): "Qt7o6"}
    assert anchor_values(g, "observation") == obs
    with_ids = ADVANTAGE_ESTIMATORS["gigpo"](two_paths_one_observation(), AdvantageConfig(anchor="context"))
    without = ADVANTAGE_ESTIMATORS["gigpo"](g, AdvantageConfig(anchor="context"))
    assert all(abs(with_ids[k] - without[k]) < TOL for k in with_ids)
    with pytest.raises(ValueError, match="anchor"):
        anchor_values(f, "history")  # type: ignore[arg-type]


def test_state_keys_group_different_contexts() -> None:
    """A stateful env's key (``anchor="state"``): steps after different actions that reach the same
    state group, whatever their observations."""
    f = Forest(
        "p",
        [
            Tree([root(state_key="db0"), step(1, 0, 5, 6, state_key="db1"), step(2, 1, 3, None, 1.0)]),
            Tree([root(state_key="db0"), step(1, 0, 7, 8, state_key="db1"), step(2, 1, 4, None, 0.0)]),
        ],
    )
    keys = anchor_values(f, "state")
    assert keys[(0, 2)] == keys[(1, 2)] == "db1" and keys[(0, 1)] == "db0"
    cfg = AdvantageConfig(gamma=0.5, anchor="state")
    adv = ADVANTAGE_ESTIMATORS["gigpo"](f, cfg)
    # E: rows R = [1, 1, 0, 0]: ±.5; prompt group G = [.5, 0]: ±.25; state db1 group G = [1, 0]: ±.5
    assert abs(adv[(0, 1)] - 0.75) < TOL and abs(adv[(0, 2)] - 1.0) < TOL
    assert abs(adv[(1, 1)] + 0.75) < TOL and abs(adv[(1, 2)] + 1.0) < TOL
    # the observations differ (o6, o8): under the default anchor the second steps are alone, S = 0
    adv = ADVANTAGE_ESTIMATORS["gigpo"](f, AdvantageConfig(gamma=0.5))
    assert abs(adv[(0, 2)] - 0.5) < TOL and abs(adv[(1, 2)] + 0.5) < TOL
    f.trees[1].node(1).extra["state_key"] = "db2"  # another state: both second steps alone, S = 0
    adv = ADVANTAGE_ESTIMATORS["gigpo"](f, cfg)
    assert abs(adv[(0, 2)] - 0.5) < TOL and abs(adv[(1, 2)] + 0.5) < TOL


def test_similarity_groups_near_identical_observations() -> None:
    f = chain_group()
    f.trees[3].node(1).observation = "o6!"  # D's observation now close to A's and B's "o6"
    exact = shared_anchor_stats([f])
    sim = shared_anchor_stats([f], AdvantageConfig(enable_similarity=True, similarity_thresh=0.8))
    assert exact["shared_frac"] == 6 / 7 and sim["shared_frac"] == 1.0
    strict = shared_anchor_stats([f], AdvantageConfig(enable_similarity=True, similarity_thresh=0.9))
    assert strict["shared_frac"] == 6 / 7  # ratio("o6!", "o6") = 0.8


def test_all_equal_and_single_trajectory() -> None:
    # all-equal rewards: the episode term is 0; the step term too where the returns are equal
    f = chain_group()
    for t in f.trees:
        for leaf in t.leaves():
            leaf.reward = 0.3
    adv = ADVANTAGE_ESTIMATORS["gigpo"](f, AdvantageConfig())
    # but C answers at its first step: G = .3 against .3 * .95 for A, B, D in the prompt group
    c1 = 0.3 - (3 * 0.3 * 0.95 + 0.3) / 4
    assert abs(adv[(2, 1)] - c1) < TOL and abs(adv[(0, 1)] - (0.3 * 0.95 - (3 * 0.3 * 0.95 + 0.3) / 4)) < TOL
    assert all(abs(adv[k]) < TOL for k in ((0, 2), (1, 2), (3, 2)))
    del f.trees[2]
    assert all(
        abs(v) < TOL for v in ADVANTAGE_ESTIMATORS["gigpo"](f, AdvantageConfig(mode="mean_std_norm")).values()
    )
    # one trajectory of one step: the episode group has one row (mean 0, std 1), the step term 0
    one = Forest("p", [Tree([root(), step(1, 0, 3, None, 0.8)])])
    assert ADVANTAGE_ESTIMATORS["gigpo"](one, AdvantageConfig()) == {(0, 1): 0.8}
    r = gigpo_rows([0.8], [0.8], ["p"], ["x"], mode="mean_std_norm")
    assert abs(float(r.advantages_R[0]) - 0.8 / (1 + EPS)) < TOL


def test_config_validation() -> None:
    for bad in (
        {"mode": "std"},
        {"gamma": 1.5},
        {"similarity_thresh": 1.0},
        {"step_advantage_w": math.inf},
        {"anchor": "history"},
    ):
        with pytest.raises(ValueError):
            AdvantageConfig(**bad)  # type: ignore[arg-type]


def test_other_estimators_unchanged_by_gigpo_fields() -> None:
    """The GiGPO fields do not reach the other estimators."""
    f = small_tree()
    for name in ("grpo", "tree_grpo", "intra_only", "inter_only", "treerl"):
        a = ADVANTAGE_ESTIMATORS[name](f, AdvantageConfig())
        b = ADVANTAGE_ESTIMATORS[name](
            f, AdvantageConfig(gamma=0.1, step_advantage_w=5.0, mode="mean_std_norm", anchor="state")
        )
        assert a == b, name
