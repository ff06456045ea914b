"""Chat templates for tool agents in the model's own protocol, and the start-up checks on a template.

Built-in templates (:data:`BUILTIN_TEMPLATES`, Jinja files next to this module; transformers'
conventions: ``messages``, ``tools``, ``add_generation_prompt``, assistant ``tool_calls`` with
``function.name`` / ``function.arguments``, role ``tool``):

- ``chatml-tools``: ChatML with Hermes-style calls, for SmolLM2 (whose own template renders no
  tools): the tools' schemas in the system turn inside ``<tools></tools>``, each call a
  ``<tool_call>\\n{"name": …, "arguments": …}\\n</tool_call>`` block, each result a ``tool`` turn;
- ``qwen2.5``: Qwen2.5-Instruct's structure and system texts; consecutive results grouped into one
  user turn of ``<tool_response>`` blocks;
- ``llama3.1``: Llama 3.1's structure (header ids, ``<|eot_id|>``, the date header, JSON calls
  ``{"name": …, "parameters": …}`` separated by ``"; "``, results as ``ipython`` turns).

All three write the newline between turns before the next turn, so every history renders as a
prefix of the longer ones and a whole conversation ends at its last end-of-turn token: the ids
trained on (prompt + generated + appended) are the template's rendering of the conversation.
:func:`set_chat_template` also sets the matching transformers ``response_template`` (read by
``tokenizer.parse_response``, by :func:`treegrpo.rollout.toolcall.parse_tool_calls` and by TRL's
``GRPOTrainer(tools=…)``, which refuses a template it does not know without one).
"""

from __future__ import annotations

import copy
import re
from importlib import resources
from pathlib import Path
from typing import Any

from treegrpo.errors import ConfigError
from treegrpo.rollout.toolcall import end_of_turn_tokens

BUILTIN_TEMPLATES: tuple[str, ...] = ("chatml-tools", "qwen2.5", "llama3.1")

_HERMES_RESPONSE: dict[str, Any] = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}
_LLAMA3_RESPONSE: dict[str, Any] = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "fields": {
        "tool_calls": {
            "open_pattern": r'(?:<\|python_tag\|>)?\{"name":\s*"(?P<name>[^"]+)",\s*"parameters":\s*',
            "close_pattern": r"\}\s*(?:;\s*|(?=<\|eot_id\|>|<\|eom_id\|>)|$)",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
        },
        "content": {"close_pattern": r"(?:<\|eot_id\|>|<\|eom_id\|>)\s*", "content": "text"},
    },
}
#: transformers' ``response_template`` of each built-in template (how ``parse_response`` reads a turn).
RESPONSE_TEMPLATES: dict[str, dict[str, Any]] = {
    "chatml-tools": _HERMES_RESPONSE,
    "qwen2.5": _HERMES_RESPONSE,
    "llama3.1": _LLAMA3_RESPONSE,
}
_SPECIAL = re.compile(r"<\|[A-Za-z0-9_]+\|>")
_FIX = "use --chat-template chatml-tools or a template that supports tools"
_PROBE_DATE = {"date_string": "26 Jul 2024"}  # templates with a date header: the same date each render


def load_chat_template(spec: str) -> str:
    """The Jinja text of a built-in template (:data:`BUILTIN_TEMPLATES`) or of a Jinja file."""
    if spec in BUILTIN_TEMPLATES:
        return (resources.files(__name__) / f"{spec}.jinja").read_text(encoding="utf-8")
    path = Path(spec).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    raise ConfigError(
        f"--chat-template {spec!r} is neither a built-in template ({', '.join(BUILTIN_TEMPLATES)}) "
        "nor a path to a Jinja file"
    )


def builtin_name(template: str | None) -> str | None:
    """The built-in template whose text ``template`` is, else ``None``."""
    return next((n for n in BUILTIN_TEMPLATES if template == load_chat_template(n)), None)


