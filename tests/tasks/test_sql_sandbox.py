"""The SQL sandbox's time bound (treegrpo.tasks.sql.tool, .guard, .expansion): no statement runs long,
the size producing functions, the pattern matchers and what SQLite builds at prepare time included;
printf's ``%c`` repeat loop (one VM instruction that neither the step limit nor the wall clock could
stop) is cut short; the guarded printf gives SQLite's results.

The bound checked: with ``wall_s`` = 0.3 s, every generated statement takes at most ``wall_s + 0.5``
s of this thread's CPU time (CPU time, so a loaded machine does not fail it; the wall clock can only
stop a statement sooner). The 0.5 s is one loop iteration of the worst statement: the progress
handler runs between VM instructions, and one row of a statement can hold ~150 pattern matches
(``max_sql`` / 12 bytes each), each at most ``max_length`` x ``max_pattern`` character steps:
measured up to 0.3 s of CPU on the 2-core development machine (``GLOB '*[a][a]…b'`` on 9,800
characters), every other generated statement under 0.2 s. Before these limits, one
``printf('%.*c', 2**31 - 1, 'x')`` took 3 s of CPU, issue 34's statement (``ISSUE_LIKE``: 1,000 rows,
three 5,001-byte ``LIKE`` patterns a row) 12 s, and a 258-byte nest of subqueries 12 s to prepare
(``_flatten_bomb(7, 8)``; one level more: 101 s)."""

from __future__ import annotations

import sqlite3
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from treegrpo.tasks.sql.env import SqlEnv
from treegrpo.tasks.sql.guard import char_repeats
from treegrpo.tasks.sql.problems import SqlConfig, build_problems
from treegrpo.tasks.sql.tool import SqlDb, SqlLimits

SCRIPT = (
    "CREATE TABLE accounts(name TEXT, balance INTEGER); INSERT INTO accounts VALUES ('ann', 10), ('bo', 20);"
)
WALL_S = 0.3
BOUND_S = WALL_S + 0.5


def _timed(db: SqlDb, sql: str) -> tuple[str, bool, float]:
    t = time.thread_time()
    text, ok = db.run(sql)
    return text, ok, time.thread_time() - t


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT printf('%.*c', 1000000000, 'x')",
        "SELECT format('%.*c', 2147483647, 'x')",
        "SELECT printf('%.1000000000c', 'x')",
        "SELECT printf('%-*.*c', 5, '2147483647', 'x')",  # the count as text
        "SELECT printf('%.*c', 5294967296, 'x')",  # 2**32 + 10**9: 10**9 as a 32-bit int
        "SELECT printf('%.*c', -2147483647, 'x')",  # a negative count is its magnitude
        "SELECT length(printf('%s%.*c%.*c', 'a', 2147483647, 'x', 2147483647, 'y'))",
    ],
)
def test_printf_char_repeat_is_cut_short(sql: str) -> None:
    db = SqlDb(SqlLimits(), script=SCRIPT)
    text, ok, cpu = _timed(db, sql)
    assert (text, ok) == ("NULL", True)  # SQLite's own result for a value past the limit
    assert cpu < 0.1, f"{sql} took {cpu:.2f} s of CPU"


def test_a_blocked_statement_is_an_observation() -> None:
    env = SqlEnv(limits=SqlLimits(wall_s=WALL_S))
    task = build_problems(SqlConfig(n_warmup=2, n_train=2, n_eval=2)).tasks("train")[0]
    db = env.initial_state(task)
    steps = ["<sql>SELECT printf('%.*c', 2147483647, 'x')</sql>", "<sql>SELECT zeroblob(1000000000)</sql>"]
    outs = env.step([task, task], steps, [True, True], states=[db, db])
    assert [(o.kind, o.done, o.observation) for o in outs] == [
        ("sql", False, "<result>NULL</result>"),
        ("sql", False, "<result>error: string or blob too big</result>"),
    ]
    env.close_state(db)


