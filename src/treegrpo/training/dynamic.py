"""Dynamic sampling (DAPO's, verl's ``algorithm.filter_groups``): train only on groups that carry a
signal, drawing more prompts until a step has enough of them.

A group (one prompt's forest) whose leaves all got the same reward has every advantage 0: it costs
a rollout and teaches nothing. With ``dynamic_sampling = K`` (> 0) a step drops such groups and,
while fewer than ``prompts_per_step`` groups carry a signal, draws another ``prompts_per_step``
prompts from the run's prompt stream and rolls them out — at most ``K`` extra draws. It trains on
the first ``prompts_per_step`` informative groups in the order they were drawn (fewer when the
draws run out; none when no group carried a signal: the update then leaves the weights as they are). Every rollout drawn is
the step's cost: its ``budget/*`` metrics, the run's token totals and the EM-per-token curve count
the dropped groups too, and the step's rollout metrics (reward, informative fraction) describe all
the groups drawn; ``rollout/trajectories`` and ``rollout/prompt_ids`` are the ones trained on.
``dynamic/draws``, ``dynamic/groups_drawn`` and ``dynamic/groups_kept`` say what happened.

Off (0, the default) nothing here runs: the run's prompt, pick and sampling streams are as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from treegrpo.rollout.agent import RolloutResult
from treegrpo.tree import Forest


def informative(forest: Forest) -> bool:
    """Whether ``forest``'s leaves got different rewards (a non-zero advantage somewhere)."""
    return len({leaf.reward for _, leaf in forest.leaves()}) > 1


def merged(results: Sequence[RolloutResult]) -> RolloutResult:
    """The rollouts of several draws as one result: forests and budgets in draw order, engine
    calls, wall time and engine work added."""
    out = RolloutResult([], [])
    for r in results:
        out.forests += r.forests
        out.budgets += r.budgets
        out.engine_calls += r.engine_calls
        out.wall_s += r.wall_s
        if r.engine_stats is not None:
            out.engine_stats = r.engine_stats if out.engine_stats is None else out.engine_stats + r.engine_stats
    return out


@dataclass
class DynamicStep:
    """One step's dynamic sampling: what it trains on (``kept``, ``tasks``), everything it rolled out
    (``drawn``) and its ``dynamic/*`` metrics."""

    kept: RolloutResult
    tasks: list[Any]
    drawn: RolloutResult
    metrics: dict[str, float] = field(default_factory=dict)


def dynamic_rollout(
    first: RolloutResult,
    tasks: Sequence[Any],
    roll: Callable[[list[Any]], RolloutResult],
    draw: Callable[[int], list[Any]],
    want: int,
    extra_draws: int,
) -> DynamicStep:
    """Keep ``first``'s informative groups and, while fewer than ``want``, ``roll`` out ``draw(want)``
    more prompts, at most ``extra_draws`` times; the first ``want`` informative groups are trained
    on (the module docstring). ``tasks``: ``first``'s prompts, one per forest."""
    results, all_tasks = [first], list(tasks)
    while sum(informative(f) for r in results for f in r.forests) < want and len(results) <= extra_draws:
        more = draw(want)
        if not more:
            break
        results.append(roll(more))
        all_tasks += more
    drawn = merged(results)
    keep = [i for i, f in enumerate(drawn.forests) if informative(f)][:want]
    kept = RolloutResult([drawn.forests[i] for i in keep], [drawn.budgets[i] for i in keep])
    metrics = {
        "dynamic/draws": float(len(results)),
        "dynamic/groups_drawn": float(len(drawn.forests)),
        "dynamic/groups_kept": float(len(keep)),
    }
    return DynamicStep(kept, [all_tasks[i] for i in keep], drawn, metrics)


def dynamic_note(metrics: dict[str, float], want: int) -> str | None:
    """A console line when a step's draws ran out before ``want`` groups carried a signal."""
    kept = int(metrics.get("dynamic/groups_kept", want))
    if kept >= want:
        return None
    draws = int(metrics["dynamic/draws"])
    return (
        f"warning: dynamic sampling: {kept} of {want} groups carry a signal after {draws} draws of prompts "
        f"({int(metrics['dynamic/groups_drawn'])} groups rolled out); the step trains on {kept}. Raise "
        "dynamic_sampling for more draws, or the questions are too hard or too easy for the policy"
    )


__all__ = ["DynamicStep", "dynamic_note", "dynamic_rollout", "informative", "merged"]
