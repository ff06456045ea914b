"""The synthetic search world as a run's task family: the preset's world (or its ``world_seed``
variant), BM25 over its passages, its ``train``/``eval`` splits; the starting policy is the
preset's bootstrapped tiny agent."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from treegrpo.envs.search import SearchEnv, reward_options
from treegrpo.errors import ConfigError
from treegrpo.models.loader import LoadedModel
from treegrpo.retrieval.bm25 import BM25Retriever
from treegrpo.tasks.base import TaskFamily, TaskSource
from treegrpo.tasks.world.bootstrap import ensure_bootstrapped
from treegrpo.tasks.world.world import PRESETS, build_world
from treegrpo.training.config import TrainConfig


def starting_model(cfg: TrainConfig) -> Path:
    """The preset's bootstrapped tiny agent (built and cached on first use)."""
    return ensure_bootstrapped(cfg.preset, world_seed=cfg.world_seed)


def source(cfg: TrainConfig, model: LoadedModel) -> TaskSource:
    """The preset's world searched with BM25; the ``minimal`` prompt unless the config names one.
    Only a bootstrapped tiny agent knows the fictional world's protocol: any other model is an
    error that says what to pass instead (questions and a retriever)."""
    if not model.is_tiny:
        raise ConfigError(
            f"--model {cfg.model}: without --data the run trains on the synthetic world, which only a "
            "bootstrapped tiny agent is taught; give questions and a retriever, e.g. "
            "--data wiki-vital-qa --corpus wiki-vital (built in) or --data FILE.parquet --retriever-url URL"
        )
    if cfg.preset not in PRESETS:
        raise ConfigError(f"unknown world preset {cfg.preset!r}; choose one of {sorted(PRESETS)}")
    wcfg = PRESETS[cfg.preset]
    if cfg.world_seed is not None:
        wcfg = dataclasses.replace(wcfg, seed=cfg.world_seed)
    world = build_world(wcfg)
    template = "minimal" if cfg.prompt_template == "auto" else cfg.prompt_template
    env = SearchEnv(BM25Retriever(world.corpus), topk=cfg.topk, **reward_options(cfg.reward, cfg.reward_weights), prompt_template=template)
    return TaskSource(env, world.tasks("train"), world.tasks("eval"))


WORLD = TaskFamily("world", starting_model, source)