def test_char_repeats_reads_the_format_as_sqlite_does() -> None:
    assert char_repeats(b"%.*c %5.3c %*.*c %%%.7c") == [(True, 0), (False, 3), (True, 4), (False, 7)]
    assert char_repeats(b"%d %s %.*c") == [(True, 2)]  # each conversion before it reads one argument
    assert char_repeats(b"%n%.*c") == [(True, 0)]  # %n reads none
    assert char_repeats(b"%c %-c %5c") == []  # no precision: one character
    assert char_repeats(b"%.c %.0c") == [(False, 0), (False, 0)]
    assert char_repeats(b"%.4294967301c %.2147483648c") == [
        (False, 5),
        (False, 0),
    ]  # 32-bit unsigned, low 31 bits
    assert char_repeats(b"%lld%.*llc") == [(True, 1)] and char_repeats(b"%ll.*c") == []  # 'l' goes last
    assert char_repeats(b"%y %.*c") == [] and char_repeats(b"%T%.9c") == []  # SQLite stops at these
    assert char_repeats(b"%5*d%.9c") == []  # '*' after a width is no conversion: stop
    assert char_repeats(b"%.5c\0%.6c") == [(False, 5)]  # a C string
    assert char_repeats(b"100%") == [] and char_repeats(b"%-0+ #!,.3c") == [(False, 3)]


# -- the guarded printf gives the built-in's results ----------------------------------------------
SPEC = st.builds(
    lambda flags, width, prec, length, conv: f"%{flags}{width}{prec}{length}{conv}",
    st.text(alphabet="-+ #!0,", max_size=3),
    st.sampled_from(["", "*", "7", "12"]),
    st.sampled_from(["", ".", ".*", ".3", ".0", ".4294967301"]),
    st.sampled_from(["", "l", "ll"]),
    st.sampled_from([*"cdsqQwzfgeExXoiunp%rTy.*", "é"]),
)
FORMAT = st.lists(st.one_of(SPEC, st.sampled_from(["", "a", " | ", "é"])), min_size=1, max_size=6).map(
    "".join
)
NUMBERS = [0, 1, 5, 9999, 10_000, 10_001, 10**6, 2**32 + 3, -(2**32) + 7, -5, -(2**31), 2**63 - 1, -(2**63)]
OTHERS = [1.9, -2.5, 1e300, "12", "12abc", " -7", "x", "", "é", "%", b"7", b"\x00ab", None]
ARG = st.sampled_from([*NUMBERS, *OTHERS])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    fmt=FORMAT, args=st.lists(ARG, max_size=6), name=st.sampled_from(["printf", "format"]), blob=st.booleans()
)
def test_guarded_printf_gives_the_builtins_result(
    fmt: str, args: list[object], name: str, blob: bool
) -> None:
    limit = 10_000
    db = SqlDb(SqlLimits(max_length=limit))
    plain = sqlite3.connect(":memory:")
    plain.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, limit)
    params = (fmt.encode() if blob else fmt, *args)
    sql = f"SELECT {name}({', '.join('?' * len(params))})"
    assert _outcome(db.conn, sql, params) == _outcome(plain, sql, params)


def _outcome(conn: sqlite3.Connection, sql: str, params: tuple[object, ...]) -> object:
    """The row, or the error's class: a result that is not valid UTF-8 (a precision that cuts a
    character, ``'%.1s'`` of ``'é'``) cannot be read by Python's sqlite3 from the built-in either."""
    try:
        return conn.execute(sql, params).fetchone()
    except sqlite3.OperationalError as e:
        return type(e)


def test_a_result_cut_inside_a_character_is_an_error_on_both_sides() -> None:
    params = ("%.*c%*c%.*s", 0, 0, 0, 0, 1, "é")  # found by hypothesis: '%.1s' keeps half of 'é'
    db = SqlDb(SqlLimits(max_length=10_000))
    plain = sqlite3.connect(":memory:")
    sql = f"SELECT printf({', '.join('?' * len(params))})"
    assert _outcome(db.conn, sql, params) is _outcome(plain, sql, params) is sqlite3.OperationalError
    assert _outcome(plain, "SELECT printf('%.2s', 'é')", ()) == ("é",)  # a whole character reads back


# -- no statement runs long -----------------------------------------------------------------------
HUGE = st.sampled_from(
    [
        "1000000",
        "1000000000",
        "2147483647",
        "2147483648",
        "5294967296",
        "9223372036854775807",
        "-9223372036854775808",
    ]
) | st.sampled_from(["-1000000000", "'1000000000'", "1e300", "x'31303030303030303030'"])
BIG = st.sampled_from(
    [
        "hex(zeroblob(4500))",
        "replace(hex(zeroblob(4000)), '0', 'ab')",
        "printf('%.*c', 9000, 'a')",
        "zeroblob(9000)",
    ]
) | st.sampled_from(["'x'", "''", "NULL", "'%a_b'", "printf('%.*c', 900, '%')"])
CSPEC = st.builds(
    lambda flags, width, prec, conv: f"%{flags}{width}{prec}{conv}",
    st.sampled_from(["", "-", "0", "!", "#", ","]),
    st.sampled_from(["", "*", "1000000000"]),
    st.sampled_from(["", ".*", ".1000000000", ".4294967295"]),
    st.sampled_from(list("ccccdsqQwfgeExiu%n!")),
)


