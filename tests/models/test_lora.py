"""LoRA through peft: the wrapped model starts equal to the base, the adapter-disabled view is
the base, the saved folder is a plain model with the merged weights, the adapter reloads exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _optional import needs_package
from treegrpo.errors import ConfigError
from treegrpo.models.loader import load_model
from treegrpo.models.lora import (
    ADAPTER_DIR,
    AdapterDisabled,
    apply_lora,
    is_lora,
    load_adapter,
    sampling_module,
    save_model_folder,
)

pytestmark = needs_package("peft")  # skipped without it; in CI (which installs it) a failure

IDS = torch.tensor([[3, 17, 42, 5, 99, 7, 11]])


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _perturb_adapter(model: torch.nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(0.05 * torch.randn(p.shape, generator=g))


def test_wrapped_model_starts_as_the_base_and_trains_only_the_adapter(tiny_model_dir: Path) -> None:
    base = _logits(load_model(tiny_model_dir))
    model = apply_lora(load_model(tiny_model_dir), rank=4, alpha=8.0)
    assert is_lora(model) and not is_lora(sampling_module(model))
    assert torch.equal(_logits(model), base)  # lora_B = 0: exactly the base
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if "lora_" in n)
    _perturb_adapter(model)
    moved = _logits(model)
    assert float((moved - base).abs().max()) > 1e-3
    assert torch.equal(_logits(sampling_module(model)), moved)  # the engine runs the adapter too
    with AdapterDisabled(model).active() as ref:
        assert torch.equal(_logits(ref), base)  # the reference: the same module, adapter off
    assert torch.equal(_logits(model), moved)  # and back on afterwards


def test_saved_folder_is_a_plain_model_with_merged_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = apply_lora(load_model(tiny_model_dir), rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"])
    _perturb_adapter(model)
    save_model_folder(model, tmp_path / "ck")
    assert not (tmp_path / "ck" / "adapter_config.json").exists()  # transformers would load it as an adapter
    assert (tmp_path / "ck" / ADAPTER_DIR / "adapter_config.json").is_file()
    merged = load_model(tmp_path / "ck")
    assert not is_lora(merged)
    torch.testing.assert_close(_logits(merged), _logits(model), rtol=1e-5, atol=1e-5)
    # the live model is not touched by the save (no merge/unmerge rounding of its base weights)
    fresh = apply_lora(load_model(tiny_model_dir), rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"])
    base_now = {n: p for n, p in model.named_parameters() if "lora_" not in n}
    for n, p in fresh.named_parameters():
        if "lora_" not in n:
            assert torch.equal(p, base_now[n]), n
    # the adapter reloads exactly into a new wrapper of the same base
    load_adapter(fresh, tmp_path / "ck")
    assert torch.equal(_logits(fresh), _logits(model))
    with pytest.raises(ConfigError, match="no LoRA adapter"):
        load_adapter(fresh, tiny_model_dir)


def test_unknown_target_modules_are_one_line(tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match="lora_target_modules"):
        apply_lora(load_model(tiny_model_dir), rank=2, alpha=4.0, target_modules=["no_such_proj"])
