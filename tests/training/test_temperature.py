"""Log-probs at the sampling temperature: the trainer's (old, current, reference; packed and per
path) are those of logits / T, the distribution the HF engine drew from, and the update reports
their mean distance to the engine's as ``rollout/logprob_diff``. Greedy (T = 0) counts as T = 1."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from treegrpo.algos.advantages import token_advantages
from treegrpo.algos.losses import LossConfig
from treegrpo.models.loader import load_model, load_tokenizer
from treegrpo.rollout.engine import SamplingParams
from treegrpo.rollout.hf_engine import HFEngine
from treegrpo.training.batching import collate, forest_sequences, token_logprobs
from treegrpo.training.config import make_config
from treegrpo.training.logprobs import effective_temperature
from treegrpo.training.policy import Policy
from treegrpo.training.update import update
from treegrpo.tree import Forest, Node, Tree

PROMPTS = ["Question: what is the capital of france?", "Question: who founded rome? <think>"]


def sampled_forests(model_dir: Path, temperature: float) -> list[Forest]:
    """Two chains per prompt sampled by the HF engine at ``temperature`` (engine log-probs kept)."""
    tok = load_tokenizer(model_dir)
    engine = HFEngine(load_model(model_dir), tok)
    forests = []
    for i, text in enumerate(PROMPTS):
        ids = list(tok.encode(text, add_special_tokens=False))
        gens = engine.generate(
            [ids, ids],
            SamplingParams(max_new_tokens=10, temperature=temperature),
            torch.Generator().manual_seed(i),
        )
        trees = []
        for j, g in enumerate(gens):
            root = Node(0, None, tokens=ids, policy_mask=[0] * len(ids))
            step = Node(
                1, 0, tokens=g.tokens, policy_mask=[1] * len(g.tokens), logprobs=g.logprobs, reward=float(j)
            )
            trees.append(Tree([root, step]))
        forests.append(Forest(f"p{i}", trees))
    return forests


def test_effective_temperature() -> None:
    assert effective_temperature(0.7) == 0.7 and effective_temperature(0.0) == 1.0
    with pytest.raises(ValueError, match="temperature"):
        effective_temperature(-1.0)


def test_trainer_logprobs_match_the_engine_at_its_temperature(tiny_model_dir: Path) -> None:
    forests = sampled_forests(tiny_model_dir, 0.7)
    seqs = forest_sequences(forests, [token_advantages(f, "grpo") for f in forests])
    mb = collate(seqs, pad_id=0)
    model = load_model(tiny_model_dir)
    on = mb.policy_mask_B_T > 0
    with torch.no_grad():
        at_t, _ = token_logprobs(model, mb, temperature=0.7)
        at_1, _ = token_logprobs(model, mb)
    engine = mb.sample_logprobs_B_T[on]
    assert float((at_t[on] - engine).abs().max()) <= 1e-5
    assert float((at_1[on] - engine).abs().max()) > 1e-2  # the old, temperature-blind trainer


def _update(model_dir: Path, forests: list[Forest], **kw: Any) -> dict[str, float]:
    cfg = make_config({"kl_coef": 0.05, "micro_batch_tokens": 64, **kw})
    loss_cfg = LossConfig(kl_coef=cfg.kl_coef)
    model = load_model(model_dir)
    ref = load_model(model_dir).eval()
    advs = [token_advantages(f, "grpo") for f in forests]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return update(Policy(model, ref), opt, forests, advs, cfg, loss_cfg, pad_id=0)


@pytest.mark.parametrize("packing", ["on", "off"])
@pytest.mark.parametrize("mini_batches", [1, 2])
def test_update_reports_logprob_diff_at_the_sampling_temperature(
    tiny_model_dir: Path, packing: str, mini_batches: int
) -> None:
    forests = sampled_forests(tiny_model_dir, 0.7)
    m = _update(tiny_model_dir, forests, temperature=0.7, packing=packing, mini_batches=mini_batches)
    assert m["update/packed"] == (1.0 if packing == "on" else 0.0)
    assert 0.0 <= m["rollout/logprob_diff"] <= 1e-5
    assert all(v == v for v in m.values())  # no NaN
    wrong = _update(tiny_model_dir, forests, temperature=1.0, packing=packing, mini_batches=mini_batches)
    assert wrong["rollout/logprob_diff"] > 1e-2  # trainer at T=1, engine at 0.7: the diff shows it


@pytest.mark.parametrize("packing", ["on", "off"])
def test_greedy_rollouts_train_at_temperature_one(tiny_model_dir: Path, packing: str) -> None:
    forests = sampled_forests(tiny_model_dir, 0.0)
    m = _update(tiny_model_dir, forests, temperature=0.0, packing=packing)
    assert m["rollout/logprob_diff"] <= 1e-5
    assert all(v == v for v in m.values())
