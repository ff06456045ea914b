"""LoRA through ``peft`` (the ``[lora]`` extra): wrap a causal LM, use it without the adapter as
the KL reference, save it as a plain model folder, restore the adapter exactly.

- :func:`apply_lora` wraps the model in place (``peft.get_peft_model``): the base weights are
  frozen, the adapter's ``lora_B`` starts at 0, so the wrapped model computes exactly what the base
  did. Adapter weights are kept in float32 even on a bfloat16 base (peft's
  ``autocast_adapter_dtype``).
- :class:`AdapterDisabled` is the reference policy of a LoRA run: the *same* module, run inside
  ``with model.disable_adapter():`` — no second copy of the weights. At step 0 it equals the
  policy exactly (KL = 0).
- :func:`sampling_module` is what the rollout engine runs: the transformers model inside the peft
  wrapper (adapter layers injected, active), so the engine keeps its ``logits_to_keep`` and cache
  keywords.
- :func:`save_model_folder` writes a loadable ``--model`` folder: for a LoRA model the *merged*
  weights (``W + scale·B·A``, computed functionally — the live model is not merged and unmerged,
  which would round its base weights) under the transformers names, and the adapter itself in
  ``lora_adapter/`` (a subfolder: an ``adapter_config.json`` at the top would make transformers
  treat the folder as an adapter). :func:`load_adapter` puts those saved adapter tensors back.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from treegrpo.errors import ConfigError

ADAPTER_DIR = "lora_adapter"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

__all__ = [
    "ADAPTER_DIR",
    "AdapterDisabled",
    "apply_lora",
    "is_lora",
    "load_adapter",
    "merged_state_dict",
    "sampling_module",
    "save_model_folder",
]


def _peft() -> Any:
    try:
        import peft
    except ImportError:
        raise ConfigError("lora_rank > 0 needs peft: pip install 'treegrpo[lora]'") from None
    return peft


def is_lora(model: object) -> bool:
    """Whether ``model`` is a peft-wrapped model (without importing peft when it is absent)."""
    return type(model).__module__.startswith("peft.")


def apply_lora(
    model: torch.nn.Module,
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    target_modules: list[str] | str = "all-linear",
    seed: int = 0,
) -> torch.nn.Module:
    """``model`` wrapped with a LoRA adapter of ``rank`` (the base frozen, only adapters train).
    ``target_modules`` ``["all-linear"]`` (or the string) = every linear layer but the LM head.
    The adapter's random ``lora_A`` is drawn from ``seed`` (the global RNG is left as it was), so
    a run's adapter depends on its seed only."""
    peft = _peft()
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    targets: list[str] | str = target_modules
    if isinstance(targets, list) and targets == ["all-linear"]:
        targets = "all-linear"
    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, task_type="CAUSAL_LM"
    )
    try:
        with warnings.catch_warnings(), torch.random.fork_rng():
            # peft reads transformers' deprecated is_gradient_checkpointing
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            torch.manual_seed(seed)
            return peft.get_peft_model(model, config)
    except ValueError as e:  # e.g. target modules not found in the model
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"lora_target_modules={target_modules!r}: {first[:200]}") from None


def sampling_module(model: torch.nn.Module) -> torch.nn.Module:
    """The module the rollout engine runs: the transformers model inside a peft wrapper (the
    adapter layers are injected into it, active), else ``model`` itself."""
    return model.get_base_model() if is_lora(model) else model  # type: ignore[operator]


class AdapterDisabled:
    """The reference policy of a LoRA run: ``model`` with its adapter switched off (no copy).

    ``with ref.active() as m:`` yields the peft model inside ``model.disable_adapter()``; every
    forward pass of the reference runs inside it."""

    def __init__(self, model: torch.nn.Module) -> None:
        if not is_lora(model):
            raise TypeError("AdapterDisabled needs a peft-wrapped model")
        self.model = model

    @contextmanager
    def active(self) -> Iterator[torch.nn.Module]:
        with self.model.disable_adapter():  # type: ignore[operator]
            yield self.model


def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The transformers state dict of a LoRA model with its adapter merged into the weights
    (``base_layer.weight + delta``), under the base model's own names; the live model is left as
    it is."""
    base = sampling_module(model)
    deltas: dict[str, torch.Tensor] = {}
    for name, module in base.named_modules():
        if hasattr(module, "get_delta_weight") and hasattr(module, "base_layer"):
            for adapter in getattr(module, "active_adapters", ["default"]):
                if adapter in getattr(module, "lora_A", {}):
                    d = module.get_delta_weight(adapter).detach()
                    deltas[f"{name}.weight"] = deltas.get(f"{name}.weight", 0) + d  # type: ignore[operator]
    out: dict[str, torch.Tensor] = {}
    for key, value in base.state_dict().items():
        if "lora_" in key:
            continue
        clean = key.replace(".base_layer.", ".")
        if clean in deltas:
            value = (value.detach() + deltas[clean].to(value.dtype)).contiguous()
        out[clean] = value
    return out


def save_model_folder(model: torch.nn.Module, folder: Path) -> None:
    """``model.save_pretrained(folder)``; a LoRA model is saved merged (a plain ``--model`` folder)
    with its adapter in ``folder/lora_adapter/``."""
    folder = Path(folder)
    if not is_lora(model):
        model.save_pretrained(folder)  # type: ignore[operator]
        return
    sampling_module(model).save_pretrained(folder, state_dict=merged_state_dict(model))  # type: ignore[operator]
    from safetensors.torch import save_file

    peft = _peft()
    (folder / ADAPTER_DIR).mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in peft.get_peft_model_state_dict(model).items()}
    save_file(state, str(folder / ADAPTER_DIR / ADAPTER_WEIGHTS))
    model.peft_config["default"].save_pretrained(str(folder / ADAPTER_DIR))  # type: ignore[index]


def load_adapter(model: torch.nn.Module, folder: Path) -> None:
    """Load the adapter saved by :func:`save_model_folder` in ``folder`` into ``model`` (exactly:
    the saved float tensors are copied in)."""
    from safetensors.torch import load_file

    path = Path(folder) / ADAPTER_DIR / ADAPTER_WEIGHTS
    if not path.is_file():
        raise ConfigError(
            f"{folder} holds no LoRA adapter ({ADAPTER_DIR}/{ADAPTER_WEIGHTS}); it was not saved by a LoRA run"
        )
    peft = _peft()
    result = peft.set_peft_model_state_dict(model, load_file(str(path)))
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    if unexpected:
        raise ConfigError(
            f"{path}: adapter tensors that this run's adapter does not have ({unexpected[0]}, ...)"
        )
