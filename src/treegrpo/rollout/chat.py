"""How an observation enters the context of a chat model: ``obs_format`` ``inline`` | ``chat``.

``inline`` (Search-R1's way, the default): the observation text follows the generated step inside
the same assistant turn (``… </search><information> … </information>``), so the whole trajectory
is one assistant message and the model's next step continues it.

``chat``: the observation becomes a new user turn through the tokenizer's chat template — the
assistant turn is closed, the observation is the next message, and a new assistant turn is opened
for the next step. With ChatML (SmolLM2, Qwen) the appended text is::

    <|im_end|>\\n<|im_start|>user\\n<information> … </information><|im_end|>\\n<|im_start|>assistant\\n

The pieces before and after the observation come from the template itself
(:func:`observation_turn`), rendered once with a placeholder, so any template that renders a
history as a prefix of its longer histories works; one that does not is refused with a clear error.
In both formats the ids trained on are the ids generated plus the ids of what the environment
returned (masked), and the template's rendering of the history is exactly those ids (tested).
"""

from __future__ import annotations

from typing import Any, Literal

from treegrpo.errors import ConfigError

ObsFormat = Literal["inline", "chat"]
OBS_FORMATS: tuple[str, ...] = ("inline", "chat")
#: The role of an observation turn in ``chat`` format (Search-R1's multi-turn variants and most
#: instruct templates know ``user``; not every template knows ``tool``).
OBS_ROLE = "user"
_MARK = "\u2063OBSERVATION\u2063"


def appended_text(
    tokenizer: Any,
    history: list[dict[str, Any]],
    added: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    close: tuple[str, ...] | None = None,
) -> str | None:
    """The text the chat template appends to ``history`` (ending with an assistant message) when the
    messages ``added`` follow it and the next assistant turn is opened (``add_generation_prompt``).

    Where ``history``'s rendering stops: with ``close`` (end-of-turn token strings), right after the
    last of them in the rendered history — the generated ids stop at that token, included (the
    native tool protocol, :func:`treegrpo.rollout.toolcall.tool_turn_text`); without it, the
    assistant turn is left open (``continue_final_message``) and the text returned closes it (the
    ``chat`` observation format, :func:`observation_turn`). Where the rendered history has no
    end-of-turn token after the assistant turn and the longer rendering continues with one (GLM
    writes ``<|observation|>`` as the tool turn's opening), the model generates that token: the text
    returned begins after it. ``None`` when the template does not render ``history`` as a prefix of
    the longer conversation (or ``close`` is not in it)."""
    kw: dict[str, Any] = {"tools": tools} if tools else {}
    if close is None:
        head = tokenizer.apply_chat_template(history, continue_final_message=True, tokenize=False, **kw)
    else:
        head = tokenizer.apply_chat_template(history, tokenize=False, **kw)
        full = tokenizer.apply_chat_template([*history, *added], add_generation_prompt=True, tokenize=False, **kw)
        rest = full[len(head) :] if full.startswith(head) else ""
        opens = next((t for t in close if t and rest.startswith(t)), None)
        if opens is not None and not any(t and head.rstrip().endswith(t) for t in close):
            return rest[len(opens) :]  # the turn's end token opens the next turn (GLM's <|observation|>)
        cut = max((head.rfind(t) + len(t) for t in close if t and t in head), default=-1)
        if cut < 0:
            return None
        head = head[:cut]
        return full[len(head) :] if full.startswith(head) else None
    full = tokenizer.apply_chat_template([*history, *added], add_generation_prompt=True, tokenize=False, **kw)
    return full[len(head) :] if full.startswith(head) else None


def observation_turn(tokenizer: Any) -> tuple[str, str]:
    """The text ``(before, after)`` an observation in ``chat`` format: ``before`` closes the
    assistant turn and opens an observation turn, ``after`` closes it and opens the next
    assistant turn. Raises :class:`ConfigError` when the tokenizer has no chat template or its
    rendering of a history is not a prefix of the rendering with one more turn."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("obs_format=chat needs a tokenizer with a chat template; use obs_format=inline")
    history = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    text = appended_text(tokenizer, history, [{"role": OBS_ROLE, "content": _MARK}])
    if text is None or text.count(_MARK) != 1:
        raise ConfigError(
            "obs_format=chat: this chat template does not render a conversation as a prefix of the same "
            "conversation with one more turn, so a trajectory cannot grow turn by turn; use obs_format=inline"
        )
    before, _, after = text.partition(_MARK)
    return before, after


def special_token_strings(tokenizer: Any) -> tuple[str, ...]:
    """The tokenizer's control tokens as text: its added tokens marked special (``<|im_end|>``,
    ``<|eot_id|>`` …), longest first."""
    dec = getattr(tokenizer, "added_tokens_decoder", None) or {}
    found = {t.content for t in dec.values() if getattr(t, "special", False) and t.content}
    return tuple(sorted(found, key=lambda s: (-len(s), s)))


def encode_observation(tokenizer: Any, text: str, parts: Any = None, *, plain: bool = True) -> list[int]:
    """The ids of an observation (DESIGN §3.10). ``parts``: its ``(text, control)`` pieces
    (:attr:`~treegrpo.envs.base.StepOutcome.observation_parts`; ``None``: the whole of ``text`` is
    plain). Control pieces (template turn markers) are tokenized with special tokens; plain pieces
    (tool results, retrieved text) as plain text, so ``<|im_end|>`` written in a result is the
    characters, never the control token. ``plain=False``: the whole text with special tokens parsed
    (transformers', TRL's and vLLM's chat path: a result can forge a turn).

    Where no plain piece holds a control token's text (:func:`special_token_strings`) the ids are
    exactly ``tokenizer.encode(text)``'s (one tokenization of the whole, as before)."""
    pieces = ((text, False),) if parts is None else tuple(parts)
    whole = "".join(t for t, _ in pieces)
    specials = special_token_strings(tokenizer) if plain else ()
    if not any(s in t for t, control in pieces if not control for s in specials):
        return list(tokenizer.encode(whole, add_special_tokens=False))
    ids: list[int] = []
    for t, control in pieces:
        if control:
            ids += tokenizer.encode(t, add_special_tokens=False)
        else:
            ids += tokenizer(t, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return ids