def _call(name: str, *args: str) -> str:
    return f"{name}({', '.join(args)})"


def _expr(big: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    """Calls of the size-producing functions on ``big`` values and ``HUGE`` counts."""
    return st.one_of(
        st.builds(
            lambda name, specs, args: _call(name, "'" + "".join(specs) + "'", *args),
            st.sampled_from(["printf", "format"]),
            st.lists(CSPEC, min_size=1, max_size=3),
            st.lists(st.one_of(HUGE, big), max_size=6),
        ),
        st.builds(
            lambda f, n: f.format(n),
            st.sampled_from(
                ["zeroblob({})", "randomblob({})", "char({})", "round(1.5, {})", "hex(zeroblob({}))"]
            ),
            HUGE,
        ),
        st.builds(lambda s, a, b: f"substr({s}, {a}, {b})", big, HUGE, HUGE),
        st.builds(lambda a, b, c: f"replace({a}, {b}, {c})", big, big, big),
        st.builds(lambda a, b, c: f"char({a}, {b}, {c})", HUGE, HUGE, HUGE),
        st.builds(
            lambda f, a, b: f"{f}({a}, {b})",
            st.sampled_from(["trim", "ltrim", "rtrim", "instr", "like", "glob"]),
            big,
            big,
        ),
        st.builds(
            lambda f, a: f"{f}({a})",
            st.sampled_from(["upper", "quote", "hex", "unicode", "json_quote", "soundex"]),
            big,
        ),
        st.builds(lambda a, b: f"json_array({a}, {b})", big, big),
        st.builds(lambda a, b: f"{a} || {b}", big, big),
        st.builds(lambda a: f"rtreenode(2, {a})", big),
    )


EXPR = _expr(BIG)
# in a recursive CTE: values that change with the row, so SQLite cannot compute a call once for all rows
ROW_EXPR = _expr(
    st.one_of(BIG, st.sampled_from(["(hex(zeroblob(4000)) || i)", "(i || printf('%.*c', 9000, 'a'))"]))
)


def _cte(row: str, limit: str) -> str:
    return f"WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r LIMIT {limit}) {row}"


STATEMENT = st.one_of(
    EXPR.map(lambda e: f"SELECT {e}"),
    EXPR.map(lambda e: f"SELECT length({e})"),
    st.builds(lambda e, n: _cte(f"SELECT group_concat({e} || i) FROM r", n), ROW_EXPR, HUGE),
    st.builds(
        lambda e, n: _cte(f"SELECT max(x) FROM (SELECT {e} || i AS x FROM r ORDER BY x)", n), ROW_EXPR, HUGE
    ),
    st.builds(lambda e, n: _cte(f"SELECT count(DISTINCT {e} || i) FROM r", n), ROW_EXPR, HUGE),
    st.builds(
        lambda e, n: (
            f"WITH RECURSIVE r(i, s) AS (SELECT 1, {e} UNION ALL SELECT i + 1, s || {e} FROM r WHERE i < {n}) "
            "SELECT count(*), max(length(s)) FROM r"
        ),
        ROW_EXPR,
        HUGE,
    ),
    EXPR.map(lambda e: f"UPDATE accounts SET name = {e}"),
)


def _within_bound(sql: str) -> tuple[str, bool]:
    """Run ``sql`` in a fresh sandbox (``wall_s`` = WALL_S); it must end within BOUND_S of CPU."""
    db = SqlDb(SqlLimits(wall_s=WALL_S), script=SCRIPT)
    text, ok, cpu = _timed(db, sql)
    db.close()
    assert isinstance(text, str) and isinstance(ok, bool)
    assert cpu <= BOUND_S, f"{sql} took {cpu:.2f} s of CPU (bound {BOUND_S} s)"
    return text, ok


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sql=STATEMENT)
def test_no_statement_runs_longer_than_the_bound(sql: str) -> None:
    _within_bound(sql)


