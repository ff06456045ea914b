"""The SQL agent as a run's task family: the problem set the starting policy was bootstrapped
with (its ``train``/``eval`` splits), a snapshot-mode :class:`~treegrpo.tasks.sql.env.SqlEnv`;
the starting policy is the cached tiny SQL agent (:mod:`treegrpo.tasks.sql.bootstrap`). The agent
loop's limits come from the model's record (the run derives them, as for the search world)."""

from __future__ import annotations

from pathlib import Path

from treegrpo.models.loader import LoadedModel
from treegrpo.tasks.base import TaskFamily, TaskSource
from treegrpo.tasks.sql.bootstrap import ensure_sql_bootstrapped, recorded_config
from treegrpo.tasks.sql.env import SqlEnv
from treegrpo.tasks.sql.problems import build_problems
from treegrpo.training.config import TrainConfig


def starting_model(cfg: TrainConfig) -> Path:
    """The cached SQL starting policy (built on first use)."""
    return ensure_sql_bootstrapped()


def source(cfg: TrainConfig, model: LoadedModel) -> TaskSource:
    problems = build_problems(recorded_config(model.folder).problems)
    return TaskSource(SqlEnv("snapshot"), problems.tasks("train"), problems.tasks("eval"))


SQL = TaskFamily("sql", starting_model, source)
