"""The layout rules (DESIGN.md §6): every module imports, dependencies point down, no cycles.

The import graph is read from the source (every ``import`` statement, function-level ones
included), so a lazy import cannot hide a cycle or a layer violation.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

import treegrpo

SRC = Path(treegrpo.__file__).parent
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Library modules ``name`` imports at run time (a ``from pkg import sub`` counts as importing
    ``pkg.sub``; imports under ``if TYPE_CHECKING:`` are for type checkers only and do not count)."""
    out: set[str] = set()
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only = {
        id(n)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for stmt in block.body
        for n in ast.walk(stmt)
    }
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        out.update(t for t in targets if t in MODULES and t != name)
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


@pytest.mark.parametrize("name", [m.name for m in pkgutil.walk_packages(treegrpo.__path__, "treegrpo.")])
def test_every_module_imports(name: str) -> None:
    importlib.import_module(name)


def test_walk_finds_every_file() -> None:
    walked = {"treegrpo", *(m.name for m in pkgutil.walk_packages(treegrpo.__path__, "treegrpo."))}
    assert walked == set(MODULES)


def test_no_library_module_imports_a_benchmark() -> None:
    bad = {
        (m, dep)
        for m, deps in GRAPH.items()
        if not m.startswith("treegrpo.benchmarks") and m != "treegrpo.cli"
        for dep in deps
        if dep.startswith("treegrpo.benchmarks")
    }
    assert not bad


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles() -> None:
    assert _cycles(GRAPH) == []


def test_engines_are_reached_through_the_factory() -> None:
    """Nothing above ``rollout/`` names a concrete engine: the trainer, evaluation, tasks and
    benchmarks get one from :func:`treegrpo.rollout.engine.make_engine`."""
    concrete = {"treegrpo.rollout.hf_engine", "treegrpo.rollout.vllm_engine"}
    bad = {(m, dep) for m, deps in GRAPH.items() if not m.startswith("treegrpo.rollout") for dep in deps & concrete}
    assert not bad


def test_models_only_build_and_load() -> None:
    """``models/`` knows nothing task- or RL-specific."""
    above = ("treegrpo.tasks", "treegrpo.training", "treegrpo.rollout", "treegrpo.envs", "treegrpo.benchmarks")
    bad = {(m, d) for m, deps in GRAPH.items() if m.startswith("treegrpo.models") for d in deps if d.startswith(above)}
    assert not bad


def test_no_source_file_over_the_limit() -> None:
    long = {str(p.relative_to(SRC)): n for p in MODULES.values() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long
