"""Tool-call parsers, one per call syntax, in a registry (:data:`PARSERS`, :func:`register`).

Each parser reads the text of one assistant turn (special tokens kept, the end-of-turn token
already stripped) into its content and its calls in order: a :class:`ToolCall`, or a
:class:`ToolCallError` in the call's place when the call cannot be run. A parser never raises on
model text: JSON is decoded by :func:`safe_json` (at most :data:`MAX_JSON_DEPTH` levels of nesting,
integers of at most :data:`MAX_INT_DIGITS` digits, at most :data:`MAX_CALL_CHARS` characters per
call) and :func:`parse_turn` caps a turn at :data:`MAX_CALLS_PER_TURN` calls (the excess are
errors) and turns any failure into one error.

Syntaxes (``name``: what the model writes; which chat templates write it):

- ``hermes``: ``<tool_call>{"name": …, "arguments": {…}}</tool_call>`` (Qwen2.5, Qwen3,
  Qwen3-Instruct-2507, Qwen3-VL, treegrpo's chatml-tools and qwen2.5);
- ``qwen3_xml``: ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>…</function></tool_call>``
  (Qwen3-Coder, Qwen3.5, Qwen3.6, Qwen3-8, Nemotron 3); a value is typed by the tool's JSON schema
  (a string stays text; integers, numbers, booleans, arrays and objects are decoded), without a
  schema decoded as JSON when it is JSON, else text;
- ``glm45``: ``<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>…</tool_call>``
  (GLM-4.5 / GLM-4-MoE), values typed as ``qwen3_xml``'s;
- ``harmony``: gpt-oss's ``… to=functions.NAME<|channel|>commentary json<|message|>{…}<|call|>``; the
  content is the ``final`` channel's text;
- ``deepseek_v3``: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`` then a
  fenced JSON block and ``<｜tool▁call▁end｜>``, per call;
- ``pythonic``: LFM2's ``<|tool_call_start|>[name(key=value, …), …]<|tool_call_end|>`` (Python
  literals only, read with ``ast``: nothing is evaluated);
- ``llama3_json``: Llama 3.1/3.2's JSON objects ``{"name": …, "parameters"|"arguments": {…}}``
  (whitespace anywhere JSON allows it), separated by ``;`` or whitespace, optionally after
  ``<|python_tag|>``.

:func:`detect_format` picks the parser of a chat template from its text (each parser's
:attr:`ToolParser.markers`, most specific first); ``fmt=`` forces one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, ClassVar

#: At most this many calls of one turn run; the rest are errors ("too many calls").
MAX_CALLS_PER_TURN = 16
#: A call whose text is longer than this many characters is an error (never decoded).
MAX_CALL_CHARS = 32_768
#: JSON nested deeper than this (arrays/objects) is an error (never decoded).
MAX_JSON_DEPTH = 64
#: An integer literal with more digits than this is an error (Python refuses > 4,300 anyway).
MAX_INT_DIGITS = 64


@dataclass
class ToolCall:
    """One parsed call: the function's ``name``, its ``arguments`` (a JSON object), and the call's
    ``id`` when the model wrote one (else ``None``; the caller may number the calls)."""

    name: str
    arguments: dict[str, Any]
    id: str | None = None


@dataclass
class ToolCallError:
    """A call the model wrote but that cannot be run: why (``message``) and its ``raw`` text
    (cut to 200 characters)."""

    message: str
    raw: str

    def __post_init__(self) -> None:
        self.raw = self.raw if len(self.raw) <= 200 else self.raw[:200] + " …"


Parsed = list[ToolCall | ToolCallError]


def _json_extent(text: str, pos: int) -> int | str:
    """The end of the JSON value starting at ``text[pos]`` (an object or array, by bracket
    matching outside strings; a scalar: the rest), or why it cannot be decoded safely."""
    if pos >= len(text) or text[pos] not in "[{":
        return len(text)
    depth, in_str, esc = 0, False, False
    stop = min(len(text), pos + MAX_CALL_CHARS + 1)
    for i in range(pos, stop):
        ch = text[i]
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            if depth > MAX_JSON_DEPTH:
                return f"JSON nested deeper than {MAX_JSON_DEPTH} levels"
        elif ch in "]}":
            depth -= 1
            if depth == 0:
                return i + 1
    if stop - pos > MAX_CALL_CHARS:
        return f"a call longer than {MAX_CALL_CHARS} characters"
    return len(text)  # unterminated: json.loads says where


def _int(s: str) -> int:
    if len(s.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(s.lstrip('-'))} digits (limit {MAX_INT_DIGITS})")
    return int(s)


def safe_json(text: str) -> tuple[Any, str | None]:
    """``(value, None)`` for JSON text, else ``(None, why)``: never raises (depth, length and
    integer-size limits above; what ``json`` refuses is reported, not raised)."""
    body = text.strip()
    if len(body) > MAX_CALL_CHARS:
        return None, f"a call longer than {MAX_CALL_CHARS} characters ({len(body)})"
    end = _json_extent(body, 0)
    if isinstance(end, str):
        return None, end
    try:
        return json.loads(body, parse_int=_int), None
    except json.JSONDecodeError as e:
        return None, f"invalid JSON: {e.msg} at char {e.pos}"
    except (ValueError, RecursionError) as e:  # parse_int's limit, anything json refuses
        return None, f"invalid JSON: {str(e).splitlines()[0] if str(e) else type(e).__name__}"


def json_call(obj: Any, raw: str, keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | ToolCallError:
    """A decoded JSON call (``{"name": …, "arguments": {…}}``) checked: fields other than ``name``,
    the arguments and ``id`` are ignored; arguments written as a JSON string are decoded."""
    if not isinstance(obj, dict):
        return ToolCallError(f"a tool call must be a JSON object, got {type(obj).__name__}", raw)
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return ToolCallError('a tool call needs a "name" (a non-empty string)', raw)
    key = next((k for k in keys if k in obj), None)
    args: Any = {} if key is None or obj[key] is None else obj[key]
    if isinstance(args, str):
        args, why = safe_json(args) if args.strip() else ({}, None)
        if why is not None:
            return ToolCallError(f"the arguments of {name.strip()} are not JSON ({why})", raw)
    if not isinstance(args, dict):
        return ToolCallError(f"the arguments of {name.strip()} must be a JSON object, got {type(args).__name__}", raw)
    cid = obj.get("id")
    return ToolCall(name.strip(), args, cid if isinstance(cid, str) else None)


def _decode_call(body: str, raw: str) -> ToolCall | ToolCallError:
    obj, why = safe_json(body)
    return ToolCallError(why, raw) if why is not None else json_call(obj, raw)


def schema_types(schemas: list[dict[str, Any]] | None) -> dict[str, dict[str, str]]:
    """``{tool: {argument: JSON type}}`` from OpenAI-style schemas (the first non-null type of a
    union)."""
    out: dict[str, dict[str, str]] = {}
    for s in schemas or []:
        fn = s.get("function", s) if isinstance(s, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            continue
        props = (fn.get("parameters") or {}).get("properties") or {}
        types: dict[str, str] = {}
        for k, p in props.items() if isinstance(props, dict) else ():
            t = p.get("type") if isinstance(p, dict) else None
            if isinstance(t, list):
                t = next((x for x in t if x != "null"), None)
            if isinstance(t, str):
                types[k] = t
        out[fn["name"]] = types
    return out


def typed_value(value: str, kind: str | None) -> Any:
    """A parameter written as text (XML-style calls), typed by its schema type ``kind``: a string
    stays text; others are decoded (``true``/``True`` for booleans), and kept as text when they do
    not decode (the tool's own argument check then names the problem). Without a type: decoded
    when it is JSON, else text."""
    if kind == "string":
        return value
    v = value.strip()
    if kind == "boolean" and v.lower() in ("true", "false"):
        return v.lower() == "true"
    if kind == "null" and v in ("null", "None"):
        return None
    if kind in (None, "integer", "number", "boolean", "object", "array", "null"):
        decoded, why = safe_json(v)
        if why is None and (kind is not None or not isinstance(decoded, str)):
            return decoded
    return value


class ToolParser:
    """One call syntax. Subclasses set :attr:`name` and :attr:`markers` and implement :meth:`split`."""

    name: ClassVar[str]
    #: Strings that all appear in a chat template that writes this syntax (its fingerprint).
    markers: ClassVar[tuple[str, ...]]

    def split(self, text: str, types: dict[str, dict[str, str]]) -> tuple[str, Parsed]:
        """The turn's content (the text outside its calls, not stripped) and its calls."""
        raise NotImplementedError


#: The parsers by name, in detection order (most specific syntax first).
PARSERS: dict[str, ToolParser] = {}


def register(cls: type[ToolParser]) -> type[ToolParser]:
    """Add a parser class to :data:`PARSERS` under its ``name`` (class decorator)."""
    PARSERS[cls.name] = cls()
    return cls


def _blocks(text: str, open_: str, close: str, on_block: Callable[[str, str], ToolCall | ToolCallError]) -> tuple[str, Parsed]:
    """Every ``open_ … close`` block of ``text`` through ``on_block(body, raw)``; a block left open
    (the turn was cut) is an error. Returns the text outside the blocks and the calls."""
    calls: Parsed = []
    kept, pos = [], 0
    while True:
        start = text.find(open_, pos)
        if start < 0:
            break
        end = text.find(close, start + len(open_))
        kept.append(text[pos:start])
        if end < 0:
            calls.append(ToolCallError(f"{open_} without {close}", text[start:]))
            pos = len(text)
            break
        calls.append(on_block(text[start + len(open_) : end], text[start : end + len(close)]))
        pos = end + len(close)
    kept.append(text[pos:])
    return "".join(kept), calls


@register
class HarmonyParser(ToolParser):
    name = "harmony"
    markers = ("<|call|>", "<|channel|>")
    _MESSAGE = re.compile(r"<\|message\|>")

    def split(self, text: str, types: dict[str, dict[str, str]]) -> tuple[str, Parsed]:
        calls: Parsed = []
        content: list[str] = []
        for msg in re.split(r"<\|start\|>", text):
            head, sep, body = msg.partition("<|message|>")
            if not sep:
                if "to=functions." in head:
                    calls.append(ToolCallError("a call without <|message|>", msg))
                elif "<|channel|>" not in head:
                    content.append(head)
                continue
            body = re.split(r"<\|(?:end|call|return)\|>", body, maxsplit=1)[0]
            m = re.search(r"to=functions\.([^\s<]+)", head)
            if m is not None:
                args, why = safe_json(body) if body.strip() else ({}, None)
                if why is not None:
                    calls.append(ToolCallError(f"the arguments of {m.group(1)} are not JSON ({why})", msg))
                elif not isinstance(args, dict):
                    calls.append(ToolCallError(f"the arguments of {m.group(1)} must be a JSON object", msg))
                else:
                    calls.append(ToolCall(m.group(1), args))
            elif "<|channel|>" not in head or re.search(r"<\|channel\|>\s*final", head):
                content.append(body)
        return "".join(content), calls


@register
class DeepSeekV3Parser(ToolParser):
    name = "deepseek_v3"
    markers = ("<｜tool▁calls▁begin｜>", "<｜tool▁sep｜>")
    _CALL = re.compile(r"^\s*(?:function)?<｜tool▁sep｜>([^\n]*)\n\s*```(?:json)?\s*\n?(.*?)\n?\s*```\s*$", re.DOTALL)

    def split(self, text: str, types: dict[str, dict[str, str]]) -> tuple[str, Parsed]:
        head, sep, tail = text.partition("<｜tool▁calls▁begin｜>")
        if not sep:
            return text, []
        tail, closed, after = tail.partition("<｜tool▁calls▁end｜>")
        _, calls = _blocks(tail, "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", self._one)
        if not closed:
            calls.append(ToolCallError("<｜tool▁calls▁begin｜> without <｜tool▁calls▁end｜>", tail))
        return head + after, calls

    def _one(self, body: str, raw: str) -> ToolCall | ToolCallError:
        m = self._CALL.match(body)
        if m is None:
            return ToolCallError("a call must be function<｜tool▁sep｜>NAME then a ```json block", raw)
        obj, why = safe_json(m.group(2))
        if why is not None:
            return ToolCallError(f"the arguments of {m.group(1).strip()} are not JSON ({why})", raw)
        return json_call({"name": m.group(1), "arguments": obj}, raw)


@register
class GLM45Parser(ToolParser):
    name = "glm45"
    markers = ("<tool_call>", "<arg_key>", "<arg_value>")
    _ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

    def split(self, text: str, types: dict[str, dict[str, str]]) -> tuple[str, Parsed]:
        return _blocks(text, "<tool_call>", "</tool_call>", lambda b, r: self._one(b, r, types))

    def _one(self, body: str, raw: str, types: dict[str, dict[str, str]]) -> ToolCall | ToolCallError:
        name = body.split("<arg_key>", 1)[0].strip()
        if not name or "<" in name:
            return ToolCallError("a call must start with the tool's name", raw)
        rest = body[len(body.split("<arg_key>", 1)[0]) :]
        args = {k.strip(): typed_value(v, types.get(name, {}).get(k.strip())) for k, v in self._ARG.findall(rest)}
        if self._ARG.sub("", rest).strip():
            return ToolCallError(f"the arguments of {name} must be <arg_key>…</arg_key><arg_value>…</arg_value> pairs", raw)
        return ToolCall(name, args)


@register
class Qwen3XMLParser(ToolParser):
    name = "qwen3_xml"
    markers = ("<tool_call>", "<function=", "<parameter=")
    _FUNC = re.compile(r"^\s*<function=([^>\n]+)>(.*)</function>\s*$", re.DOTALL)
    _PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)

    def split(self, text: str, types: dict[str, dict[str, str]]) -> tuple[str, Parsed]:
        return _blocks(text, "<tool_call>", "</tool_call>", lambda b, r: self._one(b, r, types))

    def _one(self, body: str, raw: str, types: dict[str, dict[str, str]]) -> ToolCall | ToolCallError:
        m = self._FUNC.match(body)
        if m is None:
            return ToolCallError("a call must be <function=NAME>…</function> inside <tool_call>", raw)
        name, inner = m.group(1).strip(), m.group(2)
        if self._PARAM.sub("", inner).strip():
            return ToolCallError(f"the arguments of {name} must be <parameter=KEY>…</parameter> blocks", raw)
        args = {}
        for k, v in self._PARAM.findall(inner):
            v = v[1:] if v.startswith("\n") else v
            v = v[:-1] if v.endswith("\n") else v
            args[k.strip()] = typed_value(v, types.get(name, {}).get(k.strip()))
        return ToolCall(name, args)


