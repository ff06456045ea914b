"""Build tiny local models: a tokenizer trained with ``tokenizers`` and a small Qwen2, saved with
``save_pretrained`` (plus a marker file) so that :mod:`treegrpo.models.loader` loads them back
through the same ``from_pretrained`` path as a real model. Nothing is downloaded."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

from treegrpo.errors import ConfigError
from treegrpo.models.loader import EOS, MARKER_FILE, PAD

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


def model_for(cfg: Any, tok: PreTrainedTokenizerFast) -> torch.nn.Module:
    """The small Qwen2 a bootstrap config describes (its ``hidden_size``, ``layers``, ``heads``,
    ``kv_heads``, ``intermediate_size``, ``max_positions`` and ``seed``), sized to ``tok``."""
    return build_model(
        vocab_size=len(tok),
        hidden_size=cfg.hidden_size,
        layers=cfg.layers,
        heads=cfg.heads,
        kv_heads=cfg.kv_heads,
        intermediate_size=cfg.intermediate_size,
        max_positions=cfg.max_positions,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        seed=cfg.seed,
    )


def cut_layers(folder: str | Path, n_layers: int, out: str | Path) -> Path:
    """Save into ``out`` the model of ``folder`` cut to its first ``n_layers`` decoder layers (the
    embeddings, final norm, head and tokenizer kept): a real architecture and tokenizer at a
    fraction of the cost, for tests and quick runs. ``folder`` is a model folder or any model
    reference (a ``.gguf`` file, a built-in name such as ``smollm2-135m``, a hub id). Works for the
    usual ``model.layers.<i>.`` layout (Llama, Qwen2, Mistral …)."""
    from transformers import AutoConfig, AutoTokenizer

    from treegrpo.models.refs import resolve_model_ref

    folder, out = (Path(folder) if Path(folder).is_dir() else resolve_model_ref(folder)), Path(out)
    config = AutoConfig.from_pretrained(folder)
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or not 0 < n_layers <= config.num_hidden_layers:
        raise ConfigError(f"cut_layers: {n_layers} layers asked of a {config.num_hidden_layers}-layer model; give 1 to {config.num_hidden_layers}")
    full = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    keep = {
        k: v
        for k, v in full.state_dict().items()
        if not k.startswith("model.layers.") or int(k.split(".")[2]) < n_layers
    }
    config.num_hidden_layers = n_layers
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:n_layers]
    small = AutoModelForCausalLM.from_config(config)
    missing, unexpected = small.load_state_dict(keep, strict=False)
    if unexpected or [m for m in missing if "rotary" not in m]:
        odd = [*unexpected, *missing][:3]
        raise ConfigError(f"cut_layers: {folder} does not use the model.layers.<i> layout (Llama, Qwen2, Mistral …): {odd} …")
    small.save_pretrained(out)
    AutoTokenizer.from_pretrained(folder).save_pretrained(out)
    return out
