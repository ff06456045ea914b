"""ToolEnv in the tag protocol (envs/tool_env.py): a step is a tool call or an answer, every bad
call is data (the model reads the error), answers are scored by the reward functions with the
whole trajectory as messages, and a tool class is one trajectory's state."""

from __future__ import annotations

import pytest

from treegrpo.envs.base import Task, check_env
from treegrpo.envs.state import state_mode
from treegrpo.envs.tool_env import INVALID_TOOL_ACTION, ToolEnv, parse_call, tool_response
from treegrpo.errors import ConfigError


def add(a: int, b: int) -> int:
    """Add.

    Args:
        a: first
        b: second
    """
    return a + b


class Notes:
    """A stateful tool: one notebook per trajectory."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def reset(self, **row: object) -> str | None:
        self.lines = [str(row.get("seed_note", ""))]
        return None

    def write(self, text: str) -> str:
        """Append a note.

        Args:
            text: the note
        """
        self.lines.append(text)
        return f"{len(self.lines)} notes"

    def read(self) -> str:
        """All notes, one per line."""
        return "\n".join(self.lines)

    def get_reward(self) -> float:
        return 0.25 * len(self.lines)


TASK = Task("t0", "What is 2 + 3?", ["5"], meta={"id": "t0", "question": "What is 2 + 3?", "answer": "5", "seed_note": "n0"})


def seen(completions, prompts, **kw):
    return [float(len(c)) for c in completions]  # the number of messages: the history reached it


def test_a_call_runs_and_its_result_comes_back_inline() -> None:
    env = ToolEnv([add])
    check_env(env)
    (out,) = env.step([TASK], ['I add. <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'], [True])
    assert (out.kind, out.done, out.tool_calls) == ("tool", False, 1)
    assert out.observation == tool_response("5") == "\n<tool_response>\n5\n</tool_response>\n"
    assert out.info["messages"] == [
        {"role": "assistant", "content": "I add.", "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
        {"role": "tool", "name": "add", "content": "5"},
    ]


@pytest.mark.parametrize(
    ("payload", "error", "ran"),
    [
        ('{"name": "add", "arguments": {"a": 2}', "not valid JSON", 0),
        ('{"name": "mul", "arguments": {}}', "there is no tool 'mul' (tools: add)", 0),
        ('{"name": "add", "arguments": {"a": 2}}', "add needs the argument b", 0),
        ('{"name": "add", "arguments": {"a": "2", "b": 1}}', "argument a of add must be integer", 0),
        ('["add"]', 'must be a JSON object with a "name"', 0),
    ],
)
def test_bad_calls_are_invalid_actions_the_model_reads(payload: str, error: str, ran: int) -> None:
    (out,) = ToolEnv([add]).step([TASK], [f"<tool_call>{payload}</tool_call>"], [True])
    assert out.kind == "invalid" and not out.done and out.tool_calls == ran
    assert error in out.info["tool_error"] and "Error: " in out.observation


def test_answers_are_scored_with_the_trajectory_as_messages() -> None:
    env = ToolEnv([add], rewards=["em", seen], reward_weights=[1.0, 0.1])
    history = [[{"role": "assistant", "content": "x"}, {"role": "tool", "content": "5"}]]
    (out,) = env.step([TASK], ["<answer> 5 </answer>"], [True], messages=history)
    assert out.kind == "answer" and out.done
    # em 1.0 + 0.1 x 3 messages (two of history, the answer)
    assert out.reward == pytest.approx(1.3) and out.info["rewards"] == {"em": 1.0, "seen": 3.0}
    assert out.info["messages"] == [{"role": "assistant", "content": "5"}]


def test_no_action_and_the_final_turn() -> None:
    env = ToolEnv([add])
    (free, last_call, last_text) = env.step(
        [TASK] * 3, ["hmm", '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>', "hmm"], [True, False, False]
    )
    assert (free.kind, free.done, free.observation) == ("invalid", False, INVALID_TOOL_ACTION)
    assert (last_call.kind, last_call.done, last_call.reward, last_call.tool_calls) == ("tool", True, 0.0, 0)
    assert (last_text.kind, last_text.done, last_text.reward) == ("invalid", True, 0.0)


def last_content(completions, **kw):
    return [float(c[-1]["content"] == "") for c in completions]  # the docs' way to read a final answer: completion[-1]


def test_a_trajectory_ended_with_nothing_written_is_still_an_assistant_turn() -> None:
    """A trajectory the loop ends before the model wrote anything (a context overflow before the first
    step, an end-of-turn at once) reaches the rewards as one empty assistant message, as in TRL —
    a reward reading ``completion[-1]`` once raised IndexError on it, stopping the run."""
    env = ToolEnv([add], rewards=[last_content])
    assert env.score(TASK, "") == 1.0
    reward, info = env.score_outcome(TASK, "", [])
    assert reward == 1.0 and info["rewards"] == {"last_content": 1.0}
    history = [{"role": "assistant", "content": "x"}, {"role": "tool", "content": "5"}]
    assert env.score_outcome(TASK, "", history)[0] == 1.0  # the final turn is the empty one, not the tool's result


def test_the_prompt_lists_the_tools_and_the_protocol() -> None:
    p = ToolEnv([add]).prompt(TASK)
    assert p.startswith("What is 2 + 3?\n\n") and '"name": "add"' in p and "<tool_call>" in p and "<answer>" in p
    assert ToolEnv([add], prompt_template="minimal").prompt(TASK) == "Question: What is 2 + 3?\n"
    with pytest.raises(ConfigError, match="format string with"):
        ToolEnv([add], prompt_template="no placeholder")


def test_parse_call_accepts_llama_parameters_and_string_arguments() -> None:
    assert parse_call('{"name": "f", "parameters": {"x": 1}}') == ("f", {"x": 1})
    assert parse_call('{"name": "f", "arguments": "{\\"x\\": 1}"}') == ("f", {"x": 1})


def test_a_tool_class_is_a_trajectorys_state() -> None:
    env = ToolEnv(environment_factory=Notes, rewards=["em"])
    assert state_mode(env) == "replay"  # neither fork nor snapshot: branches replay their path
    a, b = env.initial_state(TASK), env.initial_state(TASK)
    assert a.obj.lines == ["n0"]  # reset(**row) got the row (a handle: the instance and the thread it lives on)
    write = '<tool_call>{"name": "write", "arguments": {"text": "hello"}}</tool_call>'
    (o1,) = env.step([TASK], [write], [True], states=[a])
    (o2,) = env.step([TASK], ['<tool_call>{"name": "read", "arguments": {}}</tool_call>'], [True], states=[b])
    assert o1.observation == tool_response("2 notes") and o2.observation == tool_response("n0")  # b never saw a's write
    (end,) = env.step([TASK], ["<answer> 5 </answer>"], [True], states=[a])
    assert end.info["rewards"] == {"em": 1.0, "Notes": 0.5} and end.reward == pytest.approx(1.5)  # get_reward: 2 notes
    assert not env.binary_reward


def test_env_needs_tools_and_one_protocol() -> None:
    with pytest.raises(ConfigError, match="no tools"):
        ToolEnv([])
    with pytest.raises(ConfigError, match="choose tags or tools"):
        ToolEnv([add], protocol="xml")  # type: ignore[arg-type]
