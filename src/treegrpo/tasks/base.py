"""The task-family contract: what a training run needs from a task, and nothing about RL.

A family answers two questions for a run config (:class:`~treegrpo.training.config.TrainConfig`):

- ``starting_model(cfg)``: the folder of the policy to start from when the user gives no
  ``--model`` (a family's own tiny agent, bootstrapped and cached on first use);
- ``source(cfg, model)``: the environment and the train/eval questions for the loaded model
  (:class:`~treegrpo.models.loader.LoadedModel`: its bootstrap record says which world, env and
  agent limits it was taught with).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from treegrpo.envs.base import AgentEnv, Task
from treegrpo.models.loader import LoadedModel
from treegrpo.rollout.agent import AgentConfig


@dataclass
class TaskSource:
    """A run's environment and questions.

    Attributes:
        env: the environment every trajectory steps through.
        train_tasks: questions the RL steps sample from.
        eval_tasks: held-out questions (the run keeps the first ``eval_prompts``).
        agent: the agent-loop settings when the family fixes them (``None``: the run derives them
            from the config and the model's recorded limits).
    """

    env: AgentEnv
    train_tasks: list[Task]
    eval_tasks: list[Task]
    agent: AgentConfig | None = None


@dataclass(frozen=True)
class TaskFamily:
    """A named task family: where its starting policy comes from and how it builds a run's source."""

    name: str
    starting_model: Callable[[Any], Path]
    source: Callable[[Any, LoadedModel], TaskSource]
