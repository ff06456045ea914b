"""The built-in tool templates on real tokenizers (SmolLM2's; for llama3.1 a copy with Llama 3's
special tokens and pre-tokenizer): token in / token out — the ids of the prompt, the model's turn,
the appended tool turn and the final turn are the template's rendering of the whole conversation,
token for token — plus the start-up checks and TRL 1.16's tool loop on our template."""

from __future__ import annotations

import copy
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from _optional import needs_package
from templating import templated, with_llama_tokens
from treegrpo.errors import ConfigError
from treegrpo.models.loader import load_tokenizer
from treegrpo.rollout.templates import (
    BUILTIN_TEMPLATES,
    check_tool_template,
    load_chat_template,
    prepare_tool_template,
    rerender_note,
    set_chat_template,
)
from treegrpo.rollout.toolcall import ToolCall, assistant_message, parse_tool_calls, tool_turn_text

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city today.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
USER = {"role": "user", "content": "What is the weather in Paris and in Rome?"}
CALLS = [ToolCall("get_weather", {"city": "Paris"}), ToolCall("get_weather", {"city": "Rome"})]
RESULTS = [
    {"role": "tool", "name": "get_weather", "content": "sunny, 24 C"},
    {"role": "tool", "name": "get_weather", "content": "rain, 12 C"},
]
ANSWER = "Paris is sunny (24 C), Rome rainy (12 C)."
DATE = {"date_string": "26 Jul 2024"}  # llama3.1's date header: one date for every rendering in a test

