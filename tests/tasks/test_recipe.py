"""The one tiny-agent recipe (:mod:`treegrpo.tasks.recipe`): what the families configure — their
settings (defaults, warm-up, cache key, records), their measurement figures — is what it was
when each family wrote the recipe out itself."""

from __future__ import annotations

import dataclasses
import json

import pytest

from treegrpo.envs.base import Task
from treegrpo.rollout.agent import AgentConfig, Budget, RolloutResult
from treegrpo.tasks import recipe
from treegrpo.tasks.arith.bootstrap import WEIGHT_MODULES as ARITH_MODULES
from treegrpo.tasks.arith.bootstrap import ArithBootstrapConfig, arith_metrics
from treegrpo.tasks.arith.problems import ArithConfig
from treegrpo.tasks.sql.bootstrap import WEIGHT_MODULES as SQL_MODULES
from treegrpo.tasks.sql.bootstrap import SqlBootstrapConfig, sql_metrics
from treegrpo.tasks.sql.problems import SqlConfig
from treegrpo.tasks.world.bootstrap import WEIGHT_MODULES as WORLD_MODULES
from treegrpo.tasks.world.bootstrap import BootstrapConfig, search_metrics
from treegrpo.training.warmup import WarmupConfig
from treegrpo.tree import Forest, Node, Tree

# Each family's model, warm-up and loop settings as the three bootstraps wrote them out before the
# recipe was shared (commit ca2f19a): what the inherited defaults must still give.
FAMILY_DEFAULTS = {
    BootstrapConfig: dict(
        vocab_size=3000, hidden_size=96, layers=3, heads=4, kv_heads=2, intermediate_size=256, max_positions=1024,
        epochs=6, batch_size=32, pack_len=256, lr=3e-3, n_eval=None, max_turns=4, max_step_tokens=48,
        max_obs_tokens=160, max_context_tokens=1024,
    ),
    ArithBootstrapConfig: dict(
        vocab_size=320, hidden_size=96, layers=2, heads=4, kv_heads=2, intermediate_size=256, max_positions=256,
        epochs=3, batch_size=32, pack_len=256, lr=3e-3, n_eval=256,
    ),
    SqlBootstrapConfig: dict(
        vocab_size=700, hidden_size=96, layers=2, heads=4, kv_heads=2, intermediate_size=256, max_positions=384,
        epochs=4, batch_size=32, pack_len=384, lr=3e-3, n_eval=200, max_turns=4, max_step_tokens=40,
        max_obs_tokens=32, max_context_tokens=384,
    ),
}  # fmt: skip


@pytest.mark.parametrize("cls", list(FAMILY_DEFAULTS), ids=lambda c: c.__name__)
def test_family_defaults_are_the_recipes_they_were(cls: type) -> None:
    cfg = cls()
    assert {k: getattr(cfg, k) for k in FAMILY_DEFAULTS[cls]} == FAMILY_DEFAULTS[cls]
    warm = cfg.warmup_config()
    assert type(warm) is WarmupConfig
    assert (warm.epochs, warm.pack_len, warm.lr_decay_frac, warm.decision_weight, warm.micro_batch_size) == (
        FAMILY_DEFAULTS[cls]["epochs"], FAMILY_DEFAULTS[cls]["pack_len"], 0.25, 1.0, 0,
    )  # fmt: skip


def test_arith_agent_is_one_turn_of_max_new_tokens() -> None:
    agent = ArithBootstrapConfig(max_new_tokens=20, max_positions=200).agent_config(0.0)
    assert (agent.max_turns, agent.max_step_tokens, agent.max_obs_tokens, agent.max_context_tokens) == (
        1,
        20,
        1,
        200,
    )
    assert agent.temperature == 0.0 and not agent.use_chat_template


def test_loop_agent_follows_the_limits() -> None:
    agent = SqlBootstrapConfig(max_turns=3, max_step_tokens=30).agent_config(0.5)
    assert agent == AgentConfig(
        max_turns=3,
        max_step_tokens=30,
        max_obs_tokens=32,
        max_context_tokens=384,
        temperature=0.5,
        use_chat_template=False,
    )


def test_from_dict_rebuilds_the_nested_problems_and_ignores_unknown_keys() -> None:
    cfg = ArithBootstrapConfig(problems=ArithConfig(n_eval=8), n_demos=300, epochs=1)
    back = ArithBootstrapConfig.from_dict({**cfg.to_dict(), "no_such_knob": 1})
    assert back == cfg and isinstance(back.problems, ArithConfig)
    old_record = {k: v for k, v in cfg.to_dict().items() if k not in ("pack_len", "micro_batch_size")}
    assert ArithBootstrapConfig.from_dict(old_record) == cfg  # a record written before those keys


