"""Tree packing: layout (tokens once, positions, ancestor mask, padding) and exactness — packed
log-probs, loss and gradients equal the per-path computation (collate + compute_loss)."""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest
import torch

from treegrpo.algos.advantages import token_advantages
from treegrpo.algos.losses import AGG_MODES, LossConfig, compute_loss
from treegrpo.models.loader import load_model
from treegrpo.training.batching import collate, forest_sequences, token_logprobs
from treegrpo.training.packing import (
    PackedBatch,
    attention_pair_cost,
    pack_forests,
    packed_logprobs,
    packed_loss,
    path_logprobs_packed,
    split_rows,
)
from treegrpo.tree import Forest, Node, Tree

PAD = 1


# -- random forests -------------------------------------------------------------------------------


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(2, 200) for _ in range(n)]


def random_tree(rng: random.Random, prompt: list[int], n_expand: int = 3, max_depth: int = 3) -> Tree:
    """Initialize-then-expand shaped tree: steps = policy tokens then observation tokens."""
    tree = Tree([Node(0, None, tokens=list(prompt), policy_mask=[0] * len(prompt))])

    def chain(parent: int) -> None:
        depth = rng.randint(1, max(1, max_depth - tree.depth(parent)))
        cur = parent
        for k in range(depth):
            last = k == depth - 1
            pol, obs = _ids(rng, rng.randint(1, 5)), ([] if last else _ids(rng, rng.randint(0, 4)))
            node = Node(tree.next_id(), cur, tokens=pol + obs, policy_mask=[1] * len(pol) + [0] * len(obs))
            if last:
                node.reward = rng.choice([0.0, 1.0, 1.0, 0.5])
            tree.add(node)
            cur = node.id

    chain(0)
    for _ in range(n_expand):
        chain(rng.choice([n for n in tree.nodes if tree.children[n.id] or n.parent is None]).id)
    return tree


def random_forest(
    rng: random.Random, n_trees: int = 2, n_expand: int = 3, edge_cases: bool = False
) -> Forest:
    """A forest whose trees share one prompt. ``edge_cases``: adds a leaf step identical to a
    sibling (different reward) and a leaf with no policy token (a path with an empty mask)."""
    prompt = _ids(rng, rng.randint(4, 9))
    trees = [random_tree(rng, prompt, n_expand) for _ in range(n_trees)]
    if edge_cases:
        t = trees[0]
        leaf = t.leaves()[0]
        t.add(
            Node(
                t.next_id(),
                leaf.parent,
                tokens=list(leaf.tokens),
                policy_mask=list(leaf.policy_mask),
                reward=1.0 - (leaf.reward or 0.0),
            )
        )
        t.add(Node(t.next_id(), t.root.id, tokens=_ids(rng, 3), policy_mask=[0, 0, 0], reward=0.0))
    return Forest(f"p{rng.random():.6f}", trees)


def forests_for_tests(seed: int = 0, n: int = 3) -> list[Forest]:
    rng = random.Random(seed)
    return [random_forest(rng, edge_cases=(i == 0)) for i in range(n)]


@pytest.fixture(scope="module")
def models(tiny_model_dir: Path) -> dict[str, torch.nn.Module]:
    """The policy, an 'old' policy and a reference policy (perturbed copies, so ratio ≠ 1)."""
    model = load_model(tiny_model_dir)
    out = {"model": model}
    for name, seed, scale in (("old", 1, 0.05), ("ref", 2, 0.03)):
        m = copy.deepcopy(model)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn(p.shape, generator=g) * scale)
        m.eval()
        out[name] = m
    return out


# -- layout ---------------------------------------------------------------------------------------


def _batches_by_path(batches: list[PackedBatch]) -> dict[int, tuple[PackedBatch, int]]:
    out = {}
    for b in batches:
        for i, g in enumerate(b.path_ids):
            assert g not in out
            out[g] = (b, i)
    return out


def test_each_path_is_recovered_with_its_positions_and_predecessors() -> None:
    forests = forests_for_tests()
    seqs = forest_sequences(forests, [token_advantages(f, "tree_grpo") for f in forests])
    batches = pack_forests(forests, max_tokens=120, pad_id=PAD)
    where = _batches_by_path(batches)
    assert sorted(where) == list(range(len(seqs)))
    for g, s in enumerate(seqs):
        b, i = where[g]
        row, idx = int(b.path_row_P[i]), b.path_index_P_T[i, : b.path_len_P[i]]
        assert b.input_ids_B_L[row, idx].tolist() == s.tokens
        assert b.position_ids_B_L[row, idx].tolist() == list(range(len(s.tokens)))
        assert b.prev_B_L[row, idx].tolist() == [-1, *idx[:-1].tolist()]
        assert bool(b.valid_B_L[row, idx].all())


