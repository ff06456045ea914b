"""Tool calls in the model's own protocol: parse them from an assistant turn, and the text the chat
template appends after the turn (the tool results and the next generation prompt).

A turn is generated up to the model's end-of-turn token (:func:`end_of_turn_ids`), included. Its
decoded text (special tokens kept) is parsed by :func:`parse_tool_calls` with the parser of the
template's call syntax (:mod:`treegrpo.rollout.tool_parsers`: a registry, one parser per syntax,
chosen from the chat template's text; ``fmt=`` forces one). A malformed call (invalid JSON, no
name, arguments that are not an object, too deep, too long, one call too many) is a
:class:`ToolCallError` in the list, in its place: bad model output is data, never an exception.

The results of one assistant turn's calls go back as ``role: "tool"`` messages; the text to append
(masked, never trained) is :func:`tool_turn_text` — the template's rendering of those messages and
of the next assistant turn's generation prompt, taken as the difference of two renderings
(:func:`treegrpo.rollout.chat.appended_text`), so the ids trained on are exactly the template's
rendering of the whole conversation wherever the template renders histories as prefixes.
:func:`tool_turn_parts` splits that text into the template's markers and the results' contents, so
a result is tokenized as plain text (:func:`treegrpo.rollout.chat.encode_observation`).
"""

from __future__ import annotations

import json
from typing import Any

from treegrpo.errors import ConfigError
from treegrpo.models.loader import GENERATION_EOS_ATTR
from treegrpo.rollout.chat import appended_text
from treegrpo.rollout.tool_parsers import (
    PARSERS,
    ToolCall,
    ToolCallError,
    detect_format,
    json_call,
    parse_turn,
)

#: ``fmt`` of :func:`parse_tool_calls`: ``auto`` or a parser name (:data:`~treegrpo.rollout.tool_parsers.PARSERS`;
#: ``llama3`` is ``llama3_json``).
ToolCallFormat = str
_ALIASES = {"llama3": "llama3_json"}
#: Tokens that end an assistant turn when the tokenizer has them (besides its EOS and the model's
#: ``generation_config.eos_token_id``): ChatML's; Llama 3's end of turn and end of message; GLM's
#: observation and user headers (its turns end where the next begins); gpt-oss's end of a call and
#: of the answer; DeepSeek's end of sentence.
END_OF_TURN_TOKENS: tuple[str, ...] = (
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|observation|>", "<|user|>", "<|call|>", "<|return|>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>",
)  # fmt: skip


def end_of_turn_ids(tokenizer: Any) -> set[int]:
    """The ids that end an assistant turn: the tokenizer's EOS, the model's generation EOS ids
    (``generation_config.eos_token_id``, read by :func:`~treegrpo.models.loader.load_tokenizer`:
    Llama's ``<|end_of_text|>``, Qwen's ``<|endoftext|>``, a list),
    and whichever of :data:`END_OF_TURN_TOKENS` it has as single tokens."""
    out: set[int] = set()
    for eos in (getattr(tokenizer, "eos_token_id", None), getattr(tokenizer, GENERATION_EOS_ATTR, None)):
        out.update(int(i) for i in (eos if isinstance(eos, (list, tuple, set)) else [] if eos is None else [eos]))
    for tok in END_OF_TURN_TOKENS:
        ids = tokenizer.encode(tok, add_special_tokens=False)
        if len(ids) == 1 and tokenizer.convert_ids_to_tokens(ids[0]) == tok:
            out.add(ids[0])
    return out


def end_of_turn_tokens(tokenizer: Any | None) -> tuple[str, ...]:
    """The strings of :func:`end_of_turn_ids` (without a tokenizer: :data:`END_OF_TURN_TOKENS`)."""
    if tokenizer is None:
        return END_OF_TURN_TOKENS
    return tuple(sorted({tokenizer.convert_ids_to_tokens(i) for i in end_of_turn_ids(tokenizer)}))


def _strip_turn_end(text: str, ends: tuple[str, ...]) -> str:
    text = text.rstrip()
    while any(e and text.endswith(e) for e in ends):
        text = text[: -len(next(e for e in ends if e and text.endswith(e)))].rstrip()
    return text


def tool_call_format(tokenizer: Any | None) -> str | None:
    """The parser of the tokenizer's chat template (:func:`~treegrpo.rollout.tool_parsers.detect_format`)."""
    return detect_format(getattr(tokenizer, "chat_template", None))


