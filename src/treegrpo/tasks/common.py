"""What the generated task families share below the bootstrap recipe: the splits they draw their
problems into — ``warmup`` (demonstrations for the supervised warm-up), ``train`` (RL) and
``eval`` (held out), disjoint —, the problem set that holds them (:class:`ProblemSet`), and the
record round trip of their settings dataclasses (:class:`Settings`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Generic, Literal, Self, TypeVar

from treegrpo.envs.base import Task

Split = Literal["warmup", "train", "eval"]
SPLITS: tuple[Split, ...] = ("warmup", "train", "eval")

C = TypeVar("C")


@dataclass
class ProblemSet(Generic[C]):
    """The problem set of a config ``cfg``: its tasks by split."""

    cfg: C
    splits: dict[str, list[Task]]

    def tasks(self, split: Split) -> list[Task]:
        """The tasks of ``split``, in a fixed order.

        Raises:
            ValueError: an unknown split (the message names the known ones).
        """
        if split not in self.splits:
            raise ValueError(f"unknown split {split!r}; choose one of {list(SPLITS)}")
        return self.splits[split]


class Settings:
    """A dataclass of settings written into a record as JSON and read back from it."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Self:
        """The settings a record holds: unknown keys ignored, missing ones at their defaults, a
        JSON list back to a tuple where the default is a tuple, a nested settings dict back to its
        class (a field whose ``default_factory`` has ``from_dict``)."""
        fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        kw = {k: v for k, v in d.items() if k in fields}
        for k, v in kw.items():
            f = fields[k]
            if isinstance(v, dict) and hasattr(f.default_factory, "from_dict"):
                kw[k] = f.default_factory.from_dict(v)  # type: ignore[union-attr]
            elif isinstance(v, list) and isinstance(f.default, tuple):
                kw[k] = tuple(v)
        return cls(**kw)


__all__ = ["SPLITS", "ProblemSet", "Settings", "Split"]
