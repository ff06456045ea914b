"""The one place tool calls run (envs/tool_runner.py, DESIGN.md §3.9): a batch's calls at once on a
bounded pool, each trajectory's in order, outcomes that do not depend on timing, per-call time-outs
that stop the abandoned thread, a cap on abandoned threads, and no tool that can end the run."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import pytest

from treegrpo.envs.base import Task, step_stream
from treegrpo.envs.tool_env import ToolEnv, tool_response
from treegrpo.envs.tool_runner import REAPER, Job, ToolRunner
from treegrpo.envs.tools import Tool
from treegrpo.errors import ConfigError

TASK = Task("q", "What?", ["5"])


def wait(seconds: float) -> str:
    """Sleep, then say how long.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return f"slept {seconds}"


def jitter(key: str) -> str:
    """A deterministic result after a random delay.

    Args:
        key: what to echo
    """
    time.sleep(random.random() * 0.05)
    return key.upper()


EXITED = threading.Event()


def spin(n: int) -> str:
    """A busy loop that never returns by itself.

    Args:
        n: a start
    """
    try:
        while True:
            n += 1
    finally:
        EXITED.set()


def leave(how: str) -> str:
    """Raise what a hostile tool raises.

    Args:
        how: exit | generator | interrupt
    """
    import sys

    if how == "exit":
        sys.exit(3)
    if how == "generator":
        raise GeneratorExit("gone")
    raise KeyboardInterrupt


def call(name: str, **arguments: object) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def test_a_batchs_calls_run_at_once_and_one_at_a_time_with_concurrency_1() -> None:
    """Eight 0.2 s calls of one step: about 0.2 s at once (they ran one after another before: 1.6 s)."""
    steps = [call("wait", seconds=0.2)] * 8
    env = ToolEnv([wait], tool_concurrency=8)
    t0 = time.perf_counter()
    out = env.step([TASK] * 8, steps, [True] * 8)
    wall = time.perf_counter() - t0
    assert all(o.observation == tool_response("slept 0.2") for o in out) and wall < 0.8, wall
    stats = env.tool_stats.take()
    assert stats["calls"] == 8 and stats["peak_in_flight"] == 8 and stats["abandoned"] == 0
    assert 0.19 < stats["busy_s"] < 0.8
    assert env.tool_stats.take() == {"calls": 0.0, "busy_s": 0.0, "peak_in_flight": 0.0, "abandoned": 0.0}
    one = ToolEnv([wait], tool_concurrency=1)
    t0 = time.perf_counter()
    assert [o.observation for o in one.step([TASK] * 4, steps[:4], [True] * 4)] == [o.observation for o in out[:4]]
    assert time.perf_counter() - t0 >= 0.8 and one.tool_stats.take()["peak_in_flight"] == 1


def test_outcomes_do_not_depend_on_timing_and_answers_come_first() -> None:
    """Random latencies, deterministic tools: the same outcomes as one call at a time; the stream
    gives the answers (scored together) before any tool result, every index once."""
    steps = [call("jitter", key=f"k{i}") if i % 3 else "<answer> 5 </answer>" for i in range(12)]
    many, one = ToolEnv([jitter], tool_concurrency=12), ToolEnv([jitter], tool_concurrency=1)
    a = many.step([TASK] * 12, steps, [True] * 12)
    b = one.step([TASK] * 12, steps, [True] * 12)
    strip = [(o.kind, o.done, o.reward, o.observation, o.info["messages"]) for o in a]
    assert strip == [(o.kind, o.done, o.reward, o.observation, o.info["messages"]) for o in b]
    order = [i for i, _ in step_stream(many, [TASK] * 12, steps, [True] * 12)]
    assert sorted(order) == list(range(12)) and order[:4] == [0, 3, 6, 9]


def test_each_call_records_its_latency_in_call_order() -> None:
    (out,) = ToolEnv([wait]).step([TASK], [call("wait", seconds=0.1)], [True])
    (bad,) = ToolEnv([wait]).step([TASK], [call("nope")], [True])
    assert len(out.info["tool_latency_s"]) == 1 and 0.09 < out.info["tool_latency_s"][0] < 0.5
    assert bad.info["tool_latency_s"] == [0.0]  # refused before it ran


def test_a_hung_call_does_not_hold_the_step_and_a_busy_loop_stops_spinning() -> None:
    """A call past its time-out is a time-out result at once; the abandoned thread is stopped (a busy
    pure-Python loop kept spinning on its thread before, slowing everything after it)."""
    EXITED.clear()
    env = ToolEnv([spin, wait], timeout_s=0.3)
    t0 = time.perf_counter()
    out = env.step([TASK] * 2, [call("spin", n=0), call("wait", seconds=0.0)], [True] * 2)
    assert time.perf_counter() - t0 < 1.5
    assert out[0].info["tool_error"] == "spin timed out after 0.3 s" and out[1].observation == tool_response("slept 0.0")
    assert EXITED.wait(5.0), "the abandoned busy loop is still running"
    assert env.tool_stats.take()["abandoned"] == 1