def test_cache_key_follows_settings_and_code(monkeypatch: pytest.MonkeyPatch) -> None:
    key = SqlBootstrapConfig().config_hash()
    assert SqlBootstrapConfig(seed=1).config_hash() != key
    assert recipe.cache_folder("sql", SqlBootstrapConfig()).name == f"sql-{key}"
    monkeypatch.setattr(recipe, "code_fingerprint", lambda mods: "other-code")
    assert SqlBootstrapConfig().config_hash() != key


@pytest.mark.parametrize("modules", [ARITH_MODULES, SQL_MODULES, WORLD_MODULES])
def test_every_family_hashes_the_shared_recipe_code(modules: tuple[str, ...]) -> None:
    assert set(recipe.RECIPE_MODULES) <= set(modules)
    assert "treegrpo.tasks.recipe" in modules and "treegrpo.training.warmup" in modules


def _result() -> tuple[list[Task], RolloutResult]:
    """Four one-chain tasks: a 2-hop answered right after 2 searches, a 2-hop answered wrong after
    1 search, a 1-hop answered right without searching, a 1-hop cut off (invalid)."""
    spec = [  # (hops, reward, leaf kind, text, tool calls, invalid actions, generated tokens)
        (2, 1.0, "answer", "<search>a</search>", 2, 0, 10),
        (2, 0.0, "answer", "<answer>x</answer>", 1, 0, 6),
        (1, 1.0, "answer", "<answer>y</answer>", 0, 0, 4),
        (1, 0.0, "invalid", "oops", 0, 1, 20),
    ]
    tasks, forests, budgets = [], [], []
    for i, (hops, r, kind, text, calls, invalid, gen) in enumerate(spec):
        tasks.append(Task(f"t{i}", "q", ["a"], "x", {"hops": hops}))
        leaf = Node(id=1, parent=0, text=text, reward=r, extra={"kind": kind})
        forests.append(Forest(f"t{i}", [Tree([Node(id=0, parent=None), leaf])]))
        budgets.append(Budget(generated_tokens=gen, tool_calls=calls, invalid_actions=invalid))
    return tasks, RolloutResult(forests, budgets, wall_s=2.5)


def test_chain_summary_gives_the_named_figures_in_order() -> None:
    _, res = _result()
    out = recipe.chain_summary(res, ("n", "success", "answered", "tool_calls", "extra"), extra=7)
    assert list(out) == ["n", "success", "answered", "tool_calls", "extra"]
    assert out == {"n": 4, "success": 0.5, "answered": 0.75, "tool_calls": 0.75, "extra": 7}
    with pytest.raises(KeyError):
        recipe.chain_summary(res, ("no_such_figure",))


def test_family_metrics_are_the_figures_each_reported() -> None:
    tasks, res = _result()
    assert list(arith_metrics(tasks, res)) == [
        "success",
        "answered",
        "guess",
        "generated_tokens",
        "n",
        "wall_s",
    ]
    assert arith_metrics(tasks, res)["guess"] == 0.5  # two leaves start with <answer>
    assert list(sql_metrics(tasks, res)) == [
        "success", "state_ok", "answered", "tool_calls", "generated_tokens", "n", "wall_s",
    ]  # fmt: skip
    world = search_metrics(tasks, res)
    assert world == {
        "success": 0.5,
        "success_by_hops": {"1": 0.5, "2": 0.5},
        "tool_calls": 0.75,
        "answer_after_one_search": 0.25,
        "early_answer": 0.5,  # of the two 2-hop chains, one answered after 1 search
        "no_search_answer": 0.25,
        "invalid_actions": 0.25,
        "generated_tokens": 10.0,
        "n": 4,
        "wall_s": 2.5,
    }


def test_a_family_config_must_say_its_agent_loop() -> None:
    @dataclasses.dataclass(frozen=True)
    class Bare(recipe.RecipeConfig):
        pass

    with pytest.raises(NotImplementedError, match="Bare"):
        Bare().agent_config()


def test_settings_records_read_back_tuples_and_nested_settings() -> None:
    cfg = ArithConfig(ops=("+",), n_eval=8)
    record = json.loads(json.dumps(ArithBootstrapConfig(problems=cfg).to_dict()))  # tuples become lists
    assert record["problems"]["ops"] == ["+"]
    back = ArithBootstrapConfig.from_dict(record)
    assert back.problems == cfg and back.problems.ops == ("+",)
    assert SqlConfig.from_dict({"kinds": ["deposit"], "n_eval": 3}) == SqlConfig(kinds=("deposit",), n_eval=3)