def _from_response_parser(tokenizer: Any, text: str, ends: tuple[str, ...]) -> tuple[str, list[ToolCall | ToolCallError]] | str:
    """``tokenizer.parse_response`` (transformers 5's response parser, for a template no registered
    parser reads): the content and calls, or why the parser failed on the text."""
    try:
        msg = tokenizer.parse_response(text, prefix="")
        calls: list[ToolCall | ToolCallError] = []
        for tc in msg.get("tool_calls") or []:
            fn = tc.get("function", tc) if isinstance(tc, dict) else tc
            call = json_call(fn, json.dumps(tc, ensure_ascii=False, default=str)[:200])
            if isinstance(call, ToolCall) and isinstance(tc, dict) and isinstance(tc.get("id"), str):
                call.id = tc["id"]
            calls.append(call)
        content = msg.get("content")
        return _strip_turn_end(content if isinstance(content, str) else "", ends).strip(), calls
    except Exception as e:  # the parser fails on bad model output: data, never a crash
        return f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"


def parse_tool_calls(
    text: str, tokenizer: Any | None = None, fmt: ToolCallFormat = "auto", schemas: list[dict[str, Any]] | None = None
) -> tuple[str, list[ToolCall | ToolCallError]]:
    """The content of one assistant turn (its decoded text, special tokens included) without its
    tool calls and its end-of-turn token (stripped), and its calls in order. Never raises on ``text``.

    ``fmt="auto"``: the parser of the tokenizer's chat template (:func:`tool_call_format`); for a
    template no parser recognizes, the tokenizer's response parser when it has one
    (``response_template``; where it fails on the text, the fallback below, and one error holding
    the text when that finds no call either), else ``hermes`` when the text holds ``<tool_call>``
    and ``llama3_json`` otherwise. A parser name forces that parser. ``schemas`` (the tools' JSON
    schemas) type the values of XML-style calls (``qwen3_xml``, ``glm45``). The content leaves out
    the turn's thinking (:func:`strip_thinking`): it is the answer the rewards read; the ids keep
    the thinking."""
    name = _ALIASES.get(fmt, fmt)
    if name != "auto" and name not in PARSERS:
        raise ValueError(f"unknown tool-call format {fmt!r}: auto or one of {', '.join(PARSERS)}")
    ends = end_of_turn_tokens(tokenizer)
    body = _strip_turn_end(text, ends)
    failed = None
    if name == "auto":
        name = tool_call_format(tokenizer)
        if name is None and getattr(tokenizer, "response_template", None) is not None:
            parsed = _from_response_parser(tokenizer, text, ends)
            if not isinstance(parsed, str):
                return parsed
            failed = parsed  # then the built-in parsers, each bad call on its own
        name = name or ("hermes" if "<tool_call>" in body else "llama3_json")
    content, calls = parse_turn(body, name, schemas)
    if failed is not None and not calls:
        return "", [ToolCallError(f"the tokenizer's response parser failed on the turn ({failed})", body)]
    return strip_thinking(content).strip(), calls


def strip_thinking(content: str) -> str:
    """A turn's content without its thinking: the text after the last ``</think>`` (a thinking model
    writes ``<think>…</think>`` first, or only ``…</think>`` after a prompt that opened the block)."""
    return content.rsplit("</think>", 1)[1] if "</think>" in content else content


