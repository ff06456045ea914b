"""The pipelined loop (rollout/pipeline.py) under random tool latencies: DESIGN.md §3 invariants 1-5
and 9 — token-in/token-out, exact budget, masking, shared prefixes generated once, and the same
forest as the sequential loop with per-trajectory streams, whatever the timing."""

from __future__ import annotations

import dataclasses
import queue
import random
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from fakes import ScriptedEngine
from treegrpo.benchmarks.stateful_exact import ByteTokenizer, agent_config
from treegrpo.envs.base import StepOutcome, Task
from treegrpo.envs.search import SearchEnv
from treegrpo.errors import ConfigError
from treegrpo.models.loader import load_tokenizer
from treegrpo.retrieval.base import Doc
from treegrpo.retrieval.bm25 import BM25Retriever
from treegrpo.rollout.agent import AgentConfig, RolloutResult, StepRunner
from treegrpo.rollout.engine import Generation, SamplingParams
from treegrpo.rollout.pipeline import chain_latency, launch_due, tool_latency
from treegrpo.rollout.samplers import SamplerConfig, sample_chains, sample_trees
from treegrpo.rollout.token_budget import sample_token_matched
from treegrpo.tasks.kv.env import KVEnv, kv_tasks, random_kv_action
from treegrpo.tree import Forest, Node, Tree

DOCS = [
    Doc("0", "paris\nparis is the capital of france."),
    Doc("1", "rome\nrome is the capital of italy."),
    Doc("2", "oslo\noslo is the capital of norway."),
]
TASKS = [Task(f"q{i}", f"what is the capital number {i}?", ["paris"]) for i in range(5)]


def wandering_policy(context: str, draw: float) -> str:
    """Searches a while (what depends on the draw), then answers; sometimes malformed."""
    if context.count("<information>") >= 3 or draw < 0.25:
        return "<answer> paris </answer>" if draw < 0.15 or draw > 0.6 else "<answer> rome </answer>"
    if draw < 0.35:
        return "no tags at all"
    return "<search> capital france </search>" if draw < 0.7 else "<search> oslo norway </search>"


class LatencyEnv:
    """Wraps an env: each step of a batch is answered on its own thread after a random delay
    (``step_stream`` yields in completion order, so out of order), calls record
    ``tool_latency_s``, and ``tool_stats`` counts them. ``step`` is the same, collected in order."""

    def __init__(self, inner: Any, seed: int, max_delay: float = 0.015) -> None:
        self.inner = inner
        self.rng = random.Random(seed)
        self.max_delay = max_delay
        self.lock = threading.Lock()
        self.stats = {"calls": 0, "busy_s": 0.0, "peak_in_flight": 0, "abandoned": 0}
        self.out = 0
        self.batches = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @property
    def tool_stats(self) -> LatencyEnv:
        return self

    def take(self) -> dict[str, Any]:
        with self.lock:
            out, self.stats = self.stats, {"calls": 0, "busy_s": 0.0, "peak_in_flight": 0, "abandoned": 0}
        return out

    def step_stream(self, tasks: Sequence[Task], steps: Sequence[str], allowed: Sequence[bool], **kw: Any
                    ) -> Iterator[tuple[int, StepOutcome]]:  # fmt: skip
        done: queue.SimpleQueue[tuple[int, StepOutcome]] = queue.SimpleQueue()
        with self.lock:
            self.batches += 1
            delays = [self.rng.uniform(0.0, self.max_delay) for _ in steps]

        def one(i: int) -> None:
            with self.lock:
                self.out += 1
                self.stats["peak_in_flight"] = max(self.stats["peak_in_flight"], self.out)
            time.sleep(delays[i])
            (o,) = self.inner.step([tasks[i]], [steps[i]], [allowed[i]], **{k: [v[i]] for k, v in kw.items()})
            if o.tool_calls:
                o.info = {**o.info, "tool_latency_s": [round(delays[i], 6)]}
            with self.lock:
                self.out -= 1
                self.stats["calls"] += o.tool_calls
                self.stats["busy_s"] += delays[i]
            done.put((i, o))

        for i in range(len(steps)):
            threading.Thread(target=one, args=(i,), daemon=True).start()
        for _ in steps:
            yield done.get()

    def step(self, tasks: Sequence[Task], steps: Sequence[str], allowed: Sequence[bool], **kw: Any) -> list[StepOutcome]:
        got = dict(self.step_stream(tasks, steps, allowed, **kw))
        return [got[i] for i in range(len(steps))]


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Any:
    return load_tokenizer(tiny_model_dir)


