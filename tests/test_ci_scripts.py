"""The CI scripts (``.ci/``) and the READMEs name only test files that exist, and the scripts parse."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for p in (ROOT / ".ci").iterdir() if p.is_file())
DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TEST_PATH = re.compile(r"\btests/[\w/.-]+\.py\b")


def test_named_test_files_exist() -> None:
    named = {
        (p.relative_to(ROOT).as_posix(), m)
        for p in SCRIPTS + DOCS
        for m in TEST_PATH.findall(p.read_text())
    }
    assert any(m == "tests/viz/test_viz_browser.py" for _, m in named)  # the browser script names its tests
    missing = sorted((where, m) for where, m in named if not (ROOT / m).is_file())
    assert missing == []


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_scripts_parse() -> None:
    for p in SCRIPTS:
        if p.read_text().startswith("#!/usr/bin/env bash"):
            res = subprocess.run(["bash", "-n", str(p)], capture_output=True, text=True)
            assert res.returncode == 0, (p.name, res.stderr)
