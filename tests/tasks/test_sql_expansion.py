"""The prepare-time bound (treegrpo.tasks.sql.expansion) on hand-derived values: tokens as SQLite
splits them, subquery regions, WITH references, and the product the flattener can build."""

from __future__ import annotations

import pytest

from treegrpo.tasks.sql.expansion import expansion_bound


@pytest.mark.parametrize(
    ("sql", "bound"),
    [
        # 8 tokens, no subquery: 8 * (1 + 0)
        ("SELECT balance FROM accounts WHERE name = 'ann'", 8),
        # the root region SELECT x FROM (3) over a subquery of 4 tokens: 3 * (1 + 4) + 4
        ("SELECT x FROM (SELECT 1 AS x)", 19),
        # root WITH t AS SELECT x FROM t , t (9); the body (4) is below it once as a subquery and once
        # per reference: 9 * (1 + 4) + 3 * 4
        ("WITH t AS (SELECT 1 AS x) SELECT x FROM t, t", 57),
        # the body SELECT 1 UNION ALL SELECT i + 1 FROM r (10) reads itself: 1; so 10 * (1 + 1) + 1 = 21;
        # root WITH RECURSIVE r i AS SELECT i FROM r (9, the column list is no subquery): 9 * 22 + 2 * 21
        ("WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i+1 FROM r) SELECT i FROM r", 240),
        # names in any quoting, case-insensitive; comments are no tokens: the third case again
        ('WITH "T" AS (SELECT 1 AS x) SELECT x FROM [t] /* t, t */ -- t, t\n, `T`', 57),
        # parentheses that are no subquery add their tokens, no product: SELECT abs abs abs 1
        ("SELECT abs(abs(abs(1)))", 5),
        # a name defined twice: a reference counts the larger body. Bodies SELECT 1 (2) and SELECT 1 , 2
        # (4); the inner subquery WITH t AS SELECT 1 (5) over its body: 5 * (1 + 4) + 4 = 29; the root
        # WITH t AS SELECT * FROM t , (8) over [2, 29, t: max(2, 4)]: 8 * (1 + 29) + 35
        ("WITH t AS (SELECT 1) SELECT * FROM t, (WITH t AS (SELECT 1, 2) SELECT 1)", 275),
    ],
)
def test_bound_on_hand_derived_values(sql: str, bound: int) -> None:
    assert expansion_bound(sql) == bound


def test_unbalanced_parentheses_do_not_fail() -> None:
    assert expansion_bound("SELECT ((1") == 2 and expansion_bound("SELECT 1))") == 2
    assert expansion_bound("SELECT '(', \")\", [(], `)`") == 8  # quoted parentheses are tokens


def test_nesting_multiplies() -> None:
    """A FROM subquery whose column is read k times a level: the bound grows by the level's token
    count each level (what the flattener can copy); a linear chain of WITH tables likewise."""
    sql = "SELECT 1 AS a"
    bounds = []
    for _ in range(4):
        sql = f"SELECT a+a AS a FROM ({sql})"
        bounds.append(expansion_bound(sql))
    # a level's region: SELECT a + a AS a FROM = 7 tokens; b' = 7 * (1 + b) + b, from b = 4
    assert bounds == [39, 319, 2559, 20479]
