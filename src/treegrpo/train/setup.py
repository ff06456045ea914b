"""Everything a run needs, built from its config: model, tokenizer, environment, questions."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from treegrpo.envs.base import Task
from treegrpo.envs.search import SearchEnv
from treegrpo.models.tiny import MARKER_FILE, load_model, load_tokenizer, tiny_info
from treegrpo.rollout.agent import AgentConfig
from treegrpo.train.config import ConfigError, TrainConfig


@dataclass
class RunParts:
    """The pieces the trainer loop uses; nothing here knows about RL."""

    model_dir: Path
    model: torch.nn.Module
    tokenizer: Any
    env: SearchEnv
    train_tasks: list[Task]
    eval_tasks: list[Task]
    agent_cfg: AgentConfig
    extra_files: dict[str, str]
    info: dict[str, Any]


_LIMITS = ("max_turns", "max_step_tokens", "max_obs_tokens", "max_context_tokens")


def agent_config(cfg: TrainConfig, recorded: dict[str, Any] | None = None, max_positions: int | None = None) -> AgentConfig:
    """The agent loop's limits: fields the user set win; otherwise the limits a bootstrapped model
    was taught with (``recorded``), then the config defaults. The context never exceeds what the
    model can position (``max_positions``)."""
    recorded = recorded or {}
    limits = {
        k: getattr(cfg, k) if k in cfg.model_fields_set or k not in recorded else int(recorded[k]) for k in _LIMITS
    }
    if max_positions is not None:
        limits["max_context_tokens"] = min(limits["max_context_tokens"], int(max_positions))
    return AgentConfig(**limits, temperature=cfg.temperature, top_p=cfg.top_p)


def _world_parts(cfg: TrainConfig) -> tuple[Any, list[Task], list[Task]]:
    from treegrpo.envs.world import PRESETS, build_world
    from treegrpo.retrieval.bm25 import BM25Retriever

    if cfg.preset not in PRESETS:
        raise ConfigError(f"unknown world preset {cfg.preset!r}; choose one of {sorted(PRESETS)}")
    wcfg = PRESETS[cfg.preset]
    if cfg.world_seed is not None:
        wcfg = dataclasses.replace(wcfg, seed=cfg.world_seed)
    world = build_world(wcfg)
    template = "minimal" if cfg.prompt_template == "auto" else cfg.prompt_template
    env = SearchEnv(BM25Retriever(world.corpus), topk=cfg.topk, metric=cfg.reward, prompt_template=template)
    return env, world.tasks("train"), world.tasks("eval")


def _data_parts(cfg: TrainConfig, is_tiny: bool) -> tuple[Any, list[Task], list[Task]]:
    from treegrpo.data import load_tasks
    from treegrpo.retrieval.factory import make_retriever

    tasks = load_tasks(cfg.data)  # type: ignore[arg-type]
    if cfg.eval_data:
        eval_tasks = load_tasks(cfg.eval_data)
    else:  # hold out the last slice of the data
        k = max(1, min(cfg.eval_prompts, len(tasks) // 5))
        if len(tasks) < 2:
            raise ConfigError(f"{cfg.data}: needs at least 2 questions to hold some out, or pass --eval-data")
        tasks, eval_tasks = tasks[:-k], tasks[-k:]
    template = (
        cfg.prompt_template if cfg.prompt_template != "auto" else ("minimal" if is_tiny else "search_r1")
    )
    retriever = make_retriever(corpus=cfg.corpus, url=cfg.retriever_url, allow_offline=cfg.allow_offline_retriever)
    env = SearchEnv(retriever, topk=cfg.topk, metric=cfg.reward, prompt_template=template)
    return env, tasks, eval_tasks


def build_run(cfg: TrainConfig, model_dir: Path | None = None) -> RunParts:
    """Load the model (bootstrapping the tiny agent when no model is given) and the task source."""
    if model_dir is None:
        if cfg.model is None and cfg.task == "arith":
            from treegrpo.envs.arith import ensure_arith_bootstrapped

            model_dir = ensure_arith_bootstrapped()
        elif cfg.model is None:
            from treegrpo.models.bootstrap import ensure_bootstrapped

            model_dir = ensure_bootstrapped(cfg.preset, world_seed=cfg.world_seed)
        else:
            model_dir = Path(cfg.model).expanduser()
            if not (model_dir / "config.json").exists():
                raise ConfigError(
                    f"--model {model_dir}: not a model folder (no config.json); give a local causal-LM folder"
                )
    is_tiny = (model_dir / MARKER_FILE).exists()
    tokenizer = load_tokenizer(model_dir)
    model = load_model(model_dir).to(cfg.device)
    info = tiny_info(model_dir)
    agent_cfg = agent_config(cfg, info.get("agent"), getattr(model.config, "max_position_embeddings", None))
    if cfg.task == "arith":
        from treegrpo.envs.arith import arith_run_parts

        env, train_tasks, eval_tasks, agent_cfg = arith_run_parts(cfg, model_dir)
    elif cfg.data:
        env, train_tasks, eval_tasks = _data_parts(cfg, is_tiny)
    else:
        env, train_tasks, eval_tasks = _world_parts(cfg)
    extra = {MARKER_FILE: (model_dir / MARKER_FILE).read_text()} if is_tiny else {}
    return RunParts(
        model_dir=model_dir,
        model=model,
        tokenizer=tokenizer,
        env=env,
        train_tasks=train_tasks,
        eval_tasks=eval_tasks[: cfg.eval_prompts],
        agent_cfg=agent_cfg,
        extra_files=extra,
        info=info,
    )
