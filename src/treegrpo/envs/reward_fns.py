"""Reward functions with TRL's convention, and the weighted set a run scores trajectories with.

A reward function takes keyword arguments and returns one number (or ``None``: "does not apply")
per completion::

    def reward(prompts, completions, answers, **kwargs) -> list[float]:
        return [float(c[-1]["content"].strip() == a[0]) for c, a in zip(completions, answers)]

- ``prompts``: each prompt as chat messages: the row's ``prompt`` messages as the dataset gave
  them (:func:`given_prompt`), else ``[{"role": "user", "content": <the env's prompt text>}]``;
- ``completions``: each trajectory as chat messages after the prompt — assistant turns (with
  ``tool_calls``), tool results (role ``tool``); the last message is the final answer, its
  ``content`` the answer text alone (in the tag protocol: inside ``<answer>``, stripped);
- ``completion_ids``: each trajectory's ids after the prompt, as the policy holds them — the ids
  the model generated and, between its turns, the tool results' ids (TRL's multi-turn
  ``completion_ids`` with its ``tool_mask``; ours has no mask argument: a node's ``policy_mask``
  in the rollouts says which are generated); ``None`` per completion from an env that passes no
  ids (the search env);
- ``trainer_state``: a :class:`TrainerState` (``global_step``: optimizer steps done, ``epoch``,
  ``max_steps``), as transformers' ``TrainerState`` names them;
- ``log_metric(name, value)`` / ``log_extra(name, values)``: values that land in the step's row of
  ``metrics.jsonl`` (:class:`RewardLog`);
- ``environments``: each trajectory's tool-class instance (``None`` without a tool class);
- ``answers``: each question's gold answers (a list of strings, possibly empty);
- every other column of the question's dataset row, by its name (one value per completion).

A function need not take ``**kwargs``: it gets only the arguments it names. An ``async def``
function is awaited on the run's event loop (:func:`treegrpo.aio.resolve`). Several functions
are summed with ``reward_weights`` (default 1 each), each logged by name; ``None`` values are left
out of the sum (TRL's convention). The built-in rewards (:data:`BUILTIN_REWARDS`: ``em``,
``sub_em``, ``f1``) are functions of the same kind.
"""

from __future__ import annotations

import inspect
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from treegrpo import aio
from treegrpo.envs.base import Task
from treegrpo.envs.rewards import em, f1, sub_em
from treegrpo.errors import ConfigError
from treegrpo.imports import import_object, object_ref

Message = dict[str, Any]


#: The arguments the library gives every reward function (the rest are the row's columns).
LIBRARY_ARGS = (
    "prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra", "environments", "answers",
)  # fmt: skip
#: Columns whose presence makes a row Search-R1/verl data (its question follows ``Question:``).
SEARCH_R1_COLUMNS = ("data_source", "reward_model")


def given_prompt(task: Task) -> list[Message] | None:
    """The prompt a task's row gives whole: its ``prompt`` column as chat messages (a string is
    one user message), or ``None`` — the row has no ``prompt``, or it is Search-R1/verl data (a
    ``data_source`` or ``reward_model`` column, or a task with a ``data_source``), whose question
    is taken from the prompt's last ``Question:`` instead (:mod:`treegrpo.tasks.datafile`)."""
    prompt = task.meta.get("prompt")
    if prompt is None or task.data_source or any(c in task.meta for c in SEARCH_R1_COLUMNS):
        return None
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list | tuple) and prompt and all(isinstance(m, Mapping) for m in prompt):
        return [dict(m) for m in prompt]
    return None


@dataclass
class TrainerState:
    """A reward function's ``trainer_state`` (the names of transformers' ``TrainerState``).

    Attributes:
        global_step: optimizer steps done (0 while the first step's rollouts are scored).
        epoch: training prompts drawn so far over the number of training prompts.
        max_steps: the run's steps.
    """

    global_step: int = 0
    epoch: float = 0.0
    max_steps: int = 0


