"""The tools of ``treegrpo bench tools``: a search whose every query is one call of a given latency.

A web search API answers one query per request and takes its time. :func:`latency_s` is the
latency of one call — ``none`` (0), ``constant`` (:data:`CONSTANT_S`) or ``heavy`` (lognormal with
median :data:`CONSTANT_S` and p99 ≈ 2 s: ``exp(ln 0.2 + 0.99 z)``) — drawn deterministically from
the query's text (the same query waits as long in every row, so rows compare the same calls), and
spent as a sleep. :class:`LatencySearchEnv` is the default job's search env (Search-R1's tags) with
each query its own call through a :class:`~treegrpo.envs.tool_runner.ToolRunner`: concurrently up
to ``tool_concurrency`` at a time, each trajectory's outcome yielded when *its* call is back
(``step_stream``), the observation exactly :class:`~treegrpo.envs.search.SearchEnv`'s.
:func:`latency_search_tool` is the same search as a plain tool function (``search(query)``) for
the model's own tool calls — treegrpo's ``ToolEnv`` and TRL's ``GRPOTrainer(tools=...)`` get the
very same function.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any

from treegrpo.envs.base import StepOutcome, Task
from treegrpo.envs.search import History, SearchEnv, information, parse_action
from treegrpo.envs.tool_runner import Job, ToolResult, ToolRunner
from treegrpo.retrieval.base import Retriever, format_passages
from treegrpo.tasks.datafile import search_tool

LATENCIES: tuple[str, ...] = ("none", "constant", "heavy")
CONSTANT_S = 0.2
"""The constant tool's latency, and the heavy-tailed tool's median (seconds)."""
HEAVY_SIGMA = 0.99
"""The heavy-tailed tool's lognormal sigma: p99 = 0.2 s x exp(0.99 x 2.326) ≈ 2.0 s."""


def unit_draw(query: str, salt: str = "treegrpo-bench-tools") -> float:
    """A number in (0, 1) fixed by ``query`` (SHA-256 of ``salt`` and the text; never 0 or 1)."""
    h = int.from_bytes(hashlib.sha256(f"{salt}\0{query}".encode()).digest()[:8], "big")
    return (h + 0.5) / 2.0**64


def latency_s(kind: str, query: str) -> float:
    """The latency of one call with ``query`` (seconds): ``none`` 0, ``constant`` 0.2,
    ``heavy`` ``exp(ln 0.2 + 0.99 z)`` with ``z`` the standard normal quantile of
    :func:`unit_draw` (median 0.2 s, p99 ≈ 2.0 s).

    Raises:
        ValueError: an unknown ``kind``.
    """
    if kind == "none":
        return 0.0
    if kind == "constant":
        return CONSTANT_S
    if kind == "heavy":
        return math.exp(math.log(CONSTANT_S) + HEAVY_SIGMA * NormalDist().inv_cdf(unit_draw(query)))
    raise ValueError(f"unknown latency {kind!r}; choose one of {', '.join(LATENCIES)}")


def latency_search_tool(retriever: Retriever, topk: int, latency: str) -> Callable[[str], str]:
    """:func:`~treegrpo.tasks.datafile.search_tool` (same name, docstring, schema and result text)
    that first sleeps :func:`latency_s` of its query: one call, one request of a slow API."""
    inner = search_tool(retriever, topk)

    def search(query: str) -> str:
        time.sleep(latency_s(latency, query))
        return inner(query)

    search.__doc__ = inner.__doc__
    return search


@dataclass(frozen=True)
class _Call:
    """What a :class:`ToolRunner` job calls: a ``name`` and a function ``fn(**arguments)``."""

    name: str
    fn: Callable[..., Any]


@dataclass
class LatencySearchEnv(SearchEnv):
    """:class:`SearchEnv` with each query its own call of latency :func:`latency_s` (``latency``),
    run by a :class:`ToolRunner` at most ``tool_concurrency`` at a time (1: one after another, as a
    loop over the batch would). Outcomes, observations and rewards are ``SearchEnv``'s for the same
    steps (per-query retrieval returns what the batched request does); a search outcome's ``info``
    also holds ``tool_latency_s`` (its call's measured seconds). ``tool_stats``: the runner's
    counters (the trainer logs them per step)."""

    latency: str = "constant"
    tool_concurrency: int = 32
    _runner: ToolRunner = field(init=False, repr=False)
    _lock: threading.Lock = field(init=False, repr=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        super().__post_init__()
        latency_s(self.latency, "")  # an unknown kind fails here
        self._runner = ToolRunner(self.tool_concurrency, timeout_s=None)
        self.tool_stats = self._runner.stats
        self._search = _Call("search", self._one_query)

    def _one_query(self, query: str) -> str:
        time.sleep(latency_s(self.latency, query))
        with self._lock:  # the index is read by one call at a time (the sleep is what overlaps)
            hits = self.retriever.retrieve([query], self.topk)[0]
        return information(format_passages(hits) if hits else "No results.")

    def step(
        self,
        tasks: Sequence[Task],
        steps: Sequence[str],
        search_allowed: Sequence[bool],
        histories: Sequence[History] | None = None,
    ) -> list[StepOutcome]:
        """:meth:`step_stream`'s outcomes, in step order."""
        out = dict(self.step_stream(tasks, steps, search_allowed, histories))
        return [out[i] for i in range(len(steps))]

    def step_stream(
        self,
        tasks: Sequence[Task],
        steps: Sequence[str],
        search_allowed: Sequence[bool],
        histories: Sequence[History] | None = None,
    ) -> Iterator[tuple[int, StepOutcome]]:
        """``(index, outcome)`` of each step as it is ready: steps without a search at once
        (``SearchEnv.step`` on each alone), each search when its own call is back."""
        jobs: list[Job] = []
        for i, (task, text, allowed) in enumerate(zip(tasks, steps, search_allowed, strict=True)):
            kind, content = parse_action(text)
            if kind == "search" and content and allowed:
                jobs.append(Job(i, [(self._search, {"query": content})]))
                continue
            history = [histories[i]] if histories is not None else None
            yield i, SearchEnv.step(self, [task], [text], [allowed], history)[0]
        if not jobs:
            return
        for job in self._runner.run(jobs):
            yield job.index, self._outcome(job)

    def _outcome(self, job: Job) -> StepOutcome:
        result: ToolResult = job.results[0]
        query = job.calls[0][1]["query"]  # type: ignore[index]
        failed = result.error is not None
        obs = information(f"Search failed: {result.error}. Try again.") if failed else result.content
        info = {"query": query, "tool_latency_s": [round(x, 6) for x in job.latency_s]}
        return StepOutcome("search", False, observation=obs, tool_calls=1, retrieval_error=failed, info=info)


__all__ = ["CONSTANT_S", "HEAVY_SIGMA", "LATENCIES", "LatencySearchEnv", "latency_s", "latency_search_tool", "unit_draw"]
