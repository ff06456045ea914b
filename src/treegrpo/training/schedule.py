r"""The learning-rate schedule: linear warm-up, then constant, cosine or linear decay.

A pure function of the RL step (one value per step: every mini-batch optimizer step of a rollout
batch uses it, as verl steps its scheduler once per training step). With ``i = step - 1`` the
number of steps before this one, ``W = lr_warmup_steps``, ``S = steps`` and ``r = min_lr_ratio``::

    i < W:   lr · (i + 1) / W                       (step W reaches the peak; step 1 is not 0)
    else:    p = (i − W) / max(1, S − W − 1)         (0 on the first step after warm-up, 1 on the last)
             constant  lr
             cosine    lr · (r + (1 − r) · ½ (1 + cos π p))
             linear    lr · (r + (1 − r) · (1 − p))

so a decaying schedule reaches exactly ``r · lr`` on the run's last step. The schedule depends on
``steps``: extending a run (``--resume`` with more steps) stretches the decay from there on.
"""

from __future__ import annotations

import math

import torch

__all__ = ["lr_at", "set_lr"]


def lr_at(
    step: int,
    lr: float,
    steps: int,
    warmup_steps: int = 0,
    schedule: str = "constant",
    min_lr_ratio: float = 0.0,
) -> float:
    """The learning rate of RL step ``step`` (1-based) of ``steps`` (module docstring)."""
    if step < 1:
        raise ValueError(f"step is 1-based, got {step}")
    if schedule not in ("constant", "cosine", "linear"):
        raise ValueError(f"unknown lr schedule {schedule!r}; choose constant, cosine or linear")
    i = step - 1
    if i < warmup_steps:
        return lr * (i + 1) / warmup_steps
    if schedule == "constant":
        return lr
    p = min(1.0, (i - warmup_steps) / max(1, steps - warmup_steps - 1))
    decay = 0.5 * (1.0 + math.cos(math.pi * p)) if schedule == "cosine" else 1.0 - p
    return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * decay)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Give every parameter group of ``optimizer`` the learning rate ``lr``."""
    for group in optimizer.param_groups:
        group["lr"] = lr
