"""Tokenizers with the built-in chat templates for tests: SmolLM2's tokenizer as it is (chatml-tools,
qwen2.5), or with Llama 3's special tokens and pre-tokenizer added (llama3.1)."""

from __future__ import annotations

import copy
from typing import Any

from tokenizers import Regex, pre_tokenizers
from transformers import AddedToken

from treegrpo.rollout.templates import set_chat_template

LLAMA_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]
# Llama 3's pre-tokenizer: "\n\n" after a header stays one piece whatever follows (GPT-2's regex,
# SmolLM2's, splits "\n\n{" into "\n" "\n" "{", so the prompt's trailing "\n\n" would not match).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def with_llama_tokens(tok: Any, llama_split: bool = True) -> Any:
    """A copy of ``tok`` with Llama 3's special tokens (and its pre-tokenizer)."""
    tok = copy.deepcopy(tok)
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in LLAMA_TOKENS], special_tokens=True)
    if llama_split:
        tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    return tok


def templated(smollm2: Any, name: str) -> Any:
    tok = with_llama_tokens(smollm2) if name == "llama3.1" else copy.deepcopy(smollm2)
    set_chat_template(tok, name)
    return tok
