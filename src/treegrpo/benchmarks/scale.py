"""``treegrpo bench scale``: one process against K data-parallel processes (torchrun, gloo on the
CPU), each world size training the same run through ``treegrpo train --nproc K`` (the method and
the figures: benchmarks/README.md). Per step the slowest rank's CPU seconds (rollout, update; wall
beside them), the first step dropped, the median of the rest; efficiency at K is
``T_1 / (K · T_K)``. The ranks draw from their own streams, so the generated tokens per step are
reported beside the times.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from treegrpo.benchmarks.runner import pyplot, save_figure, write_result

KEYS = (
    "time/rollout_cpu_s",
    "time/update_cpu_s",
    "time/rollout_s",
    "time/update_s",
    "budget/generated_tokens",
)


def measure(
    world: int,
    steps: int,
    out_dir: Path,
    model: str | None,
    extra: Sequence[str],
    log: Callable[[str], object],
) -> dict[str, float]:
    """Train ``steps`` steps on ``world`` processes; the medians (steps 2..) of :data:`KEYS`."""
    cmd = [sys.executable, "-m", "treegrpo", "train", "--steps", str(steps), "--out-dir", str(out_dir)]
    cmd += ["--model", model] if model else []
    cmd += ["--nproc", str(world)] if world > 1 else []
    for kv in ("threads=1", "eval_prompts=8", "eval_sampled=false", "dump_rollouts_every=0", "tensorboard=false"):
        cmd += ["--set", kv]
    cmd += list(extra)
    log(f"scale: {world} process(es): {' '.join(cmd[1:])}")
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"{world}-process run failed: {proc.stderr[-1500:]}")
    rows = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["step"] >= 2] or [r for r in rows if r["step"] >= 1]
    return {k: statistics.median(r[k] for r in rows) for k in KEYS}


def efficiency(one: dict[str, float], many: dict[str, float], world: int) -> dict[str, float]:
    """``T_1 / (K · T_K)`` of the step, the rollout and the update (CPU seconds of the slowest rank)."""
    r1, u1 = one["time/rollout_cpu_s"], one["time/update_cpu_s"]
    rk, uk = many["time/rollout_cpu_s"], many["time/update_cpu_s"]
    return {
        "step": (r1 + u1) / (world * (rk + uk)),
        "rollout": r1 / (world * rk),
        "update": u1 / (world * uk),
    }


def run_bench(
    out: Path,
    steps: int = 6,
    worlds: Sequence[int] = (1, 2),
    model: str | None = None,
    extra: Sequence[str] = (),
    log: Callable[[str], object] = print,
) -> dict[str, Any]:
    from treegrpo.benchmarks.provenance import provenance

    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="treegrpo-scale-") as tmp:
        per_world = {w: measure(w, steps, Path(tmp) / f"w{w}", model, extra, log) for w in worlds}
    base = per_world[worlds[0]]
    result = {
        "provenance": provenance(model_dir=Path(model) if model else None),
        "steps": steps,
        "worlds": {
            str(w): {**m, "efficiency": efficiency(base, m, w) if w > worlds[0] else None}
            for w, m in per_world.items()
        },
    }
    write_result(out, result, plot, indent=2, newline=True)
    for w, m in result["worlds"].items():
        eff = m["efficiency"]
        log(
            f"scale: {w} process(es): rollout {m['time/rollout_cpu_s']:.2f} + update {m['time/update_cpu_s']:.2f} "
            f"CPU s/step (slowest rank)"
            + (
                f"; efficiency step {eff['step']:.2f}, rollout {eff['rollout']:.2f}, update {eff['update']:.2f}"
                if eff
                else ""
            )
        )
    return result


def plot(result: dict[str, Any], png: Path) -> None:
    """Stacked bars: CPU seconds per step of the slowest rank (rollout, update) per world size."""
    plt = pyplot()
    worlds = list(result["worlds"])
    roll = [result["worlds"][w]["time/rollout_cpu_s"] for w in worlds]
    upd = [result["worlds"][w]["time/update_cpu_s"] for w in worlds]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar(worlds, roll, label="rollout")
    ax.bar(worlds, upd, bottom=roll, label="update")
    for i, w in enumerate(worlds):
        eff = result["worlds"][w]["efficiency"]
        if eff:
            ax.text(
                i,
                roll[i] + upd[i],
                f"eff. step {eff['step']:.2f}\nupdate {eff['update']:.2f}",
                ha="center",
                va="bottom",
                fontsize=8,
            )
    ax.set_xlabel("processes (gloo, 1 thread each)")
    ax.set_ylabel("CPU s per step, slowest rank")
    ax.set_title("treegrpo bench scale: data-parallel training")
    ax.legend()
    save_figure(fig, png, dpi=120)
