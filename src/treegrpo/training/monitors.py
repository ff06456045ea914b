"""Collapse monitors: pure functions of a run's per-step metrics that see trouble coming.

Late-stage collapse (reward and entropy falling to zero) shows up first in the metrics the trainer
already logs. :func:`check_step` reads one step's metrics and the earlier steps' rows and returns
``monitor/...`` values for ``metrics.jsonl`` plus warning lines for the console.

Monitors (keys read → keys written):

- **zero signal** (``rollout/informative_groups``, ``reward/pass_at_group``): the fraction of
  groups (forests) whose leaves all got the same reward, so every advantage is zero and the
  prompt teaches nothing → ``monitor/zero_signal_frac``, split into ``monitor/all_fail_frac``
  (no leaf rewarded: collapse) and ``monitor/all_success_frac`` (saturated). Exact for 0/1 rewards.
- **mixed outcomes** (``rollout/informative_groups``): the fraction of groups with mixed outcomes
  relative to the run's early level → ``monitor/mixed_outcome_ratio`` (1.0 = as informative as
  at the start; it falls when the policy turns all-or-nothing).
- **entropy** (``actor/entropy``): relative to the run's early entropy →
  ``monitor/entropy_ratio``; collapse below ``entropy_low``, explosion above ``entropy_high``.
- **log-prob gap** (``rollout/logprob_diff``, the engine–trainer log-prob difference; absent in
  older runs): ``monitor/logprob_gap`` and ``monitor/logprob_gap_ratio`` (to its early level).
- **reward without answers** (``reward/mean``, ``rollout/answered_frac``): reward earned while
  few trajectories end in a well-formed answer (a reward the answer check does not explain) →
  ``monitor/reward_unanswered`` (1.0 while it holds).
- **non-finite** (every metric): ``monitor/nonfinite``, the number of NaN/inf values.

Each monitor whose condition holds also writes ``monitor/alert/<name>``: for how many consecutive
steps it has held (0 when it does not). A warning line is returned when that count reaches
``patience`` and again every ``repeat_every`` steps after (at once for a non-finite value, and
for a step where no group carries a signal, with the remedy). The count is carried through the
history: pass the earlier rows *as logged*, with the ``monitor/`` values this function returned
merged in (otherwise every count restarts at 1). A monitor whose inputs are missing writes
nothing. "Early" is the mean over the first ``early_steps`` rows that have the key; a monitor
needing it waits until the current step comes after them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Row = Mapping[str, Any]


@dataclass(frozen=True)
class MonitorThresholds:
    """Where each monitor warns (defaults chosen for the tiny default runs; see module docstring).

    Attributes:
        zero_signal_max: warn when at least this fraction of groups has no advantage signal
            (0.95: at most one prompt in twenty teaches anything; the default 3-step run starts at
            0.81-0.94, a weak policy rather than a collapse).
        mixed_outcome_min: warn when the mixed-outcome fraction falls below this multiple of its
            early level (0.25).
        entropy_low: entropy collapse below this multiple of the early entropy (0.2).
        entropy_high: entropy explosion above this multiple of the early entropy (3.0).
        logprob_gap_max: warn when the engine–trainer log-prob gap exceeds this absolute value
            (0.05 nats per token).
        logprob_gap_growth: warn when the gap grows past this multiple of its early level (4.0)…
        logprob_gap_floor: …and is at least this large (0.005), so float noise does not count.
        answered_min: "reward without answers" when reward > 0 and fewer than this fraction of
            trajectories end in a well-formed answer (0.5).
        early_steps: rows averaged for the early reference levels (3).
        patience: consecutive steps a condition must hold before the first warning (2; the
            non-finite monitor always warns at once).
        repeat_every: warn again every this many steps while it holds (10; 0: once).
    """

    zero_signal_max: float = 0.95
    mixed_outcome_min: float = 0.25
    entropy_low: float = 0.2
    entropy_high: float = 3.0
    logprob_gap_max: float = 0.05
    logprob_gap_growth: float = 4.0
    logprob_gap_floor: float = 0.005
    answered_min: float = 0.5
    early_steps: int = 3
    patience: int = 2
    repeat_every: int = 10


def _num(row: Row, key: str) -> float | None:
    v = row.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def early_level(history: Sequence[Row], key: str, n: int) -> tuple[float, int] | None:
    """Mean of ``key`` over the first ``n`` rows of ``history`` that have it, and how many rows
    of ``history`` hold it; None when fewer than ``n`` rows do."""
    vals = [v for row in history if (v := _num(row, key)) is not None]
    if len(vals) < n or n < 1:
        return None
    return sum(vals[:n]) / n, len(vals)


def _alert(history: Sequence[Row], name: str, active: bool) -> int:
    if not active:
        return 0
    prev = _num(history[-1], f"monitor/alert/{name}") if history else None
    return int(prev or 0) + 1


def _ratio(value: float, ref: float) -> float:
    if ref > 0:
        return value / ref
    return 1.0 if value == 0 else math.inf


def zero_signal(metrics: Row) -> dict[str, float]:
    """``monitor/zero_signal_frac`` and its split into all-fail and all-success groups."""
    inf = _num(metrics, "rollout/informative_groups")
    if inf is None:
        return {}
    out = {"monitor/zero_signal_frac": 1.0 - inf}
    passed = _num(metrics, "reward/pass_at_group")
    if passed is not None:
        out["monitor/all_success_frac"] = max(0.0, passed - inf)
        out["monitor/all_fail_frac"] = max(0.0, 1.0 - passed)
    return out


def mixed_outcome_ratio(history: Sequence[Row], metrics: Row, n_early: int) -> float | None:
    """The mixed-outcome fraction over its early level (None until the early level is known)."""
    cur = _num(metrics, "rollout/informative_groups")
    early = early_level(history, "rollout/informative_groups", n_early)
    return None if cur is None or early is None else _ratio(cur, early[0])


def entropy_ratio(history: Sequence[Row], metrics: Row, n_early: int) -> float | None:
    """``actor/entropy`` over its early level (None until the early level is known)."""
    cur = _num(metrics, "actor/entropy")
    early = early_level(history, "actor/entropy", n_early)
    return None if cur is None or early is None else _ratio(cur, early[0])


def logprob_gap(history: Sequence[Row], metrics: Row, n_early: int) -> tuple[float, float | None] | None:
    """|``rollout/logprob_diff``| and its ratio to the early level (None where unknown)."""
    cur = _num(metrics, "rollout/logprob_diff")
    if cur is None:
        return None
    early = early_level(history, "rollout/logprob_diff", n_early)
    return abs(cur), None if early is None else _ratio(abs(cur), abs(early[0]))


def reward_without_answers(metrics: Row, answered_min: float) -> bool | None:
    """Reward > 0 while fewer than ``answered_min`` of the trajectories answered (None: unknown)."""
    reward, answered = _num(metrics, "reward/mean"), _num(metrics, "rollout/answered_frac")
    if reward is None or answered is None:
        return None
    return reward > 0 and answered < answered_min


def nonfinite_keys(metrics: Row) -> list[str]:
    """Keys of ``metrics`` whose value is a NaN or infinite float."""
    return sorted(k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v))


def check_step(
    history: Sequence[Row],
    metrics: Row,
    thresholds: MonitorThresholds | None = None,
    step: int | None = None,
) -> tuple[dict[str, float], list[str]]:
    """Run every monitor on one step.

    Args:
        history: the earlier steps' metrics rows, oldest first, as logged (with this function's
            ``monitor/`` values merged in; rows without training keys, like the step-0
            evaluation row, are simply skipped by every monitor).
        metrics: this step's metrics (the same keys the trainer logs).
        thresholds: where to warn; the defaults of :class:`MonitorThresholds` when None.
        step: this step's number, only for the warning lines.

    Returns:
        ``(new_metrics, warnings)``: ``monitor/...`` values to merge into this step's metrics,
        and the warning lines (each starts with ``warning:``) to print.
    """
    th = thresholds or MonitorThresholds()
    n = th.early_steps
    out: dict[str, float] = {}
    conds: dict[str, str | None] = {}  # name -> reason text when active, None when not

    zs = zero_signal(metrics)
    out.update(zs)
    if zs:
        frac = zs["monitor/zero_signal_frac"]
        why = ""
        if "monitor/all_fail_frac" in zs:
            why = f" ({zs['monitor/all_fail_frac']:.0%} all fail, {zs['monitor/all_success_frac']:.0%} all succeed)"
        remedy = "; every advantage is 0, so this step taught nothing" + (
            "" if _num(metrics, "dynamic/draws") is not None else
            ": set dynamic_sampling=4 (drop such groups, draw more prompts: DAPO's dynamic sampling) or give questions the policy sometimes solves"
        )  # fmt: skip
        conds["zero_signal"] = (
            f"{frac:.0%} of groups have no advantage signal{why}; threshold {th.zero_signal_max:.0%}"
            + (remedy if frac >= 1.0 else "")
            if frac >= th.zero_signal_max
            else None
        )
    mix = mixed_outcome_ratio(history, metrics, n)
    if mix is not None:
        out["monitor/mixed_outcome_ratio"] = mix
        conds["mixed_outcome"] = (
            f"mixed-outcome groups fell to {mix:.2f}× their early level; threshold {th.mixed_outcome_min:g}×"
            if mix < th.mixed_outcome_min
            else None
        )
    ent = entropy_ratio(history, metrics, n)
    if ent is not None:
        out["monitor/entropy_ratio"] = ent
        cur = _num(metrics, "actor/entropy")
        conds["entropy_collapse"] = (
            f"entropy collapse: actor/entropy {cur:.4g} is {ent:.2f}× its early level; threshold {th.entropy_low:g}×"
            if ent < th.entropy_low
            else None
        )
        conds["entropy_explosion"] = (
            f"entropy explosion: actor/entropy {cur:.4g} is {ent:.2f}× its early level; threshold {th.entropy_high:g}×"
            if ent > th.entropy_high
            else None
        )
    gap = logprob_gap(history, metrics, n)
    if gap is not None:
        value, growth = gap
        out["monitor/logprob_gap"] = value
        reasons = []
        if value > th.logprob_gap_max:
            reasons.append(f"above {th.logprob_gap_max:g}")
        if growth is not None:
            out["monitor/logprob_gap_ratio"] = growth
            if growth > th.logprob_gap_growth and value >= th.logprob_gap_floor:
                reasons.append(f"{growth:.1f}× its early level (threshold {th.logprob_gap_growth:g}×)")
        conds["logprob_gap"] = (
            f"engine–trainer log-prob gap {value:.4g} is " + " and ".join(reasons) if reasons else None
        )
    rwa = reward_without_answers(metrics, th.answered_min)
    if rwa is not None:
        out["monitor/reward_unanswered"] = float(rwa)
        conds["reward_unanswered"] = (
            f"reward {_num(metrics, 'reward/mean'):.3f} while only {_num(metrics, 'rollout/answered_frac'):.0%} "
            f"of trajectories answered (threshold {th.answered_min:.0%}): check the reward"
            if rwa
            else None
        )
    bad = nonfinite_keys(metrics)
    out["monitor/nonfinite"] = float(len(bad))
    conds["nonfinite"] = f"non-finite values in {', '.join(bad)}" if bad else None

    warnings = []
    where = f"step {step}: " if step is not None else ""
    for name, reason in conds.items():
        count = _alert(history, name, reason is not None)
        out[f"monitor/alert/{name}"] = float(count)
        patience = 1 if name == "nonfinite" else max(1, th.patience)  # a NaN is news at once
        due = count == patience or (th.repeat_every > 0 and count > patience and (count - patience) % th.repeat_every == 0)
        due = due or (count == 1 and name == "zero_signal" and out.get("monitor/zero_signal_frac") == 1.0)  # no signal at all
        if reason is not None and due:
            held = f" (for {count} steps)" if count > 1 else ""
            warnings.append(f"warning: {where}{reason}{held}")
    return out, warnings


__all__ = [
    "MonitorThresholds",
    "check_step",
    "early_level",
    "entropy_ratio",
    "logprob_gap",
    "mixed_outcome_ratio",
    "nonfinite_keys",
    "reward_without_answers",
    "zero_signal",
]
