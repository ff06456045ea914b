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
from treegrpo.rollout.templates.loop import PROBE_DATE, agent_conversation, loop_mismatch, loop_pieces, render
from treegrpo.rollout.templates.training import use_training_template
from treegrpo.rollout.tool_parsers import PARSERS, ToolCall
from treegrpo.rollout.toolcall import parse_tool_calls, tool_call_format, tool_turn_text

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
_PROBE_DATE = PROBE_DATE


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
    return render(tokenizer, messages, schemas, gen)


def check_tool_template(tokenizer: Any, schemas: list[dict[str, Any]]) -> None:
    """Raise a one-line :class:`ConfigError` wherever a tool run would fail later: no chat
    template; the schemas absent from the rendered prompt; assistant ``tool_calls`` dropped; no
    tool result rendered (TRL's ``supports_tool_calling``, plus the schemas); the results of a turn
    not appendable turn by turn (:func:`~treegrpo.rollout.toolcall.tool_turn_text`: the template
    re-renders a turn once its results follow, as Qwen3's own does); no assistant turn the template
    renders after its own generation prompt; or no parser that reads back the calls the template
    writes (:mod:`treegrpo.rollout.tool_parsers`)."""
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
    tool_turn_text(tokenizer, [{"role": "tool", "name": name, "content": result}], schemas)  # raises its one line
    _check_parser(tokenizer, schemas)


def _check_parser(tokenizer: Any, schemas: list[dict[str, Any]]) -> None:
    """A call the template writes after its generation prompt must parse back (name, arguments)."""
    tool = next((n for n in map(_schema_name, schemas) if n), "add")
    fmt = tool_call_format(tokenizer)
    pieces: Any = None
    for thinking in (False, True):
        conv = agent_conversation(tool, thinking=thinking, first_calls=1)
        try:
            pieces = loop_pieces(tokenizer, conv[:3], schemas)
        except ConfigError:
            raise
        except Exception as e:  # a template that refuses the shape: try the other
            pieces = f"{type(e).__name__}: {e}"
        if not isinstance(pieces, str):
            break
    if isinstance(pieces, str):
        raise ConfigError(f"the chat template cannot write an assistant turn after its own generation prompt ({pieces}); {_FIX}")
    turn = pieces[1][1]
    _, calls = parse_tool_calls(turn, tokenizer, schemas=schemas)
    want = [(tool, {"a": 21, "b": 34})]
    if [(c.name, c.arguments) for c in calls if isinstance(c, ToolCall)] != want or len(calls) != 1:
        raise ConfigError(
            f"no tool-call parser reads the calls this chat template writes (parser {fmt or 'none detected'} read "
            f"{calls!r:.120} from {turn[-120:]!r}); parsers: {', '.join(PARSERS)}; {_FIX}"
        )


def rerender_note(tokenizer: Any, schemas: list[dict[str, Any]]) -> str | None:
    """One line when the template's rendering of a conversation is not what the loop holds — the
    loop never re-renders: prompt ids + generated ids + each appended turn's ids — else ``None``.

    Fires when the loop's pieces of an agent conversation (:func:`.loop.loop_mismatch`: two tool
    rounds, two calls in the first, with and without thinking) differ from rendering it whole
    (the template drops earlier thinking, say, as gpt-oss's drops analysis once a final answer
    follows); when the pieces, tokenized one by one as the loop does, differ from the whole
    tokenized at once (the tokenizer merges text across a turn boundary); when the template
    refuses several calls in one turn (Meta's Llama 3.1); or when it writes today's date
    (``strftime_now``, as Llama 3.2+'s header does), so the same conversation renders differently
    on another day."""
    reasons = []
    tool = next((n for n in map(_schema_name, schemas) if n), "add")
    try:
        _render(tokenizer, agent_conversation(tool, thinking=False), schemas, False)
    except Exception as e:  # a template that refuses two calls in one turn raises anything
        reasons.append(f"it refuses several tool calls in one turn ({type(e).__name__}: {e})")
    why = loop_mismatch(tokenizer, schemas)
    if why is not None:
        reasons.append(f"it re-renders earlier turns ({why})")
    else:
        for thinking in (False, True):
            try:
                pieces = loop_pieces(tokenizer, agent_conversation(tool, thinking=thinking, first_calls=1), schemas)
            except Exception:  # a shape the template refuses: loop_mismatch judged it
                continue
            if isinstance(pieces, str):
                continue
            ids = [i for _, t in pieces for i in tokenizer.encode(t, add_special_tokens=False)]
            if ids != tokenizer.encode("".join(t for _, t in pieces), add_special_tokens=False):
                reasons.append("the tokenizer splits the text at a turn boundary differently from the whole conversation")
                break
    if "strftime_now" in str(tokenizer.chat_template or ""):
        reasons.append("it writes today's date (strftime_now), so the conversation renders differently on another day")
    if not reasons:
        return None
    return (
        f"chat template note: {'; '.join(reasons)} — treegrpo never re-renders or re-tokenizes a conversation (the ids "
        "trained on are the prompt's, the generated and the appended turns' ids), so they can differ from the "
        "template's rendering of the whole conversation"
    )


def prepare_tool_template(tokenizer: Any, schemas: list[dict[str, Any]]) -> list[str]:
    """Start-up for a tool run in the model's own protocol: TRL's training variant swapped in where
    the template needs it (:func:`.training.use_training_template`), the template checked
    (:func:`check_tool_template`: raises one line), and the notes to print (the swap,
    :func:`rerender_note`)."""
    notes = [use_training_template(tokenizer, schemas)]
    check_tool_template(tokenizer, schemas)
    notes.append(rerender_note(tokenizer, schemas))
    return [n for n in notes if n]
