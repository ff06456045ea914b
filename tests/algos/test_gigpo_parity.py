"""GiGPO parity with verl-agent: our :mod:`treegrpo.algos.gigpo` against a test-only restatement of
verl-agent's ``compute_gigpo_outcome_advantage`` (:mod:`gigpo_reference`), to 1e-6, on 200 seeded
random batches per (mode, similarity) combination — singleton episode and step groups, all-equal
rewards, intermediate step rewards and shuffled rows included — and on random chain and tree
forests flattened into verl-agent's step rows, where the test builds each row's ``anchor_obs``
itself from the raw forest (the observation the step acts on: the prompt, or the previous step's
observation), as verl-agent's env manager records it, and the reference groups those strings.
Similarity grouping at a threshold close to 1 is exact grouping, under every anchor."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from gigpo_reference import ref_build_step_group, ref_discounted_returns, ref_gigpo

from treegrpo.algos.advantages import AdvantageConfig, get_advantage_estimator
from treegrpo.algos.gigpo import discounted_returns, gigpo_rows, step_groups
from treegrpo.tree import Forest, Node, Tree

TOL = 1e-6
N_BATCHES = 200
COMBOS = [(m, s) for m in ("mean_norm", "mean_std_norm") for s in (False, True)]
WORDS = ["the door is open", "you see a key", "nothing happens", "a red box", "the room is dark"]


def _obs(rng: random.Random) -> str:
    """An observation from a small pool, sometimes lightly edited (similar, not identical)."""
    base = rng.choice(WORDS)
    if rng.random() < 0.3:
        k = rng.randrange(len(base))
        base = base[:k] + rng.choice("xyz!") + base[k + 1 :]
    return base


def random_batch(seed: int) -> dict:
    """verl-agent's step rows: prompts with 1-5 trajectories of 1-4 steps, rows interleaved."""
    rng = random.Random(seed)
    kind = ["binary", "float", "equal", "step"][seed % 4]
    trajs = []
    for p in range(rng.randint(1, 4)):
        for t in range(rng.randint(1, 5)):
            steps = rng.randint(1, 4)
            outcome = {"binary": float(rng.random() < 0.5), "float": rng.uniform(-2, 3), "equal": 0.7}.get(
                kind
            )
            if kind == "step":
                rewards = [rng.choice([0.0, 0.0, 0.5, -0.1]) for _ in range(steps)]
            else:
                rewards = [0.0] * (steps - 1) + [outcome]
            anchors = [WORDS[0] if s == 0 else _obs(rng) for s in range(steps)]  # first step: the task
            trajs.append({"index": f"p{p}", "traj": f"p{p}t{t}", "rewards": rewards, "anchors": anchors})
    # interleave the trajectories' rows randomly, each trajectory's steps in order
    queues = [list(range(len(t["rewards"]))) for t in trajs]
    rows = []
    while any(queues):
        j = rng.choice([i for i, q in enumerate(queues) if q])
        rows.append((j, queues[j].pop(0)))
    width = 6
    mask = torch.zeros(len(rows), width, dtype=torch.float64)
    tlr = torch.zeros(len(rows), width, dtype=torch.float64)
    out = {"index": [], "traj": [], "rewards": [], "anchors": [], "episode": []}
    for i, (j, s) in enumerate(rows):
        t = trajs[j]
        n = rng.randint(1, width)
        mask[i, :n] = 1.0
        tlr[i, n - 1] = sum(t["rewards"])  # verl-agent: the episode's reward at the last valid token
        out["index"].append(t["index"])
        out["traj"].append(t["traj"])
        out["rewards"].append(t["rewards"][s])
        out["anchors"].append(t["anchors"][s])
        out["episode"].append(sum(t["rewards"]))
    out.update(mask=mask, token_level_rewards=tlr, gamma=rng.choice([0.95, 0.5, 1.0, rng.random()]))
    out["w"] = rng.choice([1.0, 0.5, 2.0])
    out["thresh"] = rng.choice([0.95, 0.8, 0.6])
    return out


def _obj(xs: list) -> np.ndarray:
    a = np.empty(len(xs), dtype=object)
    a[:] = xs
    return a


