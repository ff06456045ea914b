"""Reward functions tried before the model loads: a function that raises, returns the wrong number
of values or a non-number, or needs a column some row lacks fails the run in one line naming the
function, the row and the fix — not at the first training step, or only when that row is drawn.

Two checks, on the rows of the run (training and held out alike, so the held-out evaluation is
held to what training is):

- **columns**: a function without ``**kwargs`` gets only the arguments it names; each of its
  parameters without a default that is not an argument the library gives
  (:data:`~treegrpo.envs.reward_fns.LIBRARY_ARGS`) is a column, and every row must have it;
- **a trial call**: every function is called once on a batch of :data:`TRIAL_TRAIN` training rows
  and :data:`TRIAL_HELD_OUT` held-out row, each with a placeholder completion — one assistant
  message whose content is the row's first gold answer (empty without one), ``completion_ids``
  empty, ``trainer_state`` at step 0, a tool class's fresh instance (``reset(**row)`` called) as
  its ``environments`` entry when a function reads it — through :meth:`~treegrpo.envs.reward_fns.RewardSet.score`, so the
  count and the type of what it returns are checked as in training. What it logs is dropped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from treegrpo import aio
from treegrpo.envs.base import Task
from treegrpo.envs.reward_fns import LIBRARY_ARGS, Message, RewardLog, RewardSet, TrainerState
from treegrpo.errors import ConfigError

TRIAL_TRAIN = 2
TRIAL_HELD_OUT = 1


def needed_columns(fn: Callable[..., Any]) -> list[str]:
    """The row columns ``fn`` needs: its parameters without a default that are not library
    arguments (none when it takes ``**kwargs``: it reads what it reads)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return []
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return []
    return [
        p.name
        for p in params
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty and p.name not in LIBRARY_ARGS
    ]


def check_columns(rewards: RewardSet, splits: Sequence[tuple[str, Sequence[Task]]]) -> None:
    """Every row of every split (``(label, tasks)``) has each column a function needs.

    Raises:
        ConfigError: one line naming the function, the column, the first row without it and the fix.
    """
    for name, fn in zip(rewards.names, rewards.funcs, strict=True):
        for column in needed_columns(fn):
            for label, tasks in splits:
                for i, task in enumerate(tasks, 1):
                    if column not in task.meta:
                        raise ConfigError(
                            f"reward function {name} needs the column {column!r}, which {label} row {i} (id {task.id}) "
                            f"lacks: add it to every row, give the parameter a default ({column}=None) or take **kwargs"
                        )


def placeholder_completion(task: Task) -> list[Message]:
    """The trial completion of a row: one assistant message holding its first gold answer."""
    return [{"role": "assistant", "content": task.answers[0] if task.answers else ""}]


def trial_rows(train: Sequence[Task], held_out: Sequence[Task]) -> list[Task]:
    """The rows of the trial call: the first :data:`TRIAL_TRAIN` training rows and the first
    :data:`TRIAL_HELD_OUT` held-out ones."""
    return [*train[:TRIAL_TRAIN], *held_out[:TRIAL_HELD_OUT]]


def trial_call(
    rewards: RewardSet, tasks: Sequence[Task], environment_factory: Callable[[], Any] | None = None, max_steps: int = 0
) -> None:
    """Score placeholder completions of ``tasks`` with every function (module docstring).

    Raises:
        ConfigError: a function raised or returned the wrong count or a non-number (one line,
            the function and the row named, with what the trial call gave it).
    """
    if not tasks:
        return
    trial = dataclasses.replace(rewards, state=TrainerState(max_steps=max_steps), log=RewardLog())
    make = environment_factory is not None and rewards.wants("environments")
    instances = [_instance(environment_factory, t) for t in tasks] if make else None  # type: ignore[arg-type]
    try:
        prompts = [[{"role": "user", "content": t.question}] for t in tasks]
        trial.score(tasks, prompts, [placeholder_completion(t) for t in tasks], [[] for _ in tasks], instances)
    except ConfigError as e:
        raise ConfigError(
            f"{e} — in the check before the model loads, on rows {', '.join(t.id for t in tasks)} with a placeholder "
            "completion (one assistant message holding the row's first gold answer): a reward function must take any "
            "completion, one value per completion"
        ) from None
    finally:
        for inst in instances or ():
            close = getattr(inst, "close", None)
            if callable(close):
                with contextlib.suppress(Exception):  # a trial instance: its close() is the run's business
                    aio.resolve(close())


def _instance(factory: Callable[[], Any], task: Task) -> Any:
    name = getattr(factory, "__name__", type(factory).__name__)
    try:
        inst = factory()
        reset = getattr(inst, "reset", None)
        if callable(reset):
            aio.resolve(reset(**task.meta))
    except Exception as e:
        raise ConfigError(f"tool class {name} failed to make or reset an instance for row {task.id}: {type(e).__name__}: {e}") from None
    return inst


def check_rewards(
    rewards: RewardSet,
    train: Sequence[Task],
    held_out: Sequence[Task],
    environment_factory: Callable[[], Any] | None = None,
    max_steps: int = 0,
) -> None:
    """Both checks of the module docstring, on a run's training and held-out rows."""
    check_columns(rewards, [("training", train), ("held-out", held_out)])
    trial_call(rewards, trial_rows(train, held_out), environment_factory, max_steps)


__all__ = ["TRIAL_HELD_OUT", "TRIAL_TRAIN", "check_columns", "check_rewards", "needed_columns", "placeholder_completion", "trial_call"]
