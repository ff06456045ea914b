"""Arithmetic as a run's task family: the problem set and response cap the starting policy was
bootstrapped with (:func:`~treegrpo.tasks.arith.bootstrap.arith_run_parts`)."""

from __future__ import annotations

from pathlib import Path

from treegrpo.models.loader import LoadedModel
from treegrpo.tasks.arith.bootstrap import arith_run_parts, ensure_arith_bootstrapped
from treegrpo.tasks.base import TaskFamily, TaskSource
from treegrpo.training.config import TrainConfig


def starting_model(cfg: TrainConfig) -> Path:
    """The cached arithmetic starting policy (built on first use)."""
    return ensure_arith_bootstrapped()


def source(cfg: TrainConfig, model: LoadedModel) -> TaskSource:
    env, train_tasks, eval_tasks, agent = arith_run_parts(cfg, model.folder)
    return TaskSource(env, train_tasks, eval_tasks, agent)


ARITH = TaskFamily("arith", starting_model, source)
