"""``treegrpo warmup``: supervised warm-up of any model on protocol demonstrations made from a run's
questions and retriever, so a small instruct model learns the tags before RL.

The same idea as the tiny agent's bootstrap (:mod:`treegrpo.tasks.world.bootstrap`), for a real
model: the run config (:class:`~treegrpo.training.config.TrainConfig`: ``--model``, ``--data``,
``--corpus``/``--retriever-url``, prompt and agent limits) builds the model, env and questions
exactly as ``treegrpo train`` would (:func:`~treegrpo.training.setup.build_run`); demonstrations come
from :func:`~treegrpo.tasks.datafile.search_demos` (search the question, read, answer) and are
encoded exactly as the agent loop builds a context (chat template included); the held-out
questions are measured before and after through the real agent loop (success and well-formed
rate, greedy and sampled). The output folder is a ``from_pretrained`` folder — a ``--model`` for
``treegrpo train`` — written atomically, with ``treegrpo_warmup.json`` recording what was done.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from treegrpo.errors import ConfigError
from treegrpo.io import atomic_write_dir
from treegrpo.models.loader import LoadedModel
from treegrpo.progress import progress_bars
from treegrpo.rollout.agent import StepRunner
from treegrpo.rollout.engine import make_engine
from treegrpo.tasks.custom import UserObjects, is_custom, protocol_of
from treegrpo.tasks.datafile import search_demos
from treegrpo.training.config import TrainConfig
from treegrpo.training.demo_file import read_demos
from treegrpo.training.evaluate import evaluate
from treegrpo.training.memory import return_freed_memory
from treegrpo.training.report import eval_label
from treegrpo.training.setup import build_run
from treegrpo.training.warmup import (
    WARMUP_RECORD,
    WarmupConfig,
    demos_over_context,
    sft_steps,
    supervised_warmup,
)

RECORD_FILE = WARMUP_RECORD  # read back by build_run: the agent settings it was taught with
#: The real-model warm-up recipe: one epoch at lr 1e-4 (full fine-tuning), batches of 4, one demo
#: per forward/backward (a whole batch of SmolLM2-135M demos in one pass ran out of memory). On
#: SmolLM2-135M, 96 demos (24 steps) took held-out EM 0.000 -> 0.625 (``bench real``).
REAL_MODEL_SFT = WarmupConfig(epochs=1, batch_size=4, pack_len=1024, lr=1e-4, warmup_frac=0.1, micro_batch_size=1)


@dataclass(frozen=True)
class WarmupRun:
    """What to warm up on, beyond the run config.

    Attributes:
        out: the folder to write (a ``--model`` for ``treegrpo train``).
        demos: demonstrations to train on (the first questions of the training split).
        sft: the optimisation recipe (:data:`REAL_MODEL_SFT`).
        eval_prompts: held-out questions measured before and after.
        seed: batch order.
        log_every: when the console is not a terminal (a log file, a pipe), a progress line
            (step, loss, demos/s, ETA) every this many optimizer steps and after the last;
            0 = about 20 lines a run (every ``steps // 20`` steps, at least every step).
    """

    out: Path
    demos: int = 96
    sft: WarmupConfig = REAL_MODEL_SFT
    eval_prompts: int = 32
    seed: int = 0
    log_every: int = 0
    demos_file: Path | Sequence[Mapping[str, Any]] | None = None
    """Your own demonstrations (a JSONL/parquet file or records, :mod:`treegrpo.training.demo_file`)
    instead of the search task's made ones."""


def sft_recipe(epochs: float = 1.0, lr: float = 1e-4, batch_size: int = 4, share_prefix: bool = False) -> WarmupConfig:
    """:data:`REAL_MODEL_SFT` with these passes, learning rate, batch size and prefix sharing
    (:attr:`~treegrpo.training.warmup.WarmupConfig.share_prefix`)."""
    return dataclasses.replace(REAL_MODEL_SFT, epochs=epochs, lr=lr, batch_size=batch_size, share_prefix=share_prefix)


def run_warmup(
    cfg: TrainConfig,
    run: WarmupRun,
    console: Console | None = None,
    user: UserObjects | None = None,
    loaded: LoadedModel | None = None,
) -> dict[str, Any]:
    """Warm ``cfg.model`` up (see the module docstring) on ``run.demos_file`` (your own
    demonstrations, for any env or tools: ``user`` holds a Python caller's objects) or on search
    demos made from ``cfg.data``; returns the record written with it."""
    console = console or Console(soft_wrap=True)
    if run.demos_file is None and (is_custom(cfg, user) or not cfg.data):
        raise ConfigError(
            "warmup needs demonstrations: --demos demos.jsonl (your own, docs/tools.md), or for the search task "
            "--data Q (e.g. wiki-vital-qa) --corpus C to make them"
        )
    t0 = time.perf_counter()
    return_freed_memory()  # glibc: freed activations go back to the OS (peak RSS), see training/memory.py
    parts = build_run(cfg, user=user, loaded=loaded, need_data=run.demos_file is None)
    model, tok = parts.model, parts.tokenizer
    env = parts.env
    if run.demos_file is not None:
        demos = read_demos(env, run.demos_file, parts.agent_cfg.max_turns)
    else:
        demos = search_demos(parts.train_tasks[: run.demos], env)  # type: ignore[arg-type]
    if not demos:
        raise ConfigError(f"--data {cfg.data}: no question's search found its answer; check the retriever/corpus")
    encoder = StepRunner(None, env, tok, parts.agent_cfg)  # type: ignore[arg-type]  # encoding only
    encoded, too_long, over = demos_over_context(encoder, demos)
    if over:  # longer than the context the loop allows: one line naming the first, the fix
        i, n = over[0]
        source = run.demos_file.name if isinstance(run.demos_file, Path) else "demos"
        raise ConfigError(
            f"{source}: demo {i + 1} ({demos[i].task.question[:40]!r}) is {n} tokens, longer than max_context_tokens="
            f"{encoder.cfg.max_context_tokens} (the agent loop would end it there); shorten it or raise "
            f"--set max_context_tokens=N ({len(over)} demo(s) over)"
        )
    if too_long:
        console.print(
            f"skipped {too_long} of {len(demos)} demos with a step over max_step_tokens="
            f"{parts.agent_cfg.max_step_tokens} (the loop would cut it off)"
        )
    if not encoded:
        raise ConfigError(
            f"every demo has a step over max_step_tokens={parts.agent_cfg.max_step_tokens}; raise it (--set max_step_tokens=N)"
        )
    runner = StepRunner(make_engine(cfg.engine, model, tok, device=cfg.device, **cfg.engine_options), env, tok, parts.agent_cfg)
    if runner.context_note:  # the engine's max_model_len is below the context budget
        console.print(runner.context_note)
    eval_tasks = parts.eval_tasks[: run.eval_prompts]
    asked = len(demos) if run.demos_file is not None else min(run.demos, len(parts.train_tasks))
    console.print(f"[bold]warmup[/] {parts.model_dir} · {len(encoded)} demos of {asked} · {len(eval_tasks)} held-out")
    measure = (lambda: evaluate(runner, eval_tasks, cfg.eval_sampled)) if eval_tasks else dict
    if not eval_tasks:
        console.print("no held-out questions to measure: give --eval-data (or --data) to see the warm-up's effect")
    label = eval_label(env)  # held-out "success" (0/1 rewards) or "reward", as the trainer says
    before = measure()
    console.print(f"before: {_fmt(before, label)}")
    steps = sft_steps(len(encoded), run.sft)
    every = run.log_every or max(1, steps // 20)
    say = None if console.is_terminal else (lambda line: console.print(line, markup=False, highlight=False))
    console.print(f"SFT: {steps} optimizer steps of {run.sft.batch_size} demos")
    with progress_bars(console.is_terminal) as prog:  # a log gets `say`'s lines instead of a bar
        sft = supervised_warmup(
            model, encoded, run.sft, tok.pad_token_id, random.Random(run.seed), prog, say=say, say_every=every
        )
    runner.engine.load_weights(model)
    after = measure()
    console.print(f"after:  {_fmt(after, label)}")
    record = {
        "model": str(parts.model_dir),
        "data": cfg.data,
        "corpus": cfg.corpus,
        "retriever_url": cfg.retriever_url,
        "demos": len(encoded),
        "demos_file": str(run.demos_file) if isinstance(run.demos_file, str | Path) else None,
        "demos_over_step_cap": too_long,
        "demos_asked": run.demos,
        "eval_prompts": len(eval_tasks),
        "mean_tokens": sum(len(e.ids) for e in encoded) / len(encoded),
        "sft_config": asdict(run.sft),
        "sft": sft,
        "eval_before": before,
        "eval_after": after,
        "agent": asdict(parts.agent_cfg),
        "protocol": protocol_of(env),  # what protocol: auto resolves to when this folder is trained
        "wall_s": time.perf_counter() - t0,
    }

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / RECORD_FILE).write_text(json.dumps(record, indent=1))

    atomic_write_dir(run.out, write)
    console.print(f"saved to {run.out} (a --model for treegrpo train) in {record['wall_s']:.0f}s")
    return record


def _fmt(ev: dict[str, float], label: str = "success") -> str:
    """Held-out figures for the before/after lines; ``success_*`` is called ``label``
    (:func:`~treegrpo.training.report.eval_label`: ``reward`` when the rewards are not 0/1)."""
    return " · ".join(
        f"{k.removeprefix('eval/').replace('success_', f'{label}_')} {v:.3f}"
        for k, v in sorted(ev.items())
        if "tool" not in k
    )