def search_runner(tok: Any, seed: int, **cfg: Any) -> tuple[StepRunner, ScriptedEngine, LatencyEnv]:
    engine = ScriptedEngine(tok, wandering_policy)
    env = LatencyEnv(SearchEnv(BM25Retriever(DOCS), topk=2, prompt_template="minimal"), seed)
    return StepRunner(engine, env, tok, AgentConfig(max_turns=3, **cfg)), engine, env


def grow(runner: StepRunner, shape: tuple[int, int, int] = (2, 2, 2), seed: int = 0) -> RolloutResult:
    m, n, l = shape
    cfg = SamplerConfig("tree", m=m, n=n, l=l, expand_mode="random")
    return sample_trees(runner, TASKS, cfg, random.Random(seed), torch.Generator().manual_seed(seed))


def timeless(forests: Sequence[Forest]) -> list[Any]:
    """The forests as JSON, without the measured latencies (the one thing timing may change)."""
    docs = [f.to_json() for f in forests]
    for d in docs:
        for t in d["trees"]:
            for n in t["nodes"]:
                n.pop("tool_latency_s", None)
    return docs


# ------------------------------------------------------------------ the same forest, any timing


def test_pipelined_forest_is_the_sequential_forest_with_trajectory_streams(tok: Any) -> None:
    seq, _, _ = search_runner(tok, 1, trajectory_streams=True)
    want = grow(seq)
    for latency_seed in (2, 3, 4):
        pipe, engine, env = search_runner(tok, latency_seed, rollout_pipeline=True)
        got = grow(pipe)
        assert timeless(got.forests) == timeless(want.forests)
        assert [b.to_dict() for b in got.budgets] == [b.to_dict() for b in want.budgets]
    assert env.batches > 0 and len(engine.calls) > 0
    # the trees really branched, and node ids are dense in place order
    assert max(f.n_trajectories() for f in want.forests) == 2 * (1 + 2 * 2)
    for f in want.forests:
        for t in f.trees:
            assert [n.id for n in t.nodes] == list(range(len(t.nodes)))


def test_trajectory_streams_do_not_depend_on_who_shares_a_call(tok: Any) -> None:
    """Per-trajectory streams: one prompt alone grows the same forest as with four others."""
    alone, _, _ = search_runner(tok, 1, trajectory_streams=True)
    crowd, _, _ = search_runner(tok, 1, trajectory_streams=True)
    cfg = SamplerConfig("tree", m=2, n=2, l=1)
    # the first forest of a call: same forest index, same streams
    a = sample_trees(alone, TASKS[:1], cfg, random.Random(0), torch.Generator().manual_seed(0))
    b = sample_trees(crowd, TASKS, cfg, random.Random(0), torch.Generator().manual_seed(0))
    assert timeless(a.forests) == timeless(b.forests[:1])


def test_batch_stream_default_is_the_old_loop(tok: Any) -> None:
    """Streams off: no lineage in the nodes, the batch generator drawn in request order (a
    scripted engine that ignores seeds would give the same forest)."""
    runner, _, _ = search_runner(tok, 1)
    res = grow(runner)
    assert all("lineage" not in n.extra for f in res.forests for t in f.trees for n in t.nodes)
    assert runner.cfg.streams is False


# ------------------------------------------------------------------ the §3 invariants under latency


def request_contexts(engine: ScriptedEngine) -> list[tuple[int, ...]]:
    return sorted(tuple(c) for call in engine.calls for c in call)


@pytest.mark.parametrize("seed", [5, 6])
def test_invariants_under_random_latencies(tok: Any, seed: int) -> None:
    runner, engine, _ = search_runner(tok, seed, rollout_pipeline=True)
    res = grow(runner, shape=(2, 2, 2), seed=seed)
    stored, parents, nodes = [], [], 0
    for f, b in zip(res.forests, res.budgets, strict=True):
        gen = calls = reqs = 0
        for t in f.trees:
            for n in t.nodes[1:]:
                k = n.n_policy_tokens
                assert n.policy_mask == [1] * k + [0] * (len(n.tokens) - k)  # masking
                assert n.logprobs[k:] == [0.0] * (len(n.tokens) - k)
                if n.observation is not None:  # tokenized once, as kept
                    assert n.tokens[k:] == tok.encode(n.observation, add_special_tokens=False)
                stored.append(tuple(n.tokens[:k]))
                parents.append(tuple(t.context(n.parent)))
                gen, calls, reqs = gen + k, calls + ("tool_latency_s" in n.extra), reqs + 1
        assert (b.generated_tokens, b.tool_calls, b.engine_requests) == (gen, calls, reqs)  # exact budget
        nodes += reqs
    # token-in/token-out: the ids stored are the ids the engine returned, each once
    assert sorted(stored) == sorted(tuple(g) for g in engine.generated)
    # each node's step was generated once, from its parent's full context (expansions start there)
    assert request_contexts(engine) == sorted(parents) and len(parents) == nodes
    assert res.engine_calls == len(engine.calls)