def test_a_tool_that_cannot_be_stopped_is_capped_with_one_line() -> None:
    """Calls that never return and cannot be interrupted (blocked in C) leak a thread each: past
    ``max_abandoned`` alive the run stops with one ConfigError line naming the tool."""
    gate = threading.Event()

    def block(n: int) -> str:
        """Block forever.

        Args:
            n: anything
        """
        gate.wait()
        return "never"

    tool = Tool.of(block)
    runner = ToolRunner(8, timeout_s=0.1, max_abandoned=len(REAPER.alive()) + 2)
    try:
        with pytest.raises(ConfigError, match=r"tool calls are still running after their time-out \(block") as e:
            for _ in range(3):
                list(runner.run([Job(i, [(tool, {"n": i})]) for i in range(2)]))
        assert "\n" not in str(e.value)
    finally:
        gate.set()
        runner.close()


def test_a_tool_cannot_end_the_run() -> None:
    """SystemExit and GeneratorExit from a tool are error results the model reads (a tool calling
    sys.exit() once ended training silently with exit code 0); KeyboardInterrupt stops with one line."""
    env = ToolEnv([leave])
    out = env.step([TASK] * 2, [call("leave", how="exit"), call("leave", how="generator")], [True] * 2)
    assert out[0].info["tool_error"] == "leave raised SystemExit: 3"
    assert out[1].info["tool_error"] == "leave raised GeneratorExit: gone"
    with pytest.raises(ConfigError, match="leave raised KeyboardInterrupt: the run stops"):
        env.step([TASK], [call("leave", how="interrupt")], [True])
    assert Tool.of(leave).call({"how": "exit"}).error == "leave raised SystemExit: 3"


async def await_wait(seconds: float) -> str:
    """Sleep, then say how long (async).

    Args:
        seconds: how long
    """
    await asyncio.sleep(seconds)
    return f"slept {seconds}"


def test_async_tools_are_awaited_concurrently_and_time_out() -> None:
    """An ``async def`` tool is awaited on the run's loop (it returned the text "<coroutine object …>")."""
    env = ToolEnv([await_wait], timeout_s=0.5)
    t0 = time.perf_counter()
    out = env.step([TASK] * 6, [call("await_wait", seconds=0.2)] * 6 + [], [True] * 6)
    assert all(o.observation == tool_response("slept 0.2") for o in out) and time.perf_counter() - t0 < 0.9
    (late,) = env.step([TASK], [call("await_wait", seconds=5.0)], [True])
    assert late.info["tool_error"] == "await_wait timed out after 0.5 s"


def test_tool_concurrency_reaches_the_env_from_the_config() -> None:
    """``tool_concurrency`` (TrainConfig) is the env's bound; 0 is refused in one line."""
    from treegrpo.tasks.custom import UserObjects, user_env
    from treegrpo.training.config import TrainConfig

    env = user_env(TrainConfig(tool_concurrency=3), UserObjects(tools=[wait]))
    assert isinstance(env, ToolEnv) and env._runner.concurrency == 3
    assert user_env(TrainConfig(), UserObjects(tools=[wait]))._runner.concurrency == 32  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="tool_concurrency=0: give 1"):
        ToolEnv([wait], tool_concurrency=0)


def nap(s: float) -> str:
    """Busy for ``s`` seconds.

    Args:
        s: seconds
    """
    end = time.perf_counter() + s
    while time.perf_counter() < end:
        pass
    return "ok"


def test_random_latencies_and_time_outs_on_pool_and_lanes_finish_every_job() -> None:
    """A race test: calls of random length around the time-out, on the pool and on four lanes, in
    jobs of one to three calls: every job comes back, with one result per call, each a result or a
    time-out or (after its lane died) a lost state. (An abandoned thread that finished its job's
    bookkeeping once lost a job, and the batch waited forever.)"""
    from treegrpo.envs.tool_runner import Lane

    rng = random.Random(0)
    runner = ToolRunner(6, timeout_s=0.04, max_abandoned=10_000)
    tool = Tool.of(nap)
    box: dict[str, object] = {}

    def rounds() -> None:
        for _ in range(3):
            lanes = [Lane() for _ in range(4)]
            jobs = [Job(i, [(tool, {"s": rng.random() * 0.06}) for _ in range(rng.randrange(1, 4))],
                        rng.choice([*lanes, None, None, None, None])) for i in range(40)]  # fmt: skip
            got = list(runner.run(jobs))
            assert sorted(j.index for j in got) == list(range(40))
            assert all(len(j.results) == len(j.calls) == len(j.latency_s) for j in got)
            assert {r.content.split(":")[0] for j in got for r in j.results} <= {"ok", "Error"}
            for lane in lanes:
                lane.stop()
        box["done"] = True

    t = threading.Thread(target=rounds, daemon=True)
    t.start()
    t.join(60)
    assert box.get("done"), "a batch never finished"
    runner.close()
