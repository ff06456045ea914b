"""Tool calls parsed from hand-written assistant turns (Hermes/Qwen and Llama 3.1 forms), the
tokenizer's response parser where it has one, end-of-turn ids and the assistant message."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from transformers import AddedToken

from treegrpo.models.loader import load_tokenizer
from treegrpo.rollout.templates import set_chat_template
from treegrpo.rollout.toolcall import (
    ToolCall,
    ToolCallError,
    assistant_message,
    end_of_turn_ids,
    parse_tool_calls,
)

PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ROME = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n</tool_call>'
LLAMA_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]


def test_hermes_one_call_and_its_end_of_turn_token() -> None:
    assert parse_tool_calls(PARIS + "<|im_end|>") == ("", [ToolCall("get_weather", {"city": "Paris"})])


def test_hermes_several_calls_in_order_with_the_text_around_them() -> None:
    content, calls = parse_tool_calls(f"Let me check both.\n{PARIS}\n{ROME}\nOne moment.<|im_end|>")
    assert content == "Let me check both.\n\n\nOne moment."
    assert calls == [ToolCall("get_weather", {"city": "Paris"}), ToolCall("get_weather", {"city": "Rome", "days": 2})]


def test_hermes_invalid_json_is_an_error_in_its_place() -> None:
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>'
    content, calls = parse_tool_calls(f"{ROME}\n{bad}\n{PARIS}<|im_end|>")
    assert content == ""
    assert isinstance(calls[0], ToolCall) and isinstance(calls[2], ToolCall)
    err = calls[1]
    assert isinstance(err, ToolCallError) and err.raw == bad and "invalid JSON" in err.message


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ('{"arguments": {"city": "Paris"}}', "needs a \"name\""),
        ('{"name": "", "arguments": {}}', "needs a \"name\""),
        ('{"name": 3, "arguments": {}}', "needs a \"name\""),
        ('{"name": "get_weather", "arguments": ["Paris"]}', "must be a JSON object, got list"),
        ('{"name": "get_weather", "arguments": "Paris"}', "are not JSON"),
        ('["get_weather", {"city": "Paris"}]', "must be a JSON object, got list"),
    ],
)
def test_hermes_missing_name_or_non_object_arguments_are_errors(body: str, why: str) -> None:
    raw = f"<tool_call>\n{body}\n</tool_call>"
    _, calls = parse_tool_calls(raw + "<|im_end|>")
    assert len(calls) == 1 and isinstance(calls[0], ToolCallError)
    assert why in calls[0].message and calls[0].raw == raw


def test_hermes_unknown_fields_are_ignored_an_id_is_kept_string_arguments_are_decoded() -> None:
    text = (
        '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}", "id": "call_7", "why": 1}\n'
        '</tool_call><tool_call>{"name": "ping", "type": "function"}</tool_call><|im_end|>'
    )
    assert parse_tool_calls(text)[1] == [ToolCall("get_weather", {"city": "Paris"}, "call_7"), ToolCall("ping", {})]


def test_hermes_unclosed_call_is_an_error() -> None:
    content, calls = parse_tool_calls('I will check.\n<tool_call>\n{"name": "get_weather", "argu')
    assert content == "I will check."
    assert len(calls) == 1 and isinstance(calls[0], ToolCallError) and "without </tool_call>" in calls[0].message


def test_no_call_is_the_content_alone() -> None:
    assert parse_tool_calls("Paris is sunny.<|im_end|>") == ("Paris is sunny.", [])
    assert parse_tool_calls('The JSON {"name": "x"} is not a call.<|eot_id|>') == ('The JSON {"name": "x"} is not a call.', [])
    assert parse_tool_calls("", fmt="hermes") == ("", [])


def test_llama3_calls_several_separated_by_semicolons_arguments_key_accepted() -> None:
    text = 'Let me check.\n{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_weather", "arguments": {"city": "Rome"}}<|eot_id|>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert calls == [ToolCall("get_weather", {"city": "Paris"}), ToolCall("get_weather", {"city": "Rome"})]
    assert parse_tool_calls(text, fmt="llama3") == (content, calls)


def test_llama3_python_tag_form() -> None:
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}<|eom_id|>'
    assert parse_tool_calls(text) == ("", [ToolCall("get_weather", {"city": "Paris"})])


def test_llama3_invalid_json_is_an_error_holding_the_rest_of_the_turn() -> None:
    text = '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_weather", "parameters": {"city": }<|eot_id|>'
    content, calls = parse_tool_calls(text)
    assert content == "" and calls[0] == ToolCall("get_weather", {"city": "Paris"})
    err = calls[1]
    assert isinstance(err, ToolCallError) and err.raw == '{"name": "get_weather", "parameters": {"city": }'


def test_a_named_format_uses_that_parser_only() -> None:
    llama = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert parse_tool_calls(llama + "<|eot_id|>", fmt="hermes") == (llama, [])
    assert parse_tool_calls(llama + "<|eot_id|>", fmt="llama3") == parse_tool_calls(llama, fmt="llama3_json")
    with pytest.raises(ValueError, match="auto or one of harmony, deepseek_v3"):
        parse_tool_calls(PARIS, fmt="xml")  # type: ignore[arg-type]


class _Parsing:
    """A tokenizer with a response parser (transformers 5's ``parse_response``): scripted."""

    eos_token_id = None

    def __init__(self, reply: dict[str, Any] | Exception) -> None:
        self.reply = reply
        self.response_template: dict[str, Any] = {"fields": {}}

    def parse_response(self, text: str, prefix: str) -> dict[str, Any]:
        assert prefix == ""
        if isinstance(self.reply, Exception):
            raise self.reply
        return self.reply

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def convert_ids_to_tokens(self, i: int) -> str:
        return chr(i)


def test_the_tokenizers_response_parser_is_used_and_checked() -> None:
    reply = {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": [
            {"type": "function", "id": "c1", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"type": "function", "function": {"name": "get_weather", "arguments": [1]}},
        ],
    }
    content, calls = parse_tool_calls("whatever the model wrote", _Parsing(reply))
    assert content == "Checking." and calls[0] == ToolCall("get_weather", {"city": "Paris"}, "c1")
    assert isinstance(calls[1], ToolCallError) and '"arguments": [1]' in calls[1].raw


