"""Tool calls in the model's own protocol: parse them from an assistant turn, and the text the chat
template appends after the turn (the tool results and the next generation prompt).

A turn is generated up to the model's end-of-turn token (:func:`end_of_turn_ids`), included. Its
decoded text (special tokens kept) is parsed by :func:`parse_tool_calls`:

- with the tokenizer's own response parser where transformers 5 gives it one
  (``tokenizer.response_template``, read by ``tokenizer.parse_response``; the built-in templates of
  :mod:`treegrpo.rollout.templates` set one), else
- ``hermes``: Hermes / Qwen2.5 / Qwen3 ``<tool_call>{"name": …, "arguments": …}</tool_call>`` blocks,
- ``llama3``: Llama 3.1's JSON calls ``{"name": …, "parameters": …}`` (``"arguments"`` accepted),
  several separated by ``;`` or whitespace, optionally after ``<|python_tag|>``.

A malformed call (invalid JSON, no name, arguments that are not an object) is a
:class:`ToolCallError` in the list, in its place: bad model output is data, never an exception.

The results of one assistant turn's calls go back as ``role: "tool"`` messages; the text to append
(masked, never trained) is :func:`tool_turn_text` — the template's rendering of those messages and
of the next assistant turn's generation prompt, taken as the difference of two renderings
(:func:`treegrpo.rollout.chat.appended_text`), so the ids trained on are exactly the template's
rendering of the whole conversation wherever the template renders histories as prefixes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from treegrpo.errors import ConfigError
from treegrpo.rollout.chat import appended_text

ToolCallFormat = Literal["auto", "hermes", "llama3"]
#: Tokens that end an assistant turn when the tokenizer has them (besides its EOS): ChatML's,
#: Llama 3's end of turn and end of message (the latter: "a tool result follows").
END_OF_TURN_TOKENS: tuple[str, ...] = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>")
PYTHON_TAG = "<|python_tag|>"
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_LLAMA_CALL_START = re.compile(r'\{\s*"name"\s*:')


@dataclass
class ToolCall:
    """One parsed call: the function's ``name``, its ``arguments`` (a JSON object), and the call's
    ``id`` when the model wrote one (else ``None``; the caller may number the calls)."""

    name: str
    arguments: dict[str, Any]
    id: str | None = None


@dataclass
class ToolCallError:
    """A call the model wrote but that cannot be run: why (``message``) and its ``raw`` text."""

    message: str
    raw: str


def end_of_turn_ids(tokenizer: Any) -> set[int]:
    """The ids that end an assistant turn: the tokenizer's EOS and whichever of
    :data:`END_OF_TURN_TOKENS` it has as single tokens."""
    out: set[int] = set()
    eos = getattr(tokenizer, "eos_token_id", None)
    out.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
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


def _call(obj: Any, raw: str, keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | ToolCallError:
    """A decoded JSON call (``{"name": …, "arguments": {…}}``) checked: fields other than
    ``name``, the arguments and ``id`` are ignored; arguments written as a JSON string are decoded."""
    if not isinstance(obj, dict):
        return ToolCallError(f"a tool call must be a JSON object, got {type(obj).__name__}", raw)
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return ToolCallError('a tool call needs a "name" (a non-empty string)', raw)
    key = next((k for k in keys if k in obj), None)
    args: Any = {} if key is None or obj[key] is None else obj[key]
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return ToolCallError(f"the arguments of {name} are not JSON: {args[:80]!r}", raw)
    if not isinstance(args, dict):
        return ToolCallError(f"the arguments of {name} must be a JSON object, got {type(args).__name__}", raw)
    cid = obj.get("id")
    return ToolCall(name.strip(), args, cid if isinstance(cid, str) else None)


def parse_hermes(text: str) -> tuple[str, list[ToolCall | ToolCallError]]:
    """``<tool_call>{json}</tool_call>`` blocks; a block left open (the turn was cut) is an error.
    Returns the text outside the blocks (not stripped) and the calls."""
    calls: list[ToolCall | ToolCallError] = []
    kept, pos = [], 0
    for m in _HERMES_BLOCK.finditer(text):
        kept.append(text[pos : m.start()])
        pos = m.end()
        body = m.group(1).strip()
        try:
            calls.append(_call(json.loads(body), m.group(0)))
        except json.JSONDecodeError as e:
            calls.append(ToolCallError(f"invalid JSON in <tool_call>: {e.msg} at char {e.pos}", m.group(0)))
    rest = text[pos:]
    if "<tool_call>" in rest:
        before, _, tail = rest.partition("<tool_call>")
        calls.append(ToolCallError("<tool_call> without </tool_call>", "<tool_call>" + tail))
        rest = before
    kept.append(rest)
    return "".join(kept), calls


def parse_llama3(text: str) -> tuple[str, list[ToolCall | ToolCallError]]:
    """Llama 3.1's JSON calls: every ``{"name": …, "parameters"|"arguments": …}`` object in the
    text (after ``<|python_tag|>`` when there is one), separated by ``;`` or whitespace; an object
    starting ``{"name":`` that is not valid JSON is an error (it runs to the end of the text)."""
    dec = json.JSONDecoder()
    head, tag, tail = text.partition(PYTHON_TAG)
    region, kept = (tail, [head]) if tag else (text, [])
    calls: list[ToolCall | ToolCallError] = []
    pos = 0
    for m in _LLAMA_CALL_START.finditer(region):
        if m.start() < pos:
            continue
        try:
            obj, end = dec.raw_decode(region, m.start())
        except json.JSONDecodeError as e:
            kept.append(region[pos : m.start()])
            calls.append(ToolCallError(f"invalid JSON in a tool call: {e.msg}", region[m.start() :].strip()))
            pos = len(region)
            break
        if not (isinstance(obj, dict) and ("parameters" in obj or "arguments" in obj)):
            continue  # a JSON object with a "name" that is not a call: content
        kept.append(region[pos : m.start()])
        calls.append(_call(obj, region[m.start() : end]))
        pos = end
        sep = re.match(r"\s*;", region[pos:])
        pos += sep.end() if sep else 0
    kept.append(region[pos:])
    return "".join(kept), calls


def _from_response_parser(
    tokenizer: Any, text: str, ends: tuple[str, ...]
) -> tuple[str, list[ToolCall | ToolCallError]] | str:
    """``tokenizer.parse_response`` (transformers 5's response parser, for a tokenizer with a
    ``response_template``): the content and calls, or why the parser failed on the text."""
    try:
        msg = tokenizer.parse_response(text, prefix="")
    except Exception as e:  # the parser fails on bad model output: data, never a crash
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    calls: list[ToolCall | ToolCallError] = []
    for tc in msg.get("tool_calls") or []:
        fn = tc.get("function", tc) if isinstance(tc, dict) else tc
        call = _call(fn, json.dumps(tc, ensure_ascii=False, default=str))
        if isinstance(call, ToolCall) and isinstance(tc, dict) and isinstance(tc.get("id"), str):
            call.id = tc["id"]
        calls.append(call)
    content = msg.get("content")
    return _strip_turn_end(content if isinstance(content, str) else "", ends).strip(), calls


def parse_tool_calls(
    text: str, tokenizer: Any | None = None, fmt: ToolCallFormat = "auto"
) -> tuple[str, list[ToolCall | ToolCallError]]:
    """The content of one assistant turn (its decoded text, special tokens included) without its
    tool calls and its end-of-turn token (stripped), and its calls in order.

    ``fmt="auto"``: the tokenizer's response parser where it has one (``response_template``; the
    built-in parser's content where both find the same calls); where that parser fails on the text,
    the built-in parsers, and one :class:`ToolCallError` holding the text when they find no call
    either. The built-in parser: ``hermes`` when the text holds ``<tool_call>``, else ``llama3``
    (which finds nothing in plain text). ``"hermes"`` / ``"llama3"``: that parser only."""
    if fmt not in ("auto", "hermes", "llama3"):
        raise ValueError(f"unknown tool-call format {fmt!r}: auto, hermes or llama3")
    ends = end_of_turn_tokens(tokenizer)
    body = _strip_turn_end(text, ends)
    failed = None
    hermes = fmt == "hermes" or (fmt == "auto" and "<tool_call>" in body)
    content, calls = parse_hermes(body) if hermes else parse_llama3(body)
    if fmt == "auto" and getattr(tokenizer, "response_template", None) is not None:
        parsed = _from_response_parser(tokenizer, text, ends)
        if isinstance(parsed, str):
            failed = parsed
        elif parsed[1] != calls:
            return parsed
        # else both find the same calls: keep the built-in parser's content, the text on both
        # sides of the calls (transformers' keeps only the text after the last call, if any)
    if failed is not None and not calls:
        return "", [ToolCallError(f"the tokenizer's response parser failed on the turn ({failed})", body)]
    return content.strip(), calls


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
