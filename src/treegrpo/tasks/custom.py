"""Your own agent as a task family: your env, or your tools and reward functions, over your rows.

A run is *custom* when it names an env (``--env package.module:Class``) or tools
(``--tools package.module:fn,…``), from the CLI or through :func:`treegrpo.train`. Its questions
are dataset rows — a JSONL file (one object per line), a Search-R1/verl parquet file, or the rows
the Python API wrote into the run folder — read by :func:`rows_to_tasks`:

- the prompt: a ``prompt`` column of chat messages (TRL's conversational form: a system message,
  earlier turns, context) is rendered as given, or a ``prompt`` string as one user message
  (:meth:`~treegrpo.envs.tool_env.ToolEnv.prompt_messages` says what the protocol adds to its last
  user message); else the ``question`` alone. Search-R1/verl rows (a ``data_source`` or
  ``reward_model`` column) are the exception: their question is the text after the last user
  message's last ``Question:`` (:func:`~treegrpo.tasks.datafile.extract_question`), Search-R1's
  instruction before it dropped;
- the question (what the viewer shows and a ``question`` reward argument holds): ``question``,
  else the last user message of ``prompt``, whole;
- the gold answers, when there are any: ``answers`` (a list or a string), ``answer``,
  ``golden_answers``, or Search-R1's ``reward_model.ground_truth.target``;
- the id: ``id``, else the row number; every column is kept (``Task.meta``): reward functions get
  them as keyword arguments, a tool class's ``reset(**row)`` gets them too.

Held out: ``--eval-data``, else the last slice of the rows (as for ``--data``).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from treegrpo.envs.base import AgentEnv, Task
from treegrpo.envs.reward_check import check_rewards
from treegrpo.envs.reward_fns import BUILTIN_REWARDS, SEARCH_R1_COLUMNS, RewardSet
from treegrpo.envs.tool_env import ToolEnv
from treegrpo.errors import ConfigError
from treegrpo.imports import import_object
from treegrpo.io import jsonl_objects
from treegrpo.models.loader import LoadedModel
from treegrpo.tasks.base import TaskFamily, TaskSource
from treegrpo.tasks.datafile import BUILTIN_QUESTION_SETS, DataError, extract_question, split_tasks
from treegrpo.training.config import TrainConfig
from treegrpo.training.warmup import WARMUP_RECORD

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
        search_r1 = any(c in row for c in SEARCH_R1_COLUMNS)
        whole = row.get("prompt") is not None and not search_r1
        if whole:
            last_user = _prompt_messages(row["prompt"], where)
        if isinstance(row.get("question"), str) and row["question"].strip():
            question = row["question"].strip()
        elif whole:
            question = last_user
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


def _prompt_messages(prompt: Any, where: str) -> str:
    """Check a ``prompt`` kept whole — a non-empty string, or chat messages with string ``role`` and
    ``content`` whose last is a user message — and return its last user message's content.

    Raises:
        DataError: one line naming the row and what the prompt must be.
    """
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(f"{where}: field 'prompt' is empty")
        return prompt.strip()
    form = "a list of chat messages {'role', 'content'} ending with a user message, or a string"
    if not isinstance(prompt, list | tuple) or not prompt:
        raise DataError(f"{where}: field 'prompt' must be {form}")
    for m in prompt:
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: field 'prompt' must be {form}; got {str(m)[:60]}")
    if prompt[-1]["role"] != "user" or not prompt[-1]["content"].strip():
        raise DataError(f"{where}: field 'prompt' must be {form} (its last message is the question)")
    return prompt[-1]["content"].strip()


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


def user_env(cfg: TrainConfig, user: UserObjects | None, tokenizer: Any = None, taught: str | None = None) -> AgentEnv:
    """The run's env: the user's own (``--env`` / ``env=``), or a :class:`ToolEnv` of their tools and
    rewards (the ``tools`` protocol renders through ``tokenizer``; ``taught``: the protocol a
    warm-up folder was taught, :func:`tool_protocol`)."""
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
        protocol=tool_protocol(cfg.protocol, tokenizer, taught),
        prompt_template=template,
        timeout_s=cfg.tool_timeout_s,
        tool_concurrency=cfg.tool_concurrency,
        tokenizer=tokenizer,
        max_result_tokens=cfg.max_obs_tokens,
    )


PROBE_TOOL = {
    "type": "function",
    "function": {"name": "treegrpo_probe_tool", "description": "A probe.", "parameters": {"type": "object", "properties": {}}},
}


def renders_tools(tokenizer: Any) -> bool:
    """Whether ``tokenizer``'s chat template renders tools: a probe tool's name is in the prompt it
    renders with ``tools=[probe]`` (False without a template, or when rendering fails)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return False
    messages = [{"role": "user", "content": "Hi."}]
    try:
        text = tokenizer.apply_chat_template(messages, tools=[PROBE_TOOL], add_generation_prompt=True, tokenize=False)
    except Exception:
        return False
    return isinstance(text, str) and PROBE_TOOL["function"]["name"] in text


