"""The plumbing every ``treegrpo bench …`` shares: run configurations in their own processes and
collect their rows (or one command in a process of its own, its peak RSS measured), key a run by
its settings, carry on from an earlier result (``--resume``: the rows of the result JSON, or
a finished run's own ``done`` file in a work folder), write the result JSON atomically and draw its
figure, set torch's threads meanwhile.

A bench keeps only what it measures and how it reads the measurements; the runner knows nothing
about any bench (it imports none of them).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from treegrpo.io import atomic_write_text

Log = Callable[[str], object]


@dataclass(frozen=True)
class Shape:
    """A rollout configuration matched to a chain budget: ``mode`` (``chain`` / ``tree``),
    ``budget`` (chains per prompt it is matched to), ``m`` initial chains per prompt (for ``chain``
    the group size ``G``), ``n`` expansions per tree per round and ``l`` rounds (0 for ``chain``),
    ``expand_mode`` the tree sampler's pick rule (``None`` for ``chain``)."""

    mode: Literal["chain", "tree"]
    budget: int
    m: int
    n: int
    l: int
    expand_mode: str | None


def make_console(width: int = 150) -> Any:
    """A rich console, ``width`` columns wide when the output is not a terminal (a pipe or a file:
    tables are not squeezed into 80 columns)."""
    from rich.console import Console

    return Console(soft_wrap=True, width=None if Console().is_terminal else width)


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """torch's intra-op threads set to ``threads`` meanwhile, restored after (``None`` / 0: left)."""
    import torch

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_jobs(
    fn: Callable[..., dict[str, Any]],
    jobs: Sequence[tuple[Any, tuple[Any, ...]]],
    workers: int,
    done: Callable[[Any, dict[str, Any]], None],
) -> None:
    """Call ``fn(*args)`` for every ``(key, args)`` of ``jobs`` and ``done(key, row)`` as each
    finishes: in this process one after the other when ``workers <= 1``, else in ``workers`` fresh
    (spawned) processes, rows handed over as they come."""
    if workers <= 1:
        for key, args in jobs:
            done(key, fn(*args))
        return
    import multiprocessing as mp

    with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as pool:
        pending: dict[Future[dict[str, Any]], Any] = {pool.submit(fn, *args): key for key, args in jobs}
        while pending:
            ready, _ = wait(pending, return_when=FIRST_COMPLETED)
            for fut in ready:
                done(pending.pop(fut), fut.result())


def without_timings(obj: Any) -> Any:
    """``obj`` with every ``wall_s`` key dropped, at any depth: how long something took is not what
    it was (a starting policy bootstrapped again on another day is the same policy, bit for bit,
    with other timings in its record)."""
    if isinstance(obj, dict):
        return {k: without_timings(v) for k, v in obj.items() if k != "wall_s"}
    if isinstance(obj, list):
        return [without_timings(v) for v in obj]
    return obj


