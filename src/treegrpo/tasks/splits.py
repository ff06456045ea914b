"""The splits of a generated task family's problems (``warmup`` demonstrations, ``train`` for RL,
``eval`` held out), the problem set that holds them with the config they were drawn from, and that
config's record (a dict in the bootstrap's record, read back)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Generic, Literal, Self, TypeVar

from treegrpo.envs.base import Task

Split = Literal["warmup", "train", "eval"]
SPLITS: tuple[Split, ...] = ("warmup", "train", "eval")
C = TypeVar("C")


class RecordedConfig:
    """A family's config dataclass as a bootstrap records it (:meth:`to_dict`, JSON-ready) and
    reads it back (:meth:`from_dict`: keys it does not know dropped, lists back to tuples where the
    field's default is a tuple)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Self:
        tuples = {f.name for f in fields(cls) if isinstance(f.default, tuple)}  # type: ignore[arg-type]
        known = cls.__dataclass_fields__  # type: ignore[attr-defined]
        return cls(**{k: tuple(v) if k in tuples else v for k, v in d.items() if k in known})


@dataclass
class ProblemSet(Generic[C]):
    """The problems drawn from a config ``cfg``, one list of tasks per split."""

    cfg: C
    splits: dict[str, list[Task]]

    def tasks(self, split: Split) -> list[Task]:
        if split not in self.splits:
            raise ValueError(f"unknown split {split!r}; choose one of {list(SPLITS)}")
        return self.splits[split]
