"""The pipelined agent loop (``AgentConfig.rollout_pipeline``; DESIGN.md §3.9): a trajectory whose
tool results are back goes to the next engine call without waiting for the slowest call of its
turn, and generation runs while other trajectories' calls are in flight.

The main thread owns the engine, the trees, the budgets and the sampler's ``on_end``; every
engine call's batch is handed to the env on its own worker thread, which iterates
:func:`~treegrpo.envs.base.step_stream` (an env's concurrent ``step_stream``, else ``env.step`` on
the batch — the search env's retrieval is then batched across whatever was ready — whose outcomes
are posted together) and posts each outcome as it comes. The main thread turns each outcome into its node as it arrives
(:meth:`Loop.finish_step`); a trajectory that goes on, and the expansions ``on_end`` starts for
one that ended, wait in the *ready* set for the next engine call.

**Batching policy.** An engine call starts with every ready cursor when

1. nothing is in flight (no result can join it: exactly the sequential loop's batch — so with
   tools that answer at once the two loops make the same calls), or
2. no result has arrived for ``quiet`` = max(2 ms, 5% of the last engine call's wall): the
   results that come back together (one turn's calls of a constant-latency tool) go together, or
3. the first ready cursor has waited half the last engine call's wall: a straggler does not hold
   back the ones that are ready (a later call takes it).

Per-trajectory sampling streams (:mod:`.streams`) are always on here, so which cursors share a
call, and when, changes nothing a forest contains (up to batch-dependent engine numerics).

Env threads: ``env.step`` / ``step_stream`` may be called from several worker threads at once,
each with a disjoint batch (a trajectory's state handle is used by one thread at a time; the
main thread keeps, restores and closes states between steps).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from treegrpo.envs.base import StepOutcome, step_stream
from treegrpo.rollout.engine import Generation
from treegrpo.tree import Forest, Tree

if TYPE_CHECKING:
    from treegrpo.rollout.agent import Cursor
    from treegrpo.rollout.loop import Loop

__all__ = ["QUIET_MIN_S", "chain_latency", "launch_due", "run_pipelined", "tool_latency"]

QUIET_MIN_S = 0.002
"""The shortest pause in arrivals after which a gathered batch is launched (seconds)."""
QUIET_FRACTION = 0.05
"""… or this fraction of the last engine call's wall, when longer."""
MAX_WAIT_FRACTION = 0.5
"""A ready cursor waits at most this fraction of the last engine call's wall for others."""


def launch_due(now: float, in_flight: int, first_ready: float, last_arrival: float, engine_wall: float) -> bool:
    """Whether the pipelined loop starts an engine call now, with cursors ready since
    ``first_ready`` and the latest result at ``last_arrival`` (module docstring: nothing in flight,
    a quiet pause, or the longest wait reached)."""
    if in_flight == 0:
        return True
    quiet = max(QUIET_MIN_S, QUIET_FRACTION * engine_wall)
    return now - last_arrival >= quiet or now - first_ready >= MAX_WAIT_FRACTION * engine_wall


def _deadline(in_flight: int, first_ready: float, last_arrival: float, engine_wall: float) -> float:
    quiet = max(QUIET_MIN_S, QUIET_FRACTION * engine_wall)
    return min(last_arrival + quiet, first_ready + MAX_WAIT_FRACTION * engine_wall)


@dataclass
class _Flight:
    """One engine call's batch whose env step is out: its cursors, generations and texts."""

    cursors: list[Cursor]
    gens: list[Generation]
    texts: list[str]


def run_pipelined(loop: Loop, cursors: Sequence[Cursor]) -> int:
    """Advance every cursor until its trajectory ends, pipelined (module docstring); returns the
    number of engine calls. Engine wall, env wall, engine idle time and the most env steps out at
    once go to the runner's ``loop_stats``."""
    runner = loop.runner
    env, stats = runner.env, runner.loop_stats
    results: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()
    flights: dict[int, _Flight] = {}
    ready: list[Cursor] = loop.admit(cursors)
    in_flight = calls = 0
    engine_wall = 0.0
    now = time.perf_counter()
    first_ready = last_arrival = busy_since = now

    streams_own = callable(getattr(env, "step_stream", None))

    def consume(bid: int, tasks: list[Any], texts: list[str], allowed: list[bool], kwargs: dict[str, Any]) -> None:
        try:
            if not streams_own:  # the whole batch at once: one item, so it is never split
                results.put((bid, list(step_stream(env, tasks, texts, allowed, **kwargs))))
                return
            for i, outcome in step_stream(env, tasks, texts, allowed, **kwargs):
                results.put((bid, [(i, outcome)]))
        except BaseException as e:  # handed to the main thread, raised there
            results.put((bid, e))

    def arrive(bid: int, outcomes: list[tuple[int, StepOutcome]] | BaseException) -> None:
        nonlocal in_flight, first_ready, last_arrival
        if isinstance(outcomes, BaseException):
            raise outcomes
        flight = flights[bid]
        for i, outcome in outcomes:
            go_on = loop.admit(loop.finish_step(flight.cursors[i], flight.gens[i], flight.texts[i], outcome))
            in_flight -= 1
            if in_flight == 0:
                stats.env_s += time.perf_counter() - busy_since
            if go_on and not ready:
                first_ready = time.perf_counter()
            ready.extend(go_on)
        last_arrival = time.perf_counter()

    while ready or in_flight:
        now = time.perf_counter()
        if ready and launch_due(now, in_flight, first_ready, last_arrival, engine_wall):
            batch, ready[:] = list(ready), []
            t0 = time.perf_counter()
            gens, texts = loop.generate(batch)
            engine_wall = time.perf_counter() - t0
            calls += 1
            allowed, kwargs = loop.step_args(batch)
            bid = calls
            flights[bid] = _Flight(batch, gens, texts)
            if in_flight == 0:
                busy_since = time.perf_counter()
            in_flight += len(batch)
            stats.peak_in_flight = max(stats.peak_in_flight, in_flight)
            args = (bid, [c.task for c in batch], texts, allowed, kwargs)
            threading.Thread(target=consume, args=args, name=f"treegrpo-env-{bid}", daemon=True).start()
            continue
        timeout = None if not ready else max(0.0, _deadline(in_flight, first_ready, last_arrival, engine_wall) - now)
        t0 = time.perf_counter()
        try:
            item = results.get(timeout=timeout)
        except queue.Empty:
            stats.idle_s += time.perf_counter() - t0
            continue
        stats.idle_s += time.perf_counter() - t0
        arrive(*item)
        while True:  # whatever else is back already
            try:
                item = results.get_nowait()
            except queue.Empty:
                break
            arrive(*item)
    return calls


def tool_latency(tree: Tree) -> float:
    """The latency of ``tree``'s longest chain of dependent tool calls: the most, over root→leaf
    paths, of the summed ``tool_latency_s`` (seconds, a list per node: one per call) of the path's
    nodes. A path runs its calls one after another; an expansion shares its start node's calls."""
    best: dict[int, float] = {}
    top = 0.0
    for node in tree.dfs():  # parents before children
        own = sum(float(x) for x in node.extra.get("tool_latency_s") or ())
        total = own + (best[node.parent] if node.parent is not None else 0.0)
        best[node.id] = total
        top = max(top, total)
    return top


def chain_latency(forests: Iterable[Forest]) -> float:
    """The longest chain of dependent tool calls over every tree of ``forests`` (:func:`tool_latency`):
    with tools that cost only their latency, a rollout cannot take less than its no-latency wall
    plus this."""
    return max((tool_latency(t) for f in forests for t in f.trees), default=0.0)

