"""One row of ``bench peers``, run in a process of its own: ``python -c "from
treegrpo.benchmarks.peers_rows import main; main()" TASK_JSON``.

``TASK_JSON`` (made by :func:`treegrpo.benchmarks.peers.run_bench`) holds the row's ``kind``
(``eval`` | ``treegrpo`` | ``trl``), its treegrpo run ``config`` (the job's data, env, limits and
evaluation; a ``trl`` row reads only those), ``threads``, the folder ``out`` and, for the training
rows, the starting model's evaluation ``eval_start`` and the prompt ``order``. The row writes
``out/row.json``: per-step lists (wall, rollout and update CPU seconds, generated and trained tokens),
the evaluation after, and its ``settings`` as each side recorded them.
"""

from __future__ import annotations

import json
import os
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from treegrpo.benchmarks.runner import held_out_eval
from treegrpo.io import atomic_write_json
from treegrpo.training.config import TrainConfig
from treegrpo.training.metrics import read_metrics
from treegrpo.training.trainer import train
from treegrpo.tree import read_forests

#: The per-phase work of a step (docs/metrics): the row's key -> treegrpo's metric.
PHASE_METRICS = {
    "prefill_positions": "engine/prefill_positions",
    "decode_steps": "engine/decode_steps",
    "decode_positions": "engine/decode_positions",
    "update_positions": "update/positions",
}
LIBRARIES = ("treegrpo", "torch", "transformers", "trl", "accelerate", "datasets", "tokenizers")


def versions() -> dict[str, str | None]:
    """The installed versions of the libraries either side runs on (``None``: not installed)."""
    out: dict[str, str | None] = {}
    for name in LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def evaluate_model(cfg: TrainConfig) -> dict[str, float]:
    """treegrpo's held-out evaluation (the agent loop, greedy) of the model ``cfg.model`` on the
    job of ``cfg``: the one evaluation every row of the bench is measured with."""
    return held_out_eval(cfg, sampled=False)["eval"]


def common_settings(cfg: TrainConfig) -> dict[str, Any]:
    """What every row records about how it ran, beyond its side's own config: threads, versions,
    the starting folder, the seed and glibc's allocator setting this process started with."""
    return {
        "threads": torch.get_num_threads(), "versions": versions(), "model_dir": cfg.model, "device": cfg.device,
        "seed": cfg.seed, "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
    }  # fmt: skip


def treegrpo_row(task: dict[str, Any]) -> dict[str, Any]:
    """treegrpo's own loop (``train``) on the job; figures from its ``metrics.jsonl`` and rollouts."""
    cfg = TrainConfig(**task["config"])
    summary = train(cfg, eval_start=task["eval_start"])
    run = Path(cfg.out_dir)
    metrics = read_metrics(run / "metrics.jsonl")
    steps = [m for m in metrics if m.get("step", 0) > 0 and "time/rollout_s" in m]
    recorded = json.loads((run / "config.json").read_text())
    prompts = []  # the prompts each step drew, as the rollouts recorded them (id and token ids)
    # per step, over its root-to-leaf training sequences: the tokens the model generated on each
    # trajectory (a shared step counted on each through it) and all their tokens (prompt and
    # observations too: what a per-path update trains; packed, a shared prefix is computed once)
    lengths, trained = [], []
    for s in range(1, cfg.steps + 1):
        forests = read_forests(run / "rollouts" / f"step_{s:05d}.jsonl")
        prompts.append([{"id": f.prompt_id, "ids": list(f.trees[0].nodes[0].tokens)} for f in forests])
        paths = [p for f in forests for p in f.paths()]
        lengths.append([sum(p.policy_mask_T) for p in paths])
        trained.append(sum(len(p.tokens_T) for p in paths))
    return {
        "steps": len(steps),
        "step_wall_s": [m["time/rollout_s"] + m["time/update_s"] for m in steps],
        "rollout_wall_s": [m["time/rollout_s"] for m in steps],
        "update_wall_s": [m["time/update_s"] for m in steps],
        "rollout_cpu_s": [m["time/rollout_cpu_s"] for m in steps],
        "update_cpu_s": [m["time/update_cpu_s"] for m in steps],
        "generated_tokens": [int(m["budget/generated_tokens"]) for m in steps],
        "prefill_tokens": [int(m["budget/prefill_tokens"]) for m in steps],
        "trained_tokens": trained,
        "computed_tokens": [int(m.get("update/tokens_packed", m.get("update/positions", 0))) for m in steps],
        "trajectories": [int(m["rollout/trajectories"]) for m in steps],
        "tool_calls": [int(m["budget/tool_calls"]) for m in steps],
        "completion_len_mean": [sum(ls) / len(ls) for ls in lengths],
        "completion_len_max": [max(ls) for ls in lengths],
        **{key: [m.get(metric) for m in steps] for key, metric in PHASE_METRICS.items()},
        "reward_mean": [m["reward/mean"] for m in steps],
        "peak_rss_gb": steps[-1]["mem/peak_rss_gb"],  # the high-water mark after the last update, before its evaluation
        "eval_before": summary.eval_start,
        "eval_after": summary.eval_end,
        "em_before": summary.eval_start["eval/success_greedy"],
        "em_after": summary.eval_end["eval/success_greedy"],
        "prompts_seen": prompts,
        "settings": {
            **common_settings(cfg),
            "group_size": recorded["group_size"] if recorded["sampler"] == "chain" else cfg.trajectories_per_prompt(),
            "max_new_tokens": recorded["max_step_tokens"],
            "lr": recorded["lr"],
            "loss": recorded["agg_mode"],
            "seed": recorded["seed"],
            "prompt_ids": [[p["id"] for p in step] for step in prompts],
            "treegrpo_config": recorded,
        },
    }


def eval_row(task: dict[str, Any]) -> dict[str, Any]:
    """The starting model's held-out evaluation, per job of ``task["configs"]``."""
    cfgs = {job: TrainConfig(**c) for job, c in task["configs"].items()}
    return {
        "eval": {job: evaluate_model(cfg) for job, cfg in cfgs.items()},
        "settings": {job: common_settings(cfg) for job, cfg in cfgs.items()},
    }


def main(argv: list[str] | None = None) -> None:
    task = json.loads((argv or sys.argv[1:])[0])
    if task.get("threads"):
        torch.set_num_threads(int(task["threads"]))
    out = Path(task["out"])
    out.mkdir(parents=True, exist_ok=True)
    if task["kind"] == "eval":
        row = eval_row(task)
    elif task["kind"] == "treegrpo":
        row = treegrpo_row(task)
    elif task["kind"] == "trl":
        from treegrpo.benchmarks.peers_trl import trl_row

        row = trl_row(task, evaluate_model, common_settings)
    else:
        raise SystemExit(f"bench peers: unknown row kind {task['kind']!r}")
    atomic_write_json(out / "row.json", row)


__all__ = ["LIBRARIES", "common_settings", "evaluate_model", "main", "versions"]
