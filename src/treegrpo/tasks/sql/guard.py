"""A guard for SQLite's ``printf`` / ``format``: the one built-in whose work the value limit does not bound.

``printf('%.*c', N, 'x')`` repeats a character N times in a loop inside one VM instruction. In
the SQLite that CPython 3.11 ships (3.40), the loop goes on after the result has passed the value
limit (``SQLITE_LIMIT_LENGTH``) and only then gives NULL, so neither the sandbox's progress handler
nor its wall-clock check gets to run: about 1.5 s per call for N = 10**9 and 3 s for 2**31 - 1,
with ``format`` (an alias) and a literal count (``'%.1000000000c'``) the same. Every other
conversion fails fast when its output would pass the limit.

:func:`install` registers ``printf`` and ``format`` on a sandboxed connection (an application
function of the same name takes the place of the built-in). The guard reads the format as SQLite
does (:func:`char_repeats`): for each ``%c`` its repeat count (the precision: a literal, or the
``*`` argument SQLite reads it from, as a 32-bit int). A count above the value limit cannot fit,
so the call's result is the built-in's result for an output past the limit (NULL in 3.40); the
guard gives it at once, from a stand-in call whose count is one past the limit. Every other call
is handed, with the same arguments (same types), to the built-in on a private plain connection of
this thread with the same value limit: results are SQLite's, byte for byte. (A result that is not
valid UTF-8 — a precision that cuts a character, ``printf('%.1s', 'é')`` — is an
``OperationalError`` here, as reading it from the built-in is in Python's sqlite3.)
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable
from typing import Any

_FLAGS = frozenset(b"-+ #!0,")
_DIGITS = frozenset(b"0123456789")
_TAKES_ARG = frozenset(b"dsgzqQwcouxXfeEGipr")  # conversions that read one argument
_NO_ARG = frozenset(b"n%")  # conversions that read none
# any other conversion character ends the formatting (SQLite stops at it: 'T', 'S', unknown ones)

_local = threading.local()


def char_repeats(fmt: bytes) -> list[tuple[bool, int]]:
    """The repeat counts of the ``%c`` conversions of a printf format, in order: ``(False, n)``
    for a literal count ``n`` (as SQLite reads it: the digits modulo 2**32, then the low 31 bits)
    or ``(True, k)`` when the count is read from argument ``k`` (0 = the first after the format).
    A ``%c`` without a precision repeats once and is left out."""
    fmt = fmt.split(b"\0", 1)[0]  # SQLite reads the format as a C string
    out: list[tuple[bool, int]] = []
    n, i, arg = len(fmt), 0, 0
    while True:
        i = fmt.find(b"%", i)
        if i < 0 or i + 1 >= n:
            return out
        i += 1
        while i < n and fmt[i] in _FLAGS:
            i += 1
        if i < n and fmt[i] == ord("*"):  # width from an argument
            arg, i = arg + 1, i + 1
        else:
            while i < n and fmt[i] in _DIGITS:
                i += 1
        repeat: tuple[bool, int] | None = None
        if i < n and fmt[i] == ord("."):
            i += 1
            if i < n and fmt[i] == ord("*"):
                repeat, arg, i = (True, arg), arg + 1, i + 1
            else:
                j = i
                while i < n and fmt[i] in _DIGITS:
                    i += 1
                repeat = (False, (int(fmt[j:i] or b"0") % 2**32) & 0x7FFFFFFF)
        for _ in range(2):  # the length modifiers 'l' and 'll'
            if i < n and fmt[i] == ord("l"):
                i += 1
        if i >= n:
            return out
        conv = fmt[i]
        i += 1
        if conv == ord("c") and repeat is not None:
            out.append(repeat)
        if conv in _TAKES_ARG:
            arg += 1
        elif conv not in _NO_ARG:
            return out


def _format_bytes(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else value.encode("utf-8", "surrogatepass")


def _engine(max_length: int) -> sqlite3.Connection:
    """This thread's plain connection with value limit ``max_length`` (runs the built-in)."""
    engines: dict[int, sqlite3.Connection] | None = getattr(_local, "engines", None)
    if engines is None:
        engines = _local.engines = {}
    conn = engines.get(max_length)
    if conn is None:
        conn = sqlite3.connect(":memory:")
        conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, max_length)
        engines[max_length] = conn
    return conn


def _as_int32(engine: sqlite3.Connection, value: Any) -> int:
    """``value`` read as SQLite's printf reads a ``*`` argument: as a 64-bit integer (SQLite's own
    conversion, asked of the engine), then cast to a 32-bit int."""
    (text,) = engine.execute("SELECT printf('%d', ?)", (value,)).fetchone()
    v = int(text) & 0xFFFFFFFF
    return v - 2**32 if v >= 2**31 else v


def too_long(args: tuple[Any, ...], max_length: int, engine: sqlite3.Connection) -> bool:
    """Whether a ``printf(*args)`` call has a ``%c`` whose repeat count is above ``max_length``."""
    if not args or not isinstance(args[0], (str, bytes)):
        return False  # no format, or a number's text: no '%c' in it
    fmt = _format_bytes(args[0])
    if b"c" not in fmt:
        return False
    rest = args[1:]
    for from_arg, v in char_repeats(fmt):
        if from_arg:
            if v >= len(rest):
                continue  # a missing argument reads as 0
            x = _as_int32(engine, rest[v])
            v = 0 if x == -(2**31) else abs(x)  # a negative count is its magnitude (-2**31: none)
        if v > max_length:
            return True
    return False


def guarded_printf(max_length: int) -> Callable[..., Any]:
    """The ``printf`` / ``format`` function for a connection whose value limit is ``max_length``."""
    overflow_sql = "SELECT printf('%.*c', ?, 'x')"

    def printf(*args: Any) -> Any:
        engine = _engine(max_length)
        if too_long(args, max_length, engine):
            return engine.execute(overflow_sql, (max_length + 1,)).fetchone()[0]
        marks = ", ".join("?" * len(args))
        return engine.execute(f"SELECT printf({marks})", args).fetchone()[0]

    return printf


def install(conn: sqlite3.Connection, max_length: int) -> None:
    """Register the guarded ``printf`` and ``format`` on ``conn``."""
    fn = guarded_printf(max_length)
    for name in ("printf", "format"):
        conn.create_function(name, -1, fn, deterministic=True)


__all__ = ["char_repeats", "guarded_printf", "install", "too_long"]
