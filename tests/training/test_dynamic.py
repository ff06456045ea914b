"""Dynamic sampling (training/dynamic.py): zero-signal groups dropped, more prompts drawn up to a
cap, every draw's cost counted; the zero-signal monitor says so at the first step."""

from __future__ import annotations

import io
import json
from pathlib import Path

from rich.console import Console
from test_trainer import parts_for, small_cfg

from treegrpo.rollout.agent import Budget, RolloutResult
from treegrpo.training.dynamic import dynamic_note, dynamic_rollout, informative
from treegrpo.training.monitors import check_step
from treegrpo.training.trainer import train
from treegrpo.tree import Forest, Node, Tree


def _forest(pid: str, rewards: list[float]) -> Forest:
    return Forest(pid, [Tree([Node(0, None), Node(1, 0, reward=r)]) for r in rewards])


def _result(groups: dict[str, list[float]]) -> RolloutResult:
    return RolloutResult([_forest(p, r) for p, r in groups.items()], [Budget(generated_tokens=10) for _ in groups], engine_calls=1)


WORLD = {"a": [0, 0], "b": [0, 1], "c": [1, 1], "d": [1, 0], "e": [0, 1], "f": [0, 0]}


def _drawer(order: list[str]) -> tuple[list[list[str]], object]:
    calls: list[list[str]] = []

    def draw(k: int) -> list[str]:
        out = order[:k]
        del order[:k]
        calls.append(out)
        return out

    return calls, draw


def test_informative_is_leaves_that_disagree() -> None:
    assert [informative(_forest(p, r)) for p, r in WORLD.items()] == [False, True, False, True, True, False]


def test_more_prompts_are_drawn_until_enough_groups_carry_a_signal() -> None:
    calls, draw = _drawer(["c", "d", "e", "f"])
    step = dynamic_rollout(_result({"a": WORLD["a"], "b": WORLD["b"]}), ["a", "b"], lambda ts: _result({t: WORLD[t] for t in ts}), draw, 2, 3)  # type: ignore[arg-type]
    assert calls == [["c", "d"]]  # a, b: one informative; c, d bring the second
    assert step.tasks == ["b", "d"] and [f.prompt_id for f in step.kept.forests] == ["b", "d"]
    assert step.metrics == {"dynamic/draws": 2.0, "dynamic/groups_drawn": 4.0, "dynamic/groups_kept": 2.0}
    assert step.drawn.total().generated_tokens == 40 and step.drawn.engine_calls == 2  # every draw's cost
    assert step.kept.total().generated_tokens == 20
    assert dynamic_note(step.metrics, 2) is None


def test_the_draws_stop_at_the_cap_and_surplus_groups_are_trimmed() -> None:
    calls, draw = _drawer(["a", "c", "f", "a"])
    step = dynamic_rollout(_result({"a": WORLD["a"], "c": WORLD["c"]}), ["a", "c"], lambda ts: _result({t: WORLD[t] for t in ts}), draw, 2, 1)  # type: ignore[arg-type]
    assert calls == [["a", "c"]] and step.metrics["dynamic/draws"] == 2 and step.kept.forests == [] and step.tasks == []
    note = dynamic_note(step.metrics, 2)
    assert note is not None and note.startswith("warning: dynamic sampling: 0 of 2 groups carry a signal after 2 draws")
    calls, draw = _drawer([])
    step = dynamic_rollout(_result({p: WORLD[p] for p in "bde"}), list("bde"), lambda ts: _result({}), draw, 2, 3)  # type: ignore[arg-type]
    assert calls == [] and step.tasks == ["b", "d"] and step.metrics["dynamic/groups_drawn"] == 3  # e drawn, not trained


def test_a_step_without_signal_is_said_at_once_with_the_remedy() -> None:
    row = {"rollout/informative_groups": 0.0, "reward/pass_at_group": 0.0}
    out, warnings = check_step([], row, step=1)
    (w,) = warnings
    assert w.startswith("warning: step 1: 100% of groups have no advantage signal (100% all fail, 0% all succeed)")
    assert "set dynamic_sampling=4" in w and out["monitor/alert/zero_signal"] == 1.0
    _, later = check_step([{**row, **out}], row, step=2)
    assert len(later) == 1  # the usual warning at patience 2 still comes
    _, weak = check_step([], {**row, "rollout/informative_groups": 0.04}, step=1)
    assert weak == []  # 96% without signal: the usual patience


def test_a_run_with_dynamic_sampling_counts_every_draw(tiny_model_dir: Path, tmp_path: Path) -> None:
    buf = io.StringIO()
    s = train(small_cfg(tmp_path / "r", steps=1, kl_coef=0.0, dynamic_sampling=2), parts=parts_for(tiny_model_dir),
              console=Console(file=buf, width=300))  # fmt: skip
    (row,) = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()][1:]
    draws, drawn, kept = row["dynamic/draws"], row["dynamic/groups_drawn"], row["dynamic/groups_kept"]
    assert 1 <= draws <= 3 and drawn == 2 * draws and kept <= 2
    assert row["rollout/trajectories"] == kept * 4 == s.trajectories  # M=2, N=L=1: 4 per prompt
    assert len(row["rollout/prompt_ids"]) == kept
    assert s.generated_tokens == row["budget/generated_tokens"] > 0  # the dropped groups' tokens too
    assert (kept < 2) == ("warning: dynamic sampling:" in buf.getvalue())
    plain = tmp_path / "p"
    train(small_cfg(plain, steps=1, kl_coef=0.0), parts=parts_for(tiny_model_dir), console=Console(file=io.StringIO()))
    assert not any(k.startswith("dynamic/") for k in json.loads((plain / "metrics.jsonl").read_text().splitlines()[1]))
