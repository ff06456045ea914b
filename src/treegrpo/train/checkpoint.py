"""Atomic checkpoints: the whole folder appears at once or not at all."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch


def save_checkpoint(
    folder: Path,
    model: torch.nn.Module,
    tokenizer: Any,
    state: dict[str, Any],
    extra_files: dict[str, str] | None = None,
) -> None:
    """Write model, tokenizer and ``state`` (optimizer, step, RNG states…) to a temp folder beside
    ``folder``, then swap it into place; an interrupted save leaves the previous checkpoint intact."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        torch.save(state, tmp / "trainer_state.pt")
        old = folder.with_name(folder.name + ".old")
        if old.exists():
            shutil.rmtree(old)
        if folder.exists():
            folder.rename(old)
        tmp.rename(folder)
        if old.exists():
            shutil.rmtree(old)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def find_checkpoint(folder: Path) -> Path | None:
    """The checkpoint folder, or the previous one if a save was interrupted mid-swap."""
    folder = Path(folder)
    for cand in (folder, folder.with_name(folder.name + ".old")):
        if (cand / "trainer_state.pt").exists():
            return cand
    return None


def load_state(folder: Path) -> dict[str, Any]:
    return torch.load(Path(folder) / "trainer_state.pt", weights_only=False)