# -- pattern matching and prepare-time expansion --------------------------------------------------
P5K = "'%'||printf('%.*c',4999,'a')||'b'"
ISSUE_LIKE = (  # issue 34's statement: 1,000 rows, three 5,001-byte LIKE patterns a row; 12 s of CPU here
    "WITH RECURSIVE r(i,s) AS (SELECT 1,printf('%.*c',9990,'a') UNION ALL SELECT i+1,s FROM r LIMIT 1000) "
    f"SELECT count(*) FROM r WHERE s LIKE {P5K} OR s LIKE {P5K} OR s LIKE {P5K}"
)


def _flatten_bomb(depth: int, refs: int) -> str:
    """Nested FROM subqueries whose column is read ``refs`` times a level: the query flattener copies
    the inner expression into each reference (8 refs x 7 levels: 12 s to prepare, 8 levels 101 s)."""
    sql = "SELECT 1 AS a"
    for _ in range(depth):
        sql = f"SELECT {'+'.join(['a'] * refs)} AS a FROM ({sql})"
    return sql


def _cte_bomb(depth: int, refs: int = 2, hint: str = "") -> str:
    """A chain of WITH tables, each reading the one before ``refs`` times: SQLite copies a table's body
    into every reference at prepare time (2 refs x 19 levels: 5.7 s, each level doubling)."""
    body = " UNION ALL ".join(["SELECT x FROM a{}"] * refs)
    defs = "".join(f",a{k + 1} AS {hint}({body.format(*[k] * refs)})" for k in range(depth))
    return f"WITH a0 AS {hint}(SELECT 1 x){defs} SELECT count(*) FROM a{depth}"


@pytest.mark.parametrize(
    "sql",
    [
        ISSUE_LIKE,
        ISSUE_LIKE.replace("LIKE", "GLOB").replace("'%'", "'*'"),
        f"SELECT printf('%.*c', 9990, 'a') LIKE {P5K}",
        _flatten_bomb(8, 8),
        _flatten_bomb(12, 3),
        _cte_bomb(19),
        _cte_bomb(30, 2, "NOT MATERIALIZED "),
        _cte_bomb(25, 3, "MATERIALIZED "),
    ],
)
def test_the_long_statements_end_at_once_as_an_error(sql: str) -> None:
    db = SqlDb(SqlLimits(wall_s=WALL_S), script=SCRIPT)
    text, ok, cpu = _timed(db, sql)
    assert not ok and text.startswith("error: ")
    assert cpu < 0.05, f"{sql} took {cpu:.2f} s of CPU"


def test_a_long_pattern_or_a_bomb_is_an_observation() -> None:
    env = SqlEnv(limits=SqlLimits(wall_s=WALL_S))
    task = build_problems(SqlConfig(n_warmup=2, n_train=2, n_eval=2)).tasks("train")[0]
    db = env.initial_state(task)
    steps = [f"<sql>{ISSUE_LIKE}</sql>", f"<sql>{_cte_bomb(19)}</sql>", "<sql>SELECT 'ann' LIKE 'a%'</sql>"]
    outs = env.step([task] * 3, steps, [True] * 3, states=[db] * 3)
    assert [(o.kind, o.done, o.observation) for o in outs] == [
        ("sql", False, "<result>error: LIKE or GLOB pattern too complex</result>"),
        ("sql", False, "<result>error: statement too complex (nested subqueries or WITH tables)</result>"),
        ("sql", False, "<result>1</result>"),
    ]
    env.close_state(db)


