"""Deliberately imperfect demonstrations of the SQL task, stepped through the real env.

A correct demo runs the task's reference statements (writes, then the read) and answers what the
read returned. The imperfections are choices RL can fix, each a wrong turn at one decision:

- ``stale`` (``p_stale``): read *before* writing, write, then answer the stale value (wrong);
- ``guess`` (``p_guess``): write, then answer at once without reading, a number off by 1-9 (wrong);
- ``one_leg`` (``p_one_leg``, transfers only): apply the debit only, read, answer what was read
  (the database is wrong, so the reward is 0 even when the read balance happens to be right).

Observations come from the env itself (every demo runs on its own copy of the task's database),
so the policy is trained on exactly the contexts the agent loop will build.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from treegrpo.envs.base import Task
from treegrpo.tasks.sql.env import SqlEnv
from treegrpo.training.warmup import Demo


def _steps(env: SqlEnv, task: Task, statements: Sequence[str], answer: str | None) -> tuple[list[tuple[str, str | None]], float, list[str]]:
    """Step ``statements`` then the answer (``None``: answer what the last read returned)."""
    db = env.initial_state(task)
    steps: list[tuple[str, str | None]] = []
    reads: list[str] = []
    for sql in statements:
        (out,) = env.step([task], [f"<sql>{sql}</sql>"], [True], states=[db])
        steps.append((f"<sql>{sql}</sql>", out.observation))
        reads.append((out.observation or "").removeprefix("<result>").removesuffix("</result>"))
    final = reads[-1] if answer is None else answer
    text = f"<answer>{final}</answer>"
    (out,) = env.step([task], [text], [True], states=[db])
    env.close_state(db)
    steps.append((text, None))
    return steps, float(out.reward or 0.0), reads


def make_demo(env: SqlEnv, task: Task, cfg: Any, rng: random.Random) -> Demo:
    """One demonstration of ``task`` (module docstring); ``cfg`` gives ``p_stale``, ``p_guess``
    and ``p_one_leg``."""
    solution: list[str] = list(task.meta["solution"])
    writes, read = solution[:-1], solution[-1]
    r = rng.random()
    if r < cfg.p_stale:
        _, _, reads = _steps(env, task, [read], "0")  # what the read says before the writes
        steps, reward, _ = _steps(env, task, [read, *writes], reads[0])
        kind = "stale"
    elif r < cfg.p_stale + cfg.p_guess:
        off = rng.choice([d for d in range(-9, 10) if d != 0])
        steps, reward, _ = _steps(env, task, writes, str(int(task.answers[0]) + off))
        kind = "guess"
    elif task.meta["kind"] == "transfer" and rng.random() < cfg.p_one_leg:
        steps, reward, _ = _steps(env, task, [writes[0], read], None)
        kind = "one_leg"
    else:
        steps, reward, _ = _steps(env, task, solution, None)
        kind = "correct"
    return Demo(task, steps, kind, reward)


def make_demos(env: SqlEnv, tasks: Sequence[Task], cfg: Any, rng: random.Random) -> list[Demo]:
    """``cfg.n_demos`` demonstrations cycling through ``tasks`` (independent imperfections)."""
    return [make_demo(env, tasks[i % len(tasks)], cfg, rng) for i in range(cfg.n_demos)]


__all__ = ["make_demo", "make_demos"]
