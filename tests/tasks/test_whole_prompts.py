"""Prompts kept whole (issue 40 item 1): a row's ``prompt`` of chat messages — a system message,
earlier turns, context — is rendered as given by the chat template (or, without one, as one text
with the same content); Search-R1/verl rows keep the ``Question:`` rule; the question path renders
exactly as before."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from templating import templated
from treegrpo.envs.base import Task
from treegrpo.envs.reward_fns import given_prompt
from treegrpo.envs.search import SEARCH_R1_PROMPT
from treegrpo.envs.tool_env import TOOLS_PROMPT, ToolEnv
from treegrpo.models.loader import load_tokenizer
from treegrpo.rollout.agent import AgentConfig, StepRunner
from treegrpo.tasks.custom import rows_to_tasks
from treegrpo.tasks.datafile import DataError


def add(a: int, b: int) -> int:
    """Add two whole numbers.

    Args:
        a: the first
        b: the second
    """
    return a + b


MESSAGES = [
    {"role": "system", "content": "You are a careful accountant. Answer with a number."},
    {"role": "user", "content": "Hi."},
    {"role": "assistant", "content": "Hello. What shall I add?"},
    {"role": "user", "content": "Context: the shop sold 17 apples and 23 pears. Question: how many fruits?"},
]
ROW = {"id": "r0", "prompt": MESSAGES, "answer": "40", "level": 2}


@pytest.fixture(scope="module")
def smollm2(smollm2_2layer_dir: Path) -> Any:
    return load_tokenizer(smollm2_2layer_dir)


def runner(env: ToolEnv, tok: Any) -> StepRunner:
    return StepRunner(None, env, tok, AgentConfig(max_context_tokens=4096))  # type: ignore[arg-type]  # prompts only


def tools_text(env: ToolEnv) -> str:
    return "\n".join(json.dumps(s["function"], ensure_ascii=False) for s in env.tool_schemas)


def test_chat_messages_are_rendered_as_given_by_the_template(smollm2: Any) -> None:
    """Native protocol: the ids are the template's rendering of the row's own messages (the old code
    kept only what followed "Question:" — "how many fruits?" — and dropped the system message)."""
    tok = templated(smollm2, "chatml-tools")
    env = ToolEnv([add], rewards=["em"], protocol="tools", tokenizer=tok)
    (task,) = rows_to_tasks([ROW], "rows")
    want = tok.apply_chat_template(MESSAGES, tools=env.tool_schemas, add_generation_prompt=True, tokenize=False)
    assert runner(env, tok).prompt_ids(task) == tok.encode(want, add_special_tokens=False)
    assert "careful accountant" in want and "17 apples" in want
    assert task.question == MESSAGES[-1]["content"]  # the last user message, whole


def test_tag_protocol_sets_the_last_user_message_in_its_template(smollm2: Any, tiny_model_dir: Path) -> None:
    """Tag protocol: the same messages, the last user message's content standing for {question} in
    the tag prompt (with the tools); without a chat template the messages' contents joined by blank
    lines."""
    tok = templated(smollm2, "chatml-tools")
    env = ToolEnv([add], rewards=["em"], tokenizer=tok)
    (task,) = rows_to_tasks([ROW], "rows")
    last = TOOLS_PROMPT.format(question=MESSAGES[-1]["content"], tools=tools_text(env))
    msgs = [*MESSAGES[:-1], {"role": "user", "content": last}]
    assert env.prompt_messages(task) == msgs
    want = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert runner(env, tok).prompt_ids(task) == tok.encode(want, add_special_tokens=False)
    tiny = load_tokenizer(tiny_model_dir)
    assert not getattr(tiny, "chat_template", None)
    text = "\n\n".join(m["content"] for m in MESSAGES[:-1]) + "\n\n" + last
    assert env.prompt(task) == text
    assert runner(env, tiny).prompt_ids(task) == tiny.encode(text, add_special_tokens=False)
    assert MESSAGES[-1]["content"] == ROW["prompt"][-1]["content"]  # the row itself is not changed


def test_a_string_prompt_is_one_user_message(smollm2: Any) -> None:
    tok = templated(smollm2, "chatml-tools")
    env = ToolEnv([add], rewards=["em"], protocol="tools", tokenizer=tok)
    (task,) = rows_to_tasks([{"prompt": "Context: 2 and 3. Question: the sum?", "answer": "5"}], "rows")
    assert env.prompt_messages(task) == [{"role": "user", "content": "Context: 2 and 3. Question: the sum?"}]


def test_search_r1_rows_keep_the_question_rule() -> None:
    """A row with data_source / reward_model is Search-R1's: its question follows "Question:" and
    the prompt is the env's own (Search-R1's instruction is for its <search> tags, not these tools)."""
    row = {
        "data_source": "nq",
        "prompt": [{"role": "user", "content": SEARCH_R1_PROMPT.format(question="who wrote hamlet?")}],
        "reward_model": {"style": "rule", "ground_truth": {"target": ["Shakespeare"]}},
    }
    (task,) = rows_to_tasks([row], "rows")
    assert task.question == "who wrote hamlet?" and task.answers == ["Shakespeare"]
    assert given_prompt(task) is None
    env = ToolEnv([add], rewards=["em"])
    assert env.prompt_messages(task) == [{"role": "user", "content": env.prompt(task)}]
    assert env.prompt(task) == TOOLS_PROMPT.format(question="who wrote hamlet?", tools=tools_text(env))


def test_the_question_path_renders_as_before(smollm2: Any, tiny_model_dir: Path) -> None:
    """A question row (no prompt column) renders bit-identically to the one-user-message formula
    the loop always used, with and without a chat template, in both protocols."""
    task = rows_to_tasks([{"question": "What is 2 + 3?", "answer": "5"}], "rows")[0]
    for tok in (load_tokenizer(tiny_model_dir), templated(smollm2, "chatml-tools"), templated(smollm2, "qwen2.5")):
        for protocol in (("tags", "tools") if getattr(tok, "chat_template", None) else ("tags",)):
            env = ToolEnv([add], rewards=["em"], protocol=protocol, tokenizer=tok)  # type: ignore[arg-type]
            r = runner(env, tok)
            text = env.prompt(task)
            if getattr(tok, "chat_template", None):
                kw = {"tools": env.tool_schemas} if protocol == "tools" else {}
                text = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False, **kw)
            assert r.prompt_ids(task) == tok.encode(text, add_special_tokens=False)
            assert r.new_forest(task, 1).trees[0].nodes[0].text == env.prompt(task)


def test_rewards_get_the_messages_as_given_and_the_columns(tiny_model_dir: Path) -> None:
    """The reward functions' ``prompts`` are the row's messages as given (not the tag template's
    rendering); the gold answer and every other column still arrive by name."""
    seen: dict[str, Any] = {}

    def spy(prompts, completions, answer, answers, level):  # type: ignore[no-untyped-def]
        seen.update(prompts=prompts, answer=answer, answers=answers, level=level)
        return [1.0] * len(completions)

    env = ToolEnv([add], rewards=[spy], tokenizer=load_tokenizer(tiny_model_dir))
    (task,) = rows_to_tasks([ROW], "rows")
    (out,) = env.step([task], ["<answer> 40 </answer>"], [True], messages=[[]])
    assert out.reward == 1.0
    assert seen == {"prompts": [MESSAGES], "answer": ["40"], "answers": [["40"]], "level": [2]}


@pytest.mark.parametrize(
    ("prompt", "error"),
    [
        ([], "field 'prompt' must be a list of chat messages"),
        ([{"role": "user"}], "field 'prompt' must be a list of chat messages"),
        ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "its last message is the question"),
        ("   ", "field 'prompt' is empty"),
    ],
)
def test_a_bad_prompt_is_one_line_naming_the_row(prompt: Any, error: str) -> None:
    with pytest.raises(DataError, match=error) as e:
        rows_to_tasks([{"question": "ok", "answer": "1"}, {"prompt": prompt, "answer": "1"}], "rows.jsonl")
    assert str(e.value).startswith("rows.jsonl: row 2:") and "\n" not in str(e.value)


def test_datafile_tasks_are_search_r1s() -> None:
    """A Search-R1 parquet's tasks (search task) are never rendered whole, with or without data_source."""
    t = Task("x-0", "who?", ["a"], meta={"prompt": [{"role": "user", "content": "Question: who?"}], "reward_model": {}})
    assert given_prompt(t) is None
    assert given_prompt(Task("x-0", "who?", ["a"], data_source="nq", meta={"prompt": "Question: who?"})) is None


def test_a_search_r1_parquet_without_data_source_keeps_the_question_rule(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from treegrpo.tasks.datafile import load_tasks

    row = {"prompt": [{"role": "user", "content": "Search first. Question: who?\n"}],
           "reward_model": {"ground_truth": {"target": ["a"]}}}  # fmt: skip
    pq.write_table(pa.Table.from_pylist([row]), tmp_path / "q.parquet")
    (task,) = load_tasks(tmp_path / "q.parquet")
    assert task.question == "who?" and not task.data_source and given_prompt(task) is None
