"""What a run shows about its tools (issue 41 item 3): tool wall seconds, calls in flight at peak,
engine idle time and the longest chain of dependent calls, in metrics.jsonl and the printed line —
and nothing new for a run whose env keeps no tool counters (the default run)."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from treegrpo.envs.base import StepOutcome, Task
from treegrpo.envs.search import SearchEnv
from treegrpo.models.loader import MARKER_FILE, load_model, load_tokenizer
from treegrpo.retrieval.base import Doc
from treegrpo.retrieval.bm25 import BM25Retriever
from treegrpo.rollout.agent import AgentConfig, LoopStats
from treegrpo.training.config import make_config
from treegrpo.training.report import step_line, tool_metrics
from treegrpo.training.setup import RunParts
from treegrpo.training.trainer import train
from treegrpo.tree import Forest, Node, Tree

DOCS = [Doc(str(i), f"city{i}\ncity{i} is in country{i % 3}.") for i in range(4)]
BASE = {
    "reward/mean": 0.5, "rollout/trajectories": 4, "budget/generated_tokens": 10, "budget/tool_calls_per_traj": 1.0,
    "rollout/turns_mean": 2.0, "time/rollout_s": 1.0, "time/update_s": 0.5,
}  # fmt: skip


def test_tool_metrics_prefer_the_envs_counters() -> None:
    tree = Tree([Node(0, None), Node(1, 0, extra={"tool_latency_s": [0.25, 0.5]}), Node(2, 1, extra={"tool_latency_s": [1.0]})])
    loop = LoopStats(engine_s=2.0, env_s=3.0, idle_s=1.5, peak_in_flight=8)
    own = tool_metrics(loop, None, [Forest("p", [tree])])
    assert own == {"tools/wall_s": 3.0, "tools/peak_in_flight": 8.0, "time/engine_idle_s": 1.5, "time/engine_s": 2.0,
                   "tools/chain_latency_s": 1.75}  # fmt: skip
    env = tool_metrics(loop, {"calls": 12, "busy_s": 0.9, "peak_in_flight": 5, "abandoned": 1}, [])
    assert (env["tools/wall_s"], env["tools/peak_in_flight"], env["tools/calls"], env["tools/abandoned"]) == (0.9, 5.0, 12.0, 1.0)
    assert env["tools/chain_latency_s"] == 0.0


def test_the_printed_line_shows_tools_only_when_measured() -> None:
    assert "tools" not in step_line(1, BASE).split("·")[-1]
    line = step_line(1, BASE | tool_metrics(LoopStats(1.0, 2.0, 0.75, 3), {"calls": 4, "busy_s": 2.5,
                                                                             "peak_in_flight": 6, "abandoned": 0}, []))  # fmt: skip
    assert "tools 2.5s peak 6 idle 0.8s chain 0.0s" in line


class CountingSearch(SearchEnv):
    """The search env with a 20 ms search, a latency per call in the node and ``tool_stats``."""

    def __init__(self) -> None:
        super().__init__(BM25Retriever(DOCS), topk=1, prompt_template="minimal")
        self.tool_stats = self
        self.calls = 0
        self.takes = 0

    def take(self) -> dict[str, Any]:
        self.takes += 1
        out = {"calls": self.calls, "busy_s": 0.02 * self.calls, "peak_in_flight": min(self.calls, 2), "abandoned": 0}
        self.calls = 0
        return out

    def step_stream(self, tasks: Sequence[Task], steps: Sequence[str], allowed: Sequence[bool], **kw: Any
                    ) -> Iterator[tuple[int, StepOutcome]]:  # fmt: skip
        for i, o in enumerate(self.step(tasks, steps, allowed, **kw)):
            if o.tool_calls:
                time.sleep(0.02)
                self.calls += o.tool_calls
                o.info = {**o.info, "tool_latency_s": [0.02]}
            yield i, o


def parts_of(tiny_model_dir: Path, env: Any, **agent: Any) -> RunParts:
    tasks = [Task("a", "where is city1?", ["country1"]), Task("b", "where is city2?", ["country2"])]
    return RunParts(
        model_dir=tiny_model_dir, model=load_model(tiny_model_dir), tokenizer=load_tokenizer(tiny_model_dir), env=env,
        train_tasks=tasks, eval_tasks=tasks,
        agent_cfg=AgentConfig(max_turns=2, max_step_tokens=12, max_obs_tokens=24, max_context_tokens=200, **agent),
        extra_files={MARKER_FILE: (tiny_model_dir / MARKER_FILE).read_text()}, info={},
    )  # fmt: skip


def test_a_pipelined_run_logs_and_prints_its_tools(tiny_model_dir: Path, tmp_path: Path) -> None:
    env = CountingSearch()
    out = tmp_path / "run"
    cfg = make_config({"steps": 1, "prompts_per_step": 2, "eval_every": 0, "out_dir": str(out), "tensorboard": False,
                       "dump_rollouts_every": 1})  # fmt: skip
    text = io.StringIO()
    train(cfg, Console(file=text, width=300), parts=parts_of(tiny_model_dir, env, rollout_pipeline=True))
    row = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][-1]
    forests = [json.loads(x) for x in next((out / "rollouts").glob("*.jsonl")).read_text().splitlines()]
    lat = [n["tool_latency_s"] for f in forests for t in f["trees"] for n in t["nodes"] if "tool_latency_s" in n]
    assert row["tools/calls"] == row["budget/tool_calls"] == len(lat)  # this rollout's calls, evaluation's dropped
    assert row["tools/wall_s"] == 0.02 * len(lat) and row["time/engine_idle_s"] >= 0.0
    assert (row["tools/chain_latency_s"] > 0) == bool(lat)
    assert " · tools " in text.getvalue() and env.takes == 2


def test_the_default_run_logs_no_tool_metrics(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    cfg = make_config({"steps": 1, "prompts_per_step": 2, "eval_every": 0, "out_dir": str(out), "tensorboard": False})
    env = SearchEnv(BM25Retriever(DOCS), topk=1, prompt_template="minimal")
    text = io.StringIO()
    train(cfg, Console(file=text, width=300), parts=parts_of(tiny_model_dir, env))
    row = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert not [k for k in row if k.startswith("tools/") or k in ("time/engine_idle_s", "time/engine_s")]
    assert " · tools " not in text.getvalue()
