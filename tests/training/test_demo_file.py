"""Your own demonstrations (training/demo_file.py, docs/tools.md): both forms — a message list and
question/steps — run through the example's calculator tools, and every bad demonstration is one
line naming the file and the demonstration."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from treegrpo import ConfigError, ToolEnv
from treegrpo.training.demo_file import read_demos

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "calculator" / "tools.py"
_spec = importlib.util.spec_from_file_location("calculator_example_tools", EXAMPLE)
calc = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(calc)  # type: ignore[union-attr]

QUESTION = "What is 3 times the area of Quell?"
STEPS = [
    {"tool": "lookup", "arguments": {"place": "Quell", "fact": "area"}},
    {"tool": "calculator", "arguments": {"expression": "12 * 3"}, "thought": "now multiply"},
    {"answer": "36"},
]


def call(name: str, arguments: object) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


MESSAGES = [
    {"role": "system", "content": "You answer with tools."},
    {"role": "user", "content": QUESTION},
    {"role": "assistant", "content": "", "tool_calls": [call("lookup", {"place": "Quell", "fact": "area"})]},
    {"role": "tool", "content": "999"},  # a wrong result: tool messages are recomputed, never trusted
    {"role": "assistant", "content": "now multiply", "tool_calls": [call("calculator", '{"expression": "12 * 3"}')]},
    {"role": "assistant", "content": "36"},
]


@pytest.fixture
def env() -> ToolEnv:
    return ToolEnv(tools=[calc.calculator, calc.lookup], rewards=[calc.reward])


def write(path: Path, *records: object) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_a_message_list_runs_through_the_tools(env: ToolEnv, tmp_path: Path) -> None:
    """The message-list form is the question/steps form of the same demonstration: the same step
    texts, the tools' own results (the demo's wrong tool message is ignored), the reward of its answer."""
    chat, steps = read_demos(env, write(tmp_path / "demos.jsonl", {"messages": MESSAGES, "answer": "36"}, {"question": QUESTION, "answer": "36", "steps": STEPS}), 4)
    assert chat.steps == steps.steps and chat.task.question == QUESTION == steps.task.question
    (t1, o1), (t2, o2), (t3, o3) = chat.steps
    assert t1 == '<tool_call>{"name": "lookup", "arguments": {"place": "Quell", "fact": "area"}}</tool_call>'
    assert "12" in o1 and "999" not in o1  # lookup's own result
    assert t2.startswith("now multiply\n<tool_call>") and "36" in o2
    assert t3 == "<answer> 36 </answer>" and o3 is None
    assert chat.reward == steps.reward == 1.0
    wrong = read_demos(env, [{"messages": MESSAGES, "answer": "37"}], 4)[0]  # the demo's own row feeds the reward
    assert wrong.reward == 0.0 and wrong.task.id == "demo-0"


def test_several_calls_in_one_assistant_message_are_steps_in_order(env: ToolEnv) -> None:
    msgs = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "", "tool_calls": [call("lookup", {"place": "Quell", "fact": "area"}), call("calculator", {"expression": "12 * 3"})]},
        {"role": "assistant", "content": "36"},
    ]  # fmt: skip
    (demo,) = read_demos(env, [{"messages": msgs, "answer": "36"}], 4)
    assert [t.split('"name": ')[1].split(",")[0] for t, _ in demo.steps[:2]] == ['"lookup"', '"calculator"']


BAD = [
    # (records, max_turns, what the one line says)
    (["{not json"], 4, "demos.jsonl: row 1"),
    ([{"question": QUESTION, "answer": "36", "steps": STEPS[:2]}], 4, "demos.jsonl: demo 1: the demonstration does not end with an answer"),
    ([{"messages": MESSAGES[:5], "answer": "36"}], 4, "demos.jsonl: demo 1: the demonstration does not end with an answer"),
    ([{"question": QUESTION, "answer": "8", "steps": [{"tool": "calculator", "arguments": {"expression": "2 ** 3"}}, {"answer": "8"}]}], 4,
     "demos.jsonl: demo 1: step 1 is not a valid action: "),
    ([{"question": QUESTION, "answer": "1", "steps": [{"tool": "nope", "arguments": {}}, {"answer": "1"}]}], 4, "demo 1: step 1 is not a valid action"),
    ([{"question": QUESTION, "answer": "36", "steps": [{"answer": "36"}, {"answer": "36"}]}], 4, "demo 1: step 1 ends the trajectory (answer) but 1 more follow"),
    ([{"question": QUESTION, "answer": "36", "steps": STEPS}], 1, "demo 1: 2 tool steps, more than max_turns=1: raise max_turns"),
    ([{"question": QUESTION, "answer": "36"}], 4, "demo 1: give 'messages' (a chat) or 'question' and 'steps'"),
    ([{"question": QUESTION, "answer": "36", "steps": []}], 4, "demo 1: 'steps' must be a non-empty list"),
    ([{"question": QUESTION, "answer": "36", "steps": [42]}], 4, "demo 1, step 1: a step must be a string or an object"),
    ([{"question": QUESTION, "answer": "36", "steps": [{"say": "hi"}]}], 4, "demo 1, step 1: a step object needs 'tool'"),
    ([{"messages": [MESSAGES[1], {"role": "assistant", "content": "hm"}, MESSAGES[-1]], "answer": "36"}], 4,
     "demo 1: assistant message 1 has no tool_calls but is not the last one"),
    ([{"messages": [MESSAGES[1], {"role": "assistant", "content": "", "tool_calls": [call("calculator", "{oops")]}, MESSAGES[-1]]}], 4,
     "demo 1: the arguments of calculator are not JSON"),
    ([{"messages": [{"role": "assistant", "content": "36"}], "answer": "36"}], 4, "demo 1: 'messages' needs a user message with the question"),
    ([{"messages": "What is 2 + 2?"}], 4, "demo 1: 'messages' must be a list of chat messages"),
    ([{"question": QUESTION, "answer": "36", "steps": STEPS}, ["not", "an", "object"]], 4, "demos.jsonl: row 2"),
    ([], 4, "demos.jsonl: holds no demonstrations"),
]  # fmt: skip


@pytest.mark.parametrize(("records", "max_turns", "says"), BAD, ids=[b[2][:48] for b in BAD])
def test_a_bad_demo_file_is_one_line_naming_the_demo(env: ToolEnv, tmp_path: Path, records: list, max_turns: int, says: str) -> None:
    path = write(tmp_path / "demos.jsonl", *records) if records else tmp_path / "demos.jsonl"
    if not records:
        path.write_text("")
    with pytest.raises(ConfigError) as e:
        read_demos(env, path, max_turns)
    msg = str(e.value)
    assert "\n" not in msg and says in msg and msg.startswith(str(path)), msg


def test_the_failing_tools_error_is_in_the_line(env: ToolEnv) -> None:
    """A tool that raises: the line carries the tool's own error (what the model would have been shown)."""
    demo = {"question": "x", "answer": "8", "steps": [{"tool": "calculator", "arguments": {"expression": "2 ** 3"}}, {"answer": "8"}]}
    with pytest.raises(ConfigError, match="use whole numbers"):
        read_demos(env, [demo], 4)