def missing_special_tokens(tokenizer: Any, template: str) -> list[str]:
    """The ``<|…|>`` tokens the template writes that the tokenizer does not hold as one token."""
    out = []
    for tok in dict.fromkeys(_SPECIAL.findall(template)):
        ids = tokenizer.encode(tok, add_special_tokens=False)
        if len(ids) != 1 or tokenizer.convert_ids_to_tokens(ids[0]) != tok:
            out.append(tok)
    return out


def set_chat_template(tokenizer: Any, spec: str) -> None:
    """Set the tokenizer's chat template to ``spec`` (:func:`load_chat_template`) and its
    ``response_template`` to the matching one (a built-in's; ``None`` for another template, so
    tool calls are parsed by the built-in parsers). Raises :class:`ConfigError` when a special
    token the template writes is not a single token of the tokenizer."""
    template = load_chat_template(spec)
    missing = missing_special_tokens(tokenizer, template)
    if missing:
        raise ConfigError(
            f"--chat-template {spec}: the tokenizer has no token {', '.join(missing)} (the template writes them); "
            "use a template written for this model's tokenizer, or add the token to the tokenizer"
        )
    tokenizer.chat_template = template
    name = builtin_name(template)
    tokenizer.response_template = copy.deepcopy(RESPONSE_TEMPLATES[name]) if name else None


def _schema_name(schema: dict[str, Any]) -> str | None:
    fn = schema.get("function", schema)
    return fn.get("name") if isinstance(fn, dict) else None


def _render(tokenizer: Any, messages: list[dict[str, Any]], schemas: list[dict[str, Any]], gen: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=schemas or None, add_generation_prompt=gen, tokenize=False, **_PROBE_DATE
    )


