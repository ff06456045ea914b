"""The one place tool calls run (DESIGN.md §3.9): a batch's calls at once, each trajectory's in order.

:class:`ToolRunner` takes one :class:`Job` per trajectory — its calls of the turn, in order — and
runs all of them at once: a job without a tool-class instance on a shared pool of threads, a job on
an instance on that instance's :class:`Lane` (the one thread that made it: everything done to a
forest's instances runs there, in order, so a class holding a thread-bound object such as a
``sqlite3`` connection works). At most ``concurrency`` calls run at a time (1: one after another).
An ``async def`` tool is awaited on the run's event loop (:mod:`treegrpo.aio`).

Time-outs hold per call: a call still running ``timeout_s`` after it started gets a time-out
result and its thread is abandoned — a ``ToolAbandoned`` exception is injected into it, again and
again until it exits (a busy pure-Python loop stops; a call blocked in C stops when it returns).
The job of an abandoned pool thread goes on with its next call on another thread; an abandoned
lane is *dead*: every instance it owns is lost (:class:`StateLost`), so no call that finishes late
writes into a state any trajectory reads again. More than ``max_abandoned`` abandoned threads
still alive stop the run with one :class:`~treegrpo.errors.ConfigError` line.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import inspect
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from treegrpo import aio
from treegrpo.envs.tool_result import ToolResult, cut_result, failure, refused, result_text, timed_out
from treegrpo.errors import ConfigError

#: Grace past a call's time-out before its thread is abandoned (an async call times out by itself).
GRACE_S = 0.05
#: Seconds a pool thread waits for work before it exits.
IDLE_S = 10.0


class ToolAbandoned(BaseException):
    """Injected into a thread whose call ran past its time-out, until the thread exits."""


class StateLost(RuntimeError):
    """A tool-class instance whose lane died (a call on it ran past its time-out)."""


class Lane:
    """One thread that runs what is submitted to it, in order (a tool-class instance's owner).

    Once dead (its thread abandoned in a call) the thread touches nothing again: the work still
    waiting is failed with :class:`StateLost` by whoever calls :meth:`kill`."""

    def __init__(self, name: str = "tool-lane") -> None:
        self._q: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._waiting: set[concurrent.futures.Future[Any]] = set()
        self.dead = False
        self.refs = 0
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            while True:
                item = self._q.get()
                with self._lock:
                    if item is None or self.dead:
                        return
                    fn, fut = item
                    self._waiting.discard(fut)
                if not fut.set_running_or_notify_cancel():
                    continue
                try:
                    value = fn()
                except BaseException as e:  # handed to whoever waits on the future
                    if self.dead:
                        return
                    fut.set_exception(e)
                else:
                    if self.dead:
                        return
                    fut.set_result(value)
        except BaseException:  # an injected ToolAbandoned ends an abandoned lane quietly
            pass

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """Run ``fn()`` on this lane after what is queued; its future (:class:`StateLost` when dead)."""
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if not self.dead:
                self._waiting.add(fut)
                self._q.put((fn, fut))
                return fut
        fut.set_exception(StateLost("its thread was abandoned"))
        return fut

    def call(self, fn: Callable[[], Any], timeout_s: float | None = None) -> Any:
        """``fn()`` run on this lane (inline when called from it); raises what it raises,
        :class:`TimeoutError` past ``timeout_s``."""
        if threading.current_thread() is self.thread:
            return fn()
        try:
            return self.submit(fn).result(timeout_s)
        except concurrent.futures.TimeoutError:
            raise TimeoutError from None

    def kill(self) -> None:
        """Mark the lane dead (its thread was abandoned) and fail the work waiting on it with
        :class:`StateLost` (here, on the caller's thread)."""
        with self._lock:
            self.dead = True
            waiting, self._waiting = self._waiting, set()
            self._q.put(None)
        for fut in waiting:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(StateLost("its thread was abandoned"))

    def stop(self) -> None:
        """End the thread once what is queued has run."""
        self._q.put(None)


@dataclass
class Job:
    """One trajectory's calls of a turn: each a refusal already decided (a :class:`ToolResult`)
    or a ``(tool, arguments)`` to run, in order; ``lane``: the trajectory's instance's lane
    (``None``: any pool thread). Filled in as it runs: ``results`` and ``latency_s`` (0.0 for a
    refusal), one per call; ``lost``: why the rest of the job did not run (its lane died)."""

    index: int
    calls: Sequence[ToolResult | tuple[Any, dict[str, Any]]]
    lane: Lane | None = None
    results: list[ToolResult] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)
    lost: str | None = None
    fatal: str | None = None
    finished: bool = field(default=False, repr=False)
    taken: bool = field(default=False, repr=False)
    outbox: queue.SimpleQueue[Job] | None = field(default=None, repr=False)  # its batch's queue (:class:`Batch`)


@dataclass
class Batch:
    """Jobs started together (:meth:`ToolRunner.start`): how many are not yet yielded, and the
    queue their finished jobs arrive on."""

    left: int = 0
    done: queue.SimpleQueue[Job] = field(default_factory=queue.SimpleQueue)


@dataclass
class _Running:
    job: Job
    name: str
    thread: threading.Thread
    started: float
    deadline: float | None
    done: bool = False


class ToolStats:
    """Cumulative tool counters for the trainer to log: :meth:`take` returns and resets them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.calls = 0
        self.abandoned = 0
        self.in_flight = 0
        self.peak = 0
        self.busy_s = 0.0
        self._since = 0.0

    def start(self) -> None:
        with self._lock:
            self.calls += 1
            self.in_flight += 1
            if self.in_flight == 1:
                self._since = time.perf_counter()
            self.peak = max(self.peak, self.in_flight)

    def end(self, abandoned: bool = False) -> None:
        with self._lock:
            self.in_flight -= 1
            self.abandoned += int(abandoned)
            if self.in_flight == 0:
                self.busy_s += time.perf_counter() - self._since

    def take(self) -> dict[str, float]:
        """``calls`` (calls that ran), ``busy_s`` (wall seconds with at least one call in flight),
        ``peak_in_flight`` and ``abandoned`` (calls past their time-out) since the last take."""
        with self._lock:
            now = time.perf_counter()
            busy = self.busy_s + (now - self._since if self.in_flight else 0.0)
            out = {"calls": float(self.calls), "busy_s": busy, "peak_in_flight": float(self.peak),
                   "abandoned": float(self.abandoned)}  # fmt: skip
            self.calls, self.abandoned, self.busy_s, self.peak, self._since = 0, 0, 0.0, self.in_flight, now
            return out


def _inject(thread: threading.Thread) -> None:
    """Raise :class:`ToolAbandoned` in ``thread`` — only while it is still the thread of its ident:
    under threading's registry lock a thread cannot finish, so the ident is not yet reused by a new
    one (an injection by a stale ident once killed a fresh pool thread)."""
    with threading._active_limbo_lock:  # type: ignore[attr-defined]
        if thread.ident is not None and threading._active.get(thread.ident) is thread:  # type: ignore[attr-defined]
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(ToolAbandoned))


class _Reaper:
    """Injects :class:`ToolAbandoned` into every abandoned thread every 0.1 s until it exits."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, t: threading.Thread) -> None:
        with self._lock:
            self.threads.append(t)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="tool-reaper", daemon=True)
                self._thread.start()
        _inject(t)

    def alive(self) -> list[threading.Thread]:
        with self._lock:
            self.threads = [t for t in self.threads if t.is_alive()]
            return list(self.threads)

    def _run(self) -> None:
        while self.alive():
            for t in self.alive():
                _inject(t)
            time.sleep(0.1)


