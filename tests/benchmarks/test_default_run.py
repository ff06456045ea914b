"""``treegrpo bench default-run``: the run ``treegrpo train`` makes, recorded with the provenance
every results JSON has (here on the fixture model, one step), in the shape of the committed
``benchmarks/results/default_run.json``."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from test_result_schemas import committed, shape_problems
from typer.testing import CliRunner

from treegrpo.benchmarks.provenance import cpu_model, invocation, model_hash, source_commit
from treegrpo.cli import app

SHORT = {"preset": "tiny", "steps": 1, "prompts_per_step": 2, "n": 1, "eval_prompts": 2, "eval_every": 1,
         "save_every": 0, "dump_rollouts_every": 0, "tensorboard": False, "max_step_tokens": 8, "max_turns": 2}  # fmt: skip


def test_bench_default_run_writes_the_run_with_its_provenance(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    monkeypatch.setenv("TREEGRPO_CACHE", str(tmp_path / "cache"))  # a clean cache: nothing there yet
    out, run_dir = tmp_path / "default_run.json", tmp_path / "run"
    sets = [x for k, v in {"model": str(tiny_model_dir), **SHORT}.items() for x in ("--set", f"{k}={v}")]
    res = CliRunner().invoke(app, ["bench", "default-run", "--out", str(out), "--run-dir", str(run_dir), *sets])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert list(doc) == ["what", "summary", "config", "provenance"]
    assert doc["summary"] == json.loads((run_dir / "summary.json").read_text()) and doc["summary"]["steps"] == 1
    assert doc["config"] == json.loads((run_dir / "config.json").read_text())  # as the run recorded it
    assert doc["config"]["max_step_tokens"] == 8 and doc["config"]["out_dir"] == str(run_dir)
    assert "changed: " in doc["what"] and "steps" in doc["what"]  # a short check says it is not the default
    p = doc["provenance"]
    assert p["command"] == shlex.join(invocation()) and (p["commit"], p["dirty"]) == source_commit()
    assert p["model"] == str(tiny_model_dir) and p["model_hash"] == model_hash(tiny_model_dir)
    assert p["cpu"] == cpu_model() and p["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert p["torch_threads"] == 1  # the run's (TrainConfig.threads)
    assert p["environment"] == {"cache": str(tmp_path / "cache"), "cache_empty_at_start": True}
    # the shape of the committed figures' file (its config may lack fields added since it was made)
    assert shape_problems(doc, committed("default_run.json")) == []


def test_a_bad_set_is_a_one_line_error(tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["bench", "default-run", "--out", str(tmp_path / "x.json"), "--set", "steps=zero"])
    assert res.exit_code == 2 and res.output.startswith("error: ") and not (tmp_path / "x.json").exists()
