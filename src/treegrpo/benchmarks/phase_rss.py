"""Peak RSS per phase of one ``treegrpo train`` process, for ``bench real``'s step costs.

``python -c "from treegrpo.benchmarks.phase_rss import main; main()" OUT.json train ARGS…`` runs
``treegrpo train ARGS…`` in this process with the trainer's phases wrapped: model load, the
held-out evaluations, the rollout; inside the update the packing probe and batching
(``update_prep``), the reference/old log-probs, each micro-batch's forward, loss and backward,
the optimizer step; and the checkpoint save. At the end of each phase it records the resident
set (``VmRSS``) and the peak since the previous mark (``VmHWM``, then reset through
``/proc/self/clear_refs``), so every phase has its own maximum; ``OUT.json`` gets the list of
marks and :func:`summary` of it. Linux only (``/proc``); the wrappers change no value the
trainer computes, but the resets make the trainer's own ``mem/peak_rss_gb`` metric (``ru_maxrss``)
the peak since the last mark.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

_T0 = time.perf_counter()
MARKS: list[dict[str, Any]] = []


def _status_gb() -> dict[str, float]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) / 2**20  # kB → GB
    return out


def mark(phase: str, **extra: Any) -> None:
    """Record the end of ``phase``: RSS now and the peak since the previous mark (then reset)."""
    s = _status_gb()
    MARKS.append({"phase": phase, "t_s": round(time.perf_counter() - _T0, 1), "rss_gb": round(s["VmRSS"], 3),
                  "peak_gb": round(s["VmHWM"], 3), **extra})  # fmt: skip
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM: the next mark's peak is its own phase's


def _wrap(
    owner: Any, name: str, before: str | None, after: str, extra: Callable[..., dict] | None = None
) -> None:
    fn = getattr(owner, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if before:
            mark(before)
        out = fn(*args, **kwargs)
        mark(after, **(extra(*args, **kwargs) if extra else {}))
        return out

    setattr(owner, name, wrapped)


def install() -> None:
    """Wrap the trainer's phases (see the module docstring)."""
    import treegrpo.training.policy as pol
    import treegrpo.training.trainer as tr
    import treegrpo.training.update as up

    _wrap(tr, "build_run", None, "load")
    _wrap(tr, "evaluate", "before_eval", "eval")
    _wrap(tr, "update", "before_update", "update_end")
    _wrap(pol, "save_run", "before_save", "save")
    get_sampler = tr.get_sampler

    def sampler(name: str) -> Callable[..., Any]:
        s = get_sampler(name)

        def run(*args: Any, **kwargs: Any) -> Any:
            mark("before_rollout")
            out = s(*args, **kwargs)
            mark("rollout")
            return out

        return run

    tr.get_sampler = sampler  # type: ignore[assignment]

    def shapes(model: Any, plans: Any, *a: Any, **k: Any) -> dict[str, Any]:
        return {"shapes": [[list(mb.input_ids_B_L.shape) for mb in plan] for plan in plans]}

    _wrap(up, "_plan_logprobs", "update_prep", "reference_logprobs", shapes)
    _wrap(up, "_precompute_logprobs", "update_prep", "reference_logprobs")
    _wrap(
        up, "packed_logprobs", None, "forward", lambda m, mb, *a, **k: {"shape": list(mb.input_ids_B_L.shape)}
    )
    _wrap(
        up, "token_logprobs", None, "forward", lambda m, mb, *a, **k: {"shape": list(mb.input_ids_B_T.shape)}
    )
    _wrap(up, "clip_and_step", "before_step", "optimizer_step")
    _wrap(torch.Tensor, "backward", "loss", "backward")


#: Which summary group each mark's phase belongs to (the rest are inside the update).
GROUPS = {"load": "load", "eval": "eval", "rollout": "rollout", "save": "save"}
_BETWEEN = ("before_eval", "before_rollout", "before_update", "before_save", "end")  # between phases


def summary(marks: list[dict[str, Any]]) -> dict[str, float]:
    """``peak_rss_gb`` (the whole process) and ``peak_rss_<group>_gb`` for the groups ``load``,
    ``eval``, ``rollout``, ``update`` (probe and batching, reference log-probs, forwards, losses,
    backwards, optimizer steps) and ``save`` (the checkpoint), each the largest peak of its phases."""
    out: dict[str, float] = {"peak_rss_gb": max((m["peak_gb"] for m in marks), default=0.0)}
    for m in marks:
        if m["phase"] in _BETWEEN:
            continue
        key = f"peak_rss_{GROUPS.get(m['phase'], 'update')}_gb"
        out[key] = max(out.get(key, 0.0), m["peak_gb"])
    return out


def main() -> None:
    out, args = Path(sys.argv[1]), sys.argv[2:]
    install()
    from treegrpo.cli import main as cli

    sys.argv = ["treegrpo", *args]
    code: Any = 0
    try:
        cli()
    except SystemExit as e:
        code = e.code
    mark("end")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"summary": summary(MARKS), "marks": MARKS}, indent=1))
    sys.exit(code)
