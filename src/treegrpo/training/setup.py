"""Everything a run needs, built from its config: model, tokenizer, environment, questions.

The task family (:func:`~treegrpo.tasks.registry.task_family`) says where the starting policy
comes from when no ``--model`` is given and builds the env and questions; the model loader
(:func:`~treegrpo.models.loader.load_pretrained`) loads the model reference.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from treegrpo.envs.base import AgentEnv, Task
from treegrpo.envs.reward_fns import RewardSet
from treegrpo.envs.search import SearchEnv
from treegrpo.errors import ConfigError
from treegrpo.models.loader import MARKER_FILE, LoadedModel, load_pretrained
from treegrpo.rollout.agent import AgentConfig
from treegrpo.rollout.templates import set_chat_template
from treegrpo.tasks.custom import CUSTOM, UserObjects
from treegrpo.tasks.custom import source as custom_source
from treegrpo.tasks.registry import task_family
from treegrpo.training.config import TrainConfig
from treegrpo.training.defaults import REAL_LIMITS, TINY_LIMITS
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
    defaults, where ``auto`` is the model kind's (:data:`~treegrpo.training.defaults.TINY_LIMITS` for
    a tiny agent, :data:`~treegrpo.training.defaults.REAL_LIMITS` for a real model). The context
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
    return AgentConfig(
        **limits, temperature=cfg.temperature, top_p=cfg.top_p, obs_format=obs_format,
        rollout_pipeline=cfg.rollout_pipeline, trajectory_streams=cfg.trajectory_streams,
    )  # fmt: skip


def build_run(
    cfg: TrainConfig,
    model_dir: Path | None = None,
    user: UserObjects | None = None,
    loaded: LoadedModel | None = None,
    need_data: bool = True,
) -> RunParts:
    """Load the model (the task family's starting policy when no model is given) and the task's
    env and questions. ``user``: a Python caller's env, tools and reward functions (the CLI names
    them in ``cfg``); ``loaded``: a model and tokenizer the caller already holds; ``need_data``
    False: your own tools may come without training questions (a warm-up on demonstrations)."""
    family = task_family(cfg)
    if loaded is None:
        if model_dir is None:
            model_dir = family.starting_model(cfg) if cfg.model is None else Path(cfg.model)
        loaded = load_pretrained(model_dir, device=cfg.device, dtype=getattr(torch, cfg.dtype))
    if cfg.chat_template:  # the template the run renders prompts and tool turns with (saved with checkpoints)
        set_chat_template(loaded.tokenizer, cfg.chat_template)
    if family is CUSTOM:
        src = custom_source(cfg, loaded, user, need_data)
    else:
        src = family.source(cfg, loaded)
        if user is not None and user.rewards:  # reward functions for a built-in search task
            src.env = with_reward_functions(src.env, RewardSet.of(list(user.rewards), cfg.reward_weights))
    max_positions = getattr(loaded.model.config, "max_position_embeddings", None)
    recorded = loaded.info.get("agent") or _warmup_agent(loaded.folder)
    if src.agent is not None:  # a family's own loop settings, with what the user set on top
        agent_cfg = user_agent_fields(src.agent, cfg)
    else:
        agent_cfg = agent_config(cfg, recorded, max_positions, tiny=loaded.is_tiny)
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


def user_agent_fields(agent: AgentConfig, cfg: TrainConfig) -> AgentConfig:
    """``agent`` (a task family's fixed loop settings) with every field the user set in ``cfg``
    on top: what a caller passes is what runs."""
    fields = {f.name for f in dataclasses.fields(AgentConfig)} & cfg.model_fields_set
    update = {k: getattr(cfg, k) for k in fields if getattr(cfg, k) != "auto"}
    return dataclasses.replace(agent, **update) if update else agent


def recorded_agent_fields(cfg: TrainConfig, agent: AgentConfig) -> TrainConfig:
    """``cfg`` with the loop settings the run really uses (``agent``: a family's fixed settings or
    a model folder's taught limits) in the fields the user left unset, so ``config.json`` records
    what ran (a set field already equals ``agent``'s: :func:`user_agent_fields`)."""
    fields = ("max_turns", "max_obs_tokens", "temperature", "top_p", "obs_format")
    update = {k: getattr(agent, k) for k in fields if k not in cfg.model_fields_set and getattr(cfg, k) != getattr(agent, k)}
    if not update:
        return cfg
    return TrainConfig.model_validate({**cfg.model_dump(include=cfg.model_fields_set), **update})


def with_reward_functions(env: AgentEnv, rewards: RewardSet) -> AgentEnv:
    """A built-in search env that scores answers with ``rewards`` (reward functions apply to the
    search task and to tools; the other tasks score themselves)."""
    if not isinstance(env, SearchEnv):
        raise ConfigError(f"reward functions apply to tools and the search task, not to {type(env).__name__}")
    return dataclasses.replace(env, rewards=rewards)


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
