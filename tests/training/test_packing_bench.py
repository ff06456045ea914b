"""The packing benchmark's measurement on a tiny model and synthetic forests (the CLI run on
real rollouts of the bootstrapped agent is ``treegrpo bench packing``)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from test_packing import PAD, random_forest

from treegrpo.benchmarks.packing import measure_forests, plot
from treegrpo.models.loader import load_model

KEYS = (
    "forest",
    "tokens_paths",
    "tokens_packed",
    "seconds_paths",
    "seconds_packed",
    "peak_mb_paths",
    "peak_mb_packed",
    "max_logprob_diff",
    "max_grad_diff",
)


def test_measure_forests_row_is_exact_and_complete(tiny_model_dir: Path, tmp_path: Path) -> None:
    rng = random.Random(0)
    forests = [random_forest(rng, n_trees=2, n_expand=4) for _ in range(3)]
    row = measure_forests(
        load_model(tiny_model_dir), forests, PAD, label="synthetic", repeats=1, max_tokens=256
    )
    assert all(k in row for k in KEYS)
    assert row["tokens_packed"] < row["tokens_paths"]
    assert row["max_logprob_diff"] <= 1e-5 and row["max_grad_diff"] <= 1e-5 and row["loss_diff"] <= 1e-5
    assert row["peak_mb_paths"] > 0 and row["peak_mb_packed"] > 0
    assert row["exact"] is True and isinstance(row["meets_speed_target"], bool)
    json.dumps(row)
    plot([row, {**row, "forest": "again"}], tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000
