"""The run's Policy: what Policy.build sets up (reference, LoRA, views on one process) and its
save/restore round trip (full fine-tuning and LoRA), on the tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _optional import require_package
from treegrpo.errors import ConfigError
from treegrpo.models.loader import load_model, load_tokenizer
from treegrpo.models.lora import AdapterDisabled, is_lora
from treegrpo.training.checkpoint import RunState, read_checkpoint, resumed_run
from treegrpo.training.config import make_config
from treegrpo.training.policy import Policy, with_reference

IDS = torch.tensor([[3, 17, 42, 5, 99, 7, 11]])


def _logits(module: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return module(input_ids=IDS).logits


def _step(policy: Policy, opt: torch.optim.Optimizer) -> None:
    """One optimizer step on a made-up loss: moves the weights and fills Adam's moments."""
    opt.zero_grad(set_to_none=True)
    policy.grad_module()(input_ids=IDS).logits.float().pow(2).mean().backward()
    opt.step()


def test_one_process_views_are_the_model_and_the_reference_is_a_frozen_copy(tiny_model_dir: Path) -> None:
    cfg = make_config({"kl_coef": 0.05})
    policy = Policy.build(load_model(tiny_model_dir), cfg)
    model = policy.model
    assert policy.grad_module() is model and policy.local_module() is model
    assert policy.rollout_module() is model and not policy.sharded
    assert policy.trainable_parameters() == list(model.parameters())
    ref = policy.reference
    assert isinstance(ref, torch.nn.Module) and ref is not model and not ref.training
    assert not any(p.requires_grad for p in ref.parameters())
    opt = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-2)
    _step(policy, opt)
    assert not torch.equal(_logits(model), _logits(ref))  # the reference stays the starting policy
    assert torch.equal(with_reference(ref, _logits), _logits(load_model(tiny_model_dir)))
    assert Policy.build(load_model(tiny_model_dir), make_config({"kl_coef": 0.0})).reference is None


def test_save_then_restore_gives_the_same_weights_and_optimizer_state(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    cfg = make_config({"kl_coef": 0.0, "lr": 1e-2})
    policy = Policy.build(load_model(tiny_model_dir), cfg)
    opt = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-2)
    _step(policy, opt)
    run = RunState.fresh(0)
    run.step = 1
    policy.save(tmp_path / "ck", run, load_tokenizer(tiny_model_dir), opt, cfg)
    ck = read_checkpoint(tmp_path / "ck")
    again = Policy.build(load_model(tiny_model_dir), cfg)
    opt2 = torch.optim.AdamW(again.trainable_parameters(), lr=1e-2)
    assert not torch.equal(_logits(again.model), _logits(policy.model))
    again.restore(ck, opt2)
    assert torch.equal(_logits(again.model), _logits(policy.model))
    state, state2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert state.keys() == state2.keys() and all(
        torch.equal(state[k]["exp_avg"], state2[k]["exp_avg"]) for k in state
    )
    assert resumed_run(ck, opt2, cfg.model_copy(update={"lr": 5e-3}), {}).step == 1
    assert opt2.param_groups[0]["lr"] == 5e-3  # the resumed run's lr
    # a checkpoint of another shape is one ConfigError line, not a traceback
    other = Policy.build(torch.nn.Linear(2, 2), cfg)
    with pytest.raises(ConfigError, match="cannot load the checkpoint"):
        other.restore(ck, torch.optim.AdamW(other.trainable_parameters()))


def test_lora_policy_trains_the_adapter_and_restores_it_exactly(tiny_model_dir: Path, tmp_path: Path) -> None:
    require_package("peft")
    cfg = make_config({"lora_rank": 4, "lora_alpha": 8.0, "kl_coef": 0.05})
    policy = Policy.build(load_model(tiny_model_dir), cfg)
    assert is_lora(policy.model) and isinstance(policy.reference, AdapterDisabled)
    assert not is_lora(policy.rollout_module())  # the engine runs the transformers model inside
    names = {id(p): n for n, p in policy.model.named_parameters()}
    assert all("lora_" in names[id(p)] for p in policy.trainable_parameters())
    opt = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-2)
    _step(policy, opt)
    assert not torch.equal(_logits(policy.model), with_reference(policy.reference, _logits))
    policy.save(tmp_path / "ck", RunState.fresh(0), load_tokenizer(tiny_model_dir), opt, cfg)
    again = Policy.build(load_model(tiny_model_dir), cfg)
    again.restore(read_checkpoint(tmp_path / "ck"), torch.optim.AdamW(again.trainable_parameters()))
    assert torch.equal(_logits(again.model), _logits(policy.model))