@register
class Llama3JSONParser(ToolParser):
    name = "llama3_json"
    markers = ("parameters", "<|eot_id|>")
    _START = re.compile(r'\{\s*"name"\s*:')

    def split(self, text: str, types: dict[str, dict[str, str]]) -> tuple[str, Parsed]:
        head, tag, tail = text.partition("<|python_tag|>")
        region, kept = (tail, [head]) if tag else (text, [])
        calls: Parsed = []
        pos = 0
        for m in self._START.finditer(region):
            if m.start() < pos:
                continue
            end = _json_extent(region, m.start())
            obj, why = (None, end) if isinstance(end, str) else safe_json(region[m.start() : end])
            if why is not None:
                kept.append(region[pos : m.start()])
                calls.append(ToolCallError(why, region[m.start() :].strip()))
                pos = len(region)
                break
            if not (isinstance(obj, dict) and ("parameters" in obj or "arguments" in obj)):
                continue  # a JSON object with a "name" that is not a call: content
            kept.append(region[pos : m.start()])
            calls.append(json_call(obj, region[m.start() : end]))  # type: ignore[misc]
            pos = end  # type: ignore[assignment]
            sep = re.match(r"\s*;", region[pos:])
            pos += sep.end() if sep else 0
        kept.append(region[pos:])
        return "".join(kept), calls


