"""GiGPO in the update: a GiGPO value derived by hand on a small forest, the exact policy loss and
parameter change it makes on the tiny model (a step of a successful episode whose anchor peer did
better is pushed *down*: only the step term, grouped by the observation, says so), the runs of the
one trainer loop with ``advantage=gigpo`` / ``tree_gigpo``, and verl-agent's option names."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from test_packing import PAD
from test_trainer import parts_for, small_cfg

from treegrpo.algos import AdvantageConfig
from treegrpo.algos.advantages import token_advantages
from treegrpo.algos.gigpo import shared_anchor_stats
from treegrpo.algos.losses import LossConfig
from treegrpo.models.loader import load_model
from treegrpo.training.config import ConfigError, make_config
from treegrpo.training.config_files import parse_set
from treegrpo.training.policy import Policy
from treegrpo.training.trainer import advantage_config, train
from treegrpo.training.update import update
from treegrpo.tree import Forest, Node, Tree, read_forests

PROMPT = [10, 11, 12]


def _step(nid: int, parent: int, text: str, policy: list[int], obs: str | None, obs_ids: list[int],
          reward: float | None = None) -> Node:  # fmt: skip
    return Node(
        nid, parent, text=text, observation=obs, tokens=policy + obs_ids,
        policy_mask=[1] * len(policy) + [0] * len(obs_ids), reward=reward,
    )  # fmt: skip


def three_chains() -> Forest:
    """Three chains of one prompt ("Q", ids 10 11 12); policy ids, then observation ids:

    A: a1 [20 21] → "o6" [30 31] · a2 [22] answer r=1
    B: b1 [23]    → "o6" [30 31] · b2 [24 25] → "o8" [32] · b3 [26] answer r=1
    C: c1 [27 28 29] answer r=0

    a2 and b2 act on the same observation "o6" after different first steps: from there A answers
    at once, B takes a detour."""

    def root() -> Node:
        return Node(0, None, text="Q", tokens=list(PROMPT), policy_mask=[0, 0, 0])

    return Forest(
        "p",
        [
            Tree([root(), _step(1, 0, "a1", [20, 21], "o6", [30, 31]), _step(2, 1, "a2", [22], None, [], 1.0)]),
            Tree([
                root(), _step(1, 0, "b1", [23], "o6", [30, 31]), _step(2, 1, "b2", [24, 25], "o8", [32]),
                _step(3, 2, "b3", [26], None, [], 1.0),
            ]),
            Tree([root(), _step(1, 0, "c1", [27, 28, 29], None, [], 0.0)]),
        ],
    )  # fmt: skip


CFG = AdvantageConfig(gamma=0.5)  # mean_norm, step_advantage_w 1, the observation anchor
# rows (R, G = 0.5^(T - d) R): a1 (1, .5) a2 (1, 1) · b1 (1, .25) b2 (1, .5) b3 (1, 1) · c1 (0, 0)
# E: mean R over the 6 rows = 5/6: +1/6 on A and B, -5/6 on C
# S: first steps {a1 .5, b1 .25, c1 0}, mean .25: +.25, 0, -.25; "o6" {a2 1, b2 .5}, mean .75:
#    +.25, -.25; "o8" {b3}: 0
HAND = {"a1": 5 / 12, "a2": 5 / 12, "b1": 1 / 6, "b2": -1 / 12, "b3": 1 / 6, "c1": -13 / 12}
# the planted faults: without the step term b2 = E = +1/6; grouped by the context, a2 and b2 are
# alone (S = 0) and b2 = +1/6 too
POLICY_TOKENS = 10  # 2 + 1, 1 + 2 + 1, 3
# token-mean policy loss at ratio 1: -sum_t A_t / N = -(2 * 5/12 + 5/12 + 1/6 - 2/12 + 1/6 - 3 * 13/12) / 10
HAND_LOSS = 11 / 60


def _node_of_token(forest: Forest) -> list[list[str | None]]:
    """Per path, per token: the text of the step whose policy token it is (None elsewhere)."""
    out = []
    for ti, leaf in forest.leaves():
        row: list[str | None] = []
        for n in forest.trees[ti].path(leaf.id):
            row += [n.text if m else None for m in n.policy_mask]
        out.append(row)
    return out


def test_gigpo_token_advantages_by_hand() -> None:
    f = three_chains()
    advs = token_advantages(f, "gigpo", CFG)
    for adv, names in zip(advs, _node_of_token(f), strict=True):
        assert len(adv) == len(names)
        assert adv == pytest.approx([0.0 if n is None else HAND[n] for n in names], abs=1e-12)
    # the step that matters: b2, in a successful episode, is pushed down by its anchor peer a2
    assert HAND["b2"] < 0 < HAND["b3"]


def _expected_step(model: torch.nn.Module, forest: Forest, lr: float) -> list[torch.Tensor]:
    """The parameter change of one SGD step on -sum_t A_t log p(t) / N, computed here token by
    token with the hand-derived A_t (at ratio 1 the PPO-clip gradient is -A_t grad log p(t))."""
    model = copy.deepcopy(model)
    model.zero_grad()
    loss = torch.zeros(())
    for (ti, leaf), names in zip(forest.leaves(), _node_of_token(forest), strict=True):
        ids = forest.trees[ti].context(leaf.id)
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
        for i in range(1, len(ids)):
            if names[i] is not None:
                loss = loss - HAND[names[i]] * logp[i - 1, ids[i]] / POLICY_TOKENS
    loss.backward()
    return [-lr * p.grad for p in model.parameters()]


@pytest.mark.parametrize("packing", ["off", "on"])
def test_gigpo_update_is_the_hand_derived_policy_gradient(tiny_model_dir: Path, packing: str) -> None:
    """One update on :func:`three_chains`: the logged policy loss is the hand value (ratio 1, token
    mean: 11/60; without the step term 2/15, grouped by the context 19/120) and the parameters move
    by exactly the hand-derived advantages' policy gradient."""
    model = load_model(tiny_model_dir)
    start = [p.detach().clone() for p in model.parameters()]
    lr = 1.0
    expected = _expected_step(model, three_chains(), lr)
    cfg = make_config({"packing": packing, "kl_coef": 0.0, "entropy_coef": 0.0, "grad_clip": 1e9,
                       "micro_batch_tokens": 4096, "advantage": "gigpo", "gamma": 0.5})  # fmt: skip
    loss_cfg = LossConfig(kl_coef=0.0, entropy_coef=0.0, agg_mode="token-mean")
    forest = three_chains()
    advs = [token_advantages(forest, cfg.estimator, advantage_config(cfg))]
    metrics = update(Policy(model, None), torch.optim.SGD(model.parameters(), lr=lr), [forest], advs, cfg, loss_cfg, PAD)
    assert metrics["update/packed"] == (1.0 if packing == "on" else 0.0)
    assert metrics["loss/policy"] == pytest.approx(HAND_LOSS, abs=1e-6)
    moved = [p.detach() - s for p, s in zip(model.parameters(), start, strict=True)]
    scale = max(float(e.abs().max()) for e in expected)
    assert scale > 1e-4  # the step does something
    for m, e in zip(moved, expected, strict=True):
        assert float((m - e).abs().max()) <= 1e-5 * scale + 1e-8


