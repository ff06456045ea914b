"""The trainer on 2 gloo ranks: rank 0 writes every file, the rollouts of all ranks are in the
metrics and the written forests, checkpoints hold every rank's streams, and a run resumes with a
different world size (2 → 1 → 2, DDP → FSDP2). Plus one real launch: ``treegrpo train --nproc 2``
through torchrun."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from test_trainer import DOCS, TASKS, parts_for, small_cfg

from treegrpo.train.checkpoint import read_checkpoint
from treegrpo.train.trainer import train


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, world: int, port: int, model_dir: str, kw: dict[str, Any]) -> None:
    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    )
    torch.set_num_threads(1)
    cfg = small_cfg(Path(kw.pop("out")), **kw)
    train(cfg, parts=parts_for(Path(model_dir)))


def _spawn(model_dir: Path, **kw: Any) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(2, _free_port(), str(model_dir), kw), nprocs=2, join=True)


def _rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


RUN = {"prompts_per_step": 3, "m": 2, "n": 1, "l": 1, "kl_coef": 0.01}


def test_two_ranks_train_write_once_and_resume_with_other_world_sizes(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    _spawn(tiny_model_dir, out=str(out), steps=2, **RUN)
    rows = _rows(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[1]["rollout/trajectories"] == 3 * 2 * 2  # all ranks' forests: 3 prompts (2 + 1)
    forests = (out / "rollouts" / "step_00002.jsonl").read_text().splitlines()
    assert len(forests) == 3
    ck = read_checkpoint(out / "checkpoint")
    assert len(ck.run.rank_streams) == 2 and ck.run.rank_streams[0]["gen"].equal(ck.run.gen.get_state())
    assert not ck.run.rank_streams[1]["gen"].equal(ck.run.gen.get_state())  # rank 1 samples its own stream
    # 2 ranks → 1 process
    s = train(small_cfg(out, steps=3, resume=True, **RUN), parts=parts_for(tiny_model_dir))
    assert s.steps == 3 and [r["step"] for r in _rows(out)] == [0, 1, 2, 3]
    # 1 process → 2 ranks, DDP → FSDP2 (parallel may change on resume)
    _spawn(tiny_model_dir, out=str(out), steps=4, resume=True, parallel="fsdp2", **RUN)
    rows = _rows(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert rows[4]["rollout/trajectories"] == 12 and "eval/success_greedy" in rows[4]
    ck = read_checkpoint(out / "checkpoint")
    assert ck.step == 4 and len(ck.run.rank_streams) == 2
    assert set(ck.optimizer["state"]) == set(range(len(list(parts_for(tiny_model_dir).model.parameters()))))
    # and back to one process from the FSDP2 checkpoint: weights and the gathered optimizer state load
    s = train(small_cfg(out, steps=5, resume=True, **RUN), parts=parts_for(tiny_model_dir))
    assert s.steps == 5


def test_a_rank_without_prompts_still_takes_part(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "one"
    _spawn(tiny_model_dir, out=str(out), steps=1, **{**RUN, "prompts_per_step": 1})
    rows = _rows(out)
    assert rows[1]["rollout/trajectories"] == 4 and rows[1]["update/packed"] == 1.0


def test_nproc_launches_torchrun(tiny_model_dir: Path, tmp_path: Path) -> None:
    """``treegrpo train --nproc 2`` relaunches itself under ``torch.distributed.run``."""
    data, corpus = tmp_path / "q.jsonl", tmp_path / "docs.jsonl"
    data.write_text(
        "".join(json.dumps({"id": t.id, "question": t.question, "answers": t.answers}) + "\n" for t in TASKS)
    )
    corpus.write_text("".join(json.dumps({"id": d.id, "contents": d.contents}) + "\n" for d in DOCS))
    out = tmp_path / "cli"
    cmd = [sys.executable, "-m", "treegrpo", "train", "--nproc", "2", "--model", str(tiny_model_dir)]
    cmd += ["--data", str(data), "--eval-data", str(data), "--corpus", str(corpus), "--steps", "1"]
    cmd += ["--prompts-per-step", "3", "--m", "2", "--n", "1", "--l", "1", "--out-dir", str(out)]
    cmd += ["--set", "eval_prompts=2", "--set", "max_turns=2", "--set", "tensorboard=false"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2] / "src"), *sys.path])}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = _rows(out)
    assert [r["step"] for r in rows] == [0, 1] and rows[1]["rollout/trajectories"] == 12
    assert json.loads((out / "summary.json").read_text())["steps"] == 1
    assert proc.stdout.count("outputs in") == 1 and proc.stdout.count("treegrpo run summary") == 1  # rank 0's


def _cli_files(tmp_path: Path) -> list[str]:
    """The command line of a 1-step run on the test world: data, corpus, tree shape, out dir."""
    data, corpus = tmp_path / "q.jsonl", tmp_path / "docs.jsonl"
    data.write_text(
        "".join(json.dumps({"id": t.id, "question": t.question, "answers": t.answers}) + "\n" for t in TASKS)
    )
    corpus.write_text("".join(json.dumps({"id": d.id, "contents": d.contents}) + "\n" for d in DOCS))
    cmd = ["--data", str(data), "--eval-data", str(data), "--corpus", str(corpus), "--steps", "1"]
    cmd += ["--prompts-per-step", "3", "--ts-m", "2", "--ts-n", "1", "--ts-l", "1", "--out-dir", str(tmp_path / "cli")]
    return [*cmd, "--set", "eval_prompts=2", "--set", "max_turns=2", "--set", "tensorboard=false"]


def test_only_global_rank_0_prints_the_summary(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second node's process has LOCAL_RANK 0 but RANK 1: it wrote nothing, so it prints no
    summary and no "outputs in"."""
    from rich.console import Console

    from treegrpo.train import run as run_mod
    from treegrpo.train.trainer import TrainSummary

    done = TrainSummary(
        out_dir=str(tmp_path), steps=1, eval_start={"eval/success_greedy": 0.25}, eval_end={"eval/success_greedy": 0.5},
        trajectories=12, generated_tokens=100, prefill_tokens=300, tool_calls=4, wall_s=2.0, rollout_s=1.0,
        update_s=1.0, em_curve=[],
    )  # fmt: skip
    monkeypatch.setattr(run_mod, "train", lambda cfg, console: done)
    printed = {}
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("LOCAL_RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "2")
        console = Console(file=io.StringIO(), width=200)
        assert run_mod.run_training(small_cfg(tmp_path), console) is done  # every rank gets the summary
        printed[rank] = console.file.getvalue()  # type: ignore[attr-defined]
    assert "outputs in" in printed["0"] and "treegrpo run summary" in printed["0"]
    assert printed["1"] == ""


def test_two_torchrun_nodes_print_one_summary(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Two torchrun "nodes" on this machine (c10d rendezvous, one process each): they train as one
    job, and only the node that got global rank 0 prints the summary and "outputs in"."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2] / "src"), *sys.path])}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1"]
    cmd += ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "two-nodes", "--max_restarts", "0"]
    cmd += ["-m", "treegrpo", "train", "--model", str(tiny_model_dir), *_cli_files(tmp_path)]
    nodes = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in nodes]
    for p, (o, e) in zip(nodes, outs, strict=True):
        assert p.returncode == 0, o[-2000:] + e[-3000:]
    rows = _rows(tmp_path / "cli")
    assert [r["step"] for r in rows] == [0, 1] and rows[1]["rollout/trajectories"] == 12  # one job of 2 ranks
    printed = sorted(o.count("outputs in") + o.count("treegrpo run summary") for o, _ in outs)
    assert printed == [0, 2], [o[-1500:] for o, _ in outs]  # one node prints both, the other neither