def test_mask_allows_exactly_the_ancestors() -> None:
    forests = forests_for_tests()
    batches = pack_forests(forests, max_tokens=10_000, pad_id=PAD)
    for b in batches:
        for i in range(len(b.path_ids)):
            row, idx = int(b.path_row_P[i]), b.path_index_P_T[i, : b.path_len_P[i]].tolist()
            for t, u in enumerate(idx):
                allowed = b.allowed_B_1_L_L[row, 0, u].nonzero().flatten().tolist()
                assert allowed == sorted(idx[: t + 1])


def test_prompt_and_shared_steps_are_packed_once() -> None:
    rng = random.Random(3)
    forest = random_forest(rng, n_trees=4, n_expand=4)
    prompt = forest.trees[0].root.tokens
    (b,) = pack_forests([forest], pad_id=PAD)
    assert b.shape[0] == 1
    assert int((b.position_ids_B_L[0, : b.n_packed_tokens] == 0).sum()) == 1  # one prompt start
    assert b.input_ids_B_L[0, : len(prompt)].tolist() == prompt
    distinct = len(prompt) + sum(len(n.tokens) for t in forest.trees for n in t.nodes if n.parent is not None)
    assert b.n_packed_tokens == distinct
    assert b.n_path_tokens == sum(len(p.tokens_T) for p in forest.paths()) > distinct


def test_trees_with_different_prompts_are_not_merged() -> None:
    rng = random.Random(4)
    a, c = random_forest(rng), random_forest(rng)
    forest = Forest("mixed", a.trees + c.trees)
    (b,) = pack_forests([forest], pad_id=PAD)
    assert int((b.position_ids_B_L[0, : b.n_packed_tokens] == 0).sum()) == 2


def test_identical_sibling_steps_share_tokens_and_keep_their_advantages() -> None:
    forest = forests_for_tests()[0]  # edge cases: a duplicated leaf step with the opposite reward
    advs = token_advantages(forest, "tree_grpo")
    (b,) = pack_forests([forest], [advs], pad_id=PAD)
    t0 = forest.trees[0]
    leaves = [leaf.id for _, leaf in forest.leaves()]
    dup_leaf = t0.nodes[-2]
    orig = next(n for n in t0.leaves() if n.tokens == dup_leaf.tokens and n.id != dup_leaf.id)
    i, j = leaves.index(orig.id), leaves.index(dup_leaf.id)
    assert torch.equal(b.path_index_P_T[i], b.path_index_P_T[j])
    u = int(b.path_index_P_T[i, b.path_len_P[i] - 1])  # last token: a policy token of the leaf step
    terms = b.term_adv_J[(b.term_row_J == 0) & (b.term_col_J == u)].tolist()
    assert sorted(terms) == pytest.approx(sorted([advs[i][-1], advs[j][-1]]), abs=1e-6)
    assert advs[i][-1] != advs[j][-1]


def test_micro_batches_respect_the_cap_and_pad_cleanly() -> None:
    forests = forests_for_tests(seed=5, n=7)
    batches = pack_forests(forests, max_tokens=150, pad_id=PAD)
    assert len(batches) > 1 and any(b.shape[0] > 1 for b in batches)
    assert sorted(g for b in batches for g in b.path_ids) == list(
        range(sum(f.n_trajectories() for f in forests))
    )
    for b in batches:
        B, L = b.shape
        assert B * L <= 150 or B == 1
        pad = ~b.valid_B_L
        assert bool((b.input_ids_B_L[pad] == PAD).all()) and bool((b.prev_B_L[pad] == -1).all())
        assert float(b.weight_B_L[pad].abs().sum()) == 0.0 and float(b.count_B_L[pad].sum()) == 0.0
        eye = torch.eye(L, dtype=torch.bool).expand(B, L, L)
        allowed = b.allowed_B_1_L_L[:, 0]
        assert bool((allowed[pad] == eye[pad]).all())  # pads attend to themselves only
        assert not bool((allowed & pad[:, None, :] & b.valid_B_L[:, :, None]).any())  # nobody sees a pad


