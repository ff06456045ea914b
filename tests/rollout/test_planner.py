"""The budget planner: shape choice and predicted cost, with hand-derived values."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from treegrpo.cli import app
from treegrpo.rollout import planner
from treegrpo.rollout.planner import PAPER_PAIRS, choose_shape, make_plan, predicted_cost, trajectories


def test_predicted_cost_by_hand() -> None:
    # M·(1 + L·N·f)
    assert predicted_cost(2, 2, 1, 0.5) == pytest.approx(4.0)
    assert predicted_cost(4, 5, 1, 0.5) == pytest.approx(14.0)
    assert predicted_cost(2, 6, 1, 0.7) == pytest.approx(2 * (1 + 4.2))
    assert predicted_cost(3, 2, 2, 0.5) == pytest.approx(3 * (1 + 2))
    assert predicted_cost(4, 0, 0) == 4.0  # plain chains
    assert trajectories(2, 2, 1) == 6 and trajectories(4, 5, 1) == 24 and trajectories(3, 2, 2) == 15
    with pytest.raises(ValueError):
        predicted_cost(0, 1, 1)


@pytest.mark.parametrize("budget", sorted(PAPER_PAIRS))
def test_paper_pairs(budget: int) -> None:
    m, n, l, source = choose_shape(budget)
    assert (m, n, l) == PAPER_PAIRS[budget] and source == "paper"


def test_rule_reproduces_paper_pairs_except_16() -> None:
    # M = floor(sqrt(B)), N = floor((B/M - 1) / (L f)) with f = 0.5
    assert choose_shape(2, use_paper=False) == (1, 2, 1, "rule")  # (2/1 - 1)/0.5 = 2
    assert choose_shape(4, use_paper=False) == (2, 2, 1, "rule")  # (4/2 - 1)/0.5 = 2
    assert choose_shape(8, use_paper=False) == (2, 6, 1, "rule")  # (8/2 - 1)/0.5 = 6
    assert choose_shape(16, use_paper=False) == (4, 6, 1, "rule")  # (16/4 - 1)/0.5 = 6 (paper: 5)


def test_rule_for_other_budgets() -> None:
    assert choose_shape(3) == (1, 4, 1, "rule")  # M=1, (3-1)/0.5 = 4
    assert choose_shape(6) == (2, 4, 1, "rule")  # M=2, (3-1)/0.5 = 4
    assert choose_shape(12) == (3, 6, 1, "rule")  # M=3, (4-1)/0.5 = 6
    assert choose_shape(12, l=2) == (3, 3, 2, "rule")  # (4-1)/(2·0.5) = 3
    assert choose_shape(1.5) == (1, 1, 1, "rule")  # (1.5-1)/0.5 = 1
    assert choose_shape(1) == (1, 0, 0, "chain")  # no expansion fits
    assert choose_shape(1.4) == (1, 0, 0, "chain")


def test_measured_f_overrides_a_paper_pair_that_does_not_fit() -> None:
    # with f = 0.7 the paper's (2,2,1) costs 2·(1 + 1.4) = 4.8 > 4: the rule takes over
    assert choose_shape(4, f=0.7) == (2, 1, 1, "rule")  # (2 - 1)/0.7 = 1.43 -> 1
    assert choose_shape(8, f=0.7) == (2, 4, 1, "rule")  # (4 - 1)/0.7 = 4.29 -> 4
    assert choose_shape(16, f=0.7) == (4, 4, 1, "rule")  # (4 - 1)/0.7 = 4.29 -> 4; paper (4,5,1) costs 18


def test_the_design_docs_rule_is_the_planners() -> None:
    """docs/design.md §6 "Matching budgets" states what choose_shape computes: its worked cases,
    derived by hand from the doc's three steps, and the doc's formulas, verbatim."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "design.md").read_text()
    section = doc[doc.index("**Matching budgets**") : doc.index("## 7.")]
    for text in ("cost(M, N, L) = M · (1 + L · N · f)", "N = ⌊(B/M − 1)/(L·f)⌋ ≥ 1", "M = ⌊√B⌋, ⌊√B⌋ − 1, …, 1",
                 "the pair's cost at `f` is at most B", "⌊B⌋ chains (at least one)"):  # fmt: skip
        assert text in section, text
    # f = 1.5, B = 4: step 1, the pair (2,2,1) costs 2·(1 + 2·1.5) = 8 > 4; step 2, M = ⌊√4⌋ = 2:
    # N = ⌊(4/2 − 1)/1.5⌋ = ⌊0.67⌋ = 0, so M = 1: N = ⌊(4/1 − 1)/1.5⌋ = 2 -> (1,2,1), cost 1·(1 + 2·1.5) = 4
    assert choose_shape(4, f=1.5) == (1, 2, 1, "rule") and predicted_cost(1, 2, 1, 1.5) == pytest.approx(4.0)
    # f = 0.7, B = 4: the pair costs 4.8 > 4; M = 2: N = ⌊(2 − 1)/0.7⌋ = 1 -> (2,1,1), cost 3.4, 4 trajectories
    assert choose_shape(4, f=0.7) == (2, 1, 1, "rule") and predicted_cost(2, 1, 1, 0.7) == pytest.approx(3.4)
    assert trajectories(2, 1, 1) == 4
    # step 3: B = 2.9 at f = 3: M = 1, N = ⌊(2.9 − 1)/3⌋ = 0 -> ⌊2.9⌋ = 2 plain chains
    assert choose_shape(2.9, f=3.0) == (2, 0, 0, "chain")
    # the planner's docstring cites that section
    assert "docs/design.md`` §6" in (planner.__doc__ or "")