HERMES_TURN = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>'
)
#: The model's first turn as it generates it (after the generation prompt, up to its end-of-turn
#: token), the tool turn the template appends, and the end-of-turn token.
TURNS: dict[str, tuple[str, str, str]] = {
    "chatml-tools": (
        HERMES_TURN,
        "\n<|im_start|>tool\nsunny, 24 C<|im_end|>\n<|im_start|>tool\nrain, 12 C<|im_end|>\n<|im_start|>assistant\n",
        "<|im_end|>",
    ),
    "qwen2.5": (
        HERMES_TURN,
        "\n<|im_start|>user\n<tool_response>\nsunny, 24 C\n</tool_response>\n<tool_response>\nrain, 12 C\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n",
        "<|im_end|>",
    ),
    "llama3.1": (
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_weather", "parameters": {"city": "Rome"}}<|eot_id|>',
        "<|start_header_id|>ipython<|end_header_id|>\n\nsunny, 24 C<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n"
        "rain, 12 C<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
        "<|eot_id|>",
    ),
}
# A Qwen3-style template: an assistant turn's <think>…</think> is dropped once a later user turn exists.
THINK_DROPPING = (
    "{%- set ns = namespace(last=-1) %}{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last = loop.index0 %}"
    "{%- endif %}{%- endfor %}{%- for m in messages %}{%- set c = m.content or '' %}"
    "{%- if m.role == 'assistant' and loop.index0 < ns.last and '</think>' in c %}{%- set c = c.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}{{- '<|im_start|>' + m.role + '\\n' + c }}{%- for t in m.tool_calls or [] %}{{- '<tool_call>' + t.function.name + '</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def smollm2(smollm2_2layer_dir: Path) -> Any:
    return load_tokenizer(smollm2_2layer_dir)


def ids(tok: Any, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text_first", [False, True], ids=["calls-only", "text-then-calls"])
@pytest.mark.parametrize("name", BUILTIN_TEMPLATES)
def test_the_ids_trained_on_are_the_templates_rendering_of_the_conversation(smollm2: Any, name: str, text_first: bool) -> None:
    tok = templated(smollm2, name)
    check_tool_template(tok, SCHEMAS)
    turn, appended, end = TURNS[name]
    if text_first:
        turn = "Let me check both.\n" + turn
    prompt = tok.apply_chat_template([USER], tools=SCHEMAS, add_generation_prompt=True, return_dict=False, **DATE)
    generated = ids(tok, turn)
    assert generated[-1] in {tok.convert_tokens_to_ids(end)}  # the turn ends at the end-of-turn token
    content, calls = parse_tool_calls(tok.decode(generated), tok)
    assert (content, calls) == ("Let me check both." if text_first else "", CALLS)
    assert tool_turn_text(tok, RESULTS, SCHEMAS) == appended
    final = ids(tok, ANSWER + end)
    trained = [*prompt, *generated, *ids(tok, appended), *final]
    conversation = [USER, assistant_message(content, calls), *RESULTS, {"role": "assistant", "content": ANSWER}]
    whole = tok.apply_chat_template(conversation, tools=SCHEMAS, return_dict=False, **DATE)
    mismatches = sum(a != b for a, b in zip(trained, whole, strict=False)) + abs(len(trained) - len(whole))
    assert mismatches == 0, tok.decode(whole)
    assert prompt == whole[: len(prompt)] and len(trained) > len(prompt) + len(generated) + len(final)


def test_the_model_turn_is_the_templates_own_rendering_of_the_calls(smollm2: Any) -> None:
    for name in BUILTIN_TEMPLATES:
        tok = templated(smollm2, name)
        turn, _, end = TURNS[name]
        prompt = tok.apply_chat_template([USER], tools=SCHEMAS, add_generation_prompt=True, tokenize=False, **DATE)
        closed = tok.apply_chat_template([USER, assistant_message("", CALLS)], tools=SCHEMAS, tokenize=False, **DATE)
        assert closed == prompt + turn and closed.endswith(end)
        assert parse_tool_calls(turn, tok) == parse_tool_calls(turn, tok, fmt="llama3" if name == "llama3.1" else "hermes")


def test_tool_call_ids_reach_the_template_and_one_result_is_one_turn(smollm2: Any) -> None:
    tok = templated(smollm2, "qwen2.5")
    one = tool_turn_text(tok, [{"role": "tool", "name": "get_weather", "content": "fog", "tool_call_id": "c1"}], SCHEMAS)
    assert one == "\n<|im_start|>user\n<tool_response>\nfog\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_check_tool_template_refuses_smollm2s_own_template_in_one_line(smollm2: Any) -> None:
    with pytest.raises(ConfigError) as e:
        check_tool_template(smollm2, SCHEMAS)
    msg = str(e.value)
    assert "\n" not in msg and "get_weather absent" in msg and "--chat-template chatml-tools" in msg
    tok = copy.deepcopy(smollm2)
    tok.chat_template = THINK_DROPPING  # renders calls (by name only) and tool turns, but not the schemas
    with pytest.raises(ConfigError, match="schemas"):
        check_tool_template(tok, SCHEMAS)
    tok.chat_template = "{%- for m in messages %}{{ m.role + ': ' + m.content + '\\n' }}{%- endfor %}"
    with pytest.raises(ConfigError, match="drops an assistant message's tool_calls"):
        check_tool_template(tok, [])
    tok.chat_template = None
    with pytest.raises(ConfigError, match="no chat template"):
        check_tool_template(tok, SCHEMAS)


def test_rerender_note(smollm2: Any) -> None:
    for name in ("chatml-tools", "qwen2.5"):
        assert rerender_note(templated(smollm2, name), SCHEMAS) is None
    assert rerender_note(smollm2, SCHEMAS) is None  # SmolLM2's own: no tools, but prefix-stable
    llama = rerender_note(templated(smollm2, "llama3.1"), SCHEMAS)
    assert llama is not None and "\n" not in llama and "today's date" in llama and "earlier turns" not in llama
    gpt2_split = with_llama_tokens(smollm2, llama_split=False)
    set_chat_template(gpt2_split, "llama3.1")
    note = rerender_note(gpt2_split, SCHEMAS)
    assert note is not None and "splits the text at a turn boundary" in note
    thinking = copy.deepcopy(smollm2)  # chatml-tools that renders an assistant turn's thought only while it is last
    thinking.chat_template = load_chat_template("chatml-tools").replace(
        '"\\n<|im_start|>assistant\\n" + (message.content or "")',
        '"\\n<|im_start|>assistant\\n" + ("<think>" + message.reasoning_content + "</think>" if message.reasoning_content '
        'and loop.last else "") + (message.content or "")',
    )
    assert thinking.chat_template != load_chat_template("chatml-tools")
    note = rerender_note(thinking, SCHEMAS)
    assert note is not None and "re-renders earlier turns (with thinking" in note and "\n" not in note


def test_set_chat_template_needs_the_templates_special_tokens(smollm2: Any, tmp_path: Path) -> None:
    tok = copy.deepcopy(smollm2)
    with pytest.raises(ConfigError) as e:
        set_chat_template(tok, "llama3.1")
    assert "\n" not in str(e.value) and "<|eot_id|>" in str(e.value) and "<|start_header_id|>" in str(e.value)
    assert tok.chat_template == smollm2.chat_template  # unchanged
    path = tmp_path / "mine.jinja"
    path.write_text(load_chat_template("chatml-tools"))
    set_chat_template(tok, str(path))  # a built-in's text from a file: its response parser too
    assert tok.chat_template == load_chat_template("chatml-tools") and tok.response_template is not None
    path.write_text(THINK_DROPPING)
    set_chat_template(tok, str(path))
    assert tok.chat_template == THINK_DROPPING and tok.response_template is None
    with pytest.raises(ConfigError) as e:
        load_chat_template("chatml-tool")
    assert "\n" not in str(e.value) and "chatml-tools, qwen2.5, llama3.1" in str(e.value) and "Jinja file" in str(e.value)


def test_a_template_that_re_renders_the_history_cannot_append_tool_turns(smollm2: Any) -> None:
    tok = copy.deepcopy(smollm2)
    tok.chat_template = "{{- messages | length }}" + load_chat_template("chatml-tools")
    with pytest.raises(ConfigError, match="prefix"):
        tool_turn_text(tok, RESULTS, SCHEMAS)
    with pytest.raises(ValueError, match="at least one"):
        tool_turn_text(smollm2, [], SCHEMAS)


def test_the_templates_are_package_data() -> None:
    files = {p.name for p in resources.files("treegrpo.rollout.templates").iterdir()}
    assert {f"{n}.jinja" for n in BUILTIN_TEMPLATES} <= files
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert data["treegrpo.rollout.templates"] == ["*.jinja"]


@needs_package("trl")
def test_trl_accepts_our_templates_and_parses_their_calls(smollm2: Any) -> None:
    from trl.chat_template_utils import (
        add_response_schema,
        is_chat_template_prefix_preserving,
        parse_response,
        supports_tool_calling,
    )

    assert not supports_tool_calling(smollm2)  # SmolLM2's own template: GRPOTrainer(tools=...) refuses it
    for name in BUILTIN_TEMPLATES:
        tok = templated(smollm2, name)
        assert supports_tool_calling(tok) and is_chat_template_prefix_preserving(tok), name
        prompt = tok.apply_chat_template([USER], tools=SCHEMAS, add_generation_prompt=True, return_dict=False)
        parsed = parse_response(tok, ids(tok, TURNS[name][0]), prefix=prompt, tools=SCHEMAS)
        assert parsed["tool_calls"] == assistant_message("", CALLS)["tool_calls"], name
        tok.response_template = None  # what set_chat_template adds: without it TRL knows no parser for the template
        with pytest.raises(ValueError, match="Unrecognized chat template"):
            add_response_schema(tok)


@needs_package("trl")
def test_the_notes_on_the_real_templates_trl_ships(smollm2: Any) -> None:
    """Real templates (as TRL 1.16 ships them): Qwen3's own is refused at start-up in one line
    (it re-renders a turn once its results follow: the run died at the first tool call) and its
    TRL training variant, shipped here too, is swapped in; Meta's Llama 3.1 refuses two calls in
    one turn."""
    import trl

    def real(name: str) -> Any:
        tok = with_llama_tokens(smollm2) if name.startswith("llama") else copy.deepcopy(smollm2)
        tok.chat_template = (Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja").read_text()
        check_tool_template(tok, SCHEMAS)
        return tok

    assert rerender_note(real("qwen2_5"), SCHEMAS) is None and rerender_note(real("qwen3_training"), SCHEMAS) is None
    with pytest.raises(ConfigError) as e:  # Qwen3's own template: the run died at the first tool call
        real("qwen3")
    assert "\n" not in str(e.value) and "prefix" in str(e.value)
    qwen3 = copy.deepcopy(smollm2)
    qwen3.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja").read_text()
    (note,) = prepare_tool_template(qwen3, SCHEMAS)  # TRL's training variant, swapped in as TRL does
    assert "using TRL's prefix-preserving qwen3_training template" in note and "\n" not in note
    assert qwen3.chat_template == (Path(trl.__file__).parent / "chat_templates" / "qwen3_training.jinja").read_text()
    assert qwen3.chat_template == load_chat_template(str(resources.files("treegrpo.rollout.templates") / "trl-qwen3_training.jinja"))
    llama = real("llama3_1")
    note = rerender_note(llama, SCHEMAS)
    assert note is not None and "refuses several tool calls in one turn" in note and "\n" not in note
    with pytest.raises(ConfigError, match=r"cannot render this tool turn \(TemplateError: This model only supports single"):
        tool_turn_text(llama, RESULTS, SCHEMAS)


@pytest.mark.slow
@needs_package("trl", "datasets", "accelerate")
def test_trl_grpo_trainer_runs_its_tool_loop_on_chatml_tools(smollm2_2layer_dir: Path, tmp_path: Path) -> None:
    """One ``GRPOTrainer(tools=[lookup])`` step on SmolLM2 (2 layers) with chatml-tools: the first
    turn is scripted (a call of the tool, as the template renders it, ending at <|im_end|>), the
    rest is TRL's own loop — parse the call with our response template, run the tool, append the
    tool turn (the same ids as :func:`tool_turn_text`), generate again, train."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    tok = load_tokenizer(smollm2_2layer_dir)
    set_chat_template(tok, "chatml-tools")
    model = AutoModelForCausalLM.from_pretrained(smollm2_2layer_dir, dtype=torch.float32)
    seen: list[str] = []

    def lookup(key: str) -> str:
        """Look up a fact.

        Args:
            key: what to look up.
        """
        seen.append(key)
        return f"a fact about {key}"

    args = GRPOConfig(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, num_generations=2, max_completion_length=48,
        use_cpu=True, bf16=False, report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True,
        max_tool_calling_iterations=1, gradient_checkpointing=False, seed=0,
    )  # fmt: skip
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": "What is the capital of France?"}]}] * 2)
    trainer = GRPOTrainer(
        model=model, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)], args=args,
        train_dataset=data, processing_class=tok, tools=[lookup],
    )  # fmt: skip
    assert trainer.chat_template is None  # prefix-preserving: TRL keeps our template
    call = ids(tok, '<tool_call>\n{"name": "lookup", "arguments": {"key": "paris"}}\n</tool_call><|im_end|>')
    generate, suffix = trainer._generate_single_turn, trainer._get_tool_suffix_ids
    turns, suffixes = [0], []

    def scripted(prompt_ids: list[list[int]], *a: Any, **k: Any) -> Any:
        turns[0] += 1
        return ([list(call) for _ in prompt_ids], None) if turns[0] == 1 else generate(prompt_ids, *a, **k)

    def recorded(messages: list[dict[str, Any]]) -> list[int]:
        out = suffix(messages)
        suffixes.append((messages, out))
        return out

    trainer._generate_single_turn, trainer._get_tool_suffix_ids = scripted, recorded
    trainer.train()
    log = trainer.state.log_history[0]
    assert seen == ["paris", "paris"] and turns[0] == 2 and trainer.state.global_step == 1
    assert log["tools/call_frequency"] == 1.0 and log["tools/failure_frequency"] == 0.0
    assert len(suffixes) == 2
    for messages, out in suffixes:
        assert out == ids(tok, tool_turn_text(tok, messages, None))
        assert tok.decode(out) == "\n<|im_start|>tool\na fact about paris<|im_end|>\n<|im_start|>assistant\n"
