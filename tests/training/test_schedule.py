"""The lr schedule: warm-up, constant / cosine / linear decay, values derived by hand."""

from __future__ import annotations

import math

import pytest
import torch

from treegrpo.training.schedule import lr_at, set_lr


def _all(schedule: str, steps: int = 6, warmup: int = 2, r: float = 0.1) -> list[float]:
    return [lr_at(k, 1.0, steps, warmup, schedule, r) for k in range(1, steps + 1)]


def test_constant_with_warmup() -> None:
    # W = 2: steps 1, 2 ramp to the peak (1/2, 1), then constant
    assert _all("constant") == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert [lr_at(k, 3e-4, 5) for k in range(1, 6)] == [3e-4] * 5  # the default: no warm-up, constant


def test_cosine_and_linear_by_hand() -> None:
    # S = 6, W = 2, r = 0.1: decay steps 3..6 have p = 0, 1/3, 2/3, 1
    # cosine: 0.1 + 0.9 · ½(1 + cos πp) = 1, 0.775, 0.325, 0.1
    # linear: 0.1 + 0.9 · (1 − p)        = 1, 0.7,   0.4,   0.1
    for got, want in zip(_all("cosine"), [0.5, 1.0, 1.0, 0.775, 0.325, 0.1], strict=True):
        assert got == pytest.approx(want, abs=1e-12)
    for got, want in zip(_all("linear"), [0.5, 1.0, 1.0, 0.7, 0.4, 0.1], strict=True):
        assert got == pytest.approx(want, abs=1e-12)
    # no warm-up, r = 0: cosine from the peak on step 1 to 0 on the last step
    assert lr_at(1, 2.0, 3, schedule="cosine") == 2.0
    assert lr_at(2, 2.0, 3, schedule="cosine") == pytest.approx(2.0 * 0.5 * (1 + math.cos(math.pi / 2)))
    assert lr_at(3, 2.0, 3, schedule="cosine") == pytest.approx(0.0, abs=1e-15)


def test_edge_cases() -> None:
    assert lr_at(1, 1.0, 1, schedule="cosine") == 1.0  # one step: the peak
    assert lr_at(7, 1.0, 5, schedule="linear", min_lr_ratio=0.2) == pytest.approx(0.2)  # past the end: floor
    with pytest.raises(ValueError, match="1-based"):
        lr_at(0, 1.0, 5)
    with pytest.raises(ValueError, match="unknown lr schedule"):
        lr_at(1, 1.0, 5, schedule="step")


def test_set_lr() -> None:
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([{"params": [p]}, {"params": []}], lr=1.0)
    set_lr(opt, 0.25)
    assert [g["lr"] for g in opt.param_groups] == [0.25, 0.25]