class RewardLog:
    """Where reward functions' ``log_metric(name, value)`` and ``log_extra(name, values)`` go (safe
    from several threads); the trainer writes :meth:`drain` into the step's row of ``metrics.jsonl``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._metrics: dict[str, list[float]] = {}
        self._extras: dict[str, list[Any]] = {}

    def log_metric(self, name: str, value: float) -> None:
        """One value of the metric ``name`` (a step logs the mean of its values)."""
        v = reward_value(value, f"log_metric({name!r})")
        with self._lock:
            self._metrics.setdefault(str(name), []).append(0.0 if v is None else v)

    def log_extra(self, name: str, values: Sequence[Any]) -> None:
        """Values (one per completion, say) logged under ``name`` as a list, in call order."""
        with self._lock:
            self._extras.setdefault(str(name), []).extend(list(values))

    def drain(self, prefix: str = "") -> dict[str, Any]:
        """What was logged since the last drain (metrics as their mean, extras as lists), each
        name under ``prefix``; the log is then empty."""
        with self._lock:
            metrics, extras = self._metrics, self._extras
            self._metrics, self._extras = {}, {}
        out: dict[str, Any] = {f"{prefix}{k}": sum(v) / len(v) for k, v in metrics.items() if v}
        out.update({f"{prefix}{k}": v for k, v in extras.items()})
        return out


def reward_set_of(env: Any) -> RewardSet | None:
    """The reward functions ``env`` scores with (a :class:`RewardSet` in its ``rewards``), or ``None``."""
    rewards = getattr(env, "rewards", None)
    return rewards if isinstance(rewards, RewardSet) else None


def final_text(completion: Any) -> str:
    """The final answer text of a completion (the last message's ``content``; a string as it is)."""
    if isinstance(completion, str):
        return completion
    if not completion:
        return ""
    content = completion[-1].get("content") if isinstance(completion[-1], Mapping) else None
    return content if isinstance(content, str) else ""


def exact_match(completions: Sequence[Any], answers: Sequence[Sequence[str]], **kwargs: Any) -> list[float]:
    """1.0 when the final answer equals a gold answer after SQuAD normalization, else 0.0."""
    return [em(final_text(c), a) for c, a in zip(completions, answers, strict=True)]


def substring_match(completions: Sequence[Any], answers: Sequence[Sequence[str]], **kwargs: Any) -> list[float]:
    """1.0 when a normalized gold answer is inside the normalized final answer (Search-R1's sub-EM)."""
    return [sub_em(final_text(c), a) for c, a in zip(completions, answers, strict=True)]


def token_f1(completions: Sequence[Any], answers: Sequence[Sequence[str]], **kwargs: Any) -> list[float]:
    """The best token-level F1 of the final answer against the gold answers."""
    return [f1(final_text(c), a) for c, a in zip(completions, answers, strict=True)]


exact_match.binary = True  # type: ignore[attr-defined]  # rewards in {0, 1}: "held-out success"
substring_match.binary = True  # type: ignore[attr-defined]

#: Built-in reward functions by the names ``--reward`` takes.
BUILTIN_REWARDS: dict[str, Callable[..., list[float]]] = {"em": exact_match, "sub_em": substring_match, "f1": token_f1}


def resolve_reward(spec: str | Callable[..., Any]) -> tuple[str, Callable[..., Any]]:
    """A reward function and the name it is logged (and recorded) under: a built-in name, a
    ``package.module:function`` reference, or a callable."""
    if callable(spec):
        return getattr(spec, "__name__", type(spec).__name__), spec
    if spec in BUILTIN_REWARDS:
        return spec, BUILTIN_REWARDS[spec]
    if ":" not in spec:
        raise ConfigError(
            f"reward {spec!r}: not a built-in reward ({', '.join(BUILTIN_REWARDS)}) nor a package.module:function"
        )
    fn = import_object(spec, "reward")
    if not callable(fn):
        raise ConfigError(f"reward {spec!r} is not callable")
    return spec.rpartition(":")[2], fn


def reward_ref(spec: str | Callable[..., Any]) -> str:
    """How ``config.json`` records a reward: its name or reference as given, a callable by
    ``module:qualname``."""
    return spec if isinstance(spec, str) else object_ref(spec)


def _accepts(fn: Callable[..., Any]) -> set[str] | None:
    """The keyword names ``fn`` takes (``None``: any, it has ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


@dataclass
class RewardSet:
    """Named reward functions and their weights; :meth:`score` gives each completion its weighted
    sum and the value of every function."""

    names: list[str]
    funcs: list[Callable[..., Any]]
    weights: list[float]
    state: TrainerState = field(default_factory=TrainerState)
    """The ``trainer_state`` reward functions get (the trainer advances it)."""
    log: RewardLog = field(default_factory=RewardLog)
    """Where their ``log_metric`` / ``log_extra`` go."""

    @classmethod
    def of(
        cls, specs: Sequence[str | Callable[..., Any]] | str | Callable[..., Any], weights: Sequence[float] | None = None
    ) -> RewardSet:
        if isinstance(specs, str) or callable(specs):
            specs = [specs]
        if not specs:
            raise ConfigError("no reward function: pass reward_funcs (a function, a built-in name such as em, or several)")
        resolved = [resolve_reward(s) for s in specs]
        names = [n for n, _ in resolved]
        for n in names:
            if names.count(n) > 1:
                raise ConfigError(f"two reward functions are named {n}: names must be unique (they are logged by name)")
        if weights is None:
            weights = [1.0] * len(specs)
        if len(weights) != len(specs):
            raise ConfigError(f"reward_weights has {len(weights)} values for {len(specs)} reward functions")
        return cls(names, [f for _, f in resolved], [float(w) for w in weights])

    def advance(self, global_step: int, epoch: float, max_steps: int | None = None) -> None:
        """Set what the functions' ``trainer_state`` says (the trainer calls it before each step's rollout)."""
        self.state.global_step, self.state.epoch = int(global_step), float(epoch)
        if max_steps is not None:
            self.state.max_steps = int(max_steps)

    def wants(self, arg: str) -> bool:
        """Whether some function may read the argument ``arg`` (it names it, or takes ``**kwargs``)."""
        return any(accepted is None or arg in accepted for accepted in map(_accepts, self.funcs))

    @property
    def binary(self) -> bool:
        """The total is 0/1: a single reward function marked ``binary`` (em, sub_em) with weight 1."""
        return len(self.funcs) == 1 and self.weights[0] == 1.0 and bool(getattr(self.funcs[0], "binary", False))

    def kwargs(
        self,
        tasks: Sequence[Task],
        prompts: Sequence[Any],
        completions: Sequence[Any],
        completion_ids: Sequence[Sequence[int] | None] | None = None,
        environments: Sequence[Any] | None = None,
    ) -> dict[str, Any]:
        """Every argument a reward function may name (module docstring), one value per completion."""
        n = len(completions)
        given = [given_prompt(t) for t in tasks]
        return {
            **_columns(tasks),
            "prompts": [g if g is not None else p for g, p in zip(given, prompts, strict=True)],
            "completions": list(completions),
            "completion_ids": [list(c) if c is not None else None for c in completion_ids] if completion_ids else [None] * n,
            "trainer_state": self.state,
            "log_metric": self.log.log_metric,
            "log_extra": self.log.log_extra,
            "environments": list(environments) if environments is not None else [None] * n,
        }

    def score(
        self,
        tasks: Sequence[Task],
        prompts: Sequence[Any],
        completions: Sequence[Any],
        completion_ids: Sequence[Sequence[int] | None] | None = None,
        environments: Sequence[Any] | None = None,
    ) -> list[tuple[float, dict[str, float]]]:
        """Each completion's weighted reward and per-function values (``None`` values left out).

        Raises:
            ConfigError: a function raised, returned the wrong number of values or a non-number,
                or no function scored a completion (one line naming the function and the row).
        """
        n = len(completions)
        every = self.kwargs(tasks, prompts, completions, completion_ids, environments)
        per_fn: list[list[float | None]] = []
        for name, fn in zip(self.names, self.funcs, strict=True):
            kwargs = dict(every)
            accepted = _accepts(fn)
            if accepted is not None:
                kwargs = {k: v for k, v in kwargs.items() if k in accepted}
            per_fn.append(self._call(name, fn, kwargs, tasks, n))
        out = []
        for i, task in enumerate(tasks):
            values = {nm: v[i] for nm, v in zip(self.names, per_fn, strict=True) if v[i] is not None}
            if not values:
                raise ConfigError(f"no reward function scored row {task.id}: at least one must return a number, not None")
            total = sum(w * values[nm] for nm, w in zip(self.names, self.weights, strict=True) if nm in values)
            out.append((float(total), {nm: float(v) for nm, v in values.items()}))
        return out

    def _call(
        self, name: str, fn: Callable[..., Any], kwargs: dict[str, Any], tasks: Sequence[Task], n: int
    ) -> list[float | None]:
        try:
            values = aio.resolve(fn(**kwargs))
        except Exception as e:
            row = _failing_row(fn, kwargs, tasks)
            where = f" on row {row}" if row is not None else ""
            raise ConfigError(f"reward function {name} failed{where}: {type(e).__name__}: {e}") from None
        try:
            values = list(values)
        except TypeError:
            raise ConfigError(
                f"reward function {name} returned {type(values).__name__}: it must return a list of {n} numbers"
            ) from None
        if len(values) != n:
            raise ConfigError(f"reward function {name} returned {len(values)} values for {n} completions")
        return [reward_value(v, f"reward function {name}", task.id) for v, task in zip(values, tasks, strict=True)]


def reward_value(value: Any, who: str, row: str | None = None) -> float | None:
    """One reward as a float (``None`` stays ``None``: the reward does not apply): a Python,
    numpy or torch number — a 0-d array or tensor, or a one-element one — or a bool (``True`` is
    1.0, as TRL sums them).

    Raises:
        ConfigError: ``who`` returned anything else, or a number that is not finite (one line,
            naming ``who`` and the row).
    """
    if value is None:
        return None
    v = value
    item = getattr(v, "item", None)
    if callable(item) and _one_element(v):  # numpy / torch scalars, 0-d and one-element arrays
        v = item()
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, int | float) and math.isfinite(float(v)):
        return float(v)
    where = f" for row {row}" if row is not None else ""
    raise ConfigError(f"{who} returned {value!r}{where}: a reward is a finite number (or None: does not apply)")


def _one_element(v: Any) -> bool:
    numel = getattr(v, "numel", None)
    if callable(numel):
        try:
            return int(numel()) == 1
        except (TypeError, ValueError):
            return False
    size = getattr(v, "size", None)
    return isinstance(size, int) and size == 1


def _columns(tasks: Sequence[Task]) -> dict[str, list[Any]]:
    """The dataset columns of ``tasks`` as keyword lists (``answers`` always, normalized)."""
    keys: list[str] = []
    for t in tasks:
        keys.extend(k for k in t.meta if k not in keys and k not in LIBRARY_ARGS)
    cols = {k: [t.meta.get(k) for t in tasks] for k in keys}
    cols["answers"] = [list(t.answers) for t in tasks]
    return cols


def _failing_row(fn: Callable[..., Any], kwargs: dict[str, Any], tasks: Sequence[Task]) -> str | None:
    """The id of the first row on which ``fn`` fails alone (``None``: it fails on none alone)."""
    for i, task in enumerate(tasks):
        one = {k: [v[i]] if isinstance(v, list) else v for k, v in kwargs.items()}
        try:
            aio.resolve(fn(**one))
        except Exception:
            return task.id
    return None


__all__ = [
    "BUILTIN_REWARDS",
    "LIBRARY_ARGS",
    "RewardLog",
    "RewardSet",
    "TrainerState",
    "exact_match",
    "final_text",
    "given_prompt",
    "resolve_reward",
    "reward_ref",
    "reward_set_of",
    "reward_value",
    "substring_match",
    "token_f1",
]