@register
class PythonicParser(ToolParser):
    name = "pythonic"
    markers = ("<|tool_call_start|>", "<|tool_call_end|>")

    def split(self, text: str, types: dict[str, dict[str, str]]) -> tuple[str, Parsed]:
        content, lists = _blocks(text, "<|tool_call_start|>", "<|tool_call_end|>", lambda b, r: ToolCallError(b, r))
        calls: Parsed = []
        for item in lists:  # each block's body (in .message) holds a list of calls
            calls += [item] if item.message.startswith("<|tool_call_start|>") else self._calls(item.message, item.raw)
        return content, calls

    def _calls(self, body: str, raw: str) -> Parsed:
        import ast

        body = body.strip()
        if len(body) > MAX_CALL_CHARS:
            return [ToolCallError(f"a call longer than {MAX_CALL_CHARS} characters", raw)]
        depth = 0
        for ch in body:
            depth += (ch in "([{") - (ch in ")]}")
            if depth > MAX_JSON_DEPTH:
                return [ToolCallError(f"calls nested deeper than {MAX_JSON_DEPTH} levels", raw)]
        try:
            tree = ast.parse(body, mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
            return [ToolCallError(f"the calls are not a Python list of calls ({type(e).__name__})", raw)]
        out: Parsed = []
        for node in tree.elts if isinstance(tree, ast.List) else [tree]:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args):
                out.append(ToolCallError("a call must be name(key=value, …)", raw))
                continue
            try:
                args = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
            except (ValueError, SyntaxError, RecursionError, MemoryError, TypeError) as e:
                out.append(ToolCallError(f"the arguments of {node.func.id} are not literals ({type(e).__name__})", raw))
                continue
            big = next((v for v in args.values() if isinstance(v, int) and len(str(abs(v))) > MAX_INT_DIGITS), None)
            out.append(ToolCall(node.func.id, args) if big is None else ToolCallError(f"an integer of more than {MAX_INT_DIGITS} digits", raw))
        return out


