"""What a run config's ``auto`` fields become for the loaded model, and the settings that leave an
advantage group without a baseline (warned about before a run starts)."""

from __future__ import annotations

import os
import warnings
from typing import Any

from treegrpo.training.config import TrainConfig

#: ``auto`` values per model kind (documented in the field descriptions and the table in docs/real-models.md).
TINY_LR = 5e-4  # the bootstrapped tiny agent (0.57M parameters, trained from scratch by its bootstrap)
FULL_FT_LR = 1e-6  # Search-R1 train_grpo.sh / train_ppo.sh: actor_rollout_ref.actor.optim.lr=1e-6 (Qwen2.5-3B)
LORA_LR = 1e-5  # ~10x full fine-tuning ("LoRA Without Regret"); verl's LoRA GRPO example: 3e-6 at rank 64, alpha 32
REAL_CHUNK_TOKENS = 1024  # one chunk's float32 logits: 1024 x 49152 (SmolLM2) x 4 B = 200 MB
#: Agent limits (``max_step_tokens``, ``max_context_tokens``) when neither the user nor the model's
#: folder (a tiny agent's bootstrap, a warm-up record) sets them. A real model's search step is a
#: query copied from a question plus a short thought: with the tiny agent's 48, 7 of 16 SmolLM2
#: first searches overran the cap (``bench real``); 128 holds a p99 wiki-vital-qa question.
TINY_LIMITS = {"max_step_tokens": 48, "max_context_tokens": 3072}
REAL_LIMITS = {"max_step_tokens": 128, "max_context_tokens": 4096}
AUTO_LIMITS = tuple(TINY_LIMITS)  # the agent-limit fields that take ``auto``


def resolve_model_defaults(cfg: TrainConfig, tiny: bool, limits: dict[str, int] | None = None) -> TrainConfig:
    """``cfg`` with its ``auto`` fields decided for the loaded model — a bootstrapped tiny agent
    (``tiny``) or a real pretrained model — as a copy whose resolved fields count as set (so
    ``config.json`` and a resume carry the values, not ``auto``):

    ===========================  ==================  ==========================================
    field                        tiny agent          real model
    ===========================  ==================  ==========================================
    ``lr``                       5e-4                1e-6 full fine-tuning, 1e-5 with LoRA
    ``logprob_chunk_tokens``     0 (off)             1024
    ``gradient_checkpointing``   off                 on
    ``max_step_tokens``          48                  128
    ``max_context_tokens``       3072                4096
    ``protocol``                 tags                (decided by the env: :func:`~treegrpo.tasks.custom.tool_protocol`)
    ``threads``                  1                   :func:`machine_threads`
    ===========================  ==================  ==========================================

    The agent limits are the ones the run uses when given (``limits``: the agent settings the
    model's folder recorded win over the kind's defaults, see
    :func:`~treegrpo.training.setup.agent_config`). Deterministic: the same config and model kind
    always give the same values."""
    update: dict[str, Any] = {}
    if cfg.lr == "auto":
        update["lr"] = TINY_LR if tiny else (LORA_LR if cfg.lora_rank else FULL_FT_LR)
    if cfg.logprob_chunk_tokens == "auto":
        update["logprob_chunk_tokens"] = 0 if tiny else REAL_CHUNK_TOKENS
    if cfg.gradient_checkpointing == "auto":
        update["gradient_checkpointing"] = not tiny
    if cfg.protocol == "auto" and tiny:  # a tiny agent speaks the tags (it has no chat template)
        update["protocol"] = "tags"
    kind = TINY_LIMITS if tiny else REAL_LIMITS
    for k in AUTO_LIMITS:
        if getattr(cfg, k) == "auto":
            update[k] = (limits or kind)[k]
    if cfg.threads == "auto":
        update["threads"] = 1 if tiny else machine_threads()
    if not update:
        return cfg
    return TrainConfig.model_validate({**cfg.model_dump(include=cfg.model_fields_set), **update})


def machine_threads() -> int:
    """The CPU cores this process may use (its affinity mask, else ``os.cpu_count()``), divided
    among the processes torchrun started on this machine (``LOCAL_WORLD_SIZE``); at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS, Windows: no affinity mask
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)))


def single_leaf_groups(cfg: TrainConfig) -> str | None:
    """Why ``cfg``'s forests give some advantage group a single leaf, or ``None``.

    A one-leaf group has no baseline: GRPO's convention (mean 0, std 1) makes its advantage the raw
    reward ``r / (1 + eps)``, and TreeRL's values are all 0. That happens when a prompt has one
    trajectory (chain ``group_size=1``; a tree ``M=1, N·L=0`` is refused outright), and for the
    intra-tree term (``tree_grpo``, ``intra_only``) when every tree has one leaf: chains (each
    chain is its own tree) and trees or EPTrees with ``N·L = 0``. Only the built-in estimators
    are judged.
    """
    est = cfg.estimator
    builtin = ("grpo", "inter_only", "tree_grpo", "intra_only", "treerl", "gigpo", "tree_gigpo")
    if cfg.trajectories_per_prompt() == 1 and est in builtin:
        return (
            f"{cfg.sampler} sampler with one trajectory per prompt: every {est} group has a single leaf, "
            "so its advantage has no baseline (raise group_size / M / N·L)"
        )
    if est in ("tree_grpo", "intra_only", "tree_gigpo"):
        branches = cfg.t if cfg.sampler == "eptree" else 1
        per_tree = 1 if cfg.sampler == "chain" else 1 + cfg.n * cfg.l * branches
        if per_tree == 1:
            return (
                f"{cfg.sampler} sampler with one leaf per tree: the intra-tree group of {est} has a single "
                "leaf, so that term has no baseline (use grpo/inter_only, or N·L > 0)"
            )
    return None


def warn_single_leaf_groups(cfg: TrainConfig) -> None:
    """``warnings.warn`` (a UserWarning, shown once) when :func:`single_leaf_groups` finds one."""
    why = single_leaf_groups(cfg)
    if why is not None:
        warnings.warn(f"single-leaf advantage groups: {why}", UserWarning, stacklevel=2)