def test_a_ready_trajectory_is_generated_while_a_slow_call_is_in_flight(tok: Any) -> None:
    """One trajectory's tool call blocks until the engine has taken another trajectory's next
    step: the sequential loop would wait for it (and time out here); the pipelined loop goes on."""
    went_on = threading.Event()

    class Blocking(LatencyEnv):
        def step_stream(self, tasks: Sequence[Task], steps: Sequence[str], allowed: Sequence[bool], **kw: Any
                        ) -> Iterator[tuple[int, StepOutcome]]:  # fmt: skip
            outs = self.inner.step(tasks, steps, allowed, **kw)
            slow = [i for i, t in enumerate(tasks) if t.id == "q0" and outs[i].kind == "search"]
            for i, o in enumerate(outs):
                if i not in slow:
                    yield i, o
            for i in slow:
                assert went_on.wait(timeout=5.0), "the loop waited for the slowest call of the turn"
                yield i, outs[i]

    def policy(context: str, draw: float) -> str:
        if "capital number 1" in context and "<information>" in context:
            went_on.set()  # q1's second step is being generated
        return "<answer> paris </answer>" if "<information>" in context else "<search> capital france </search>"

    env = Blocking(SearchEnv(BM25Retriever(DOCS), topk=2, prompt_template="minimal"), 0)
    runner = StepRunner(ScriptedEngine(tok, policy), env, tok, AgentConfig(max_turns=3, rollout_pipeline=True))
    res = sample_chains(runner, TASKS[:2], SamplerConfig("chain", group_size=1), random.Random(0), None)
    assert went_on.is_set() and res.engine_calls == 3  # q0+q1, then q1 alone, then q0 alone
    assert [f.trees[0].leaves()[0].extra["kind"] for f in res.forests] == ["answer", "answer"]


def test_no_latency_pipelined_makes_the_sequential_calls(tok: Any) -> None:
    """An env without a step_stream (the search env: its batch answered by one ``step``): the
    pipelined loop's engine calls are the sequential loop's, batch for batch."""
    e1, e2 = ScriptedEngine(tok, wandering_policy), ScriptedEngine(tok, wandering_policy)
    env = SearchEnv(BM25Retriever(DOCS), topk=2, prompt_template="minimal")
    seq = StepRunner(e1, env, tok, AgentConfig(max_turns=3, trajectory_streams=True))
    pipe = StepRunner(e2, env, tok, AgentConfig(max_turns=3, rollout_pipeline=True))
    assert timeless(grow(seq).forests) == timeless(grow(pipe).forests)
    assert [sorted(map(tuple, c)) for c in e1.calls] == [sorted(map(tuple, c)) for c in e2.calls]


def test_a_failing_env_step_stops_the_rollout_with_its_error(tok: Any) -> None:
    class Broken(LatencyEnv):
        def step_stream(self, tasks: Sequence[Task], steps: Sequence[str], allowed: Sequence[bool], **kw: Any
                        ) -> Iterator[tuple[int, StepOutcome]]:  # fmt: skip
            yield 0, StepOutcome("search", False, observation="x")
            yield 0, StepOutcome("search", False, observation="x")

    env = Broken(SearchEnv(BM25Retriever(DOCS), topk=2, prompt_template="minimal"), 0)
    runner = StepRunner(ScriptedEngine(tok, wandering_policy), env, tok, AgentConfig(rollout_pipeline=True))
    with pytest.raises(ConfigError, match="step_stream gave index 0"):
        sample_chains(runner, TASKS[:2], SamplerConfig("chain", group_size=2), random.Random(0), None)


def test_an_engine_without_seeds_is_refused_with_one_line(tok: Any) -> None:
    class Old:
        eos_token_id = None

        def generate(self, contexts: Any, params: SamplingParams, generator: Any = None) -> list[Generation]:
            return []

    env = SearchEnv(BM25Retriever(DOCS), topk=2, prompt_template="minimal")
    with pytest.raises(ConfigError, match="need an engine whose generate takes seeds="):
        StepRunner(Old(), env, tok, AgentConfig(rollout_pipeline=True))  # type: ignore[arg-type]
    StepRunner(Old(), env, tok, AgentConfig())  # type: ignore[arg-type]  # the default loop needs none


# ------------------------------------------------------------------ stateful tools, token budget


