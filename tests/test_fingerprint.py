"""Cache keys cover the code: a change to what a module does is a new fingerprint; a change to its
docstrings, comments or layout is not."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from treegrpo.fingerprint import code_fingerprint, source_digest
from treegrpo.tasks.world.bootstrap import WEIGHT_MODULES, BootstrapConfig

BASE = '''"""Module doc."""


def f(x):
    """Doc."""
    return x + 1  # a comment
'''


def test_docstrings_comments_and_layout_do_not_count() -> None:
    same = BASE.replace('"""Doc."""', '"""Another doc."""').replace("# a comment", "").replace("x + 1", "x+1")
    assert source_digest(same) == source_digest(BASE)


def test_code_changes_count() -> None:
    assert source_digest(BASE.replace("x + 1", "x + 2")) != source_digest(BASE)


def test_fingerprint_follows_the_module_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mod = tmp_path / "fp_probe_mod.py"
    mod.write_text(BASE)
    monkeypatch.syspath_prepend(str(tmp_path))
    before = code_fingerprint(["fp_probe_mod"], libraries=())
    mod.write_text(BASE.replace("x + 1", "x - 1"))
    from treegrpo import fingerprint

    fingerprint._fingerprint.cache_clear()
    assert code_fingerprint(["fp_probe_mod"], libraries=()) != before
    sys.modules.pop("fp_probe_mod", None)


def test_bootstrap_cache_key_includes_the_code(monkeypatch: pytest.MonkeyPatch) -> None:
    from treegrpo import fingerprint
    from treegrpo.tasks import recipe

    key = BootstrapConfig().config_hash()
    monkeypatch.setattr(recipe, "code_fingerprint", lambda mods: "other-code")
    assert BootstrapConfig().config_hash() != key
    assert "treegrpo.training.warmup" in WEIGHT_MODULES and "treegrpo.tasks.world.demos" in WEIGHT_MODULES
    fingerprint._fingerprint.cache_clear()


def test_unknown_module_is_an_error() -> None:
    with pytest.raises(ValueError, match="no module"):
        code_fingerprint(["treegrpo.no_such_module_here"])
