"""Step costs of a real model for ``bench real``: engine vs ``model.generate``, and one RL step per mode.

:func:`engine_vs_generate` — the same prompts (the held-out questions through the chat template),
greedy, the same step cap and stop strings, once through the rollout engine (one batched call) and
once through ``model.generate`` (left-padded batch, ``stop_strings``); generated tokens are counted
up to and including the stop (EOS or the token completing a stop string), CPU seconds are the
process's (``time.process_time``), after one untimed warm call of each.

:func:`step_costs` — one ``treegrpo train --steps 1`` (tree (2,2,1), 2 prompts) per mode
(:data:`MODES`: per path, packed, packed with LoRA), each in a fresh child process of a fresh
middle process (so the modes do not share a maximum). Its peak RSS is measured per phase
(:mod:`treegrpo.benchmarks.phase_rss`; the marks are kept in the run folder's ``phases.json``):
``peak_rss_gb`` is the process's, ``peak_rss_<phase>_gb`` that of ``load``, ``eval``,
``rollout``, ``update`` and ``save``. Update and rollout seconds come from the run's
``metrics.jsonl``. A mode's figures are kept in its run folder (``cost.json``, with the command)
and reused by a later call with the same command, so an interrupted benchmark does not measure a
finished mode again.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from treegrpo.benchmarks.runner import Log, finished_row, keep_row, run_measured
from treegrpo.training.config import TrainConfig

MODES: dict[str, list[str]] = {
    "paths": ["--set", "packing=off"],
    "packed": ["--set", "packing=on"],
    "lora": ["--set", "packing=on", "--set", "lora_rank=16"],
}

def _generated(new_ids: list[int], stop_ids: set[int], tok: Any, stops: tuple[str, ...]) -> int:
    """Tokens of one ``generate`` row up to and including its stop (EOS/pad or a stop string)."""
    for k, t in enumerate(new_ids):
        if t in stop_ids:
            return k + 1
        text = tok.decode(new_ids[: k + 1], skip_special_tokens=False)
        if any(text.endswith(s) for s in stops):
            return k + 1
    return len(new_ids)


def engine_vs_generate(cfg: TrainConfig, n_prompts: int, log: Log) -> dict[str, Any]:
    """Generated tokens per CPU-second: the rollout engine vs ``model.generate``, on the first
    ``n_prompts`` held-out prompts of the run ``cfg``."""
    from treegrpo.rollout.agent import StepRunner
    from treegrpo.rollout.engine import make_engine
    from treegrpo.training.setup import build_run

    parts = build_run(cfg)
    model, tok = parts.model.eval(), parts.tokenizer
    runner = StepRunner(None, parts.env, tok, parts.agent_cfg)  # type: ignore[arg-type]  # prompts only
    prompts = [runner.prompt_ids(t) for t in parts.eval_tasks[:n_prompts]]
    params = dataclasses.replace(runner.params, temperature=0.0)
    engine = make_engine("hf", model, tok)
    stop_ids = {i for i in (tok.eos_token_id, tok.pad_token_id) if i is not None} | set(params.stop_token_ids)

    def run_engine() -> int:
        return sum(len(g.tokens) for g in engine.generate(prompts, params, torch.Generator().manual_seed(0)))

    def run_generate() -> int:
        width = max(map(len, prompts))
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=params.max_new_tokens,
                stop_strings=list(params.stop_strings), tokenizer=tok, pad_token_id=pad,
            )  # fmt: skip
        return sum(_generated(row[width:].tolist(), stop_ids, tok, params.stop_strings) for row in out)

    rows: dict[str, dict[str, float]] = {}
    for name, fn in (("engine", run_engine), ("generate", run_generate)):
        fn()  # warm: allocator, kernels
        c0, w0 = time.process_time(), time.perf_counter()
        n = fn()
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
        rows[name] = {"generated_tokens": n, "cpu_s": cpu, "wall_s": wall, "tokens_per_cpu_s": n / max(cpu, 1e-9)}
        log(f"  {name}: {n} tokens, {cpu:.1f} CPU-s, {rows[name]['tokens_per_cpu_s']:.1f} tok/CPU-s")
    ratio = rows["engine"]["tokens_per_cpu_s"] / max(rows["generate"]["tokens_per_cpu_s"], 1e-9)
    return {"prompts": len(prompts), "max_new_tokens": params.max_new_tokens, **rows, "ratio": ratio}


def step_costs(
    model_ref: Path, data: str, corpus: str, seed: int, overrides: dict[str, Any], modes: tuple[str, ...], work: Path, log: Log
) -> dict[str, dict[str, float]]:
    """One (2,2,1) step of 2 prompts per mode of ``modes`` (:data:`MODES`), each in its own
    process; ``overrides`` are further TrainConfig fields."""
    out: dict[str, dict[str, float]] = {}
    for mode in modes:
        run_dir = work / mode
        phases = run_dir / "phases.json"  # per-phase peaks (benchmarks/phase_rss.py)
        cmd = [
            sys.executable, "-c", "from treegrpo.benchmarks.phase_rss import main; main()", str(phases), "train",
            "--model", str(model_ref), "--data", data, "--corpus", corpus, "--steps", "1",
            "--prompts-per-step", "2", "--m", "2", "--n", "2", "--l", "1", "--out-dir", str(run_dir),
            "--seed", str(seed), "--set", "eval_prompts=1", "--set", "eval_sampled=false",
            "--set", "tensorboard=false", *MODES[mode],
            *(x for k, v in overrides.items() for x in ("--set", f"{k}={json.dumps(v) if not isinstance(v, str) else v}")),
        ]  # fmt: skip
        done = run_dir / "cost.json"  # a mode measured before with the same command is reused
        if (prev := finished_row(done, cmd[4:], field="command")) is not None:
            out[mode] = prev
            log(f"  {mode}: reusing {done}")
            continue
        got = run_measured(cmd)
        row: dict[str, float] = {"peak_rss_gb": got["peak_rss_gb"], "wall_s": got["wall_s"]}
        if got["rc"] != 0:
            raise RuntimeError(f"bench real: the {mode} step failed:\n{got['stderr'][-2000:]}")
        if phases.is_file():  # the phases reset the peak the middle process reads: theirs is the figure
            row.update(json.loads(phases.read_text())["summary"])
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"step": 1' in x]
        for k in ("time/update_s", "time/rollout_s", "update/packed", "rollout/trajectories"):
            if rows and k in rows[-1]:
                row[k.split("/")[-1]] = rows[-1][k]
        out[mode] = row
        keep_row(done, cmd[4:], row, field="command")
        parts = ", ".join(f"{g} {row[f'peak_rss_{g}_gb']:.2f}" for g in ("rollout", "update") if f"peak_rss_{g}_gb" in row)
        log(f"  {mode}: peak {row['peak_rss_gb']:.2f} GB ({parts}), update {row.get('update_s', float('nan')):.1f} s")
    return out
