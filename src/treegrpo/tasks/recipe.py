"""What every tiny-agent bootstrap shares (the search world's, arithmetic's, SQL's): the cache key
of a recipe, its warm-up settings, and whether a cached folder is complete.

A bootstrap config is a frozen dataclass of settings; the helpers read the fields they need by
name, so each task's config stays a flat list of its own knobs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from treegrpo.fingerprint import code_fingerprint
from treegrpo.models.loader import MARKER_FILE, tiny_info
from treegrpo.train.warmup import WarmupConfig


def recipe_hash(version: int, weight_modules: Sequence[str], settings: dict[str, Any]) -> str:
    """A short hash of everything that decides a bootstrapped model's weights: the recipe
    ``version``, the code of ``weight_modules`` (:func:`~treegrpo.fingerprint.code_fingerprint`)
    and the ``settings``."""
    blob = json.dumps({"v": version, "code": code_fingerprint(weight_modules), **settings}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def warmup_config_of(cfg: Any) -> WarmupConfig:
    """The :class:`~treegrpo.train.warmup.WarmupConfig` of a bootstrap config: every warm-up field
    the config has, the warm-up's defaults for the others."""
    names = {f.name for f in dataclasses.fields(WarmupConfig)}
    return WarmupConfig(**{n: getattr(cfg, n) for n in names if hasattr(cfg, n)})


def is_complete(folder: str | Path) -> bool:
    """``folder`` holds a complete bootstrapped model: its record, written last, has the measured
    warm-up success (a folder cut short by an interruption never has it)."""
    folder = Path(folder)
    return (folder / MARKER_FILE).is_file() and "warmup_eval" in tiny_info(folder)
