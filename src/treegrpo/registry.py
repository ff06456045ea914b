"""The name -> implementation tables behind every ``register_*`` / ``get_*`` pair (KL estimators,
policy losses, advantage estimators, samplers): one way to add a name and to look one up."""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import TypeVar

T = TypeVar("T")


def add(table: MutableMapping[str, T], name: str, value: T, what: str) -> None:
    """Put ``value`` under ``name``; ValueError when ``name`` is already taken (``what``: the kind of
    thing, for the message)."""
    if name in table:
        raise ValueError(f"{what} {name!r} is already registered")
    table[name] = value


def lookup(table: Mapping[str, T], name: str, what: str) -> T:
    """The value under ``name``; ValueError naming the known ones otherwise."""
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"unknown {what} {name!r}; known: {', '.join(sorted(table))}") from None
