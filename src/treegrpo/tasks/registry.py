"""Which task family a run config means: ``--env``/``--tools`` → your own agent (the custom
family); ``task: arith`` → arithmetic; ``task: search`` with ``--data`` → the data-file search
task; ``task: sql`` → the SQL agent (a stateful tool); otherwise the synthetic search world."""

from __future__ import annotations

from treegrpo.tasks.arith.task import ARITH
from treegrpo.tasks.base import TaskFamily
from treegrpo.tasks.custom import CUSTOM
from treegrpo.tasks.datafile import DATAFILE
from treegrpo.tasks.sql.task import SQL
from treegrpo.tasks.world.task import WORLD
from treegrpo.training.config import TrainConfig

TASK_FAMILIES: dict[str, TaskFamily] = {f.name: f for f in (WORLD, DATAFILE, ARITH, SQL, CUSTOM)}


def task_family(cfg: TrainConfig) -> TaskFamily:
    """The family of ``cfg`` (see the module docstring)."""
    if cfg.env or cfg.tools:
        return CUSTOM
    if cfg.task == "arith":
        return ARITH
    if cfg.task == "sql":
        return SQL
    return DATAFILE if cfg.data else WORLD