# the generated pattern-matching and prepare-time shapes
LONG = st.sampled_from(
    [
        "s",  # the CTE's long value (below), a new row each time
        "(i || printf('%.*c', 9800, 'a'))",
        "printf('%.*c', 9800, 'a')",
        "hex(zeroblob(4900))",
        "printf('%.*c', 4900, 'é')",
    ]
)
PIECE = st.sampled_from(["%", "_", "a", "aa", "*", "?", "[a]", "[^b]", "[a-z]", "b", "\\%", "é"])
PATTERN = st.one_of(
    st.just("p"),  # the CTE's pattern column
    st.lists(PIECE, min_size=1, max_size=30).map(lambda ps: "'" + "".join(ps) + "'"),
    st.builds(
        lambda w, n, c, end: f"'{w}' || printf('%.*c', {n}, '{c}') || '{end}'",
        st.sampled_from(["%", "*", ""]),
        st.sampled_from([10, 47, 48, 49, 50, 4999, 9000]),
        st.sampled_from(["a", "%", "_", "*"]),
        st.sampled_from(["b", "%", "*", ""]),
    ),
    st.builds(
        lambda n, cls: f"'*' || replace(printf('%.*c', {n}, 'x'), 'x', '{cls}') || 'b'",
        st.sampled_from([5, 12, 16, 3000]),
        st.sampled_from(["[a]", "[^b]", "?*", "%a", "a_%"]),
    ),
)
MATCH = st.one_of(
    st.builds(
        lambda v, op, p: f"{v} {op} {p}",
        LONG,
        st.sampled_from(["LIKE", "GLOB", "NOT LIKE", "NOT GLOB"]),
        PATTERN,
    ),
    st.builds(lambda v, p: f"{v} LIKE {p} ESCAPE '\\'", LONG, PATTERN),
    st.builds(lambda f, v, p: f"{f}({p}, {v})", st.sampled_from(["like", "glob"]), LONG, PATTERN),
    st.builds(lambda v, p: f"instr({v}, {p})", LONG, st.one_of(PATTERN, LONG)),
    st.builds(lambda v, p, z: f"length(replace({v}, {p}, {z}))", LONG, st.one_of(PATTERN, LONG), LONG),
)


def _many(expr: str, sep: str, head: str, count: str) -> str:
    """``head`` + ``count`` copies of ``expr`` joined by ``sep`` ("fill": as many as fit in max_sql)."""
    if count != "fill":
        return head + sep.join([expr] * int(count))
    n = max(1, (SqlLimits().max_sql - len(head.encode())) // len((expr + sep).encode()))
    return head + sep.join([expr] * n)


MATCH_ROWS = "WITH RECURSIVE r(i, s, p) AS (SELECT 1, {v}, {p} UNION ALL SELECT i + 1, s, p FROM r LIMIT {n}) "
PATTERN_STATEMENT = st.one_of(
    st.builds(lambda e, k: _many(e, " + ", "SELECT ", k), MATCH, st.sampled_from(["1", "3", "fill"])),
    st.builds(
        lambda v, p, n, e, k, sep: _many(
            e, sep, MATCH_ROWS.format(v=v, p=p, n=n) + "SELECT count(*) FROM r WHERE ", k
        ),
        st.sampled_from(["printf('%.*c', 9800, 'a')", "hex(zeroblob(4900))", "'ann'"]),
        PATTERN.filter(lambda p: p != "p"),
        st.sampled_from(["1000", "1000000"]),
        MATCH,
        st.sampled_from(["1", "3", "fill"]),
        st.sampled_from([" OR ", " AND ", ") + ("]),
    ),
)
BOMB = st.one_of(
    st.builds(_flatten_bomb, st.integers(1, 15), st.integers(1, 12)),
    st.builds(
        _cte_bomb,
        st.integers(1, 36),
        st.integers(1, 4),
        st.sampled_from(["", "MATERIALIZED ", "NOT MATERIALIZED "]),
    ),
    st.builds(  # a WITH chain whose bodies nest subqueries
        lambda d, k: f"WITH a AS ({_flatten_bomb(d, k)}), b AS (SELECT a.a + a.a AS a FROM a, a AS c) "
        "SELECT count(*) FROM b, b AS c",
        st.integers(1, 8),
        st.integers(1, 8),
    ),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sql=st.one_of(PATTERN_STATEMENT, BOMB))
def test_no_pattern_match_or_prepare_runs_longer_than_the_bound(sql: str) -> None:
    _within_bound(sql)


WORST_ROWS = [  # one row of the most costly matches that fit: the loop iteration the bound allows for
    _many(
        expr,
        " OR ",
        MATCH_ROWS.format(v="printf('%.*c', 9800, 'a')", p=pattern, n=1000000)
        + "SELECT count(*) FROM r WHERE ",
        "fill",
    )
    for expr, pattern in [
        ("s GLOB p", "'*' || replace(printf('%.*c', 10, 'x'), 'x', '[a]') || 'b'"),
        ("s GLOB p", "'*' || replace(printf('%.*c', 5, 'x'), 'x', '[b-za]') || 'b'"),
        ("s LIKE p", "'%' || printf('%.*c', 30, 'a') || 'b'"),
    ]
]


@pytest.mark.parametrize("sql", WORST_ROWS)
def test_the_costliest_rows_end_within_the_bound(sql: str) -> None:
    assert _within_bound(sql) == ("error: statement stopped: step limit", False)