class SeededActionEngine:
    """Every step is ``random_kv_action`` drawn from ``random.Random(seed)`` of its request."""

    eos_token_id: int | None = None

    def __init__(self) -> None:
        self.tok = ByteTokenizer()

    def generate(self, contexts: Sequence[Sequence[int]], params: SamplingParams, generator: Any = None,
                 seeds: Sequence[int] | None = None) -> list[Generation]:  # fmt: skip
        assert seeds is not None
        out = []
        for ctx, s in zip(contexts, seeds, strict=True):
            ids = self.tok.encode(random_kv_action(random.Random(s)))[: params.max_new_tokens]
            out.append(Generation(ids, [-0.5] * len(ids), "stop", prefill_tokens=len(ctx)))
        return out

    def load_weights(self, model: Any) -> None:
        pass


@pytest.mark.parametrize("mode", ["snapshot", "fork", "replay"])
def test_stateful_tools_pipelined_give_the_sequential_forest(mode: str) -> None:
    tasks = kv_tasks(6, seed=3)
    cfg = SamplerConfig("tree", m=2, n=2, l=2)
    forests = []
    for pipelined, latency_seed in ((False, 0), (True, 1), (True, 2)):
        env = LatencyEnv(KVEnv(mode), latency_seed, max_delay=0.005)
        acfg = dataclasses.replace(agent_config(3), trajectory_streams=True, rollout_pipeline=pipelined)
        runner = StepRunner(SeededActionEngine(), env, ByteTokenizer(), acfg)
        res = sample_trees(runner, tasks, cfg, random.Random(7), torch.Generator().manual_seed(7))
        assert env.inner.open_states == 0  # every state handle handed back
        forests.append(timeless(res.forests))
    assert forests[0] == forests[1] == forests[2]


def test_token_matched_tree_runs_pipelined_within_its_budget(tok: Any) -> None:
    runner, engine, _ = search_runner(tok, 3, rollout_pipeline=True)
    cfg = SamplerConfig("tree", m=2, n=2, l=1, budget_tokens=60)
    res = sample_token_matched(runner, TASKS, cfg, random.Random(0), torch.Generator().manual_seed(0))
    assert sum(b.engine_requests for b in res.budgets) == sum(len(c) for c in engine.calls)
    for f in res.forests:
        for t in f.trees:
            assert [n.id for n in t.nodes] == list(range(len(t.nodes)))


# ------------------------------------------------------------------ what a run shows


def test_loop_stats_and_tool_stats(tok: Any) -> None:
    runner, _, env = search_runner(tok, 2, rollout_pipeline=True)
    env.max_delay = 0.03
    grow(runner, shape=(2, 2, 1))
    stats = runner.loop_stats.take()
    assert stats.engine_s > 0 and stats.env_s > 0 and 0 < stats.idle_s <= stats.env_s + 0.05
    assert stats.peak_in_flight >= 2
    assert runner.loop_stats.take().env_s == 0.0  # reset
    tool = env.take()
    assert tool["calls"] > 0 and tool["peak_in_flight"] >= 2


def lat_node(i: int, parent: int | None, lat: Sequence[float] = ()) -> Node:
    return Node(i, parent, extra={"tool_latency_s": list(lat)} if lat else {})


def test_chain_latency_is_the_longest_path_sum() -> None:
    # 0 ─ 1 [0.2] ─ 2 [0.1, 0.3] ─ 3 []      path 0-1-2-3: 0.6
    #   └ 4 [0.5]                           path 0-4: 0.5
    #   1 ─ 5 [0.35]                        path 0-1-5: 0.55
    tree = Tree([lat_node(0, None), lat_node(1, 0, [0.2]), lat_node(2, 1, [0.1, 0.3]), lat_node(3, 2),
                 lat_node(4, 0, [0.5]), lat_node(5, 1, [0.35])])  # fmt: skip
    assert tool_latency(tree) == pytest.approx(0.6)
    other = Tree([lat_node(0, None), lat_node(1, 0, [1.5])])
    assert chain_latency([Forest("p", [tree]), Forest("q", [Tree([lat_node(0, None)]), other])]) == pytest.approx(1.5)
    assert chain_latency([]) == 0.0


def test_launch_policy() -> None:
    # nothing in flight: go at once, whatever the times
    assert launch_due(10.0, 0, 10.0, 10.0, 1.0)
    # results keep arriving (last one 10 ms ago, quiet = 50 ms for a 1 s call): gather
    assert not launch_due(10.0, 3, 9.9, 9.99, 1.0)
    # a quiet pause of 50 ms: go
    assert launch_due(10.0, 3, 9.9, 9.95, 1.0)
    # arrivals never pause, but the first ready one has waited half a call: go
    assert launch_due(10.0, 3, 9.5, 9.999, 1.0)
    # a fast engine (10 ms calls): the pause floor is 2 ms, the longest wait 5 ms
    assert not launch_due(10.0, 1, 9.999, 9.999, 0.01) and launch_due(10.0, 1, 9.999, 9.997, 0.01)
    assert launch_due(10.0, 1, 9.995, 9.999, 0.01)