def test_attention_mask_is_additive_float() -> None:
    (b,) = pack_forests(forests_for_tests(n=1), pad_id=PAD)
    for dtype in (torch.float32, torch.bfloat16):
        m = b.attention_mask(dtype)
        assert m.dtype == dtype and m.shape == (1, 1, b.shape[1], b.shape[1])
        assert bool((m[b.allowed_B_1_L_L] == 0).all())
        assert bool((m[~b.allowed_B_1_L_L] == torch.finfo(dtype).min).all())


def test_select_packs_only_the_chosen_paths() -> None:
    forests = forests_for_tests(n=2)
    n0 = forests[0].n_trajectories()
    batches = pack_forests(forests, select=[[0, n0 - 1], []], pad_id=PAD)
    assert [g for b in batches for g in b.path_ids] == [0, n0 - 1]
    (full,) = pack_forests(forests[:1], pad_id=PAD)
    assert sum(b.n_packed_tokens for b in batches) < full.n_packed_tokens


def test_weights_follow_the_aggregation_mode() -> None:
    forests = forests_for_tests()
    seqs = forest_sequences(forests, [token_advantages(f, "grpo") for f in forests])
    n_pol = [sum(s.policy_mask) for s in seqs]
    valid = sum(1 for n in n_pol if n)
    for mode, expect in (
        ("token-mean", 1.0),  # Σ W = Σ_p n_p / N
        ("seq-mean-token-sum", sum(n_pol) / valid),
        ("seq-mean-token-mean", 1.0),
        ("seq-mean-token-sum-norm", sum(n_pol) / (valid * max(len(s.tokens) for s in seqs))),
        ("seq-mean-token-sum-norm-legacy", sum(n_pol) / max(len(s.tokens) for s in seqs)),
    ):
        batches = pack_forests(forests, agg_mode=mode, max_tokens=100, pad_id=PAD)
        assert sum(float(b.weight_B_L.sum()) for b in batches) == pytest.approx(expect, rel=1e-5)
        assert sum(float(b.term_weight_J.sum()) for b in batches) == pytest.approx(expect, rel=1e-5)
        assert sum(float(b.term_count_J.sum()) for b in batches) == sum(n_pol)


def test_bad_inputs_are_rejected() -> None:
    forests = forests_for_tests(n=2)
    with pytest.raises(ValueError, match="advantage lists"):
        pack_forests(forests, [token_advantages(forests[0], "grpo")])
    bad = [token_advantages(f, "grpo") for f in forests]
    bad[1][0] = bad[1][0][:-1]
    with pytest.raises(ValueError, match="advantages for"):
        pack_forests(forests, bad)
    with pytest.raises(ValueError, match="agg_mode"):
        pack_forests(forests, agg_mode="nope")
    assert pack_forests([]) == []


# -- exactness against the per-path computation ------------------------------------------------------


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_logprobs_and_entropy_match_per_path(tiny_model_dir: Path, attn: str) -> None:
    model = load_model(tiny_model_dir, attn_implementation=attn)
    forests = forests_for_tests()
    seqs = forest_sequences(forests, [token_advantages(f, "grpo") for f in forests])
    with torch.no_grad():
        lp_ref, ent_ref = token_logprobs(model, collate(seqs, PAD), with_entropy=True)
        for b in pack_forests(forests, max_tokens=150, pad_id=PAD):
            lp, ent = packed_logprobs(model, b, with_entropy=True)
            rows = torch.tensor(b.path_ids)
            T = b.path_index_P_T.shape[1]
            torch.testing.assert_close(b.unpack(lp), lp_ref[rows, :T], atol=1e-5, rtol=0)
            torch.testing.assert_close(b.unpack(ent), ent_ref[rows, :T], atol=1e-5, rtol=0)
    per_path = path_logprobs_packed(model, forests, pad_id=PAD, max_tokens=150)
    for g, s in enumerate(seqs):
        torch.testing.assert_close(per_path[g], lp_ref[g, : len(s.tokens)], atol=1e-5, rtol=0)


def _grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def per_path_loss(
    models: dict[str, torch.nn.Module], forests: list[Forest], advs: list, cfg: LossConfig, off_policy: bool
) -> tuple[float, dict[str, float], torch.Tensor]:
    """What the per-path trainer computes: collate every path, token_logprobs, compute_loss."""
    model = models["model"]
    mb = collate(forest_sequences(forests, advs), PAD)
    model.zero_grad(set_to_none=True)
    lp, ent = token_logprobs(model, mb, with_entropy=True)
    with torch.no_grad():
        old = token_logprobs(models["old"], mb)[0] if off_policy else None
        ref = token_logprobs(models["ref"], mb)[0]
    loss, m = compute_loss(lp, old, ref, mb.advantages_B_T, mb.policy_mask_B_T, ent, cfg)
    loss.backward()
    return loss.item(), m, _grads(model)


