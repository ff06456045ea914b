"""Fingerprints of the code and libraries a cached artefact was built with.

A cache key made only of a recipe's settings goes stale when the code that runs the recipe
changes: a rebuilt model then differs from the cached one under the same name. :func:`code_fingerprint`
hashes what the listed modules *do* (their syntax tree without docstrings, so comments, docstrings
and formatting don't count) together with the versions of the numeric libraries that shape the
result.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.metadata
import importlib.util
from collections.abc import Sequence

LIBRARIES = ("torch", "transformers", "tokenizers", "bm25s")


def _strip_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    return tree


def source_digest(source: str) -> str:
    """sha256 of ``source``'s syntax tree without docstrings (comments and layout never count)."""
    return hashlib.sha256(ast.dump(_strip_docstrings(ast.parse(source))).encode()).hexdigest()


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def code_fingerprint(modules: Sequence[str], libraries: Sequence[str] = LIBRARIES) -> str:
    """A short hash of the code of ``modules`` (dotted names, read from their source files without
    importing them) and of the installed versions of ``libraries`` (computed once per process)."""
    return _fingerprint(tuple(modules), tuple(libraries))


@functools.cache
def _fingerprint(modules: tuple[str, ...], libraries: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for name in sorted(modules):
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            raise ValueError(f"code_fingerprint: no module {name!r}")
        with open(spec.origin, encoding="utf-8") as fh:
            h.update(f"{name}:{source_digest(fh.read())}\n".encode())
    for dist in libraries:
        h.update(f"{dist}=={_version(dist)}\n".encode())
    return h.hexdigest()[:12]
