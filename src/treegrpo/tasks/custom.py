"""Your own agent as a task family: your env, or your tools and reward functions, over your rows.

A run is *custom* when it names an env (``--env package.module:Class``) or tools
(``--tools package.module:fn,…``), from the CLI or through :func:`treegrpo.train`. Its questions
are dataset rows — a JSONL file (one object per line), a Search-R1/verl parquet file, or the rows
the Python API wrote into the run folder — read by :func:`rows_to_tasks`:

- the question: ``question``, else the last user message of ``prompt`` (chat messages or a
  string; Search-R1's "Question:" marker honoured);
- the gold answers, when there are any: ``answers`` (a list or a string), ``answer``,
  ``golden_answers``, or Search-R1's ``reward_model.ground_truth.target``;
- the id: ``id``, else the row number; every column is kept (``Task.meta``): reward functions get
  them as keyword arguments, a tool class's ``reset(**row)`` gets them too.

Held out: ``--eval-data``, else the last slice of the rows (as for ``--data``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from treegrpo.envs.base import AgentEnv, Task
from treegrpo.envs.reward_fns import BUILTIN_REWARDS, RewardSet
from treegrpo.envs.tool_env import ToolEnv
from treegrpo.errors import ConfigError
from treegrpo.imports import import_object
from treegrpo.io import jsonl_objects
from treegrpo.models.loader import LoadedModel
from treegrpo.tasks.base import TaskFamily, TaskSource
from treegrpo.tasks.datafile import BUILTIN_QUESTION_SETS, DataError, extract_question
from treegrpo.training.config import TrainConfig

_ANSWER_FIELDS = ("answers", "answer", "golden_answers")


@dataclass
class UserObjects:
    """Python objects a caller of :func:`treegrpo.train` passed (the CLI names them in the config
    instead; ``config.json`` records their references either way).

    Attributes:
        env: an env instance (any :class:`~treegrpo.envs.base.AgentEnv`).
        tools: plain function tools.
        environment_factory: a tool class (one instance per trajectory).
        rewards: reward functions (callables or built-in names).
    """

    env: AgentEnv | None = None
    tools: Sequence[Callable[..., Any]] = ()
    environment_factory: Callable[[], Any] | None = None
    rewards: Sequence[str | Callable[..., Any]] = field(default_factory=list)


def is_custom(cfg: TrainConfig, user: UserObjects | None = None) -> bool:
    """Whether ``cfg`` (with ``user``'s objects) names an env or tools of the user's."""
    has_objects = user is not None and (user.env is not None or user.tools or user.environment_factory is not None)
    return bool(cfg.env or cfg.tools or has_objects)


def _answers(row: Mapping[str, Any]) -> list[str]:
    for key in _ANSWER_FIELDS:
        if key in row and row[key] is not None:
            value = row[key]
            values = value if isinstance(value, list | tuple) else [value]
            return [str(v).strip() for v in values if str(v).strip()]
    rm = row.get("reward_model")
    gt = rm.get("ground_truth") if isinstance(rm, Mapping) else None
    target = gt.get("target") if isinstance(gt, Mapping) else gt
    if target is not None:
        values = target if isinstance(target, list | tuple) else [target]
        return [str(v).strip() for v in values if str(v).strip()]
    return []


def rows_to_tasks(rows: Iterable[Mapping[str, Any]], source: str) -> list[Task]:
    """Dataset rows as tasks (module docstring); ``source`` names them in errors (a file, ``train_data``).

    Raises:
        DataError: a row without a question, or a repeated id (one line naming the row).
    """
    tasks: list[Task] = []
    seen: set[str] = set()
    for i, row in enumerate(rows, 1):
        where = f"{source}: row {i}"
        if not isinstance(row, Mapping):
            raise DataError(f"{where}: a row must be a mapping of column -> value, got {type(row).__name__}")
        if isinstance(row.get("question"), str) and row["question"].strip():
            question = row["question"].strip()
        elif row.get("prompt") is not None:
            question = extract_question(row["prompt"], where)
        else:
            raise DataError(f"{where}: no question: give a 'question' column (or 'prompt' chat messages)")
        tid = str(row["id"]) if row.get("id") is not None else f"row-{i - 1}"
        if tid in seen:
            raise DataError(f"{where}: id {tid!r} repeats an earlier row: ids must be unique")
        seen.add(tid)
        tasks.append(Task(tid, question, _answers(row), data_source=str(row.get("data_source") or ""), meta=dict(row)))
    if not tasks:
        raise DataError(f"{source}: holds no rows")
    return tasks


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a JSONL or parquet file."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise DataError(f"{p}: no such data file (expected JSONL, one object per line, or parquet)")
    if p.suffix.lower() in (".parquet", ".pq"):
        import pyarrow.parquet as pq

        try:
            return list(pq.read_table(p).to_pylist())
        except Exception as e:
            raise DataError(f"{p}: not a readable parquet file ({type(e).__name__}: {e})") from None
    return [row for _, _, row in jsonl_objects(p, DataError, "{path}: row {line}")]


def load_rows_as_tasks(ref: str) -> list[Task]:
    if ref in BUILTIN_QUESTION_SETS:
        raise ConfigError(f"--data {ref} is a built-in search set: give both splits' rows as files for your own tools")
    return rows_to_tasks(read_rows(ref), ref)


def split_rows(cfg: TrainConfig) -> tuple[list[Task], list[Task]]:
    """Training and held-out tasks: ``--eval-data`` when given, else the last slice of ``--data``
    (``max(1, min(eval_prompts, n // 5))`` rows)."""
    if not cfg.data:
        raise ConfigError("your tools or env need questions: --data rows.jsonl (train_data= in Python)")
    tasks = load_rows_as_tasks(cfg.data)
    if cfg.eval_data:
        return tasks, load_rows_as_tasks(cfg.eval_data)
    if len(tasks) < 2:
        raise ConfigError(f"{cfg.data}: needs at least 2 rows to hold some out, or give --eval-data")
    k = max(1, min(cfg.eval_prompts, len(tasks) // 5))
    return tasks[:-k], tasks[-k:]


def make_env_object(obj: Any, ref: str) -> AgentEnv:
    """An env from what ``--env`` names: an env instance as it is, a class or factory called with
    no arguments."""
    if callable(getattr(obj, "step", None)) and not inspect.isclass(obj):
        return obj
    if not callable(obj):
        raise ConfigError(f"--env {ref}: neither an env (an object with step()) nor a class or factory that makes one")
    try:
        return obj()
    except TypeError as e:
        raise ConfigError(f"--env {ref}: cannot be made without arguments ({e}); name a factory that takes none") from None


def user_env(cfg: TrainConfig, user: UserObjects | None, tokenizer: Any = None) -> AgentEnv:
    """The run's env: the user's own (``--env`` / ``env=``), or a :class:`ToolEnv` of their tools and
    rewards (the ``tools`` protocol renders through ``tokenizer``)."""
    user = user or UserObjects()
    env = user.env
    if env is None and cfg.env:
        env = make_env_object(import_object(cfg.env, "--env"), cfg.env)
    if env is not None:
        if user.tools or cfg.tools or user.environment_factory is not None:
            raise ConfigError("give either an env or tools, not both (a ToolEnv is made from tools)")
        if cfg.reward != ["em"] or user.rewards:
            raise ConfigError("an env computes its own rewards: drop --reward / reward_funcs (or pass tools instead)")
        return env
    tools, factory = list(user.tools), user.environment_factory
    if not tools and factory is None:
        for ref in cfg.tools:
            obj = import_object(ref, "--tools")
            if inspect.isclass(obj):
                if factory is not None:
                    raise ConfigError(f"--tools {ref}: only one tool class per run (it is a trajectory's state)")
                factory = obj
            else:
                tools.append(obj)
    rewards = list(user.rewards) or list(cfg.reward)
    template = "tools" if cfg.prompt_template in ("auto", "search_r1") else cfg.prompt_template
    return ToolEnv(
        tools,
        factory,
        RewardSet.of(rewards, cfg.reward_weights),
        protocol=cfg.protocol,
        prompt_template=template,
        timeout_s=cfg.tool_timeout_s,
        tool_concurrency=cfg.tool_concurrency,
        tokenizer=tokenizer,
        max_result_tokens=cfg.max_obs_tokens,
    )


def check_answers_for(env: AgentEnv, tasks: Sequence[Task]) -> None:
    """A built-in answer reward with rows that carry no answers would score every trajectory 0."""
    rewards = getattr(env, "rewards", None)
    builtin = [n for n in getattr(rewards, "names", []) if n in BUILTIN_REWARDS]
    if builtin and not any(t.answers for t in tasks):
        raise ConfigError(
            f"the reward {builtin[0]} compares answers, but no row has one ('answers' or 'answer' column): "
            "add answers or pass your own reward function (--reward package.module:fn)"
        )


def starting_model(cfg: TrainConfig) -> Path:
    raise ConfigError(
        "your tools or env need a model: --model a folder, a .gguf file, smollm2-135m, or a warm-up folder "
        "(treegrpo warmup --demos demos.jsonl …, docs/tools.md)"
    )


def source(cfg: TrainConfig, model: LoadedModel, user: UserObjects | None = None, need_data: bool = True) -> TaskSource:
    """The user's env (:func:`user_env`) and rows (:func:`split_rows`); without ``need_data`` and
    without ``--data``, no training rows (and ``--eval-data``'s, if any, held out)."""
    env = user_env(cfg, user, model.tokenizer)
    if not need_data and not cfg.data:
        return TaskSource(env, [], load_rows_as_tasks(cfg.eval_data) if cfg.eval_data else [])
    train_tasks, eval_tasks = split_rows(cfg)
    check_answers_for(env, train_tasks)
    return TaskSource(env, train_tasks, eval_tasks)


CUSTOM = TaskFamily("custom", starting_model, source)

__all__ = ["CUSTOM", "UserObjects", "is_custom", "read_rows", "rows_to_tasks", "split_rows", "user_env"]