@register
class HermesParser(ToolParser):
    name = "hermes"
    markers = ("<tool_call>",)

    def split(self, text: str, types: dict[str, dict[str, str]]) -> tuple[str, Parsed]:
        return _blocks(text, "<tool_call>", "</tool_call>", _decode_call)


@lru_cache(maxsize=64)
def detect_format(template: str | None) -> str | None:
    """The parser (a :data:`PARSERS` name) whose markers all appear in the chat template
    ``template``, in registry order; ``None`` when none does."""
    if not isinstance(template, str):
        return None
    return next((n for n, p in PARSERS.items() if all(m in template for m in p.markers)), None)


def parse_turn(text: str, fmt: str, schemas: list[dict[str, Any]] | None = None) -> tuple[str, Parsed]:
    """``PARSERS[fmt]`` on ``text``: its content and calls, at most :data:`MAX_CALLS_PER_TURN`
    calls (each further one an error). Never raises: a parser failure is one error."""
    try:
        content, calls = PARSERS[fmt].split(text, schema_types(schemas))
    except Exception as e:  # a parser bug on hostile text must not end a run: the model reads why
        return "", [ToolCallError(f"the {fmt} tool-call parser failed on this turn ({type(e).__name__})", text)]
    if len(calls) > MAX_CALLS_PER_TURN:
        why = f"more than {MAX_CALLS_PER_TURN} tool calls in one turn: this one was not run"
        calls = calls[:MAX_CALLS_PER_TURN] + [
            ToolCallError(why, c.raw if isinstance(c, ToolCallError) else c.name) for c in calls[MAX_CALLS_PER_TURN:]
        ]
    return content, calls
