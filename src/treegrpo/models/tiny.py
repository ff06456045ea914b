"""Tiny local models: a tokenizer trained with ``tokenizers`` and a small Qwen2 model, saved with
``save_pretrained`` and loaded back through the same ``from_pretrained`` path as a real model.

Nothing is downloaded. See DESIGN.md §7 for the transformers 5.x pitfalls this module avoids
(``AutoTokenizer`` swaps in Qwen2's pre-tokenizer for a ``qwen2`` folder, so a locally trained
tokenizer is loaded with ``PreTrainedTokenizerFast``; ``padding_side`` is not saved).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config
from transformers.utils import logging as hf_logging

# Loading/saving a 1M-parameter model needs no progress bars between our own progress lines.
hf_logging.disable_progress_bar()

EOS = "<|endoftext|>"
PAD = "<|pad|>"
# Protocol tags are single tokens in the tiny vocabulary, so a stop tag is one stop id.
PROTOCOL_TAGS = (
    "<think>",
    "</think>",
    "<search>",
    "</search>",
    "<answer>",
    "</answer>",
    "<information>",
    "</information>",
)
MARKER_FILE = "treegrpo_tiny.json"


def train_tokenizer(
    texts: Iterable[str], vocab_size: int = 1024, extra_tokens: Sequence[str] = ()
) -> Tokenizer:
    """Byte-level BPE trained on ``texts``; protocol tags and ``extra_tokens`` are whole tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_tokens([*PROTOCOL_TAGS, *extra_tokens])
    return tok


def wrap_tokenizer(tok: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD, padding_side="left")


def build_model(
    vocab_size: int,
    hidden_size: int = 96,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate_size: int = 256,
    max_positions: int = 1024,
    eos_token_id: int = 0,
    pad_token_id: int = 1,
    seed: int = 0,
) -> torch.nn.Module:
    """A small Qwen2 causal LM with tied embeddings, initialised from ``seed`` (without touching
    the global torch RNG, so callers' sampling streams stay their own)."""
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    return model


def save_tiny(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, folder: str | Path, info: dict | None = None
) -> Path:
    """Save model + tokenizer with ``save_pretrained`` and a marker naming the tokenizer class."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / MARKER_FILE).write_text(
        json.dumps({"tokenizer": "PreTrainedTokenizerFast", **(info or {})}, indent=1)
    )
    return folder


def load_tokenizer(folder: str | Path) -> PreTrainedTokenizerFast:
    """Load a model folder's tokenizer, left padding, with a pad token.

    A folder written by :func:`save_tiny` is loaded with ``PreTrainedTokenizerFast`` (its saved
    ``tokenizer.json`` exactly); any other folder through ``AutoTokenizer``.
    """
    folder = Path(folder)
    if (folder / MARKER_FILE).exists():
        tok = PreTrainedTokenizerFast(
            tokenizer_file=str(folder / "tokenizer.json"), eos_token=EOS, pad_token=PAD
        )
    else:
        tok = AutoTokenizer.from_pretrained(folder)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(
    folder: str | Path, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa"
) -> torch.nn.Module:
    """Load any local causal LM folder through ``from_pretrained``."""
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=attn_implementation)


def tiny_info(folder: str | Path) -> dict:
    """The bootstrap's recorded facts (warm-up success rates…), or ``{}`` for other folders."""
    p = Path(folder) / MARKER_FILE
    return json.loads(p.read_text()) if p.exists() else {}