def resume_rows(
    out: Path,
    meta: dict[str, Any],
    wanted: Iterable[Hashable],
    key_of: Callable[[dict[str, Any]], Hashable],
    prov: dict[str, Any],
    log: Log,
    what: str = "regime or starting policy",
    identity: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> tuple[list[dict[str, Any]], float]:
    """The rows of an earlier result ``out`` to keep: those whose key is ``wanted``, when ``out``
    was made with the same ``meta`` (every key of it equal, timings aside: :func:`without_timings`),
    read off the earlier document by ``identity`` (default: its own top-level keys); with the wall
    seconds already spent on them. ``prov`` gets ``resumed_from`` (the earlier provenance) when rows
    are kept."""
    if not Path(out).is_file():
        return [], 0.0
    old = json.loads(Path(out).read_text())
    view = identity(old) if identity else old
    if without_timings({k: view.get(k) for k in meta}) != without_timings(meta):
        log(f"[yellow]not resuming[/]: {out} was made with another {what}")
        return [], 0.0
    keep = set(wanted)
    rows = [r for r in old.get("rows", []) if key_of(r) in keep]
    if rows and "provenance" in old:  # the kept rows were made by that session
        prov["resumed_from"] = old["provenance"]
    log(f"resuming: {len(rows)} runs already in {out}")
    return rows, float(old.get("wall_s", 0.0))


def finished_row(done: Path, key: Any, field: str = "key") -> dict[str, Any] | None:
    """The row a run left in its ``done`` file (``{field: key, "row": row}``, :func:`keep_row`)
    when it was made with the same ``key``; ``None`` when there is none or it was made otherwise."""
    if Path(done).is_file() and (prev := json.loads(Path(done).read_text())).get(field) == key:
        return prev["row"]
    return None


def keep_row(done: Path, key: Any, row: dict[str, Any], field: str = "key") -> None:
    """Record a finished run's ``row`` with the ``key`` it was made with (atomically), so a later
    session can take it over (:func:`finished_row`) instead of running it again."""
    atomic_write_text(Path(done), json.dumps({field: key, "row": row}, indent=1))


def write_result(
    out: Path,
    doc: dict[str, Any],
    plot: Callable[[Any, Path], None] | None = None,
    plot_of: Callable[[dict[str, Any]], Any] | None = None,
    indent: int = 1,
    newline: bool = False,
    log: Log | None = None,
) -> Path:
    """Write ``doc`` to ``out`` as JSON, atomically (an interrupted write leaves the old file), and
    when ``plot`` is given draw ``plot(plot_of(doc) or doc, png)`` beside it; ``log`` says what was
    written. Returns the PNG path."""
    out = Path(out)
    atomic_write_text(out, json.dumps(doc, indent=indent) + ("\n" if newline else ""))
    png = out.with_suffix(".png")
    if plot is not None:
        plot(doc if plot_of is None else plot_of(doc), png)
    if log is not None:
        log(f"wrote {out} and {png}" if plot is not None else f"wrote {out}")
    return png


def digest(*parts: Any, length: int = 16) -> str:
    """The first ``length`` hex digits of the SHA-256 of ``parts`` in turn: a :class:`Path`'s bytes,
    anything else as sorted-key JSON (``str`` for what JSON cannot hold). A run's key in its work
    folder: the same settings give the same key in a later session."""
    h = hashlib.sha256()
    for p in parts:
        h.update(Path(p).read_bytes() if isinstance(p, Path) else json.dumps(p, sort_keys=True, default=str).encode())
    return h.hexdigest()[:length]


# Runs in a fresh interpreter: start the command as its child (its stdout joins stderr, so the last
# stdout line is this report), report that child's peak RSS.
_MIDDLE = """
import json, resource, subprocess, sys, time
t = time.perf_counter()
rc = subprocess.run(json.loads(sys.argv[1]), stdout=sys.stderr.fileno()).returncode
peak_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB on Linux
print(json.dumps({"rc": rc, "peak_kb": peak_kb, "wall_s": time.perf_counter() - t}))
"""


def run_measured(cmd: list[str], log: Path | None = None, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Run ``cmd`` in a process of its own (the child of a fresh middle process, so no other run
    shares its maximum): ``{"rc", "peak_rss_gb", "wall_s", "stderr"}``. The command's output goes to
    ``log`` when given (``stderr`` is then ``""``), else it is captured into ``stderr``. ``env``:
    variables set for the command on top of this process's environment (e.g. glibc's
    ``MALLOC_MMAP_THRESHOLD_``, read when the process starts)."""
    middle = [sys.executable, "-c", _MIDDLE, json.dumps(cmd)]
    full = {**os.environ, **env} if env else None
    if log is None:
        res = subprocess.run(middle, capture_output=True, text=True, check=False, env=full)
    else:
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("w") as fh:
            res = subprocess.run(middle, stdout=subprocess.PIPE, stderr=fh, text=True, check=False, env=full)
    got = json.loads(res.stdout.strip().splitlines()[-1]) if res.stdout.strip() else {}
    return {
        "rc": got.get("rc", 1),
        "peak_rss_gb": got.get("peak_kb", 0) / 2**20,
        "wall_s": got.get("wall_s", 0.0),
        "stderr": res.stderr or "",
    }


def held_out_eval(cfg: Any, sampled: bool) -> dict[str, Any]:
    """treegrpo's held-out evaluation (the agent loop; greedy, and sampled when ``sampled``) of
    the run config ``cfg``'s model on its job: ``{"eval", "eval_ids"`` (the questions asked),
    ``"wall_s"`` (the evaluation's, loading excluded)``}``."""
    from treegrpo.rollout.agent import StepRunner
    from treegrpo.rollout.engine import make_engine
    from treegrpo.training.evaluate import evaluate
    from treegrpo.training.setup import build_run

    parts = build_run(cfg)
    engine = make_engine(cfg.engine, parts.model, parts.tokenizer, device=cfg.device, **cfg.engine_options)
    runner = StepRunner(engine, parts.env, parts.tokenizer, parts.agent_cfg)
    t0 = time.perf_counter()
    ev = evaluate(runner, parts.eval_tasks, sampled=sampled)
    return {"eval": ev, "eval_ids": [t.id for t in parts.eval_tasks], "wall_s": time.perf_counter() - t0}


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, png: Path, dpi: int = 110) -> None:
    """Lay ``fig`` out, write it to ``png`` and free it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(png, dpi=dpi)
    plt.close(fig)


def spread(values: Iterable[float]) -> dict[str, float]:
    """Mean, min, max, sample standard deviation (0 for one value) and count."""
    v = list(values)
    std = statistics.stdev(v) if len(v) > 1 else 0.0
    return {"mean": statistics.fmean(v), "min": min(v), "max": max(v), "std": std, "n": len(v)}


def option_flags(values: dict[str, Any]) -> str:
    """`` --name value`` for every set (not ``None``) value, underscores as dashes."""
    return "".join(f" --{k.replace('_', '-')} {v}" for k, v in values.items() if v is not None)


__all__ = [
    "Log",
    "Shape",
    "digest",
    "finished_row",
    "held_out_eval",
    "keep_row",
    "make_console",
    "option_flags",
    "pyplot",
    "resume_rows",
    "run_jobs",
    "run_measured",
    "save_figure",
    "spread",
    "torch_threads",
    "without_timings",
    "write_result",
]
