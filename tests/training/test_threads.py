"""``threads``: auto = 1 for a bootstrapped tiny agent (the default run, unchanged), the cores this
process may use for other models (divided among torchrun's local processes); recorded resolved."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from treegrpo.errors import ConfigError
from treegrpo.training import defaults
from treegrpo.training.config import make_config
from treegrpo.training.defaults import machine_threads, resolve_model_defaults


def test_auto_threads_resolve_by_model_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(defaults, "machine_threads", lambda: 7)
    assert make_config().threads == "auto"
    assert resolve_model_defaults(make_config(), tiny=True).threads == 1
    real = resolve_model_defaults(make_config(), tiny=False)
    assert real.threads == 7 and "threads" in real.model_fields_set  # config.json and a resume carry 7
    assert resolve_model_defaults(make_config(overrides={"threads": 3}), tiny=False).threads == 3
    assert resolve_model_defaults(make_config(overrides={"threads": 0}), tiny=True).threads == 0  # torch's own
    with pytest.raises(ConfigError, match="threads: must be >= 0 or auto"):
        make_config(overrides={"threads": -1})


def test_machine_threads_is_the_affinity_shared_by_local_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert machine_threads() == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert machine_threads() == 2  # 8 cores, 3 processes: 2 each
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    assert machine_threads() == 1


def test_a_tiny_run_records_one_thread_and_python_gets_its_threads_back(tiny_model_dir: Path, tmp_path: Path) -> None:
    import treegrpo

    before = torch.get_num_threads()
    rows = [{"question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(3)]

    def add(a: int, b: int) -> str:
        """Add.

        Args:
            a: the first
            b: the second
        """
        return str(a + b)

    treegrpo.train(str(tiny_model_dir), train_data=rows, tools=[add], out_dir=str(tmp_path / "r"), sampler="chain",
                   group_size=2, prompts_per_step=1, steps=1, eval_prompts=1, eval_sampled=False, max_step_tokens=8,
                   max_turns=1)  # fmt: skip
    assert json.loads((tmp_path / "r" / "config.json").read_text())["threads"] == 1
    assert torch.get_num_threads() == before