@pytest.mark.parametrize("seed", range(N_BATCHES))
def test_rows_match_verl_agent(seed: int) -> None:
    b = random_batch(seed)
    ref_returns = ref_discounted_returns(np.array(b["rewards"]), np.array(b["traj"]), b["gamma"])
    ours_returns = discounted_returns(b["rewards"], b["traj"], b["gamma"])
    assert torch.allclose(ours_returns, ref_returns, atol=TOL, rtol=0)
    for mode, sim in COMBOS:
        ref, ref_uids = ref_gigpo(
            b["token_level_rewards"], ref_returns, b["mask"], _obj(b["anchors"]), np.array(b["index"]),
            step_advantage_w=b["w"], mode=mode, enable_similarity=sim, similarity_thresh=b["thresh"],
        )  # fmt: skip
        ours = gigpo_rows(
            b["episode"], ours_returns, b["index"], b["anchors"], mode=mode, step_advantage_w=b["w"],
            enable_similarity=sim, similarity_thresh=b["thresh"],
        )  # fmt: skip
        per_token = ours.advantages_R.unsqueeze(-1) * b["mask"]
        assert torch.allclose(per_token, ref, atol=TOL, rtol=0), (mode, sim)
        # the same partition into step groups
        pairs = set(zip(ours.step_group_R.tolist(), ref_uids.tolist(), strict=True))
        assert len(pairs) == len(set(ours.step_group_R.tolist())) == len(set(ref_uids.tolist()))


def test_batches_cover_the_edge_cases() -> None:
    """The random batches include singleton episode groups, singleton step groups, all-equal
    rewards and similarity merges that exact grouping would not make (so the test can fail)."""
    single_episode = single_step = equal = merged = 0
    for seed in range(N_BATCHES):
        b = random_batch(seed)
        idx = b["index"]
        single_episode += any(idx.count(g) == 1 for g in idx)
        exact = step_groups(idx, b["anchors"]).tolist()
        single_step += any(exact.count(g) == 1 for g in exact)
        equal += len(set(b["episode"])) == 1
        merged += len(set(step_groups(idx, b["anchors"], True, b["thresh"]).tolist())) < len(set(exact))
    assert min(single_episode, single_step, equal, merged) >= 10, (single_episode, single_step, equal, merged)


def test_step_groups_partition_matches_reference_on_long_texts() -> None:
    """Clustering identical texts once gives verl-agent's partition (rows in the same order)."""
    rng = random.Random(7)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 8))) for _ in range(60)]
    texts += texts[:20]
    rng.shuffle(texts)
    index = [rng.choice("ab") for _ in texts]
    ours = step_groups(index, texts, True, 0.7).tolist()
    ref = ref_build_step_group(_obj(texts), np.array(index), True, 0.7).tolist()
    assert len(set(zip(ours, ref, strict=True))) == len(set(ours)) == len(set(ref))


# -- forests flattened into verl-agent's rows ----------------------------------------------------------


def random_forest(seed: int, chains: bool) -> Forest:
    """Chains (one tree per trajectory) or trees (expansions from random non-leaf nodes) with
    token ids drawn from a tiny vocabulary, so that contexts repeat."""
    rng = random.Random(seed)
    prompt = [1, 2, 3]
    n_trees = rng.randint(1, 5) if chains else rng.randint(1, 3)
    trees = []
    for _ in range(n_trees):
        tree = Tree([Node(0, None, text="Q", tokens=list(prompt), policy_mask=[0, 0, 0])])
        starts = [0]
        for _ in range(1 if chains else rng.randint(1, 4)):
            parent = rng.choice(starts)
            depth = tree.depth(parent)
            while True:
                tok = rng.choice([4, 5])
                done = depth >= 3 or rng.random() < 0.35
                node = Node(
                    tree.next_id(), parent, text=f"s{tok}", observation=None if done else f"o{tok}",
                    tokens=[tok] if done else [tok, 9], policy_mask=[1] if done else [1, 0],
                    reward=float(rng.random() < 0.5) if done else None,
                )  # fmt: skip
                tree.add(node)
                if done:
                    break
                starts.append(node.id)
                parent, depth = node.id, depth + 1
        trees.append(tree)
    return Forest("p", trees)


