"""The retrieval server's work scheduling: request limits and a fair, bounded work queue.

A request's queries are cut into chunks (:attr:`Limits.chunk_queries` queries or
:attr:`Limits.chunk_tokens` words, whichever comes first). One worker thread runs one retriever
call at a time; each call takes the next chunk of every waiting request in turn (round robin,
grouped by ``topk``), so concurrent small requests share a call and a small request waits for
about one chunk, not for a big request to finish. A cancelled request (its client went away) is
dropped before its next chunk; :meth:`Batcher.abort` fails every waiting request (shutdown).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from treegrpo.retrieval.base import Hit, Retriever


@dataclass(frozen=True)
class Limits:
    """What one request may ask for, and how much work may wait. Each field is a
    ``treegrpo serve-retriever`` flag of the same name (``max_body_bytes`` → ``--max-body-bytes``).

    Attributes:
        max_body_bytes: request body size; checked against ``Content-Length`` before reading and
            counted while the body streams in (a larger body is never read into memory).
        max_drain_bytes: a body over ``max_body_bytes`` but not over this is read to its end and
            discarded before the 413, so a client that sends all before it reads sees the 413; a
            larger one gets the 413 at once and the connection is closed (such a client may see a
            reset). At or below ``max_body_bytes``: never drained.
        max_queries: queries per request.
        max_query_chars: characters per query.
        max_request_tokens: whitespace-separated words over all queries of a request.
        max_pending_queries: queries accepted and not yet answered, over all requests; a request
            that would go over gets 503 (clients retry it). At least ``max_queries``.
        chunk_queries, chunk_tokens: the most queries / words a request contributes to one
            retriever call (the fairness unit: a small request waits about one chunk).
    """

    max_body_bytes: int = 8 * 2**20
    max_drain_bytes: int = 64 * 2**20
    max_queries: int = 4096
    max_query_chars: int = 4096
    max_request_tokens: int = 100_000
    max_pending_queries: int = 16_384
    chunk_queries: int = 64
    chunk_tokens: int = 2048

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_pending_queries < self.max_queries:
            raise ValueError(
                f"max_pending_queries ({self.max_pending_queries}) must be >= max_queries ({self.max_queries})"
            )

    def request_problem(self, queries: Sequence[str]) -> str | None:
        """Why a request with ``queries`` is over a limit (one line naming the flag), or None."""
        if len(queries) > self.max_queries:
            return (
                f"too many queries: {len(queries)} > {self.max_queries} per request; split them "
                "(or raise the server's --max-queries)"
            )
        tokens = 0
        for i, q in enumerate(queries):
            if len(q) > self.max_query_chars:
                return (
                    f"query {i} is {len(q)} characters > {self.max_query_chars}; shorten it "
                    "(or raise the server's --max-query-chars)"
                )
            tokens += query_tokens(q)
        if tokens > self.max_request_tokens:
            return (
                f"request has {tokens} query words > {self.max_request_tokens} per request; split it "
                "(or raise the server's --max-request-tokens)"
            )
        return None


def query_tokens(query: str) -> int:
    """A query's size for the limits and chunking: its whitespace-separated words (at least 1)."""
    return max(1, len(query.split()))


def chunk_spans(queries: Sequence[str], max_queries: int, max_tokens: int) -> list[tuple[int, int, int]]:
    """``(start, end, tokens)`` spans cutting ``queries`` in order into chunks of at most
    ``max_queries`` queries and (unless a single query is larger) ``max_tokens`` words."""
    spans: list[tuple[int, int, int]] = []
    start, tokens = 0, 0
    for i, q in enumerate(queries):
        t = query_tokens(q)
        if i > start and (i - start >= max_queries or tokens + t > max_tokens):
            spans.append((start, i, tokens))
            start, tokens = i, 0
        tokens += t
    if start < len(queries):
        spans.append((start, len(queries), tokens))
    return spans


class QueueFull(Exception):
    """More queries are waiting than :attr:`Limits.max_pending_queries` allows."""


class ServerClosing(Exception):
    """The server is shutting down; the request was not (fully) answered."""


@dataclass(eq=False)
class _Job:
    queries: list[str]
    topk: int
    spans: deque[tuple[int, int, int]]
    future: asyncio.Future[list[list[Hit]]]
    rows: list[list[Hit]] = field(default_factory=list)
    done: bool = False


@dataclass
class ServerStats:
    """Counters exposed on ``GET /``."""

    requests: int = 0
    queries: int = 0
    batches: int = 0
    errors: int = 0
    rejected: int = 0
    cancelled: int = 0
    started: float = field(default_factory=time.time)


