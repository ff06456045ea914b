"""The TRL row of ``treegrpo bench tools``: ``GRPOTrainer(tools=[search])`` on the ``smollm2`` job
with the very function treegrpo's row calls (:func:`~treegrpo.benchmarks.tools_env.latency_search_tool`),
set up as ``bench peers``' multi-turn TRL row is (:func:`~treegrpo.benchmarks.peers_trl.job_setup`,
:func:`~treegrpo.benchmarks.peers_trl.trl_args`: G = 4 completions per prompt, the prompts in the
order treegrpo draws them, its agent limits as TRL's budget and tool rounds, the same loss).

TRL calls a batch's sync tools one after another (``_tool_call_loop``); a tool round's calls of
all trajectories then wait for the next ``generate``. Per step the row records wall (a
``TrainerCallback``: ``on_step_begin`` to ``on_step_end``), the rollout's wall
(``_generate_and_score_completions``), the tool calls and the seconds with a call in flight
(``tools_wall_s``: the calls are timed by a wrapper around the tool, which TRL runs one at a time,
so it is their summed latency), and its generated tokens; the engine metrics of treegrpo's rows
(idle, chain) are ``None``.
"""

from __future__ import annotations

import functools
import io
import time
from pathlib import Path
from typing import Any

import torch

from treegrpo.benchmarks.peers import LOSS_PAIRS, prompt_order
from treegrpo.benchmarks.peers_trl import _tokenizer, agent_limits, job_setup, prompt_messages, trl_args
from treegrpo.benchmarks.tools_env import latency_search_tool


class _CallClock:
    """Wraps a tool: each call's (start, end) wall clock, for the seconds with a call in flight."""

    def __init__(self) -> None:
        self.spans: list[tuple[float, float]] = []

    def wrap(self, fn: Any) -> Any:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spans.append((t0, time.perf_counter()))

        return timed

    def take(self) -> tuple[int, float]:
        """Calls and seconds with at least one in flight since the last take."""
        spans, self.spans = sorted(self.spans), []
        busy, end = 0.0, float("-inf")
        for a, b in spans:
            busy += max(0.0, b - max(a, end))
            end = max(end, b)
        return len(spans), busy


def trl_tools_row(spec: Any, row: Any, out_dir: Path, config: dict[str, Any]) -> dict[str, Any]:
    """Train ``spec.warmup + spec.steps`` steps of TRL's tool loop on ``row`` (``smollm2``, chain)
    with the search of latency ``row.latency``; the row's record (``steps`` as ``STEP_KEYS``)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOTrainer

    from treegrpo.retrieval.factory import make_retriever
    from treegrpo.tasks.datafile import split_tasks
    from treegrpo.training.config import TrainConfig

    cfg = TrainConfig(**config)
    train_tasks = split_tasks(cfg)[0]
    tasks = {t.id: t for t in train_tasks}
    order = prompt_order(train_tasks, cfg.seed, cfg.steps, cfg.prompts_per_step)
    model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32, attn_implementation="sdpa")
    tok = _tokenizer(cfg)
    agent = agent_limits(cfg, getattr(model.config, "max_position_embeddings", None))
    setup = job_setup("multi_turn", cfg, tok, tasks, order, agent)
    retriever = make_retriever(corpus=cfg.corpus, url=cfg.retriever_url, allow_offline=cfg.allow_offline_retriever)
    calls = _CallClock()
    search = calls.wrap(latency_search_tool(retriever, cfg.topk, row.latency))
    dataset = Dataset.from_list(
        [{"prompt": prompt_messages(setup.env, tasks[i]), "task_id": i} for step in order for i in step]
    )
    args = trl_args(cfg, LOSS_PAIRS[cfg.agg_mode], out_dir / "trl", len(order[0]) * cfg.group_size,
                    setup.max_completion_length, setup.max_tool_calling_iterations)  # fmt: skip
    steps: list[dict[str, Any]] = []
    rollouts: list[tuple[float, int]] = []
    began = [0.0]

    class StepClock(TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            calls.take()
            began[0] = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            wall = time.perf_counter() - began[0]
            n, busy = calls.take()
            roll, generated = rollouts[-1] if rollouts else (0.0, 0)
            steps.append({
                "wall_s": wall, "rollout_s": roll, "update_s": wall - roll, "tools_wall_s": busy, "peak_in_flight": 1.0 if n else 0.0,
                "engine_idle_s": None, "engine_s": None, "chain_latency_s": None, "tool_calls": float(n),
                "generated_tokens": float(generated), "trajectories": float(len(order[0]) * cfg.group_size),
            })  # fmt: skip

    trainer = GRPOTrainer(model=model, reward_funcs=[setup.reward], args=args, train_dataset=dataset,
                          processing_class=tok, callbacks=[StepClock()], tools=[search])  # fmt: skip
    inner = trainer._generate_and_score_completions

    def timed(inputs: Any) -> Any:
        t0 = time.perf_counter()
        out = inner(inputs)
        own = out["completion_mask"] * out["tool_mask"] if out.get("tool_mask") is not None else out["completion_mask"]
        rollouts.append((time.perf_counter() - t0, int(own.sum())))
        return out

    trainer._generate_and_score_completions = timed  # type: ignore[method-assign]
    printed = io.StringIO()
    trainer.train()
    del trainer, model
    return {"steps": steps[spec.warmup :], "warmup_steps": steps[: spec.warmup], "config": config,
            "trl": {"loss_type": LOSS_PAIRS[cfg.agg_mode], "max_completion_length": setup.max_completion_length,
                    "max_tool_calling_iterations": setup.max_tool_calling_iterations},
            "printed_tail": printed.getvalue().splitlines()[-3:]}  # fmt: skip


__all__ = ["trl_tools_row"]
