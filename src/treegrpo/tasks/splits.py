"""The splits of a generated task family's problems (``warmup`` demonstrations, ``train`` for RL,
``eval`` held out) and the problem set that holds them with the config they were drawn from."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Generic, Literal, TypeVar

from treegrpo.envs.base import Task

Split = Literal["warmup", "train", "eval"]
SPLITS: tuple[Split, ...] = ("warmup", "train", "eval")
C = TypeVar("C")


def config_from_dict(cls: type[C], d: dict[str, Any]) -> C:
    """The config dataclass ``cls`` a recorded ``d`` (``asdict`` through JSON) describes: keys it
    does not know dropped, lists back to tuples where the field's default is a tuple."""
    tuples = {f.name for f in fields(cls) if isinstance(f.default, tuple)}  # type: ignore[arg-type]
    return cls(**{k: tuple(v) if k in tuples else v for k, v in d.items() if k in cls.__dataclass_fields__})  # type: ignore[attr-defined]


@dataclass
class ProblemSet(Generic[C]):
    """The problems drawn from a config ``cfg``, one list of tasks per split."""

    cfg: C
    splits: dict[str, list[Task]]

    def tasks(self, split: Split) -> list[Task]:
        if split not in self.splits:
            raise ValueError(f"unknown split {split!r}; choose one of {list(SPLITS)}")
        return self.splits[split]