class _Worker:
    """One daemon thread running calls in order. Daemon: a call still running when the server
    stops does not keep the process alive."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def run(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._calls.put((loop, fut, fn, args))
        return fut

    def _serve(self) -> None:
        while (item := self._calls.get()) is not None:
            loop, fut, fn, args = item
            try:
                value, error = fn(*args), None
            except Exception as e:  # handed to the awaiting coroutine
                value, error = None, e
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
                loop.call_soon_threadsafe(_settle, fut, value, error)

    def close(self) -> None:
        self._calls.put(None)


def _settle(fut: asyncio.Future[Any], value: Any, error: Exception | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)


class Batcher:
    """Runs requests' queries as batched retriever calls, one call at a time, in a worker thread
    (the event loop stays free to accept and answer requests); see the module docstring."""

    def __init__(self, retriever: Retriever, limits: Limits | None = None, max_batch_queries: int = 1024) -> None:
        self.retriever = retriever
        self.limits = limits or Limits()
        self.max_batch_queries = max_batch_queries
        self.max_batch_tokens = 8 * self.limits.chunk_tokens
        self.active: deque[_Job] = deque()  # jobs with chunks left, in turn order
        self.jobs: set[_Job] = set()  # every unfinished job (including ones in the running call)
        self.pending_queries = 0
        self.closing: str | None = None
        self.stats = ServerStats()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.wakeup: asyncio.Event | None = None
        self.task: asyncio.Task[None] | None = None
        self.worker: _Worker | None = None

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.wakeup = asyncio.Event()
        self.closing = None
        self.worker = _Worker("retriever-worker")
        self.task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        self.abort("the server is shutting down")
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        if self.worker is not None:
            self.worker.close()

    def abort(self, reason: str) -> None:
        """Refuse new work and fail every unfinished request with :class:`ServerClosing`."""
        self.closing = reason
        for job in list(self.jobs):
            self._finish(job, error=ServerClosing(reason))

    def abort_threadsafe(self, reason: str) -> None:
        """:meth:`abort` from another thread or a signal handler."""
        if self.loop is not None and not self.loop.is_closed():
            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(self.abort, reason)

    def submit(self, queries: list[str], topk: int) -> _Job:
        """Queue ``queries``; the returned job's ``future`` gets one hit list per query.
        Raises :class:`QueueFull` or :class:`ServerClosing`."""
        assert self.wakeup is not None, "Batcher.start() was not called"
        if self.closing is not None:
            raise ServerClosing(self.closing)
        n, cap = len(queries), self.limits.max_pending_queries
        if self.pending_queries + n > cap:
            raise QueueFull(
                f"server busy: {self.pending_queries} queries already waiting, {n} more would exceed "
                f"{cap}; retry shortly (or raise the server's --max-pending-queries)"
            )
        spans = deque(chunk_spans(queries, self.limits.chunk_queries, self.limits.chunk_tokens))
        job = _Job(queries, topk, spans, asyncio.get_running_loop().create_future())
        self.jobs.add(job)
        self.active.append(job)
        self.pending_queries += n
        self.wakeup.set()
        return job

    def cancel(self, job: _Job) -> None:
        """Drop a job's remaining work (its client is gone); no-op for a finished job."""
        if not job.done:
            self.stats.cancelled += 1
            self._finish(job, cancel=True)

    def _finish(
        self, job: _Job, result: list[list[Hit]] | None = None, error: Exception | None = None, cancel: bool = False
    ) -> None:
        if job.done:
            return
        job.done = True
        self.jobs.discard(job)
        self.pending_queries -= len(job.queries)
        if job.future.done():
            return
        if cancel:
            job.future.cancel()
        elif error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(result if result is not None else job.rows)

    def _take_batch(self) -> list[tuple[_Job, int, int]]:
        """The next chunk of each waiting job in turn, up to the batch caps."""
        batch: list[tuple[_Job, int, int]] = []
        n_queries = n_tokens = 0
        for _ in range(len(self.active)):
            job = self.active.popleft()
            if job.done:
                continue
            start, end, tokens = job.spans.popleft()
            batch.append((job, start, end))
            n_queries += end - start
            n_tokens += tokens
            if job.spans:
                self.active.append(job)
            if n_queries >= self.max_batch_queries or n_tokens >= self.max_batch_tokens:
                break
        return batch

    async def _run(self) -> None:
        assert self.wakeup is not None and self.worker is not None
        while True:
            if not self.active:
                self.wakeup.clear()
                await self.wakeup.wait()
                continue
            by_k: dict[int, list[tuple[_Job, int, int]]] = {}
            for item in self._take_batch():
                by_k.setdefault(item[0].topk, []).append(item)
            for k, group in by_k.items():
                group = [(job, a, b) for job, a, b in group if not job.done]
                if not group:
                    continue
                flat = [q for job, a, b in group for q in job.queries[a:b]]
                self.stats.batches += 1
                try:
                    results = await self.worker.run(self.retriever.retrieve, flat, k)
                    if len(results) != len(flat):
                        raise RuntimeError(f"retriever returned {len(results)} lists for {len(flat)} queries")
                except Exception as e:  # the requests fail, the server keeps serving
                    self.stats.errors += 1
                    for job, _, _ in group:
                        self._finish(job, error=e)
                    continue
                pos = 0
                for job, a, b in group:
                    part = results[pos : pos + b - a]
                    pos += b - a
                    if job.done:
                        continue
                    job.rows.extend(part)
                    if not job.spans:
                        self._finish(job)
