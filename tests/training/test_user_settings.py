"""What a caller sets is what runs (issue: settings silently overridden): a task family's fixed
loop settings take the user's fields on top, the run records the settings it used, and a
trajectory with any declared tool counts as well formed."""

from __future__ import annotations

from treegrpo.envs.tool_env import ToolEnv
from treegrpo.rollout.agent import AgentConfig
from treegrpo.training.config import make_config
from treegrpo.training.evaluate import action_kinds, turns_ended, well_formed
from treegrpo.training.setup import recorded_agent_fields, user_agent_fields
from treegrpo.tree import Forest, Node, Tree


def test_a_familys_fixed_agent_takes_the_fields_the_user_set() -> None:
    family = AgentConfig(max_turns=4, temperature=1.0, top_p=1.0, obs_format="inline", max_step_tokens=48)
    cfg = make_config({"temperature": 0.7, "top_p": 0.9, "obs_format": "chat"})
    agent = user_agent_fields(family, cfg)
    assert (agent.temperature, agent.top_p, agent.obs_format, agent.max_step_tokens) == (0.7, 0.9, "chat", 48)
    assert user_agent_fields(family, make_config({})) == family  # nothing set: the family's own


def test_the_run_records_the_settings_it_used() -> None:
    taught = AgentConfig(max_turns=3, max_obs_tokens=160, obs_format="chat")
    cfg = recorded_agent_fields(make_config({"temperature": 0.5}), taught)
    assert (cfg.max_turns, cfg.max_obs_tokens, cfg.obs_format, cfg.temperature) == (3, 160, "chat", 0.5)
    set_by_user = recorded_agent_fields(make_config({"max_turns": 2}), taught)
    assert set_by_user.max_turns == 2


def add(a: int) -> int:
    """Identity.

    Args:
        a: a number
    """
    return a


def _tree(kinds: list[str]) -> Tree:
    t = Tree([Node(0, None, text="q", tokens=[1], policy_mask=[0])])
    for i, k in enumerate(kinds, 1):
        t.add(Node(i, i - 1, text="s", tokens=[2], policy_mask=[1], reward=1.0 if i == len(kinds) else None, extra={"kind": k}))
    return t


def test_well_formed_counts_every_declared_action() -> None:
    """A SQL, key-value or user tool step is a valid action (it counted as malformed: 0.0
    well-formed with 1.0 tool calls)."""
    kinds = action_kinds(ToolEnv([add]))
    assert kinds == ("tool", "answer")
    assert well_formed(_tree(["tool", "tool", "answer"]), 3, kinds)
    assert not well_formed(_tree(["tool", "invalid", "answer"]), 3, kinds)
    assert not well_formed(_tree(["tool", "tool"]), 2, kinds)  # no answer
    from treegrpo.tasks.sql.env import SqlEnv

    assert well_formed(_tree(["sql", "answer"]), 2, action_kinds(SqlEnv.__new__(SqlEnv)))
    assert not well_formed(_tree(["sql", "answer"]), 2)  # the search env's kinds alone


def test_turns_ended_counts_the_turns_the_model_ended_itself() -> None:
    """eos and stop end a turn by themselves; a turn cut at the step cap (length) does not; the
    prompt and an overflow leaf (no model turn) are not turns. By hand: 3 of 5 turns."""

    def step(i: int, parent: int, reason: str, kind: str = "tool") -> Node:
        return Node(i, parent, tokens=[1], policy_mask=[1], extra={"kind": kind, "finish_reason": reason})

    a = Tree([Node(0, None, tokens=[9], policy_mask=[0]), step(1, 0, "eos"), step(2, 1, "length"), step(3, 1, "stop")])
    b = Tree([Node(0, None, tokens=[9], policy_mask=[0]), step(1, 0, "length"), step(2, 1, "eos", "answer")])
    b.add(Node(3, 2, tokens=[], policy_mask=[], extra={"kind": "overflow", "finish_reason": "length"}))
    assert turns_ended([Forest("p", [a, b])]) == 3 / 5
    assert turns_ended([]) == 0.0
