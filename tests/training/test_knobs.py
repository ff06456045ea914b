"""Training knobs on the trainer: LoRA (no model copy, KL 0 at step 0, merged checkpoints, exact
resume), bfloat16 and LoRA RL steps on the real SmolLM2 architecture (cut to 2 layers), gradient
checkpointing with packed = per path on it (non-zero advantages), and ``auto`` defaults per model
kind recorded in config.json."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from test_trainer import DOCS, TASKS, parts_for, small_cfg

from _optional import require_package
from treegrpo.algos.advantages import token_advantages
from treegrpo.algos.losses import LossConfig
from treegrpo.envs.search import SearchEnv
from treegrpo.errors import ConfigError
from treegrpo.models.loader import load_model, load_tokenizer
from treegrpo.retrieval.bm25 import BM25Retriever
from treegrpo.rollout.agent import AgentConfig
from treegrpo.training.config import make_config
from treegrpo.training.defaults import (
    FULL_FT_LR,
    LORA_LR,
    REAL_LIMITS,
    TINY_LIMITS,
    TINY_LR,
    resolve_model_defaults,
)
from treegrpo.training.policy import Policy, prepare_model, reference_of
from treegrpo.training.setup import RunParts, agent_config
from treegrpo.training.trainer import train
from treegrpo.training.update import update
from treegrpo.tree import Forest, Node, Tree


def _rows(out: Path) -> list[dict[str, float]]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


# -- auto defaults ---------------------------------------------------------------------------------


def test_auto_defaults_per_model_kind() -> None:
    tiny = resolve_model_defaults(make_config({}), tiny=True)
    full = resolve_model_defaults(make_config({}), tiny=False)
    lora = resolve_model_defaults(make_config({"lora_rank": 8}), tiny=False)
    assert (
        (tiny.lr, tiny.logprob_chunk_tokens, tiny.gradient_checkpointing)
        == (TINY_LR, 0, False)
        == (5e-4, 0, False)
    )
    assert (full.lr, full.logprob_chunk_tokens, full.gradient_checkpointing) == (FULL_FT_LR, 1024, True)
    assert (lora.lr, lora.logprob_chunk_tokens) == (LORA_LR, 1024) == (1e-5, 1024)
    assert FULL_FT_LR == 1e-6
    assert {"lr", "logprob_chunk_tokens"} <= tiny.model_fields_set  # recorded as set: a resume keeps them
    given = resolve_model_defaults(make_config({"lr": 3e-4, "logprob_chunk_tokens": 0}), tiny=False)
    assert (given.lr, given.logprob_chunk_tokens) == (3e-4, 0)  # explicit values stay
    with pytest.raises(ConfigError, match="logprob_chunk_tokens"):
        make_config({"logprob_chunk_tokens": -1})
    with pytest.raises(ConfigError, match="lr"):
        make_config({"lr": "fast"})


def test_agent_limits_are_auto_per_model_kind_and_recorded() -> None:
    assert REAL_LIMITS == {"max_step_tokens": 128, "max_context_tokens": 4096}
    assert TINY_LIMITS == {"max_step_tokens": 48, "max_context_tokens": 3072}
    cfg = make_config({})
    assert cfg.max_step_tokens == cfg.max_context_tokens == "auto"
    real, tiny = agent_config(cfg, None, None, tiny=False), agent_config(cfg, None, None, tiny=True)
    assert (real.max_step_tokens, real.max_context_tokens) == (128, 4096)
    assert (tiny.max_step_tokens, tiny.max_context_tokens) == (48, 3072)
    assert agent_config(cfg, None, 2048, tiny=False).max_context_tokens == 2048  # the model's positions cap it
    taught = agent_config(cfg, {"max_step_tokens": 40, "max_context_tokens": 900}, None, tiny=False)
    assert (taught.max_step_tokens, taught.max_context_tokens) == (40, 900)  # the folder's record wins over auto
    given = make_config({"max_step_tokens": "64", "max_context_tokens": "auto"})
    mine = agent_config(given, {"max_step_tokens": 40, "max_context_tokens": 900}, None, tiny=False)
    assert (mine.max_step_tokens, mine.max_context_tokens) == (64, 900)  # set by the user: wins; explicit auto: not
    resolved = resolve_model_defaults(cfg, tiny=False, limits={"max_step_tokens": 40, "max_context_tokens": 900})
    assert (resolved.max_step_tokens, resolved.max_context_tokens) == (40, 900)  # what the run used, in config.json
    assert {"max_step_tokens", "max_context_tokens"} <= resolved.model_fields_set  # a resume keeps them
    assert resolve_model_defaults(cfg, tiny=False).max_step_tokens == 128
    with pytest.raises(ConfigError, match="max_step_tokens"):
        make_config({"max_step_tokens": 0})
    with pytest.raises(ConfigError, match="max_context_tokens"):
        make_config({"max_context_tokens": 8})


def test_gradient_checkpointing_needs_a_transformers_model() -> None:
    with pytest.raises(ConfigError, match="gradient_checkpointing_enable"):
        prepare_model(torch.nn.Linear(2, 2), make_config({"gradient_checkpointing": True}))


# -- LoRA on the tiny model ------------------------------------------------------------------------


def test_lora_makes_no_model_copy_and_kl_starts_at_zero(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    require_package("peft")

    def no_copy(self: torch.nn.Module, memo: object) -> None:
        raise AssertionError(f"deepcopy of {type(self).__name__}")

    monkeypatch.setattr(torch.nn.Module, "__deepcopy__", no_copy, raising=False)
    with pytest.raises(AssertionError, match="deepcopy"):  # the guard catches full fine-tuning's copy
        reference_of(load_model(tiny_model_dir), make_config({"kl_coef": 0.01}))
    out = tmp_path / "lora"
    parts = parts_for(tiny_model_dir)
    train(small_cfg(out, steps=1, lora_rank=4, lora_alpha=8.0, kl_coef=0.05, entropy_coef=0.01), parts=parts)
    (row,) = _rows(out)[1:]
    assert row["loss/kl"] == 0.0  # the adapter starts at 0: policy = reference exactly
    assert row["actor/grad_norm"] > 0
    # only the adapter moved; the checkpoint is a plain model folder holding the merged weights
    base = load_model(tiny_model_dir).state_dict()
    for name, p in parts.model.state_dict().items():  # parts.model: the base inside the peft wrapper
        if "lora_" not in name:
            assert torch.equal(p, base[name.replace(".base_layer.", ".")]), name
    merged = load_model(out / "checkpoint")
    moved = max(float((merged.state_dict()[k] - base[k]).abs().max()) for k in base)
    assert moved > 0
    assert json.loads((out / "config.json").read_text())["lora_rank"] == 4


def test_lora_resume_restores_the_adapter_exactly(tiny_model_dir: Path, tmp_path: Path) -> None:
    require_package("peft")
    from safetensors.torch import load_file

    lora = {"lora_rank": 4, "lora_alpha": 8.0, "kl_coef": 0.05, "entropy_coef": 0.01}
    straight = train(small_cfg(tmp_path / "straight", steps=2, **lora), parts=parts_for(tiny_model_dir))
    train(small_cfg(tmp_path / "run", steps=1, **lora), parts=parts_for(tiny_model_dir))
    resumed = train(
        small_cfg(tmp_path / "run", steps=2, resume=True, **lora), parts=parts_for(tiny_model_dir)
    )
    assert resumed.generated_tokens == straight.generated_tokens
    a = load_file(str(tmp_path / "straight" / "checkpoint" / "lora_adapter" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "run" / "checkpoint" / "lora_adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and a
    assert all(torch.equal(a[k], b[k]) for k in a)  # bit for bit: adapter and optimizer state restored
    assert _rows(tmp_path / "run")[-1]["loss/total"] == _rows(tmp_path / "straight")[-1]["loss/total"]


# -- the real architecture: SmolLM2 cut to 2 layers ------------------------------------------------


def _smol_parts(folder: Path, dtype: torch.dtype = torch.float32) -> RunParts:
    return RunParts(
        model_dir=folder,
        model=load_model(folder, dtype=dtype),
        tokenizer=load_tokenizer(folder),
        env=SearchEnv(BM25Retriever(DOCS), topk=1, prompt_template="minimal"),
        train_tasks=TASKS[:4],
        eval_tasks=TASKS[4:5],
        agent_cfg=AgentConfig(max_turns=1, max_step_tokens=8, max_obs_tokens=24, max_context_tokens=256),
        extra_files={},
        info={},
    )


@pytest.mark.parametrize(("dtype", "lora_rank"), [("bfloat16", 4), ("float32", 4)])
def test_bf16_and_lora_rl_steps_run_on_smollm2(
    smollm2_2layer_dir: Path, tmp_path: Path, dtype: str, lora_rank: int
) -> None:
    if lora_rank:
        require_package("peft")
    out = tmp_path / "run"
    parts = _smol_parts(smollm2_2layer_dir, getattr(torch, dtype))
    cfg = small_cfg(
        out, steps=1, prompts_per_step=1, m=2, n=1, l=1, dtype=dtype, lora_rank=lora_rank, kl_coef=0.01,
        gradient_checkpointing=True, eval_sampled=False, temperature=1.0,
    )  # fmt: skip
    train(cfg, parts=parts)
    (row,) = _rows(out)[1:]
    for key in ("loss/total", "loss/kl", "actor/entropy", "actor/grad_norm", "rollout/logprob_diff"):
        assert math.isfinite(row[key]), key
    assert row["loss/kl"] == 0.0 or not lora_rank  # LoRA: the reference is the policy at step 0
    assert row["update/packed"] == 1.0
    recorded = json.loads((out / "config.json").read_text())
    assert recorded["lr"] == (LORA_LR if lora_rank else FULL_FT_LR)  # a real model: not the tiny lr
    assert recorded["logprob_chunk_tokens"] == 1024 and recorded["dtype"] == dtype
    assert recorded["gradient_checkpointing"] is True
    assert next(parts.model.parameters()).dtype == getattr(torch, dtype)
    load_model(out / "checkpoint")  # a loadable --model


def _smol_forests(tok: object) -> list[Forest]:
    """Two prompts, two trees each, with real SmolLM2 tokens: a search step with an observation,
    then right (1), wrong (0) or half-right (0.5) answers, so advantages are non-zero."""

    def ids(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]

    forests = []
    for q, right, wrong in (("capital of france", "paris", "rome"), ("river in egypt", "nile", "thames")):
        prompt = ids(f"Question: what is the {q}? Answer with <answer>.")
        trees = []
        for k in range(2):
            t = Tree([Node(0, None, tokens=prompt, policy_mask=[0] * len(prompt))])
            pol, obs = (
                ids(f"<search> {q} </search>"),
                ids(f"<information> Doc 1: {right} is the {q}. </information>"),
            )
            t.add(Node(1, 0, tokens=pol + obs, policy_mask=[1] * len(pol) + [0] * len(obs)))
            for j, (ans, r) in enumerate(((right, 1.0), (wrong, 0.0))):
                a = ids(f"<answer> {ans} </answer>")
                t.add(Node(2 + j, 1, tokens=a, policy_mask=[1] * len(a), reward=r))
            a = ids(f"<answer> {right if k else wrong} city </answer>")
            t.add(Node(4, 0, tokens=a, policy_mask=[1] * len(a), reward=0.5 * k))
            trees.append(t)
        forests.append(Forest(q, trees))
    return forests


def test_gradient_checkpointing_keeps_packed_equal_to_per_path_on_smollm2(smollm2_2layer_dir: Path) -> None:
    tok = load_tokenizer(smollm2_2layer_dir)
    forests = _smol_forests(tok)
    advs = [token_advantages(f, "tree_grpo") for f in forests]
    assert any(abs(a) > 0.1 for f in advs for path in f for a in path)  # non-zero advantages
    start = torch.cat([p.detach().flatten() for p in load_model(smollm2_2layer_dir).parameters()])
    params: dict[tuple[bool, str, int], torch.Tensor] = {}
    for gc, packing, chunk in (
        (True, "on", 0),
        (True, "off", 0),
        (False, "on", 0),
        (True, "on", 16),
        (True, "off", 16),
    ):
        cfg = make_config(
            {
                "gradient_checkpointing": gc, "packing": packing, "logprob_chunk_tokens": chunk,
                "kl_coef": 0.05, "entropy_coef": 0.01, "grad_clip": 1e6, "micro_batch_tokens": 96,
            }
        )  # fmt: skip
        loss_cfg = LossConfig(kl_coef=cfg.kl_coef, entropy_coef=cfg.entropy_coef)
        model = prepare_model(load_model(smollm2_2layer_dir), cfg)
        flag = (
            "is_activation_checkpointing"
            if hasattr(model, "is_activation_checkpointing")
            else "is_gradient_checkpointing"
        )
        assert getattr(model, flag) == gc
        ref = load_model(smollm2_2layer_dir).eval()
        with torch.no_grad():
            for p in ref.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        m = update(Policy(model, ref), opt, forests, advs, cfg, loss_cfg, tok.pad_token_id)
        assert m["update/packed"] == (1.0 if packing == "on" else 0.0)
        params[(gc, packing, chunk)] = torch.cat([p.detach().flatten() for p in model.parameters()]) - start
    step = float(params[(True, "off", 0)].abs().max())
    assert step > 1e-4  # the update did something

    def diff(a: tuple[bool, str, int], b: tuple[bool, str, int]) -> float:
        return float((params[a] - params[b]).abs().max()) / step

    assert diff((True, "on", 0), (True, "off", 0)) <= 1e-4  # packed = per path, checkpointing on
    assert diff((True, "on", 0), (False, "on", 0)) <= 1e-5  # checkpointing changes nothing
    assert diff((True, "on", 16), (True, "off", 16)) <= 1e-4  # also with chunked log-probs
    assert diff((True, "on", 16), (True, "on", 0)) <= 1e-5


def test_a_bf16_full_fine_tuning_update_runs_on_smollm2(smollm2_2layer_dir: Path) -> None:
    """bfloat16 weights, float32 log-probs and loss: one packed update with KL and entropy moves
    the weights and gives finite metrics (the trainer loop in bfloat16 runs in the LoRA test)."""
    tok = load_tokenizer(smollm2_2layer_dir)
    forests = _smol_forests(tok)
    advs = [token_advantages(f, "tree_grpo") for f in forests]
    cfg = make_config(
        {"dtype": "bfloat16", "kl_coef": 0.05, "entropy_coef": 0.01, "logprob_chunk_tokens": 32}
    )
    policy = Policy.build(load_model(smollm2_2layer_dir, dtype=torch.bfloat16), cfg)
    model = policy.model
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    m = update(
        policy, opt, forests, advs, cfg, LossConfig(kl_coef=0.05, entropy_coef=0.01), tok.pad_token_id
    )
    assert m["update/packed"] == 1.0
    assert all(math.isfinite(v) for v in m.values())
    assert next(model.parameters()).dtype == torch.bfloat16
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_the_trainer_follows_the_schedule(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Warm-up over 2 of 4 steps then cosine to 0.1·lr, from the tiny agent's auto lr (5e-4):
    steps 1..4 train at 2.5e-4, 5e-4 (peak), 5e-4 (p = 0), 5e-5 (p = 1: the floor on the last step)."""
    out = tmp_path / "run"
    cfg = small_cfg(out, steps=4, save_every=0, lr_warmup_steps=2, lr_schedule="cosine", min_lr_ratio=0.1)
    train(cfg, parts=parts_for(tiny_model_dir))
    lrs = [r["actor/lr"] for r in _rows(out)[1:]]
    assert lrs == pytest.approx([2.5e-4, 5e-4, 5e-4, 5e-5], rel=1e-12)
    state = torch.load(out / "checkpoint" / "trainer_state.pt", weights_only=True)
    assert [g["lr"] for g in state["optimizer"]["param_groups"]] == pytest.approx([5e-5])