def packed_total_loss(
    models: dict[str, torch.nn.Module],
    forests: list[Forest],
    advs: list,
    cfg: LossConfig,
    off_policy: bool,
    max_tokens: int = 150,
    pair_cost: float = 0.0,
) -> tuple[float, dict[str, float], torch.Tensor]:
    """The packed computation: several micro-batches, losses summed, one backward each."""
    model = models["model"]
    model.zero_grad(set_to_none=True)
    batches = pack_forests(
        forests, advs, agg_mode=cfg.agg_mode, max_tokens=max_tokens, pad_id=PAD, pair_cost=pair_cost
    )
    assert len(batches) > 1
    total, metrics = 0.0, {}
    for b in batches:
        lp, ent = packed_logprobs(model, b, with_entropy=True)
        with torch.no_grad():
            old = packed_logprobs(models["old"], b)[0] if off_policy else None
            ref = packed_logprobs(models["ref"], b)[0]
        loss, m = packed_loss(lp, b, old, ref, ent, cfg)
        loss.backward()
        total += loss.item()
        for k, v in m.items():
            metrics[k] = max(metrics.get(k, 0.0), v) if k == "actor/ratio_max" else metrics.get(k, 0.0) + v
    return total, metrics, _grads(model)


CASES = [
    (est, agg, kl, dual)
    for i, (est, agg) in enumerate((e, a) for e in ("tree_grpo", "grpo", "treerl") for a in AGG_MODES)
    for kl, dual in [(("k3", "k1", "k2")[i % 3], i % 2 == 0)]
]


@pytest.mark.parametrize(("estimator", "agg_mode", "kl_kind", "dual_clip"), CASES)
def test_packed_loss_and_grads_equal_per_path_off_policy(
    models: dict[str, torch.nn.Module], estimator: str, agg_mode: str, kl_kind: str, dual_clip: bool
) -> None:
    """Old log-probs from another policy (ratio ≠ 1, clipping active on both sides), KL to a
    third, entropy bonus: loss, gradient and loss metrics match the per-path computation."""
    forests = forests_for_tests()
    advs = [token_advantages(f, estimator) for f in forests]
    cfg = LossConfig(
        agg_mode=agg_mode,
        kl_coef=0.1,
        kl_kind=kl_kind,
        entropy_coef=0.01,
        dual_clip=dual_clip,
        clip_ratio_c=1.5,
    )
    loss_p, m_p, g_p = per_path_loss(models, forests, advs, cfg, off_policy=True)
    loss_k, m_k, g_k = packed_total_loss(models, forests, advs, cfg, off_policy=True)
    assert 0.05 < m_p["actor/clipfrac"] < 0.95  # clipping is really exercised
    if dual_clip:
        assert m_p["actor/clipfrac_lower"] > 0
    assert loss_k == pytest.approx(loss_p, abs=1e-5)
    assert float((g_k - g_p).abs().max()) <= 1e-5
    assert float(g_p.abs().max()) > 1e-3  # the comparison is not vacuous
    for key in ("loss/policy", "loss/kl", "loss/entropy", "loss/total"):
        assert m_k[key] == pytest.approx(m_p[key], abs=1e-5), key
    if agg_mode == "token-mean":  # per-path actor/* are token means: the same definition
        for key in (
            "actor/clipfrac",
            "actor/clipfrac_lower",
            "actor/approx_kl",
            "actor/ratio_mean",
            "actor/ratio_max",
        ):
            assert m_k[key] == pytest.approx(m_p[key], abs=1e-5), key


@pytest.mark.parametrize("estimator", ["tree_grpo", "treerl"])
def test_packed_loss_equals_per_path_on_policy(models: dict[str, torch.nn.Module], estimator: str) -> None:
    forests = forests_for_tests(seed=7)
    advs = [token_advantages(f, estimator) for f in forests]
    cfg = LossConfig(agg_mode="seq-mean-token-mean", kl_coef=0.05)
    loss_p, _, g_p = per_path_loss(models, forests, advs, cfg, off_policy=False)
    loss_k, _, g_k = packed_total_loss(models, forests, advs, cfg, off_policy=False)
    assert loss_k == pytest.approx(loss_p, abs=1e-5)
    assert float((g_k - g_p).abs().max()) <= 1e-5


