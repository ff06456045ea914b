"""Peak RSS of one RL step on a real model: per path vs packed vs LoRA (issue 14's memory targets).

Each mode is one ``treegrpo train --steps 1`` in its own child process, measured with
``resource.getrusage(RUSAGE_CHILDREN).ru_maxrss`` taken by a fresh middle process (so the modes do
not share a maximum). The step is a (2,2,1) tree over 2 prompts, held-out evaluation on 2 prompts,
full SmolLM2-135M in float32 by default (``--model smollm2-135m``, the built-in GGUF), questions
from a small JSONL written here and the built-in ``wiki-vital`` corpus. Prints one JSON line:
``{"model": ..., "modes": {mode: {"peak_rss_gb": ..., "wall_s": ..., "update_s": ..., "packed": ...}}}``.

    PYTHONPATH=src python scripts/measure_step_memory.py [--modes paths,packed,lora] [--set k=v ...]

Slow on a shared 2-core CPU (a few minutes per mode).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

QUESTIONS = [
    ("What is the capital of France?", ["Paris"]),
    ("Which river flows through Cairo?", ["Nile", "Nile River"]),
    ("Who wrote the play Hamlet?", ["William Shakespeare", "Shakespeare"]),
    ("What is the largest planet in the Solar System?", ["Jupiter"]),
    ("Which element has the chemical symbol O?", ["Oxygen"]),
    ("On which continent is Kenya?", ["Africa"]),
    ("Who painted the Mona Lisa?", ["Leonardo da Vinci", "Leonardo"]),
    ("What is the capital of Japan?", ["Tokyo"]),
]

MODES: dict[str, list[str]] = {
    "paths": ["--set", "packing=off"],
    "packed": ["--set", "packing=on"],
    "lora": ["--set", "packing=on", "--set", "lora_rank=16"],
}

# Runs in a fresh interpreter: start the trainer as its child, report that child's peak RSS.
_MIDDLE = """
import json, resource, subprocess, sys, time
t = time.perf_counter()
rc = subprocess.run(json.loads(sys.argv[1])).returncode
peak_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB on Linux
print(json.dumps({"rc": rc, "peak_kb": peak_kb, "wall_s": time.perf_counter() - t}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--corpus", default="wiki-vital")
    ap.add_argument("--modes", default="paths,packed,lora")
    ap.add_argument(
        "--work", default=None, help="folder for the questions and the runs (default: a temp folder)"
    )
    ap.add_argument("--set", dest="sets", action="append", default=[], help="extra key=value for every mode")
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="treegrpo-mem-"))
    work.mkdir(parents=True, exist_ok=True)
    q = work / "questions.jsonl"
    q.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "question": s, "answers": a}) + "\n"
            for i, (s, a) in enumerate(QUESTIONS)
        )
    )
    extra = [x for kv in args.sets for x in ("--set", kv)]
    out: dict[str, dict[str, float]] = {}
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        run_dir = work / mode
        cmd = [
            sys.executable, "-c", "from treegrpo.cli import main; main()", "train",
            "--model", args.model, "--data", str(q), "--corpus", args.corpus, "--steps", "1",
            "--prompts-per-step", "2", "--m", "2", "--n", "2", "--l", "1", "--out-dir", str(run_dir),
            "--set", "eval_prompts=2", "--set", "eval_sampled=false", "--set", "tensorboard=false",
            *MODES[mode], *extra,
        ]  # fmt: skip
        res = subprocess.run(
            [sys.executable, "-c", _MIDDLE, json.dumps(cmd)], capture_output=True, text=True, check=False
        )
        line = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else "{}"
        got = json.loads(line)
        row: dict[str, float] = {
            "peak_rss_gb": round(got.get("peak_kb", 0) / 2**20, 3),
            "wall_s": round(got.get("wall_s", 0.0), 1),
        }
        if got.get("rc", 1) != 0:
            row["error"] = 1.0
            print(res.stderr[-2000:], file=sys.stderr)
        metrics = run_dir / "metrics.jsonl"
        if metrics.is_file():
            step = [json.loads(x) for x in metrics.read_text().splitlines() if '"step": 1' in x]
            if step:
                row.update(
                    {
                        k: step[-1][k]
                        for k in ("time/update_s", "time/rollout_s", "update/packed", "rollout/trajectories")
                        if k in step[-1]
                    }
                )
        out[mode] = row
        print(f"{mode}: {row}", file=sys.stderr)
    print(json.dumps({"model": args.model, "sets": args.sets, "modes": out}))


if __name__ == "__main__":
    main()