@pytest.mark.parametrize(
    ("sampler", "advantage"), [("chain", "gigpo"), ("tree", "gigpo"), ("tree", "tree_gigpo")]
)
def test_gigpo_runs_train_and_log_anchor_groups(
    tiny_model_dir: Path, tmp_path: Path, sampler: str, advantage: str
) -> None:
    out = tmp_path / "run"
    cfg = small_cfg(
        out,
        sampler=sampler,
        group_size=3,
        advantage=advantage,
        dump_rollouts_every=1,
        save_every=0,
        gamma=0.9,
    )
    s = train(cfg, parts=parts_for(tiny_model_dir))
    assert s.steps == 2 and s.trajectories == 2 * 2 * (3 if sampler == "chain" else 4)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    for r in rows[1:]:
        assert 0.0 <= r["gigpo/shared_anchor_frac"] <= 1.0 and r["gigpo/anchor_group_size"] >= 1.0
        assert "loss/policy" in r
    forests = read_forests(out / "rollouts" / "step_00002.jsonl")
    # every first step shares the prompt: at least those steps have anchor peers
    assert rows[2]["gigpo/shared_anchor_frac"] == pytest.approx(shared_anchor_stats(forests)["shared_frac"])
    assert rows[2]["gigpo/shared_anchor_frac"] > 0


def test_default_runs_log_no_gigpo_metrics(tiny_model_dir: Path, tmp_path: Path) -> None:
    train(small_cfg(tmp_path / "run", save_every=0, dump_rollouts_every=1), parts=parts_for(tiny_model_dir))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert not any(k.startswith("gigpo/") for r in rows for k in r)
    forests = read_forests(tmp_path / "run" / "rollouts" / "step_00002.jsonl")
    assert not any("anchor_group" in n.extra for f in forests for t in f.trees for n in t.nodes)


def test_verl_agent_names_reach_the_config() -> None:
    cfg = make_config(
        {"advantage": "gigpo"},
        parse_set(["gigpo.mode=mean_std_norm", "gigpo.step_advantage_w=0.5", "algorithm.gamma=0.8",
                   "gigpo.enable_similarity=true", "gigpo.similarity_thresh=0.9"]),
    )  # fmt: skip
    a = advantage_config(cfg)
    assert (a.mode, a.step_advantage_w, a.gamma, a.enable_similarity, a.similarity_thresh) == (
        "mean_std_norm",
        0.5,
        0.8,
        True,
        0.9,
    )
    d = make_config({}).model_dump()
    assert (
        d["gamma"],
        d["step_advantage_w"],
        d["gigpo_mode"],
        d["enable_similarity"],
        d["similarity_thresh"],
    ) == (0.95, 1.0, "mean_norm", False, 0.95)
    for bad in ({"gigpo_mode": "std"}, {"similarity_thresh": 1.0}, {"gamma": -0.1}, {"gigpo_anchor": "history"}):
        with pytest.raises(ConfigError):
            make_config(bad)


def test_the_anchor_reaches_the_estimator_and_eptree_is_refused() -> None:
    assert make_config({}).gigpo_anchor == "observation" and AdvantageConfig().anchor == "observation"
    for anchor in ("observation", "context", "state"):
        assert advantage_config(make_config({"gigpo_anchor": anchor})).anchor == anchor
    for est in ("gigpo", "tree_gigpo"):
        with pytest.raises(ConfigError, match="token segments") as e:
            make_config({"sampler": "eptree", "advantage": est})
        assert "\n" not in str(e.value)
    assert make_config({"sampler": "eptree"}).estimator == "treerl"  # the default is unaffected