def test_terms_per_token_are_the_distinct_advantages_through_it() -> None:
    """treerl (per-node advantages): one term per token, unless identical steps were merged;
    tree_grpo: at most the number of distinct leaf advantages of the forest."""
    rng = random.Random(11)
    forests = [random_forest(rng, n_trees=3, n_expand=4) for _ in range(3)]
    for est in ("treerl", "tree_grpo"):
        for f in forests:
            advs = token_advantages(f, est)
            (b,) = pack_forests([f], [advs], pad_id=PAD)
            per_token = int(torch.bincount(b.term_col_J).max())
            if est == "treerl":
                assert per_token == 1
            else:
                assert 1 < per_token <= len({a[-1] for a in advs})
    forest = forests_for_tests()[0]  # a duplicated step: two nodes, two treerl values, one token
    (b,) = pack_forests([forest], [token_advantages(forest, "treerl")], pad_id=PAD)
    assert int(torch.bincount(b.term_col_J).max()) == 2


def test_sequence_level_policy_loss_is_refused(models: dict[str, torch.nn.Module]) -> None:
    (b,) = pack_forests(forests_for_tests(n=1), pad_id=PAD)
    with torch.no_grad():
        lp, _ = packed_logprobs(models["model"], b)
    with pytest.raises(ValueError, match="token-wise"):
        packed_loss(lp, b, cfg=LossConfig(policy_loss="gspo"))


def test_split_rows_trades_sharing_against_dense_attention() -> None:
    rng = random.Random(12)
    forest = random_forest(rng, n_trees=4, n_expand=4)
    segs = [[n.tokens for n in forest.trees[ti].path(leaf.id)] for ti, leaf in forest.leaves()]
    assert split_rows(segs, 0.0) == [list(range(len(segs)))]
    for cost in (1e-3, 1e-2, 1.0):
        rows = split_rows(segs, cost)
        assert sorted(p for r in rows for p in r) == list(range(len(segs)))
    counts = [len(split_rows(segs, c)) for c in (1e-3, 1e-2, 1e-1, 1.0)]
    assert counts == sorted(counts) and 1 < counts[1] < counts[-1] < len(segs)
    # a path that shares nothing with the others gets a row of its own
    lonely = [*segs, [[999, 998, 997, *range(2, 40)]]]
    assert [len(segs)] in split_rows(lonely, 1e-2)


def test_split_rows_stay_exact(models: dict[str, torch.nn.Module]) -> None:
    forests = forests_for_tests()
    advs = [token_advantages(f, "tree_grpo") for f in forests]
    cfg = LossConfig(agg_mode="seq-mean-token-mean", kl_coef=0.1, entropy_coef=0.01)
    loss_p, _, g_p = per_path_loss(models, forests, advs, cfg, off_policy=True)
    whole = pack_forests(forests, advs, pad_id=PAD)
    split = pack_forests(forests, advs, pad_id=PAD, pair_cost=1e-2)
    assert sum(b.shape[0] for b in split) > sum(b.shape[0] for b in whole)
    assert sum(b.n_packed_tokens for b in split) > sum(b.n_packed_tokens for b in whole)
    loss_k, _, g_k = packed_total_loss(models, forests, advs, cfg, off_policy=True, pair_cost=1e-2)
    assert loss_k == pytest.approx(loss_p, abs=1e-5)
    assert float((g_k - g_p).abs().max()) <= 1e-5


def test_attention_pair_cost_of_the_tiny_model(models: dict[str, torch.nn.Module]) -> None:
    cost = attention_pair_cost(models["model"])
    assert 1e-4 < cost < 1e-1
    assert attention_pair_cost(torch.nn.Linear(2, 2)) == 0.0  # not a transformers model: no split


def test_short_rows_share_a_sequence_instead_of_padding() -> None:
    rng = random.Random(13)
    big = random_forest(rng, n_trees=4, n_expand=6)
    small = [random_forest(rng, n_trees=1, n_expand=0) for _ in range(3)]
    (b,) = pack_forests([big, *small], pad_id=PAD, max_tokens=100_000)
    assert b.shape[0] < 4  # the small forests were put side by side, not each padded to the big one
    assert int((b.position_ids_B_L[b.valid_B_L] == 0).sum()) == 4  # each forest keeps its own positions
    assert b.input_ids_B_L.numel() - b.n_packed_tokens < b.shape[1]  # less than one row of padding
