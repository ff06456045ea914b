"""The TRL rows of ``treegrpo bench tools``: ``GRPOTrainer(tools=[search])`` with the very function
treegrpo's rows call (:func:`~treegrpo.benchmarks.tools_env.latency_search_tool`), set up as
``bench peers``' multi-turn TRL row is (:func:`~treegrpo.benchmarks.peers_trl.trl_args`: G = 4
completions per prompt, the prompts in the order treegrpo draws them, treegrpo's agent limits as
TRL's budget — ``max_context_tokens`` minus the shortest prompt — and tool rounds, the same loss).

``smollm2``: the model's own tool calls (``chatml-tools``; :func:`~treegrpo.benchmarks.peers_trl.job_setup`).
``tiny``: the default job's agent speaks Search-R1's tags, which TRL does not parse, so TRL is
given the tags as a chat format (:data:`TAGS_TEMPLATE`: the prompt, each assistant turn's text
with its call written ``<search> query </search>``, each tool result as ``<information>`` — the
very text treegrpo's loop builds) and a parser (:func:`parse_tags`: the first ``<search>`` of a
turn is its call, the text after it dropped; TRL cannot stop generation at ``</search>``, so each
turn runs on to EOS or the budget, as TRL's turns do); the reward is the search env's score of the
last turn's answer.

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

TAGS_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'tool' -%}{{ '\n\n<information>' ~ (m.content | trim) ~ '</information>\n\n' }}"
    "{%- else -%}{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] -%}"
    "{%- if c.function.name == 'search' -%}<search> {{ c.function.arguments['query'] }} </search>"
    "{%- else -%}<{{ c.function.name }}>{{ c.function.arguments | tojson }}</{{ c.function.name }}>{%- endif -%}"
    "{%- endfor -%}{%- endif -%}{%- endfor -%}"
)
"""The tiny agent's tags as a chat template: what treegrpo's loop holds for the same turns."""


def parse_tags(tokenizer: Any, ids: Any, prefix: Any = None, tools: Any = None) -> dict[str, Any]:
    """One generated turn as TRL's assistant message: its first ``<search> q </search>`` a
    ``search(query=q)`` call (the text before it the content, the rest dropped), else the text."""
    from treegrpo.envs.search import ACTION_RE

    text = tokenizer.decode(list(ids), skip_special_tokens=True)
    m = ACTION_RE.search(text)
    if m is None or m.group(1) != "search" or not m.group(2).strip():
        return {"role": "assistant", "content": text}
    call = {"type": "function", "function": {"name": "search", "arguments": {"query": m.group(2).strip()}}}
    return {"role": "assistant", "content": text[: m.start()], "tool_calls": [call]}


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
    if row.job == "tiny":
        cfg, model, tok, train_tasks, env, agent = _tiny_job(cfg)
    else:
        train_tasks = split_tasks(cfg)[0]
        model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32, attn_implementation="sdpa")
        tok = _tokenizer(cfg)
        agent = agent_limits(cfg, getattr(model.config, "max_position_embeddings", None))
    tasks = {t.id: t for t in train_tasks}
    order = prompt_order(train_tasks, cfg.seed, cfg.steps, cfg.prompts_per_step)
    if row.job == "tiny":
        setup = _tiny_setup(env, tok, tasks, order, agent)
        retriever, topk = env.retriever, env.topk
    else:
        setup = job_setup("multi_turn", cfg, tok, tasks, order, agent)
        retriever = make_retriever(corpus=cfg.corpus, url=cfg.retriever_url, allow_offline=cfg.allow_offline_retriever)
        topk = cfg.topk
    calls = _CallClock()
    search = calls.wrap(latency_search_tool(retriever, topk, row.latency))
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

    if row.job == "tiny":
        tok.chat_template, tok.response_schema = TAGS_TEMPLATE, {"parser": "parse_tags"}  # see parse_tags
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
    import trl.trainer.grpo_trainer as grpo

    parse = grpo.parse_response
    if row.job == "tiny":
        grpo.parse_response = parse_tags  # TRL's parser of a turn's calls, for this row only
    try:
        trainer.train()
    finally:
        grpo.parse_response = parse
    del trainer, model
    return {"steps": steps[spec.warmup :], "warmup_steps": steps[: spec.warmup], "config": config,
            "trl": {"loss_type": LOSS_PAIRS[cfg.agg_mode], "max_completion_length": setup.max_completion_length,
                    "max_tool_calling_iterations": setup.max_tool_calling_iterations},
            "printed_tail": printed.getvalue().splitlines()[-3:]}  # fmt: skip


def _tiny_job(cfg: Any) -> tuple[Any, Any, Any, list[Any], Any, Any]:
    """The default job's pieces as its run builds them: the config with its ``auto`` fields
    resolved, the model, tokenizer, training questions, search env and agent limits."""
    from treegrpo.models.loader import MARKER_FILE
    from treegrpo.training.defaults import resolve_model_defaults
    from treegrpo.training.setup import build_run

    parts = build_run(cfg)
    limits = {k: getattr(parts.agent_cfg, k) for k in ("max_step_tokens", "max_context_tokens")}
    cfg = resolve_model_defaults(cfg, tiny=(parts.model_dir / MARKER_FILE).is_file(), limits=limits)
    return cfg, parts.model, parts.tokenizer, list(parts.train_tasks), parts.env, parts.agent_cfg


def _tiny_setup(env: Any, tok: Any, tasks: dict[str, Any], order: list[list[str]], agent: Any) -> Any:
    """TRL's budget, tool rounds and reward for the default job (the module docstring)."""
    from treegrpo.benchmarks.peers_trl import JobSetup

    lengths = [len(tok.encode(env.prompt(tasks[i]), add_special_tokens=False)) for step in order for i in step]
    means: list[float] = []

    def env_reward(completions: list[Any], task_id: list[str], **_: Any) -> list[float]:
        """The search env's score of the last turn (its answer; a turn without one scores 0)."""
        last = [c[-1]["content"] if isinstance(c, list) else str(c) for c in completions]
        got = [float(env.step([tasks[i]], [t], [False])[0].reward or 0.0) for i, t in zip(task_id, last, strict=True)]
        means.append(sum(got) / max(1, len(got)))
        return got

    budget = max(agent.max_step_tokens, agent.max_context_tokens - min(lengths))
    return JobSetup(env, [], env_reward, budget, agent.max_turns, agent, reward_means=means)


__all__ = ["TAGS_TEMPLATE", "parse_tags", "trl_tools_row"]
