"""What the agent loop holds for a tool conversation, against the template's rendering of it.

The loop never re-renders: a trajectory's ids are the prompt's (the template's rendering of the
user turn with its generation prompt), each generated turn's, and each appended tool turn's
(:func:`~treegrpo.rollout.toolcall.tool_turn_text`). :func:`loop_pieces` builds those pieces for a
conversation as a model writes it (each assistant turn as the template renders it after its own
generation prompt); :func:`loop_mismatch` says where they differ from the template's rendering of
the whole conversation, for an agent conversation (one user turn, two tool rounds — two calls in
the first —, a final answer) with and without thinking.
"""

from __future__ import annotations

import json
from typing import Any

from treegrpo.rollout.toolcall import end_of_turn_tokens, tool_turn_text

PROBE_DATE = {"date_string": "26 Jul 2024"}  # templates with a date header: the same date each render


def _schema_name(schema: dict[str, Any]) -> str | None:
    fn = schema.get("function", schema)
    return fn.get("name") if isinstance(fn, dict) else None


def render(tokenizer: Any, messages: list[dict[str, Any]], schemas: list[dict[str, Any]] | None, gen: bool = False) -> str:
    """The template's text of ``messages`` (``tools=schemas``, a fixed date)."""
    return tokenizer.apply_chat_template(messages, tools=schemas or None, add_generation_prompt=gen, tokenize=False, **PROBE_DATE)


def agent_conversation(
    name: str, thinking: bool, first_calls: int = 2, string_args: bool = False, text: bool = True
) -> list[dict[str, Any]]:
    """A tool agent's conversation with tool ``name`` (arguments ``a``, ``b``): ``first_calls``
    calls, their results, one more call, its result, the answer; each assistant turn with a
    thought (``reasoning_content`` / ``thinking``, as templates read it) when ``thinking``, else
    (``text``) the first turn's calls after a line of text."""

    def call(a: int, b: int) -> dict[str, Any]:
        args: Any = {"a": a, "b": b}
        return {"type": "function", "function": {"name": name, "arguments": json.dumps(args) if string_args else args}}

    def turn(content: str, thought: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if thinking:
            msg.update(reasoning_content=thought, thinking=thought)
        return {**msg, "tool_calls": calls} if calls else msg

    sums = [(21, 34), (40, 57)][:first_calls]
    return [
        {"role": "user", "content": "Add the two pairs, then the two sums."},
        turn("Let me add." if text and not thinking else "", "Two sums.", [call(a, b) for a, b in sums]),
        *({"role": "tool", "name": name, "content": str(a + b)} for a, b in sums),
        turn("", "Now the total.", [call(55, 97)]),
        {"role": "tool", "name": name, "content": "152"},
        turn("55, 97 and 152.", "Known.", []),
    ]  # fmt: skip


def _cut(text: str, ends: tuple[str, ...]) -> str:
    """``text`` up to its last end-of-turn token (included); all of it when it has none."""
    cut = max((text.rfind(t) + len(t) for t in ends if t and t in text), default=-1)
    return text if cut < 0 else text[:cut]


def loop_pieces(
    tokenizer: Any, messages: list[dict[str, Any]], schemas: list[dict[str, Any]] | None
) -> list[tuple[str, str]] | str:
    """The loop's pieces of ``messages`` as ``(kind, text)``: ``prompt``, then per assistant turn
    ``turn`` (the template's rendering of it after its generation prompt, through its end-of-turn
    token) and, after a turn with calls, ``tool`` (:func:`tool_turn_text` of its results). A
    string instead: why a model cannot write this conversation in this template (an assistant
    turn the template does not render after its own generation prompt)."""
    ends = end_of_turn_tokens(tokenizer)
    pieces = [("prompt", render(tokenizer, messages[:1], schemas, True))]
    k = 1
    while k < len(messages):
        msg = messages[k]
        head = render(tokenizer, messages[:k], schemas, True)
        full = render(tokenizer, messages[: k + 1], schemas)
        if not full.startswith(head):
            return f"assistant turn {sum(p[0] == 'turn' for p in pieces) + 1} is not rendered after its generation prompt"
        results = []
        while k + 1 < len(messages) and messages[k + 1]["role"] == "tool":
            results.append(messages[k + 1])
            k += 1
        body = full[len(head) :]  # the turn as the model writes it (the last message)
        if msg.get("tool_calls"):
            tool = tool_turn_text(tokenizer, results, schemas)
            turn = _cut(body, ends)
            if turn == body:  # no end-of-turn token in it: the one opening the tool turn (GLM's <|observation|>)
                nxt = render(tokenizer, messages[: k + 1], schemas, True)
                rest = nxt[len(head) :] if nxt.startswith(head) else ""
                turn = body.rstrip() + next((t for t in ends if t and rest.startswith(body.rstrip() + t)), "")
            pieces += [("turn", turn), ("tool", tool)]
        else:  # the final turn: through its end-of-turn token where the template writes one
            pieces.append(("turn", _cut(body, ends) if _cut(body, ends) != body else body.rstrip()))
        k += 1
    return pieces


def loop_mismatch(tokenizer: Any, schemas: list[dict[str, Any]]) -> str | None:
    """Why the loop's pieces of an agent conversation (:func:`agent_conversation`, with and
    without thinking) are not the template's rendering of the whole conversation, or ``None``.
    A variant the template cannot render after its own generation prompt (thinking in a template
    whose prompt closes the think block, say) is one a model cannot write: skipped; both skipped
    is a mismatch. Several calls in one turn fall back to one per turn when the template refuses
    them (Meta's Llama 3.1) or drops them (gpt-oss renders one call per turn)."""
    name = next((n for n in map(_schema_name, schemas) if n), "add")
    why = None
    applicable = 0
    for thinking in (False, True):
        messages, err = None, None
        for first_calls, string_args in ((2, False), (2, True), (1, False), (1, True)):
            conv = agent_conversation(name, thinking, first_calls, string_args)
            try:
                whole = render(tokenizer, conv, schemas)
            except Exception as e:  # a template that refuses this shape raises anything
                err = e
                continue
            if first_calls == 2 and "57" not in render(tokenizer, conv[:2], schemas):
                continue  # a template that silently drops a turn's second call (gpt-oss)
            messages = conv
            break
        if messages is None:
            why = f"it cannot render a tool conversation ({type(err).__name__}: {err})"
            continue
        try:
            pieces = loop_pieces(tokenizer, messages, schemas)
        except Exception as e:  # tool_turn_text's ConfigError, or the template raising
            return f"{'with' if thinking else 'without'} thinking, {str(e).split(';')[0]}"
        if isinstance(pieces, str):
            why = why or f"{'with' if thinking else 'without'} thinking, {pieces}"
            continue
        applicable += 1
        held = "".join(t for _, t in pieces)
        if not whole.startswith(held) or whole[len(held) :].strip():
            at = next((i for i, (a, b) in enumerate(zip(held, whole, strict=False)) if a != b), min(len(held), len(whole)))
            return (
                f"{'with' if thinking else 'without'} thinking, the conversation as generated turn by turn differs from "
                f"the template's rendering of it at character {at} ({held[at : at + 40]!r} vs {whole[at : at + 40]!r})"
            )
    return None if applicable else why
