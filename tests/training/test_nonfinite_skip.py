"""A non-finite loss skips the optimizer step (reason logged) instead of poisoning the model."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from test_packing import PAD, forests_for_tests

from treegrpo.algos.advantages import token_advantages
from treegrpo.algos.losses import LossConfig
from treegrpo.models.loader import load_model
from treegrpo.training import update as update_mod
from treegrpo.training.config import make_config
from treegrpo.training.policy import Policy
from treegrpo.training.report import step_warnings


@pytest.mark.parametrize("packing", ["on", "off"])
def test_nan_loss_leaves_weights_and_optimizer_untouched(
    tiny_model_dir: Path, packing: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = "packed_loss" if packing == "on" else "compute_loss"
    real = getattr(update_mod, name)

    def nan_loss(*a, **k):
        loss, m = real(*a, **k)
        return loss * float("nan"), m

    monkeypatch.setattr(update_mod, name, nan_loss)
    model = load_model(tiny_model_dir)
    before = copy.deepcopy(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    cfg = make_config({"packing": packing, "kl_coef": 0.0, "micro_batch_tokens": 128})
    forests = forests_for_tests()
    advs = [token_advantages(f, "tree_grpo") for f in forests]
    m = update_mod.update(Policy(model), opt, forests, advs, cfg, LossConfig(kl_coef=0.0), PAD)
    assert m["update/skipped_steps"] == 1.0 and "actor/grad_norm" not in m
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not opt.state  # no Adam moments were written
    assert any("skipped" in w for w in step_warnings({**m, "budget/retrieval_errors": 0, "budget/tool_calls": 0}))


def test_finite_loss_takes_the_step(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    forests = forests_for_tests()
    advs = [token_advantages(f, "tree_grpo") for f in forests]
    m = update_mod.update(Policy(model), opt, forests, advs, make_config({"kl_coef": 0.0}), LossConfig(kl_coef=0.0), PAD)
    assert "update/skipped_steps" not in m and m["actor/grad_norm"] > 0
