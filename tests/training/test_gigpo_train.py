"""GiGPO in the one trainer loop: chain and tree runs with ``advantage=gigpo`` / ``tree_gigpo``
train, log GiGPO's anchor diagnostic, and dump forests whose advantages and anchor groups are the
estimator's; verl-agent's option names reach the config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_trainer import parts_for, small_cfg

from treegrpo.algos import score_forest
from treegrpo.algos.gigpo import shared_anchor_stats
from treegrpo.training.config import ConfigError, make_config, parse_set
from treegrpo.training.trainer import advantage_config, train
from treegrpo.tree import read_forests


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
    for f in forests:
        dumped = {
            (ti, n.id): (n.advantage, n.extra["anchor_group"])
            for ti, t in enumerate(f.trees)
            for n in t.nodes
            if n.parent is not None
        }
        score_forest(f, advantage, advantage_config(cfg))
        again = {
            (ti, n.id): (n.advantage, n.extra["anchor_group"])
            for ti, t in enumerate(f.trees)
            for n in t.nodes
            if n.parent is not None
        }
        assert dumped.keys() == again.keys() and all(v is not None for v, _ in dumped.values())
        for k, (a, g) in dumped.items():
            assert a == pytest.approx(again[k][0], abs=1e-6) and g == again[k][1]


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
    for bad in ({"gigpo_mode": "std"}, {"similarity_thresh": 1.0}, {"gamma": -0.1}):
        with pytest.raises(ConfigError):
            make_config(bad)