REAPER = _Reaper()


class ToolRunner:
    """Runs a batch's :class:`Job` s (module docstring).

    Args:
        concurrency: calls running at once, over every job (1: one at a time).
        timeout_s: a call's time limit (``None``: none).
        max_chars: a result longer than this many characters is cut (marked; ``None``: kept whole).
        max_abandoned: abandoned threads still alive that stop the run.
    """

    def __init__(self, concurrency: int = 32, timeout_s: float | None = 30.0, max_chars: int | None = None,
                 max_abandoned: int = 16) -> None:  # fmt: skip
        if concurrency < 1:
            raise ConfigError(f"tool_concurrency={concurrency}: give 1 (one call at a time) or more")
        self.concurrency, self.timeout_s, self.max_chars, self.max_abandoned = concurrency, timeout_s, max_chars, max_abandoned
        self.stats = ToolStats()
        self._slots = threading.BoundedSemaphore(concurrency)
        self._lock = threading.Lock()
        self._running: dict[int, _Running] = {}  # by thread ident
        self._pool: queue.SimpleQueue[tuple[Job, int, queue.SimpleQueue[Job]] | None] = queue.SimpleQueue()
        self._workers: set[threading.Thread] = set()
        self._retired: set[threading.Thread] = set()

    # -- running calls ----------------------------------------------------------------------------
    def _worker(self) -> None:
        me = threading.current_thread()
        try:
            while me not in self._retired:
                try:
                    item = self._pool.get(timeout=IDLE_S)
                except queue.Empty:
                    with self._lock:  # idle: leave, unless work arrived meanwhile (start() puts under the lock)
                        if self._pool.empty():
                            self._workers.discard(me)
                            return
                    continue
                if item is None:
                    return
                job, start, done = item
                if not self._run_job(job, start):  # abandoned mid-job: the job went on elsewhere
                    return
                self._finish(job, done)
        except BaseException:
            pass

    def _run_job(self, job: Job, start: int) -> bool:
        """Run ``job``'s calls from ``start`` on; ``False`` when this thread was abandoned."""
        me = threading.current_thread()
        for k in range(start, len(job.calls)):
            c = job.calls[k]
            if isinstance(c, ToolResult):
                job.results.append(c)
                job.latency_s.append(0.0)
                continue
            tool, args = c
            self._slots.acquire()
            t0 = time.perf_counter()
            deadline = None if self.timeout_s is None else t0 + self.timeout_s
            run = _Running(job, tool.name, me, t0, deadline)
            with self._lock:
                self._running[id(run)] = run
            self.stats.start()
            result = self._invoke(tool, args, deadline, job)
            with self._lock:
                abandoned = run.done  # the monitor got there first: this thread is retired
                run.done = True
                self._running.pop(id(run), None)
            if abandoned:
                return False
            self.stats.end()
            self._slots.release()
            job.results.append(result)
            job.latency_s.append(time.perf_counter() - t0)
        return True

    def _finish(self, job: Job, done: queue.SimpleQueue[Job]) -> None:
        with self._lock:
            if job.finished:
                return
            job.finished = True
        done.put(job)

    def _invoke(self, tool: Any, args: dict[str, Any], deadline: float | None, job: Job) -> ToolResult:
        try:
            value = tool.fn(**args)
            if inspect.isawaitable(value):
                left = None if deadline is None else max(0.0, deadline - time.perf_counter())
                value = aio.resolve(value, left)
            return ToolResult(tool.name, cut_result(result_text(value), self.max_chars), ran=True)
        except ToolAbandoned:
            raise
        except TimeoutError as e:  # an async call past its time-out (cancelled), or the tool's own
            if deadline is not None and time.perf_counter() >= deadline - 1e-3:
                return timed_out(tool.name, self.timeout_s)
            return failure(tool.name, e)
        except KeyboardInterrupt:
            job.fatal = f"tool {tool.name} raised KeyboardInterrupt: the run stops (a tool must not raise it)"
            return failure(tool.name, KeyboardInterrupt())
        except BaseException as e:  # SystemExit and GeneratorExit too: the model reads what was raised
            return failure(tool.name, e)

    def _spawn(self) -> None:
        t = threading.Thread(target=self._worker, name="tool-worker", daemon=True)
        self._workers.add(t)
        t.start()

    # -- the batch --------------------------------------------------------------------------------
    def run(self, jobs: Sequence[Job]) -> Iterator[Job]:
        """Run ``jobs`` at once; yield each as its last call finishes (any order). The jobs start
        before the first item is asked for (:meth:`start`, then :meth:`wait`)."""
        return self.wait(self.start(jobs))

    def start(self, jobs: Sequence[Job], batch: Batch | None = None) -> Batch:
        """Start ``jobs`` (added to ``batch`` when given); :meth:`wait` yields them as they finish."""
        batch = batch if batch is not None else Batch()
        batch.left += len(jobs)
        for j in jobs:
            j.outbox = batch.done
        pooled = [j for j in jobs if j.lane is None]
        with self._lock:
            self._workers = {t for t in self._workers if t.is_alive() and t not in self._retired}
            for _ in range(min(self.concurrency, len(pooled)) - len(self._workers)):
                self._spawn()
            for j in pooled:
                self._pool.put((j, 0, batch.done))
        for j in jobs:
            if j.lane is not None:
                fut = j.lane.submit(lambda j=j: self._run_job(j, 0))
                fut.add_done_callback(lambda f, j=j: self._lane_done(f, j, batch.done))
        return batch

    def wait(self, batch: Batch) -> Iterator[Job]:
        """``batch``'s jobs as each finishes; calls past their time-out are abandoned meanwhile.

        Raises:
            ConfigError: a tool raised ``KeyboardInterrupt``, or more than ``max_abandoned``
                abandoned threads are still alive (one line naming the tool).
        """
        while batch.left:
            try:
                job = batch.done.get(timeout=self._wait())
            except queue.Empty:
                self._abandon_overdue()
                continue
            batch.left -= 1
            if job.fatal:
                raise ConfigError(job.fatal)
            yield job

    def _lane_done(self, fut: concurrent.futures.Future[Any], job: Job, done: queue.SimpleQueue[Job]) -> None:
        with self._lock:
            if job.finished or job.taken:  # an abandoned thread never touches its job again
                return
        if fut.exception() is not None or fut.result() is False:
            job.lost = job.lost or "its thread was abandoned after a call ran past its time-out"
            self._fill_lost(job)
        self._finish(job, done)

    def _fill_lost(self, job: Job) -> None:
        why = f"the state of this trajectory was lost: {job.lost or 'its thread was abandoned'}"
        for c in job.calls[len(job.results) :]:
            name = c.name if isinstance(c, ToolResult) else c[0].name
            job.results.append(refused(name, why))
            job.latency_s.append(0.0)

    def _wait(self) -> float | None:
        with self._lock:
            deadlines = [r.deadline for r in self._running.values() if r.deadline is not None and not r.done]
        if not deadlines:
            return 0.5 if self.timeout_s is not None else None
        return max(0.0, min(deadlines) + GRACE_S - time.perf_counter())

    def _abandon_overdue(self) -> None:
        """Abandon every call past its time-out (of any batch: each job goes back to its own)."""
        now = time.perf_counter()
        with self._lock:
            overdue = [r for r in self._running.values() if r.deadline is not None and not r.done and now >= r.deadline + GRACE_S]
            for r in overdue:
                r.done = True
                self._running.pop(id(r), None)
                if r.job.lane is not None and r.thread is r.job.lane.thread:
                    r.job.lane.dead = True  # before its thread can see the call abandoned: it takes no more work
                    r.job.taken = True  # and the monitor, not that thread, finishes the job
        for r in overdue:
            job = r.job
            done = job.outbox
            assert done is not None
            self.stats.end(abandoned=True)
            self._slots.release()
            job.results.append(timed_out(r.name, self.timeout_s))
            job.latency_s.append(now - r.started)
            REAPER.add(r.thread)
            if job.lane is not None and r.thread is job.lane.thread:
                job.lost = f"a call ({r.name}) ran past its time-out and its thread was abandoned"
                job.lane.kill()  # queued work on the lane fails with StateLost
                self._fill_lost(job)
                self._finish(job, done)
            else:
                with self._lock:
                    self._retired.add(r.thread)
                    self._workers.discard(r.thread)
                    self._spawn()
                    if len(job.results) < len(job.calls):
                        self._pool.put((job, len(job.results), done))
                if len(job.results) == len(job.calls):
                    self._finish(job, done)
        alive = REAPER.alive()
        if len(alive) > self.max_abandoned:
            names = sorted({r.name for r in overdue}) or ["a tool"]
            raise ConfigError(
                f"{len(alive)} tool calls are still running after their time-out ({', '.join(names)} does not return "
                f"within tool_timeout_s={self.timeout_s:g} s, and cannot be stopped): make it return or raise in time"
            )

    def close(self) -> None:
        """Stop the pool's threads (after what is queued)."""
        for _ in self._workers:
            self._pool.put(None)
        self._workers.clear()


__all__ = ["GRACE_S", "IDLE_S", "Batch", "Job", "Lane", "StateLost", "ToolAbandoned", "ToolRunner", "ToolStats"]
