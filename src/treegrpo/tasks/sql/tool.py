"""A sandboxed SQLite tool (stdlib ``sqlite3``): in-memory databases, one statement per call.

Every live database is a private in-memory connection in autocommit mode, so each statement is
atomic: a statement that fails or is stopped half-way (an error, the step limit) is rolled back
by SQLite and leaves nothing behind. The sandbox (:func:`sandbox`):

- an authorizer allows only ``SELECT`` / ``INSERT`` / ``UPDATE`` / ``DELETE`` (reads, writes,
  recursive CTEs and functions); everything else is denied — ``ATTACH``/``DETACH``, ``PRAGMA``,
  schema changes, transactions and savepoints — and so are the functions that reach outside the
  database or are not deterministic (``load_extension``, ``readfile``/``writefile``, ``random``,
  the date/time functions: replay must give the same answers) or that read the connection's
  history rather than the database (``changes``, ``total_changes``, ``last_insert_rowid``: a
  restored copy has another history); extension loading stays disabled;
- a statement limit counted in SQLite VM steps (a progress handler; deterministic, so a replay
  stops where the original stopped), with a wall-clock backstop checked at the same points;
- size limits: value and statement length (``setlimit``), ``LIKE``/``GLOB`` pattern length, VM
  program length, database pages (``max_page_count``), and the result text (``max_rows`` rows,
  ``max_chars`` characters). A function whose value would pass ``max_length`` fails at once
  (``string or blob too big``; ``printf`` gives NULL), and ``printf``/``format`` are guarded
  (:mod:`.guard`): SQLite's ``%c`` repeat loop is a piece of work inside a single VM instruction
  that the value limit does not bound;
- a bound on what SQLite builds *preparing* a statement, before any VM instruction runs
  (:mod:`.expansion`: every reference to a ``WITH`` table copies its body, the query flattener
  copies subquery expressions into each column reference; nested, either is exponential): a
  statement whose bound passes ``max_terms`` is refused.

The time bound: the progress handler runs every ``check_every`` VM instructions, at the loop
points of the program (never inside one instruction, nor between two of one row's expressions).
No single instruction does work that the limits do not bound: a function reads and writes values
of at most ``max_length`` bytes, a ``LIKE``/``GLOB`` match costs at most ``max_length`` x
``max_pattern`` character steps, ``instr``/``replace`` a ``memcmp`` of that order, a sort or a
DISTINCT covers the rows built within ``vm_steps``. So a statement ends within ``wall_s`` plus one
loop iteration — at worst one row of ~150 pattern matches (``max_sql`` / 12 bytes), about 0.3 s of
CPU on the 2-core development machine — with the defaults about 2.3 s.
tests/tasks/test_sql_sandbox.py checks it on generated statements (the size-producing functions
with huge counts, pattern matching with long values and patterns, many per row, nested subqueries
and ``WITH`` chains, in recursive CTEs, sorts and aggregates): at most ``wall_s`` + 0.5 s of CPU.

Errors come back as text (``error: …``), never as exceptions. Snapshots and forks are
``Connection.backup`` copies into in-memory databases (:meth:`SqlDb.copy`; an env can hand in a
spare sandboxed database to copy into, so a copy costs the backup alone, not a new connection).
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass

from treegrpo.tasks.sql import guard
from treegrpo.tasks.sql.expansion import expansion_bound

_ALLOWED = {
    sqlite3.SQLITE_SELECT,
    sqlite3.SQLITE_READ,
    sqlite3.SQLITE_INSERT,
    sqlite3.SQLITE_UPDATE,
    sqlite3.SQLITE_DELETE,
    sqlite3.SQLITE_FUNCTION,
    getattr(sqlite3, "SQLITE_RECURSIVE", 33),
}
DENIED_FUNCTIONS = frozenset(
    {
        "load_extension",
        "readfile",
        "writefile",
        "edit",
        "fts3_tokenizer",
        "random",
        "randomblob",
        "date",
        "time",
        "datetime",
        "julianday",
        "unixepoch",
        "strftime",
        "timediff",
        "current_date",
        "current_time",
        "current_timestamp",
        "sqlite_offset",
        "changes",
        "total_changes",
        "last_insert_rowid",
    }
)


@dataclass(frozen=True)
class SqlLimits:
    """The sandbox's limits.

    Attributes:
        vm_steps: SQLite VM instructions a statement may run (checked every ``check_every``).
        check_every: progress-handler period, in VM instructions.
        wall_s: wall-clock backstop per statement (a slow machine may hit it before ``vm_steps``).
        max_rows / max_chars: rows and characters of a result shown to the model.
        max_length: longest string or blob value (SQLITE_LIMIT_LENGTH), bytes.
        max_sql: longest statement, bytes.
        max_pages: database size cap, pages.
        max_pattern: longest ``LIKE`` / ``GLOB`` pattern (SQLITE_LIMIT_LIKE_PATTERN_LENGTH), bytes:
            one match costs up to value length x pattern length inside one VM instruction.
        max_ops: longest VM program (SQLITE_LIMIT_VDBE_OP), instructions: bounds code generation.
        max_terms: cap on :func:`~treegrpo.tasks.sql.expansion.expansion_bound`, the terms SQLite
            may build preparing a statement (``WITH`` copies, the query flattener).
    """

    vm_steps: int = 200_000
    check_every: int = 100
    wall_s: float = 2.0
    max_rows: int = 20
    max_chars: int = 400
    max_length: int = 10_000
    max_sql: int = 2_000
    max_pages: int = 256
    max_pattern: int = 32
    max_ops: int = 25_000
    max_terms: int = 1_000_000


def _authorize(action: int, arg1: str | None, arg2: str | None, db: str | None, trigger: str | None) -> int:
    if action not in _ALLOWED:
        return sqlite3.SQLITE_DENY
    if action == sqlite3.SQLITE_FUNCTION and (arg2 or "").lower() in DENIED_FUNCTIONS:
        return sqlite3.SQLITE_DENY
    return sqlite3.SQLITE_OK


class SqlDb:
    """A live, sandboxed in-memory database (a state handle of :class:`~treegrpo.tasks.sql.env.SqlEnv`)."""

    __slots__ = ("_deadline", "_ticks", "conn", "limits")

    def __init__(self, limits: SqlLimits, source: sqlite3.Connection | None = None, script: str = "") -> None:
        self.conn = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
        self.limits = limits
        self._ticks = 0
        self._deadline = 0.0
        if source is not None:
            source.backup(self.conn)
        elif script:
            self.conn.executescript(script)
        sandbox(self)

    def _progress(self) -> int:
        self._ticks += 1
        over = self._ticks * self.limits.check_every > self.limits.vm_steps
        return int(over or time.perf_counter() > self._deadline)

    def run(self, sql: str) -> tuple[str, bool]:
        """Run one statement; the result text and whether it succeeded."""
        lim = self.limits
        if len(sql.encode()) > lim.max_sql:
            return f"error: statement longer than {lim.max_sql} bytes", False
        if expansion_bound(sql) > lim.max_terms:
            return "error: statement too complex (nested subqueries or WITH tables)", False
        self._ticks, self._deadline = 0, time.perf_counter() + lim.wall_s
        cur = None
        try:
            cur = self.conn.execute(sql)
            if cur.description is None:
                n = max(cur.rowcount, 0)  # -1 for a statement that is not DML (e.g. only a comment)
                return f"{n} row{'s' if n != 1 else ''} changed", True
            rows = cur.fetchmany(lim.max_rows + 1)
        except sqlite3.OperationalError as e:
            msg = "statement stopped: step limit" if str(e) == "interrupted" else str(e)
            return f"error: {msg}", False
        except (sqlite3.Error, ValueError, OverflowError) as e:
            return f"error: {e}", False
        except MemoryError:  # SQLite's out-of-memory, also what a program past max_ops gives
            return "error: out of memory (statement too large)", False
        finally:
            if cur is not None:
                cur.close()
        if not rows:
            return "no rows", True
        lines = [" | ".join("NULL" if v is None else str(v) for v in row) for row in rows[: lim.max_rows]]
        text = "\n".join(lines)
        more = len(rows) > lim.max_rows
        if len(text) > lim.max_chars:
            text, more = text[: lim.max_chars], True
        return text + ("\n(more rows)" if more else ""), True

    def dump(self) -> str:
        """Every user table's rows, sorted, as text (a canonical form of the database state)."""
        self.conn.set_authorizer(None)
        self.conn.set_progress_handler(None, 0)
        try:
            names = [r[0] for r in self.conn.execute("SELECT name FROM sqlite_master WHERE type='table' ORDER BY name")]
            parts = []
            for name in names:
                rows = sorted(repr(r) for r in self.conn.execute(f'SELECT * FROM "{name}"'))
                parts.append(f"{name}: " + "; ".join(rows))
            return "\n".join(parts)
        finally:
            self.conn.set_authorizer(_authorize)
            self.conn.set_progress_handler(self._progress, self.limits.check_every)

    def copy(self, into: SqlDb | None = None) -> SqlDb:
        """An independent copy: ``Connection.backup`` into ``into`` (a spare database, whose
        content it replaces entirely) or into a fresh in-memory database."""
        if into is None:
            return SqlDb(self.limits, source=self.conn)
        self.conn.backup(into.conn)
        return into

    def close(self) -> None:
        self.conn.close()


def sandbox(db: SqlDb) -> None:
    """Install the limits, the authorizer and the progress handler on ``db``'s connection."""
    conn, lim = db.conn, db.limits
    conn.execute(f"PRAGMA max_page_count = {int(lim.max_pages)}")
    conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, lim.max_length)
    conn.setlimit(sqlite3.SQLITE_LIMIT_SQL_LENGTH, lim.max_sql)
    conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
    conn.setlimit(sqlite3.SQLITE_LIMIT_LIKE_PATTERN_LENGTH, lim.max_pattern)
    conn.setlimit(sqlite3.SQLITE_LIMIT_VDBE_OP, lim.max_ops)
    conn.setlimit(sqlite3.SQLITE_LIMIT_WORKER_THREADS, 0)  # a sort runs on this thread, within its limits
    guard.install(conn, lim.max_length)
    if hasattr(conn, "enable_load_extension"):
        conn.enable_load_extension(False)
    conn.set_authorizer(_authorize)
    conn.set_progress_handler(db._progress, lim.check_every)


__all__ = ["DENIED_FUNCTIONS", "SqlDb", "SqlLimits", "sandbox"]