def tool_protocol(protocol: str, tokenizer: Any, taught: str | None = None) -> str:
    """The protocol a run of your tools speaks: ``tags`` or ``tools`` as set; ``auto`` is the one
    a ``treegrpo warmup`` folder was ``taught`` (its record says), else ``tools`` for a model whose
    chat template renders tools (:func:`renders_tools`), else ``tags``."""
    if protocol != "auto":
        return protocol
    if taught in ("tags", "tools"):
        return taught
    return "tools" if renders_tools(tokenizer) else "tags"


def taught_protocol(folder: Path | None) -> str | None:
    """The protocol a ``treegrpo warmup`` folder's record says it was taught (``None``: not one, or
    written before warm-ups recorded it)."""
    record = Path(folder) / WARMUP_RECORD if folder is not None else None
    if record is None or not record.is_file():
        return None
    try:
        protocol = json.loads(record.read_text()).get("protocol")
    except (OSError, ValueError, AttributeError):
        return None
    return protocol if protocol in ("tags", "tools") else None


def protocol_of(env: AgentEnv) -> str:
    """The protocol ``env`` speaks, as ``config.json`` records it: a :class:`ToolEnv`'s own; another
    env's ``tools`` when its turns end at the end-of-turn token, else ``tags``."""
    protocol = getattr(env, "protocol", None)
    if protocol in ("tags", "tools"):
        return protocol
    return "tools" if getattr(env, "turns_end_at_eos", False) else "tags"


def check_rewards_early(cfg: TrainConfig, user: UserObjects | None = None) -> None:
    """Before the model loads, the reward functions of a run of your tools, or of the search task
    scored by your functions, tried on its rows (:func:`~treegrpo.envs.reward_check.check_rewards`:
    the columns they name, a trial call on a few rows). Nothing for your own env (it scores itself)
    or a run without rows; a bad setting or file is left to the run's own line.

    Raises:
        ConfigError: one line naming the function, the row and the fix.
    """
    user = user or UserObjects()
    if user.env is not None or cfg.env or not cfg.data:
        return
    specs = list(user.rewards) or list(cfg.reward)
    factory = user.environment_factory
    if is_custom(cfg, user):
        train, held_out = split_rows(cfg)
        if factory is None and not user.tools:  # the CLI's --tools: a tool class among them
            classes = [o for o in (import_object(r, "--tools") for r in cfg.tools) if inspect.isclass(o)]
            factory = classes[0] if len(classes) == 1 else None
    elif all(isinstance(s, str) and ":" not in s for s in specs):
        return  # the search task's own scoring (em, sub_em, f1, format): nothing of yours to try
    else:
        train, held_out = split_tasks(cfg)
    rewards = RewardSet.of(specs, cfg.reward_weights)
    check_answers_for(rewards, train)
    check_rewards(rewards, train, held_out[: cfg.eval_prompts], factory, cfg.steps)


def check_answers_for(env: AgentEnv | RewardSet, tasks: Sequence[Task]) -> None:
    """A built-in answer reward (of ``env``, or a :class:`RewardSet`) with rows that carry no
    answers would score every trajectory 0."""
    rewards = env if isinstance(env, RewardSet) else getattr(env, "rewards", None)
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
    env = user_env(cfg, user, model.tokenizer, taught_protocol(model.folder))
    if not need_data and not cfg.data:
        return TaskSource(env, [], load_rows_as_tasks(cfg.eval_data) if cfg.eval_data else [])
    train_tasks, eval_tasks = split_rows(cfg)
    check_answers_for(env, train_tasks)
    return TaskSource(env, train_tasks, eval_tasks)


CUSTOM = TaskFamily("custom", starting_model, source)

__all__ = [
    "CUSTOM",
    "UserObjects",
    "check_rewards_early",
    "is_custom",
    "protocol_of",
    "read_rows",
    "renders_tools",
    "rows_to_tasks",
    "split_rows",
    "taught_protocol",
    "tool_protocol",
    "user_env",
]