def _reference_on_forest(forest: Forest, cfg: AdvantageConfig) -> dict[tuple[int, int], float]:
    """verl-agent's rows for ``forest`` (one per (path, node)), each with the raw observation its
    step acts on as ``anchor_obs`` (the prompt for a first step, else the previous step's
    observation: verl-agent's ``anchor``, the current observation without history), scored by the
    reference, averaged per node."""
    rows, rewards, trajs, episode, anchor_obs = [], [], [], [], []
    for ti, leaf in forest.leaves():
        tree = forest.trees[ti]
        path = tree.path(leaf.id)[1:]
        for d, node in enumerate(path, start=1):
            rows.append((ti, node.id))
            rewards.append(float(leaf.reward) if d == len(path) else 0.0)
            trajs.append(f"{ti}-{leaf.id}")
            episode.append(float(leaf.reward))
            anchor_obs.append(tree.root.text if d == 1 else path[d - 2].observation)
    tlr = torch.tensor(episode, dtype=torch.float64).unsqueeze(-1)
    returns = ref_discounted_returns(np.array(rewards), np.array(trajs), cfg.gamma)
    adv, _ = ref_gigpo(
        tlr, returns, torch.ones_like(tlr), _obj(anchor_obs), np.array(["p"] * len(rows)),
        step_advantage_w=cfg.step_advantage_w, mode=cfg.mode, enable_similarity=cfg.enable_similarity,
        similarity_thresh=cfg.similarity_thresh,
    )  # fmt: skip
    total: dict[tuple[int, int], list[float]] = {}
    for r, a in zip(rows, adv[:, 0].tolist(), strict=True):
        total.setdefault(r, []).append(a)
    return {k: sum(v) / len(v) for k, v in total.items()}


@pytest.mark.parametrize("chains", [True, False], ids=["chains", "trees"])
@pytest.mark.parametrize("seed", range(50))
def test_forest_matches_verl_agent_rows(seed: int, chains: bool) -> None:
    forest = random_forest(seed, chains)
    for mode, sim in COMBOS:
        cfg = AdvantageConfig(
            mode=mode, enable_similarity=sim, similarity_thresh=0.8, gamma=0.9, step_advantage_w=0.7
        )
        assert cfg.anchor == "observation"  # the default: verl-agent's
        ours = get_advantage_estimator("gigpo")(forest, cfg)
        ref = _reference_on_forest(forest, cfg)
        assert ours.keys() == ref.keys()
        for k, v in ref.items():
            assert abs(ours[k] - v) <= TOL, (k, mode, sim)


def test_forests_share_observations_across_paths() -> None:
    """The random forests hold steps that see one observation after different histories (so the
    test above tells an observation anchor from a context anchor)."""
    shared = 0
    for seed in range(50):
        for chains in (True, False):
            f = random_forest(seed, chains)
            obs = get_advantage_estimator("gigpo")(f, AdvantageConfig(gamma=0.9))
            ctx = get_advantage_estimator("gigpo")(f, AdvantageConfig(gamma=0.9, anchor="context"))
            shared += any(abs(obs[k] - ctx[k]) > 1e-6 for k in obs)
    assert shared >= 30, shared


@pytest.mark.parametrize("anchor", ["observation", "context", "state"])
@pytest.mark.parametrize("chains", [True, False], ids=["chains", "trees"])
def test_similarity_near_one_is_exact_grouping(anchor: str, chains: bool) -> None:
    """A difflib ratio is 1 only for equal sequences and at most 1 - 1/(len a + len b) otherwise, so
    a threshold of 1 - 1e-9 groups exactly the equal anchors."""
    for seed in range(50):
        f = random_forest(seed, chains)
        if seed % 2:  # some forests without token ids: text anchors
            for t in f.trees:
                for n in t.nodes:
                    n.tokens, n.policy_mask = [], []
        for i, t in enumerate(f.trees):  # state keys on some nodes, shared across trees
            for n in t.nodes:
                if (n.id + i + seed) % 3 == 0:
                    n.extra["state_key"] = f"db{n.id % 2}"
        for est in ("gigpo", "tree_gigpo"):
            exact = get_advantage_estimator(est)(f, AdvantageConfig(anchor=anchor, gamma=0.9))  # type: ignore[arg-type]
            near = get_advantage_estimator(est)(
                f, AdvantageConfig(anchor=anchor, gamma=0.9, enable_similarity=True, similarity_thresh=1 - 1e-9)  # type: ignore[arg-type]
            )
            assert exact.keys() == near.keys()
            assert all(abs(exact[k] - near[k]) < 1e-12 for k in exact), (seed, est)