def test_a_failing_response_parser_falls_back_and_never_raises() -> None:
    failing = _Parsing(ValueError("Expecting value: line 1"))
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
    _, calls = parse_tool_calls(f"{PARIS}\n{bad}", failing)  # the built-in parser: one error per call
    assert isinstance(calls[0], ToolCall) and isinstance(calls[1], ToolCallError) and calls[1].raw == bad
    content, calls = parse_tool_calls("<call>get_weather(Paris)</call>", failing)  # a form we do not know
    assert content == "" and len(calls) == 1 and isinstance(calls[0], ToolCallError)
    assert "ValueError: Expecting value" in calls[0].message and calls[0].raw == "<call>get_weather(Paris)</call>"
    assert parse_tool_calls(PARIS, failing, fmt="hermes")[1] == [ToolCall("get_weather", {"city": "Paris"})]


@pytest.fixture(scope="module")
def smollm2_tok(smollm2_2layer_dir: Path) -> Any:
    return load_tokenizer(smollm2_2layer_dir)


def test_end_of_turn_ids(smollm2_tok: Any) -> None:
    assert end_of_turn_ids(smollm2_tok) == {smollm2_tok.convert_tokens_to_ids("<|im_end|>")} == {2}
    llama = copy.deepcopy(smollm2_tok)
    llama.add_tokens([AddedToken(t, special=True, normalized=False) for t in LLAMA_TOKENS], special_tokens=True)
    assert end_of_turn_ids(llama) == {2, *llama.convert_tokens_to_ids(["<|eot_id|>", "<|eom_id|>"])}


def test_real_response_parser_agrees_with_the_built_in_one(smollm2_tok: Any) -> None:
    tok = copy.deepcopy(smollm2_tok)
    set_chat_template(tok, "chatml-tools")
    assert tok.response_template is not None
    for text in [f"Checking.\n{PARIS}\n{ROME}<|im_end|>", f"{PARIS}<|im_end|>", "No call.<|im_end|>"]:
        assert tok.parse_response(text, prefix="")  # the response parser itself reads it
        assert parse_tool_calls(text, tok) == parse_tool_calls(text, tok, fmt="hermes")
    around = f"Checking.\n{PARIS}\nThen Rome.<|im_end|>"
    assert tok.parse_response(around, prefix="")["content"] == "Then Rome."  # transformers drops "Checking."
    assert parse_tool_calls(around, tok) == ("Checking.\n\nThen Rome.", [ToolCall("get_weather", {"city": "Paris"})])
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call><|im_end|>'
    with pytest.raises(ValueError):
        tok.parse_response(bad, prefix="")  # transformers' parser raises on bad output ...
    _, calls = parse_tool_calls(bad, tok)  # ... we do not
    assert len(calls) == 1 and isinstance(calls[0], ToolCallError)


def test_assistant_message() -> None:
    assert assistant_message("Paris.", []) == {"role": "assistant", "content": "Paris."}
    calls = [ToolCall("get_weather", {"city": "Paris"}, "c1"), ToolCall("ping", {})]
    assert assistant_message("", calls) == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"type": "function", "function": {"name": "ping", "arguments": {}}},
        ],
    }
