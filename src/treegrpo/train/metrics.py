"""Metrics: slash-namespaced keys to JSONL (and TensorBoard when installed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class MetricsLogger:
    """Appends one JSON object per step to ``metrics.jsonl``; mirrors scalars to TensorBoard."""

    def __init__(self, out_dir: Path, tensorboard: bool = True, resume_step: int | None = None) -> None:
        self.path = Path(out_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            self.path.write_text("")
        elif self.path.exists():  # keep only what the checkpoint had seen
            kept = [
                ln
                for ln in self.path.read_text().splitlines()
                if ln.strip() and json.loads(ln).get("step", 0) <= resume_step
            ]
            self.path.write_text("".join(k + "\n" for k in kept))
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(Path(out_dir) / "tb"))
            except Exception:  # tensorboard is optional
                self.tb = None

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, **metrics}
        with self.path.open("a") as fh:
            fh.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
