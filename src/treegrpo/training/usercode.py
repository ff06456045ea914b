"""The user's own code a run depends on, recorded so a resume notices when it changed.

A run that uses the user's tools, tool class, env or reward functions (``module:name`` references
in its config) writes ``user_code.json`` in its run folder: for every module that holds one of
them, the module's source file and its sha256. A resume compares the modules as they are now with
that record and refuses a changed one (the rollouts after the resume would come from other code
than the steps before) unless the resume names ``user_code`` in ``resume_override``; the record
is then rewritten. A run folder without the record (a run started before it existed, or a run
with no code of the user's) is not checked.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from pathlib import Path

from treegrpo.errors import ConfigError
from treegrpo.io import atomic_write_json
from treegrpo.training.config import TrainConfig

USER_CODE_FILE = "user_code.json"
OVERRIDE = "user_code"
"""The ``resume_override`` name that accepts a changed user module."""


def user_modules(cfg: TrainConfig) -> list[str]:
    """The modules named by ``cfg``'s ``module:name`` references (tools, env, rewards), in order,
    once each; in-memory objects (``<lambda>``) and built-in rewards name none."""
    refs = [*cfg.tools, *([cfg.env] if cfg.env else []), *cfg.reward]
    out: list[str] = []
    for ref in refs:
        module, sep, _ = ref.partition(":")
        if sep and module and not ref.startswith("<") and module not in out:
            out.append(module)
    return out


def module_file(module: str) -> Path | None:
    """The source file of ``module``: the loaded module's, else where an import would find it
    (without running it); None when there is none (a built-in or missing module)."""
    mod = sys.modules.get(module)
    path = getattr(mod, "__file__", None) if mod is not None else None
    if path is None and module != "__main__":
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):  # a parent package that does not import
            spec = None
        path = spec.origin if spec is not None and spec.has_location else None
    return Path(path) if path and Path(path).is_file() else None


def digests(modules: list[str]) -> dict[str, dict[str, str]]:
    """``{module: {"file", "sha256"}}`` of the source of each of ``modules`` that has a file."""
    out = {}
    for module in modules:
        path = module_file(module)
        if path is not None:
            out[module] = {"file": str(path.resolve()), "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    return out


def changed_modules(recorded: dict[str, dict[str, str]], now: dict[str, dict[str, str]]) -> list[str]:
    """The recorded modules whose source differs now. A module that has no file now, or a
    ``__main__`` that is another file (a resume from the command line of a run a script started:
    its import then fails with its own hint), is not compared."""
    out = []
    for module, rec in recorded.items():
        cur = now.get(module)
        if cur is None or (module == "__main__" and cur["file"] != rec.get("file")):
            continue
        if cur["sha256"] != rec.get("sha256"):
            out.append(module)
    return out


def check_and_record(out_dir: Path, cfg: TrainConfig, resuming: bool) -> None:
    """On a resume, refuse (one line, :class:`ConfigError`) a user module changed since the run
    recorded it, unless ``cfg.resume_override`` names ``user_code``; then (re)write the record."""
    now = digests(user_modules(cfg))
    path = Path(out_dir) / USER_CODE_FILE
    if resuming and path.is_file():
        try:
            recorded = json.loads(path.read_text(encoding="utf-8"))["modules"]
        except (OSError, ValueError, KeyError, TypeError):
            recorded = {}
        changed = changed_modules(recorded if isinstance(recorded, dict) else {}, now)
        if changed and OVERRIDE not in cfg.resume_override:
            names = ", ".join(f"{m} ({Path(recorded[m]['file']).name})" for m in changed)
            raise ConfigError(
                f"--resume: your code changed since the run in {out_dir} started: {names}; restore it to resume "
                f"this run, or pass --resume-override {OVERRIDE} to continue with the new code (recorded)"
            )
    if now:
        atomic_write_json(path, {"modules": now})


__all__ = ["OVERRIDE", "USER_CODE_FILE", "changed_modules", "check_and_record", "digests", "user_modules"]
