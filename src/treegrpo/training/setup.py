"""Everything a run needs, built from its config: model, tokenizer, environment, questions.

The task family (:func:`~treegrpo.tasks.registry.task_family`) says where the starting policy
comes from when no ``--model`` is given and builds the env and questions; the model loader
(:func:`~treegrpo.models.loader.load_pretrained`) loads the model reference.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from treegrpo.envs.base import AgentEnv, Task
from treegrpo.models.loader import MARKER_FILE, load_pretrained
from treegrpo.rollout.agent import AgentConfig
from treegrpo.tasks.registry import task_family
from treegrpo.training.config import REAL_LIMITS, TINY_LIMITS, TrainConfig
from treegrpo.training.warmup import WARMUP_RECORD


@dataclass
class RunParts:
    """The pieces the trainer loop uses; nothing here knows about RL."""

    model_dir: Path
    model: torch.nn.Module
    tokenizer: Any
    env: AgentEnv
    train_tasks: list[Task]
    eval_tasks: list[Task]
    agent_cfg: AgentConfig
    extra_files: dict[str, str]
    info: dict[str, Any]


_LIMITS = ("max_turns", "max_step_tokens", "max_obs_tokens", "max_context_tokens")


def agent_config(
    cfg: TrainConfig, recorded: dict[str, Any] | None = None, max_positions: int | None = None, tiny: bool = True
) -> AgentConfig:
    """The agent loop's limits: fields the user set win; otherwise the limits the model's folder
    was taught with (``recorded``: a tiny agent's bootstrap, a warm-up record), then the config
    defaults, where ``auto`` is the model kind's (:data:`~treegrpo.training.config.TINY_LIMITS` for
    a tiny agent, :data:`~treegrpo.training.config.REAL_LIMITS` for a real model). The context
    never exceeds what the model can position (``max_positions``)."""
    recorded = recorded or {}
    kind = TINY_LIMITS if tiny else REAL_LIMITS
    limits: dict[str, int] = {}
    for k in _LIMITS:
        v = getattr(cfg, k)
        if v != "auto" and k in cfg.model_fields_set:
            limits[k] = int(v)
        elif k in recorded:
            limits[k] = int(recorded[k])
        else:
            limits[k] = int(kind[k] if v == "auto" else v)
    if max_positions is not None:
        limits["max_context_tokens"] = min(limits["max_context_tokens"], int(max_positions))
    taught = "obs_format" in recorded and "obs_format" not in cfg.model_fields_set
    obs_format = recorded["obs_format"] if taught else cfg.obs_format
    return AgentConfig(**limits, temperature=cfg.temperature, top_p=cfg.top_p, obs_format=obs_format)


def build_run(cfg: TrainConfig, model_dir: Path | None = None) -> RunParts:
    """Load the model (the task family's starting policy when no model is given) and the task's
    env and questions."""
    family = task_family(cfg)
    if model_dir is None:
        model_dir = family.starting_model(cfg) if cfg.model is None else Path(cfg.model)
    loaded = load_pretrained(model_dir, device=cfg.device, dtype=getattr(torch, cfg.dtype))
    src = family.source(cfg, loaded)
    max_positions = getattr(loaded.model.config, "max_position_embeddings", None)
    agent_cfg = src.agent or agent_config(
        cfg, loaded.info.get("agent") or _warmup_agent(loaded.folder), max_positions, tiny=loaded.is_tiny
    )
    extra = {MARKER_FILE: (loaded.folder / MARKER_FILE).read_text()} if loaded.is_tiny else {}
    return RunParts(
        model_dir=loaded.folder,
        model=loaded.model,
        tokenizer=loaded.tokenizer,
        env=src.env,
        train_tasks=src.train_tasks,
        eval_tasks=src.eval_tasks[: cfg.eval_prompts],
        agent_cfg=agent_cfg,
        extra_files=extra,
        info=loaded.info,
    )


def _warmup_agent(folder: Path) -> dict[str, Any] | None:
    """The agent settings a ``treegrpo warmup`` folder was taught with (its record), if any."""
    record = folder / WARMUP_RECORD
    if not record.is_file():
        return None
    try:
        agent = json.loads(record.read_text()).get("agent")
    except (OSError, ValueError, AttributeError):
        return None
    return agent if isinstance(agent, dict) else None