def test_make_plan_trajectories_and_tokens() -> None:
    p = make_plan(4)
    assert (p.m, p.n, p.l, p.source, p.mode) == (2, 2, 1, "paper", "tree")
    assert p.trajectories == 6 and p.chain_trajectories == 4
    assert p.predicted_cost_chains == pytest.approx(4.0) and p.predicted_tokens is None
    # 400 tokens at 100 tokens per chain = a budget of 4 chains; predicted 2·(1+1)·100 tokens
    p = make_plan(400, unit="tokens", chain_tokens=100)
    assert p.budget_chains == pytest.approx(4.0) and (p.m, p.n, p.l) == (2, 2, 1)
    assert p.predicted_tokens == pytest.approx(400.0)
    # 1400 tokens at 100 = 14 chains: rule M=3, N=floor((14/3 - 1)/0.5)=7 -> cost 3·4.5 = 13.5
    p = make_plan(1400, unit="tokens", chain_tokens=100)
    assert (p.m, p.n, p.l, p.source) == (3, 7, 1, "rule")
    assert p.predicted_cost_chains == pytest.approx(13.5) and p.predicted_tokens == pytest.approx(1350.0)
    assert p.trajectories == 24
    d = p.to_dict()
    assert d["mode"] == "tree" and d["m"] == 3
    with pytest.raises(ValueError):
        make_plan(400, unit="tokens")
    with pytest.raises(ValueError):
        make_plan(0)


def test_plan_cli() -> None:
    res = CliRunner().invoke(app, ["plan", "--budget", "8", "--json"])
    assert res.exit_code == 0, res.output
    assert '"n": 6' in res.output and '"source": "paper"' in res.output
    res = CliRunner().invoke(app, ["plan", "--budget", "6"])
    assert res.exit_code == 0, res.output
    assert "(2,4,1)" in res.output
    res = CliRunner().invoke(app, ["plan", "--budget", "4", "--unit", "bogus"])
    assert res.exit_code == 2


def test_measure_plan_on_the_fixture_model(tiny_model_dir) -> None:
    import torch

    from treegrpo.benchmarks.budget import AgentParts
    from treegrpo.benchmarks.plan import measure_plan
    from treegrpo.envs.search import SearchEnv
    from treegrpo.models.loader import load_model, load_tokenizer
    from treegrpo.rollout.agent import AgentConfig
    from treegrpo.tasks.world.world import PRESETS, build_world

    world = build_world(PRESETS["tiny"])
    env = SearchEnv(world.retriever, topk=2, prompt_template="minimal")
    cfg = AgentConfig(max_turns=2, max_step_tokens=8, max_obs_tokens=32, max_context_tokens=400, use_chat_template=False)
    agent = AgentParts(load_model(tiny_model_dir).eval(), load_tokenizer(tiny_model_dir), env, cfg, world.tasks("train"))
    plan = make_plan(2)
    threads = torch.get_num_threads()
    m = measure_plan(plan, prompts=2, agent=agent)  # one thread while measuring, then restored
    assert torch.get_num_threads() == threads
    assert m["prompts"] == 2 and m["chain"]["chains"] == 2 and m["tree"]["shape"] == [1, 2, 1]
    assert m["chain_tokens"] > 0 and m["predicted_cost_chains"] == pytest.approx(2.0)
    # f_measured reproduces the measured cost through the cost model
    assert predicted_cost(1, 2, 1, m["f_measured"]) == pytest.approx(m["measured_cost_chains"])
    assert m["ratio"] == pytest.approx(m["measured_cost_chains"] / 2.0)
