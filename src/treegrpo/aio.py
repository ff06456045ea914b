"""One event loop for the run: where ``async def`` tools, rewards, ``reset`` and ``get_reward``
are awaited (DESIGN.md §3.9).

The loop runs on one daemon thread, started on first use and kept for the process, so every
coroutine a run meets — from any thread, the agent loop's or a tool pool's — is awaited on the
same loop (an ``asyncio`` client made by one call, a connection pool say, is usable by the next).
:func:`resolve` is the one entry point: a value is returned as it is, an awaitable is run on the
loop and its result returned (its exception raised). Code already running on the loop must
``await`` instead (``resolve`` refuses, rather than dead-lock).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None


def run_loop() -> asyncio.AbstractEventLoop:
    """The run's event loop (started on its own daemon thread the first time)."""
    global _loop, _thread
    with _lock:
        if _loop is None or _loop.is_closed() or _thread is None or not _thread.is_alive():
            loop = asyncio.new_event_loop()
            ready = threading.Event()

            def serve() -> None:
                asyncio.set_event_loop(loop)
                loop.call_soon(ready.set)
                loop.run_forever()

            thread = threading.Thread(target=serve, name="treegrpo-event-loop", daemon=True)
            thread.start()
            ready.wait()
            _loop, _thread = loop, thread
        return _loop


def on_run_loop() -> bool:
    """Whether the caller is running on the run's event loop thread."""
    return _thread is not None and threading.current_thread() is _thread


def submit(awaitable: Awaitable[T]) -> concurrent.futures.Future[T]:
    """Schedule ``awaitable`` on the run's loop; a :class:`concurrent.futures.Future` of its result."""

    async def wrap() -> T:
        return await awaitable

    return asyncio.run_coroutine_threadsafe(wrap(), run_loop())


def resolve(value: Awaitable[T] | T, timeout_s: float | None = None) -> T:
    """``value`` itself, or, when it is awaitable (an ``async def`` function's result), what it
    returns once awaited on the run's loop. Raises what it raises; :class:`TimeoutError` past
    ``timeout_s`` (the coroutine is then cancelled: nothing of it runs afterwards)."""
    if not inspect.isawaitable(value):
        return value  # type: ignore[return-value]
    if on_run_loop():
        raise RuntimeError("treegrpo.aio.resolve called on the run's event loop: await the value instead")
    fut = submit(value)
    try:
        return fut.result(timeout_s)
    except concurrent.futures.TimeoutError:
        fut.cancel()
        raise TimeoutError from None


def call(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, awaited on the run's loop when ``fn`` is ``async def``."""
    return resolve(fn(*args, **kwargs))


def is_async(fn: Any) -> bool:
    """Whether calling ``fn`` gives a coroutine (an ``async def`` function or method, or an object
    whose ``__call__`` is one)."""
    dunder = type(fn).__dict__.get("__call__") if not inspect.isroutine(fn) else None
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(dunder)


__all__ = ["call", "is_async", "on_run_loop", "resolve", "run_loop", "submit"]
