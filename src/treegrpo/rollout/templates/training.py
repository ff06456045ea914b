"""TRL's prefix-preserving training templates, swapped in automatically as ``GRPOTrainer(tools=)`` does.

Some models' own chat templates cannot be a prefix of themselves in a tool loop: Qwen3 writes an
empty ``<think>\\n\\n</think>`` block only on the last assistant turn, so a turn with calls renders
differently once its tool results follow, and appending the results turn by turn is impossible.
TRL 1.16 ships a training variant of each such template (``trl/chat_templates/*_training.jinja``,
Apache-2.0, © The HuggingFace Team), recognizes a model's template by its exact text, and swaps the
variant in. :func:`use_training_template` does the same, for a template whose tool loop fails
(:func:`~treegrpo.rollout.templates.loop.loop_mismatch`) and whose variant passes: the variant is
read from the installed ``trl`` when there is one, else from the copy shipped here
(``trl-NAME_training.jinja``, byte-identical to TRL 1.16's; only those the loop needs).
"""

from __future__ import annotations

import hashlib
from importlib import resources
from pathlib import Path
from typing import Any

#: TRL 1.16's original templates with a training variant, by the first 16 hex digits of the
#: SHA-256 of their text (TRL's identity comparison, without shipping the originals).
TRL_ORIGINALS: dict[str, str] = {
    "cd8e9439f0570856": "qwen2_5",
    "a55ee1b1660128b7": "qwen3",
    "64f85b198065d0fb": "qwen3_instruct_2507",
    "a4aee8afcf2e0711": "qwen3_5_think",
    "273d8e0e683b8850": "qwen3_5_nothink",
    "e84f32a23fdda276": "qwen3_6",
    "c3cf9e34abf4f9e3": "qwen3_8",
    "3636d0f0bd6bef02": "qwen3_vl",
    "44f815868bf02fa4": "glm4moe",
    "a4c9919cbbd4acdd": "gptoss",
    "563b1ce7d61d50a9": "deepseekv3",
    "ab7813c3abdd9cb6": "nemotron_3_nano",
    "575fb74f54ed264d": "nemotron_3_super",
    "82753bef5cedc493": "nemotron_3_ultra",
    "58933db77d3099b4": "nemotron_3_5_lightning",
    "5504d163d879bfb6": "lfm2_v2",
    "cfc67e5f349f3769": "muse_glimmer",
    "9aeb7eac68ad87bb": "diffusion_gemma",
}


def trl_family(template: Any) -> str | None:
    """The TRL name of ``template`` when it is one of :data:`TRL_ORIGINALS`, else ``None``."""
    if not isinstance(template, str):
        return None
    return TRL_ORIGINALS.get(hashlib.sha256(template.encode("utf-8")).hexdigest()[:16])


def training_template(family: str) -> str | None:
    """TRL's ``{family}_training.jinja``: from the installed ``trl``, else the copy shipped here,
    else ``None``."""
    try:
        import trl

        path = Path(trl.__file__).parent / "chat_templates" / f"{family}_training.jinja"
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except ImportError:
        pass
    shipped = resources.files(__package__) / f"trl-{family}_training.jinja"
    return shipped.read_text(encoding="utf-8") if shipped.is_file() else None


def use_training_template(tokenizer: Any, schemas: list[dict[str, Any]]) -> str | None:
    """Swap TRL's training variant into ``tokenizer.chat_template`` when the template is a TRL
    original whose tool loop fails and the variant's passes; returns the line saying so (``None``:
    nothing changed). The run then renders, generates and trains with the variant, and saves it
    with its checkpoints."""
    from treegrpo.rollout.templates.loop import loop_mismatch

    family = trl_family(getattr(tokenizer, "chat_template", None))
    if family is None:
        return None
    why = loop_mismatch(tokenizer, schemas)
    variant = training_template(family) if why is not None else None
    if variant is None:
        return None
    own = tokenizer.chat_template
    tokenizer.chat_template = variant
    if loop_mismatch(tokenizer, schemas) is not None:
        tokenizer.chat_template = own
        return None
    return (
        f"chat template: {family}'s own template fails in a tool loop ({why}); using TRL's prefix-preserving "
        f"{family}_training template instead (as TRL's GRPOTrainer(tools=) does), for rollouts, updates and checkpoints"
    )
