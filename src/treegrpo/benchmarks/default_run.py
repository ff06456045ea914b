"""``treegrpo bench default-run``: the run ``treegrpo train`` makes with no arguments, recorded as
the README's default-run figures (``benchmarks/results/default_run.json``).

The run is the one :func:`treegrpo.training.run.run_training` makes for ``treegrpo train`` (the
same config: no YAML, no overrides but the run folder, and any ``--set`` field of a short check);
the document holds the run's summary, its whole config and the :func:`provenance` record (the
starting model's folder and hash among it), with
whether the user cache (``$TREEGRPO_CACHE``) was empty when the run started, that is whether the
tiny agent was bootstrapped by this run. The README's figures come from a clean cache:
``TREEGRPO_CACHE=$(mktemp -d) treegrpo bench default-run``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from treegrpo.benchmarks.provenance import provenance
from treegrpo.benchmarks.runner import write_result

#: What the document records, in its ``what`` field.
WHAT = "treegrpo train with no arguments (the run folder aside), seed 0, with the version lock"


def cache_state(cache: Path) -> dict[str, Any]:
    """The user cache folder and whether it held nothing (absent, or an empty folder)."""
    empty = not cache.is_dir() or not any(cache.iterdir())
    return {"cache": str(cache), "cache_empty_at_start": empty}


def run_default(
    out: Path = Path("benchmarks/results/default_run.json"),
    run_dir: Path | None = None,
    overrides: dict[str, Any] | None = None,
    console: Any = None,
) -> dict[str, Any]:
    """Train the default run into ``run_dir`` (default: the config's ``runs/tree``), then write
    ``out``: ``{what, summary, config, provenance}`` (the config as the run recorded it, ``auto``
    values resolved; the cache's state as ``provenance.environment``). Returns the document."""
    from treegrpo.io import user_cache_dir
    from treegrpo.tasks.registry import task_family
    from treegrpo.training.config import load_config
    from treegrpo.training.run import run_training

    cfg = load_config(None, {"out_dir": None if run_dir is None else str(run_dir), **(overrides or {})})
    environment = cache_state(user_cache_dir())
    summary = run_training(cfg, console)
    model = Path(cfg.model) if cfg.model is not None else task_family(cfg).starting_model(cfg)  # cached by now
    doc = {
        "what": WHAT if not overrides else f"{WHAT}; changed: {', '.join(sorted(overrides))}",
        "summary": summary.to_dict(),
        "config": json.loads((Path(summary.out_dir) / "config.json").read_text()),  # auto values resolved
        "provenance": {**provenance(model_dir=model, threads=cfg.threads or None), "environment": environment},
    }
    write_result(out, doc)
    return doc


__all__ = ["WHAT", "cache_state", "run_default"]
