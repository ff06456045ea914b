"""A bound on what SQLite builds when it *prepares* a statement: work that no VM-step limit sees.

SQLite expands a statement before it runs a single VM instruction, and two of its expansions copy
trees: every reference to a ``WITH`` table gets its own copy of the table's body (materialized or
not), and the query flattener replaces each reference to a column of a ``FROM`` subquery with a
copy of that column's expression. Nested, either one multiplies: measured with SQLite 3.40 on
this machine, ``WITH a0 AS (SELECT 1 x), a1 AS (SELECT x FROM a0 UNION ALL SELECT x FROM a0),
…`` took 5.7 s to prepare at 19 levels (1,065 bytes; each further level doubles it), and seven
nested ``SELECT a+a+a+a+a+a+a+a AS a FROM (…)`` (258 bytes) 12 s, eight 101 s. Neither the
progress handler nor ``interrupt()`` stops the flattener, so the sandbox refuses such a statement
before SQLite sees it.

:func:`expansion_bound` reads the statement's tokens as SQLite's tokenizer splits them (comments,
strings, the four identifier quotings) and its parenthesised groups. A *subquery* is a group that
starts with ``SELECT``, ``VALUES`` or ``WITH``, or the body of a ``WITH`` table (``name [(columns)]
AS [NOT] [MATERIALIZED] (body)``); its *region* is its own tokens and those of the groups inside it
that are not subqueries. The bound of a subquery is::

    bound(s) = tokens(region) * (1 + max(bound(q) for q in below(s)))  +  sum(bound(q) for q in below(s))

where ``below(s)`` lists the subqueries directly in the region and, for every reference to a
``WITH`` table, that table's body (once per reference).

A reference is any token of the region that names a ``WITH`` table (a name defined twice counts
its larger body; a reference back into a body still being expanded — a recursive table — counts
1). The sum is the subqueries' own trees and the body copies; the product is the flattener: each
token of the region is at most one column reference, replaced by at most one copy of an expression
of a subquery below it (a compound subquery instead copies the region once per arm: no more terms
than its own size). So the number of expression and ``FROM`` terms SQLite builds is at most the
bound of the whole statement (the root region). The bound is loose — a chain of ``WITH`` tables
that each read the previous one grows it by about the token count of a body per level — but a
statement with a few levels of nesting stays far below the sandbox's cap
(``SqlLimits.max_terms``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_TOKEN = re.compile(
    r"""(?P<space>[ \t\n\f\r\v]+)
      | (?P<comment>--[^\n]*|/\*.*?(?:\*/|\Z))
      | (?P<quoted>'(?:[^']|'')*'?|"(?:[^"]|"")*"?|`(?:[^`]|``)*`?|\[[^\]]*\]?)
      | (?P<word>[A-Za-z0-9_$\u0080-\U0010FFFF]+)
      | (?P<open>\()
      | (?P<close>\))
      | (?P<other>.)""",
    re.VERBOSE | re.DOTALL,
)
_SUBQUERY_START = frozenset({"select", "values", "with"})


@dataclass
class _Group:
    """A parenthesised group: its own items in order — a token's name (``str``: a word or a quoted
    name, lower-cased and unquoted; ``""`` for any other token) or a child group's index (``int``)."""

    parent: int
    items: list[str | int] = field(default_factory=list)


def _name(kind: str, text: str) -> str:
    if kind == "word":
        return text.lower()
    if kind == "quoted":
        q = text[0]
        end = "]" if q == "[" else q
        body = text[1:-1] if len(text) > 1 and text.endswith(end) else text[1:]
        return (body if q == "[" else body.replace(q + q, q)).lower()
    return ""


def _groups(sql: str) -> list[_Group]:
    groups = [_Group(parent=-1)]
    cur = 0
    for m in _TOKEN.finditer(sql):
        kind = m.lastgroup or "other"
        if kind in ("space", "comment"):
            continue
        if kind == "open":
            groups.append(_Group(parent=cur))
            groups[cur].items.append(len(groups) - 1)
            cur = len(groups) - 1
        elif kind == "close":
            if cur:  # an unmatched ')' is SQLite's error to report
                cur = groups[cur].parent
        else:
            groups[cur].items.append(_name(kind, m.group()))
    return groups


def _definitions(groups: list[_Group]) -> tuple[dict[str, list[int]], set[tuple[int, int]]]:
    """The ``WITH`` tables: name -> body groups, and the (group, item) places of their names."""
    defs: dict[str, list[int]] = {}
    places: set[tuple[int, int]] = set()
    for g, group in enumerate(groups):
        items = group.items
        for i, item in enumerate(items):
            if not isinstance(item, str) or not item:
                continue
            j = i + 1
            if j < len(items) and isinstance(items[j], int):  # the column list
                j += 1
            if j >= len(items) or items[j] != "as":
                continue
            j += 1
            for word in ("not", "materialized"):
                if j < len(items) and items[j] == word:
                    j += 1
            if j < len(items) and isinstance(items[j], int):
                defs.setdefault(item, []).append(items[j])
                places.add((g, i))
    return defs, places


def expansion_bound(sql: str) -> int:
    """An upper bound on the expression and ``FROM`` terms SQLite builds preparing ``sql`` (module
    docstring)."""
    groups = _groups(sql)
    defs, places = _definitions(groups)
    bodies = {b for bs in defs.values() for b in bs}

    def is_subquery(g: int) -> bool:
        items = groups[g].items
        return g == 0 or g in bodies or (bool(items) and items[0] in _SUBQUERY_START)

    # each subquery's region: its token count, the subqueries in it, the WITH tables it names
    region: dict[int, tuple[int, list[int], list[str]]] = {}
    for s in (g for g in range(len(groups)) if is_subquery(g)):
        n, subs, refs, todo = 0, [], [], [s]
        while todo:
            g = todo.pop()
            for i, item in enumerate(groups[g].items):
                if isinstance(item, int):
                    (subs if is_subquery(item) else todo).append(item)
                else:
                    n += 1
                    if item in defs and (g, i) not in places:
                        refs.append(item)
        region[s] = (max(n, 1), subs, refs)

    bound: dict[int, int] = {}
    open_: set[int] = set()
    stack: list[tuple[int, bool]] = [(0, False)]
    while stack:
        s, ready = stack.pop()
        n, subs, refs = region[s]
        if ready:
            # a body still open is a recursive reference: it counts 1
            below = [bound[q] for q in subs] + [max(bound.get(b, 1) for b in defs[r]) for r in refs]
            bound[s] = n * (1 + max(below, default=0)) + sum(below)
            open_.discard(s)
            continue
        if s in bound or s in open_:
            continue
        open_.add(s)
        stack.append((s, True))
        stack.extend((d, False) for d in [*subs, *(b for r in refs for b in defs[r])] if d not in bound)
    return bound[0]


__all__ = ["expansion_bound"]