def check_tool_template(tokenizer: Any, schemas: list[dict[str, Any]]) -> None:
    """Raise a one-line :class:`ConfigError` when the tokenizer's chat template cannot render a tool
    conversation: the schemas absent from the rendered prompt, assistant ``tool_calls`` dropped, or
    no way to render a tool result (as TRL's ``supports_tool_calling`` checks, plus the schemas)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"the tokenizer has no chat template; {_FIX}")
    name, key, value, result = "probe_tool_3f9a", "probe_key_7c21", "probe_value_b804", "probe_result_51d6"
    given = schemas
    schemas = schemas or [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}]
    call = {"type": "function", "function": {"name": name, "arguments": {key: value}}}
    user = {"role": "user", "content": "Q"}
    asked = [user, {"role": "assistant", "content": "", "tool_calls": [call]}]
    try:
        prompt = _render(tokenizer, [user], schemas, True)
        called = _render(tokenizer, asked, schemas, False)
        answered = _render(tokenizer, [*asked, {"role": "tool", "name": name, "content": result}], schemas, True)
    except Exception as e:  # a template that rejects the roles or the fields raises anything
        raise ConfigError(f"the chat template cannot render a tool conversation ({type(e).__name__}: {e}); {_FIX}") from e
    absent = [n for n in map(_schema_name, given) if n and n not in prompt]
    if absent:
        raise ConfigError(f"the chat template does not render the tools' schemas ({', '.join(absent)} absent); {_FIX}")
    if not all(s in called for s in (name, key, value)):
        raise ConfigError(f"the chat template drops an assistant message's tool_calls; {_FIX}")
    if result not in answered:
        raise ConfigError(f"the chat template renders no tool result (role tool); {_FIX}")


def _probe(schemas: list[dict[str, Any]], calls: int = 2) -> list[dict[str, Any]]:
    """A conversation as a thinking tool agent generates it: ``calls`` calls, their results, an
    answer, a follow-up question and its answer."""
    name = next((n for n in map(_schema_name, schemas) if n), "add")

    def call(a: int, b: int) -> dict[str, Any]:
        return {"type": "function", "function": {"name": name, "arguments": {"a": a, "b": b}}}

    sums = [(2, 3), (4, 5)][:calls]
    return [
        {"role": "user", "content": "What are 2+3 and 4+5?"},
        {"role": "assistant", "content": "<think>\nSums.\n</think>\n\nLet me add.", "tool_calls": [call(*s) for s in sums]},
        *({"role": "tool", "name": name, "content": str(a + b)} for a, b in sums),
        {"role": "assistant", "content": "<think>\nKnown.\n</think>\n\n5 and 9."},
        {"role": "user", "content": "And 1+1?"},
        {"role": "assistant", "content": "<think>\nEasy.\n</think>\n\n2."},
    ]  # fmt: skip


def _turn_by_turn(tokenizer: Any, messages: list[dict[str, Any]], schemas: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """What the loop holds at each point of ``messages``, rendered: each assistant turn's prompt (up
    to its generation prompt) and the history after it (up to its last end-of-turn token)."""
    ends, steps = end_of_turn_tokens(tokenizer), []
    for k, msg in enumerate(messages):
        if msg["role"] == "assistant":
            n = len(steps) // 2 + 1
            steps.append((f"the prompt of assistant turn {n}", _render(tokenizer, messages[:k], schemas, True)))
            closed = _render(tokenizer, messages[: k + 1], schemas, False)
            cut = max((closed.rfind(t) + len(t) for t in ends if t in closed), default=len(closed))
            steps.append((f"assistant turn {n}", closed[:cut]))
    return steps


def rerender_note(tokenizer: Any, schemas: list[dict[str, Any]]) -> str | None:
    """One line when the template's rendering of a conversation is not what the loop holds — the
    loop never re-renders: prompt ids + generated ids + each appended turn's ids — else ``None``.

    Fires when rendering a probe conversation (:func:`_probe`) turn by turn (each prompt up to its
    generation prompt, each history up to its last end-of-turn token) does not give prefixes of
    rendering it whole (the template re-renders earlier turns, e.g. Qwen3 drops earlier thinking);
    when the pieces, tokenized one by one as the loop does, differ from the whole tokenized at once
    (the tokenizer merges text across a turn boundary); when the template refuses several calls in
    one turn (Meta's Llama 3.1); or when it writes today's date (``strftime_now``, as Llama 3.2+'s
    header does), so the same conversation renders differently on another day."""
    reasons = []
    try:
        steps = _turn_by_turn(tokenizer, _probe(schemas), schemas)
    except Exception as e:  # a template that rejects what the probe holds raises anything
        try:
            steps = _turn_by_turn(tokenizer, _probe(schemas, calls=1), schemas)
        except Exception:
            return f"chat template note: it cannot render a tool conversation ({type(e).__name__}: {e})"
        reasons.append(f"it refuses several tool calls in one turn ({type(e).__name__}: {e})")
    bad = next((i for i in range(1, len(steps)) if not steps[i][1].startswith(steps[i - 1][1])), None)
    if bad is not None:
        reasons.append(f"it re-renders earlier turns ({steps[bad][0]} does not begin with {steps[bad - 1][0]} as rendered before)")
    else:
        ids, prev = [], ""
        for _, text in steps:
            ids += tokenizer.encode(text[len(prev) :], add_special_tokens=False)
            prev = text
        if ids != tokenizer.encode(prev, add_special_tokens=False):
            reasons.append("the tokenizer splits the text at a turn boundary differently from the whole conversation")
    if "strftime_now" in str(tokenizer.chat_template or ""):
        reasons.append("it writes today's date (strftime_now), so the conversation renders differently on another day")
    if not reasons:
        return None
    return (
        f"chat template note: {'; '.join(reasons)} — treegrpo never re-renders or re-tokenizes a conversation (the ids "
        "trained on are the prompt's, the generated and the appended turns' ids), so they can differ from the "
        "template's rendering of the whole conversation"
    )