def assistant_message(content: str, calls: list[ToolCall]) -> dict[str, Any]:
    """The OpenAI-style assistant message of a turn (for transcripts, rewards and the template):
    ``tool_calls`` only when there are calls, each with its ``id`` when it has one."""
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = [
            {**({"id": c.id} if c.id is not None else {}), "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls
        ]  # fmt: skip
    return msg


def _tool_text(tokenizer: Any, results: list[dict[str, Any]], schemas: list[dict[str, Any]] | None) -> str:
    """:func:`tool_turn_text` (the template's appended text for ``results``)."""
    if not results:
        raise ValueError("tool_turn_text needs the results of at least one call")
    calls = [
        {**({"id": r["tool_call_id"]} if r.get("tool_call_id") is not None else {}), "type": "function",
         "function": {"name": r.get("name") or "tool", "arguments": {}}}
        for r in results
    ]  # fmt: skip
    history = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    try:
        text = appended_text(tokenizer, history, results, tools=schemas, close=end_of_turn_tokens(tokenizer))
    except Exception as e:  # the template refuses the turn (e.g. Meta's Llama 3.1: one call per turn)
        raise ConfigError(
            f"the chat template cannot render this tool turn ({type(e).__name__}: {e}); "
            "use --chat-template chatml-tools or a template that supports tools"
        ) from e
    if text is None:
        raise ConfigError(
            "this chat template does not render a conversation with tool calls as a prefix of the same "
            "conversation with the tool results (or it writes no end-of-turn token), so the results cannot be "
            "appended turn by turn; use --chat-template chatml-tools or a template that supports tools"
        )
    return text


def tool_turn_text(tokenizer: Any, results: list[dict[str, Any]], schemas: list[dict[str, Any]] | None) -> str:
    """The text the chat template appends after an assistant turn that ended with its end-of-turn
    token (the generated ids stop at that token, included): the tool-result turn(s) for
    ``results`` — all the results of that turn, each ``{"role": "tool", "name": …, "content": …,
    "tool_call_id"?: …}``, in call order — and the next assistant turn's generation prompt,
    beginning with whatever the template writes after the end-of-turn token (a newline for ChatML).

    Rendered against a placeholder history (a user message and an assistant turn calling the same
    tools, with the same ``tools=schemas``) and taken as the difference of the two renderings.
    Raises :class:`ConfigError` when the template does not render that history as a prefix of the
    longer one (or renders no end-of-turn token), or refuses the turn (several calls, say)."""
    return "".join(t for t, _ in tool_turn_parts(tokenizer, results, schemas))


_MARK = "\u2063R{}\u2063"


def tool_turn_parts(
    tokenizer: Any, results: list[dict[str, Any]], schemas: list[dict[str, Any]] | None
) -> tuple[tuple[str, bool], ...]:
    """:func:`tool_turn_text` split into ``(text, control)`` pieces: the template's own text
    (``control``: turn markers, tokenized with special tokens) and each result's content as the
    template writes it (not control: tokenized as plain text, so a result that spells
    ``<|im_end|>`` cannot close the turn). The pieces join to :func:`tool_turn_text`.

    Found by rendering the results' contents as placeholders (the template's pieces) and, where the
    template does not write a content verbatim (gpt-oss quotes it as JSON), each content alone
    among placeholders (what the template wrote for it)."""
    text = _tool_text(tokenizer, results, schemas)
    marks = [_MARK.format(i) for i in range(len(results))]
    marked = _tool_text(tokenizer, [{**r, "content": m} for r, m in zip(results, marks, strict=True)], schemas)
    pieces: list[str] = []
    rest = marked
    for m in marks:
        head, found, rest = rest.partition(m)
        if not found:  # the template does not write this content where it is a plain string: all control
            return ((text, True),)
        pieces.append(head)
    pieces.append(rest)
    contents = [r["content"] if isinstance(r.get("content"), str) else None for r in results]
    if any(c is None for c in contents) or text != "".join(p + c for p, c in zip(pieces, [*contents, ""], strict=True)):
        contents = []
        for i, r in enumerate(results):  # what the template writes for content i, among placeholders
            one = _tool_text(tokenizer, [r if j == i else {**x, "content": marks[j]} for j, x in enumerate(results)], schemas)
            head = "".join(p + m for p, m in zip(pieces[: i + 1], [*marks[:i], ""], strict=True))
            tail = "".join(p + m for p, m in zip(pieces[i + 1 :], [*marks[i + 1 :], ""], strict=True))
            if not (one.startswith(head) and one.endswith(tail)):
                return ((text, True),)
            contents.append(one[len(head) : len(one) - len(tail)])
    parts = [(p, True) for p in pieces]
    out: list[tuple[str, bool]] = []
    for p, c in zip(parts, [*contents, None], strict=True):
        out.append(p)
        if c is not None:
            out.append((c, False))
    return tuple((t, k) for t, k in out if t)


def assistant_turn_text(tokenizer: Any, message: dict[str, Any], schemas: list[dict[str, Any]] | None) -> str:
    """The text of ``message`` (an assistant turn, with or without ``tool_calls``) as the chat
    template renders it after a generation prompt, through its end-of-turn token: exactly what a
    model writing that turn generates (a warm-up demonstration's step in the native protocol).

    Raises :class:`ConfigError` when the template renders the turn elsewhere than after the prompt
    or writes no end-of-turn token after it."""
    kw: dict[str, Any] = {"tools": schemas} if schemas else {}
    user = [{"role": "user", "content": "Q"}]
    head = tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=False, **kw)
    full = tokenizer.apply_chat_template([*user, message], tokenize=False, **kw)
    ends = end_of_turn_tokens(tokenizer)
    body = full[len(head) :] if full.startswith(head) else None
    cut = -1 if body is None else max((body.rfind(t) + len(t) for t in ends if t and t in body), default=-1)
    if body is None or cut < 0:
        raise ConfigError(
            "this chat template does not render an assistant turn right after its generation prompt, ending at an "
            "end-of-turn token; use --chat-template chatml-tools or a template that supports tools"
        )
    return body[:cut]
