"""Reward functions with TRL's convention, and the weighted set a run scores trajectories with.

A reward function takes keyword arguments and returns one number (or ``None``: "does not apply")
per completion::

    def reward(prompts, completions, answers, **kwargs) -> list[float]:
        return [float(c[-1]["content"].strip() == a[0]) for c, a in zip(completions, answers)]

- ``prompts``: each question's prompt as chat messages (``[{"role": "user", "content": …}]``);
- ``completions``: each trajectory as chat messages after the prompt — assistant turns (with
  ``tool_calls``), tool results (role ``tool``); the last message is the final answer, its
  ``content`` the answer text alone (in the tag protocol: inside ``<answer>``, stripped);
- ``answers``: each question's gold answers (a list of strings, possibly empty);
- every other column of the question's dataset row, by its name (one value per completion).

A function need not take ``**kwargs``: it gets only the arguments it names. Several functions
are summed with ``reward_weights`` (default 1 each), each logged by name; ``None`` values are left
out of the sum (TRL's convention). The built-in rewards (:data:`BUILTIN_REWARDS`: ``em``,
``sub_em``, ``f1``) are functions of the same kind.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from treegrpo.envs.base import Task
from treegrpo.envs.rewards import em, f1, sub_em
from treegrpo.errors import ConfigError
from treegrpo.imports import import_object, object_ref

Message = dict[str, Any]


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

    @property
    def binary(self) -> bool:
        """The total is 0/1: a single reward function marked ``binary`` (em, sub_em) with weight 1."""
        return len(self.funcs) == 1 and self.weights[0] == 1.0 and bool(getattr(self.funcs[0], "binary", False))

    def score(
        self, tasks: Sequence[Task], prompts: Sequence[Any], completions: Sequence[Any]
    ) -> list[tuple[float, dict[str, float]]]:
        """Each completion's weighted reward and per-function values (``None`` values left out).

        Raises:
            ConfigError: a function raised, returned the wrong number of values or a non-number,
                or no function scored a completion (one line naming the function and the row).
        """
        n = len(completions)
        columns = _columns(tasks)
        per_fn: list[list[float | None]] = []
        for name, fn in zip(self.names, self.funcs, strict=True):
            kwargs = {"prompts": list(prompts), "completions": list(completions), **columns}
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
            values = fn(**kwargs)
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
        keys.extend(k for k in t.meta if k not in keys and k not in ("prompts", "completions"))
    cols = {k: [t.meta.get(k) for t in tasks] for k in keys}
    cols["answers"] = [list(t.answers) for t in tasks]
    return cols


def _failing_row(fn: Callable[..., Any], kwargs: dict[str, Any], tasks: Sequence[Task]) -> str | None:
    """The id of the first row on which ``fn`` fails alone (``None``: it fails on none alone)."""
    for i, task in enumerate(tasks):
        one = {k: [v[i]] for k, v in kwargs.items()}
        try:
            fn(**one)
        except Exception:
            return task.id
    return None


__all__ = [
    "BUILTIN_REWARDS",
    "RewardSet",
    "exact_match",
    "final_text",
    "resolve_reward",
    "reward_ref",
    "reward_value",
    "substring_match",
    "token_f1",
]
