"""``package.module:name`` references to a user's own objects (``--env``, ``--tools``, ``--reward``),
and the reference that records a Python object in a run's ``config.json``."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from treegrpo.errors import ConfigError


def import_object(ref: str, what: str = "object") -> Any:
    """The object ``ref`` names, ``package.module:name`` (``name`` may be dotted: ``mod:Class.method``),
    imported with the working directory on ``sys.path`` (so a module beside the user's config or
    script is found, as ``python -m`` finds it).

    Raises:
        ConfigError: ``ref`` is not of that form, the module does not import, or has no such name.
    """
    module, sep, name = ref.strip().partition(":")
    if not sep or not module or not name:
        raise ConfigError(f"{what} {ref!r}: expected package.module:name (e.g. my_tools:calculator)")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        obj: Any = importlib.import_module(module)
    except ModuleNotFoundError as e:
        raise ConfigError(
            f"{what} {ref!r}: no module {e.name!r} importable from {cwd} (run from the folder that holds it, or "
            "install it / add it to PYTHONPATH)"
        ) from None
    except Exception as e:  # the user's module itself fails to import
        raise ConfigError(f"{what} {ref!r}: importing {module} failed: {type(e).__name__}: {e}") from None
    for part in name.split("."):
        if not hasattr(obj, part):
            if module == "__main__":  # recorded by a script's run (treegrpo.train), resumed from elsewhere
                raise ConfigError(
                    f"{what} {ref!r} was defined in the script that started the run and cannot be imported "
                    "back: move it into a module of its own (e.g. my_tools.py beside the script), import it "
                    "from there, and resume from that folder (or call treegrpo.train(..., resume=True) from the script)"
                )
            raise ConfigError(f"{what} {ref!r}: module {module} has no {name!r}")
        obj = getattr(obj, part)
    return obj


def object_ref(obj: Any) -> str:
    """``module:qualname`` of a function or class (what ``config.json`` records for a Python object a
    caller passed); an object that cannot be imported back by that name (a lambda, a nested
    function, an instance) gets its ``repr`` in angle brackets, so a resume refuses it clearly."""
    module = getattr(obj, "__module__", None)
    qual = getattr(obj, "__qualname__", None)
    if module and qual and "<" not in qual:
        return f"{module}:{qual}"
    return f"<{qual or type(obj).__name__}>"


__all__ = ["import_object", "object_ref"]
