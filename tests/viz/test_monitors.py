"""Collapse monitors on hand-made metric sequences (training/monitors.py)."""

from __future__ import annotations

import math

import pytest

from treegrpo.training.monitors import (
    MonitorThresholds,
    check_step,
    early_level,
    entropy_ratio,
    logprob_gap,
    mixed_outcome_ratio,
    reward_without_answers,
    zero_signal,
)


def run(rows: list[dict], th: MonitorThresholds | None = None) -> tuple[list[dict], list[list[str]]]:
    """Feed ``rows`` step by step the way the trainer would: monitor values merged into history."""
    history: list[dict] = []
    warns = []
    for step, row in enumerate(rows, 1):
        new, w = check_step(history, row, th, step=step)
        history.append({**row, **new})
        warns.append(w)
    return history, warns


def test_zero_signal_splits_fail_and_success() -> None:
    # 10 groups: 2 mixed, 5 with some reward (so 3 all-success), 5 with none (all fail)
    out = zero_signal({"rollout/informative_groups": 0.2, "reward/pass_at_group": 0.5})
    assert out == pytest.approx(
        {"monitor/zero_signal_frac": 0.8, "monitor/all_success_frac": 0.3, "monitor/all_fail_frac": 0.5}
    )
    assert zero_signal({"reward/mean": 1.0}) == {}
    assert zero_signal({"rollout/informative_groups": 0.5}) == {"monitor/zero_signal_frac": 0.5}


def test_early_level_needs_n_rows_with_the_key() -> None:
    hist = [{"eval/success_greedy": 0.3}, {"actor/entropy": 2.0}, {"actor/entropy": 4.0}, {"actor/entropy": 9.0}]
    assert early_level(hist, "actor/entropy", 2) == (3.0, 3)
    assert early_level(hist, "actor/entropy", 4) is None
    assert early_level([{"actor/entropy": float("nan")}], "actor/entropy", 1) is None


def test_ratios_against_the_early_level() -> None:
    hist = [{"actor/entropy": 1.0, "rollout/informative_groups": 0.5}] * 3
    assert entropy_ratio(hist, {"actor/entropy": 0.1}, 3) == pytest.approx(0.1)
    assert entropy_ratio(hist[:2], {"actor/entropy": 0.1}, 3) is None
    assert mixed_outcome_ratio(hist, {"rollout/informative_groups": 0.125}, 3) == pytest.approx(0.25)
    assert entropy_ratio([{"actor/entropy": 0.0}] * 3, {"actor/entropy": 0.0}, 3) == 1.0
    assert math.isinf(entropy_ratio([{"actor/entropy": 0.0}] * 3, {"actor/entropy": 0.5}, 3))


def test_logprob_gap_is_optional_and_absolute() -> None:
    assert logprob_gap([], {"reward/mean": 1.0}, 3) is None
    assert logprob_gap([], {"rollout/logprob_diff": -0.02}, 3) == (0.02, None)
    hist = [{"rollout/logprob_diff": 0.01}] * 3
    value, growth = logprob_gap(hist, {"rollout/logprob_diff": 0.05}, 3)
    assert (value, growth) == (0.05, pytest.approx(5.0))


def test_reward_without_answers() -> None:
    assert reward_without_answers({"reward/mean": 0.4, "rollout/answered_frac": 0.1}, 0.5) is True
    assert reward_without_answers({"reward/mean": 0.0, "rollout/answered_frac": 0.1}, 0.5) is False
    assert reward_without_answers({"reward/mean": 0.4, "rollout/answered_frac": 0.9}, 0.5) is False
    assert reward_without_answers({"reward/mean": 0.4}, 0.5) is None


def test_entropy_collapse_warns_after_patience_then_repeats() -> None:
    th = MonitorThresholds(patience=2, repeat_every=3)
    ents = [1.0, 1.2, 0.8, 0.5, 0.15, 0.1, 0.1, 0.1, 0.1, 0.1, 0.5]
    hist, warns = run([{"actor/entropy": e} for e in ents], th)
    assert "monitor/entropy_ratio" not in hist[2]  # early level = mean of steps 1-3 = 1.0
    assert hist[3]["monitor/entropy_ratio"] == pytest.approx(0.5)
    counts = [h.get("monitor/alert/entropy_collapse") for h in hist]
    assert counts == [None, None, None, 0, 1, 2, 3, 4, 5, 6, 0]
    warned = [i + 1 for i, w in enumerate(warns) if any("entropy collapse" in x for x in w)]
    assert warned == [6, 9]  # step 6: held for 2 steps (patience); again 3 steps later
    assert warns[5] == ["warning: step 6: entropy collapse: actor/entropy 0.1 is 0.10× its early level; threshold 0.2× (for 2 steps)"]


def test_entropy_explosion() -> None:
    _, warns = run([{"actor/entropy": e} for e in (1.0, 1.0, 1.0, 3.5, 4.0)], MonitorThresholds(patience=1))
    assert [len(w) for w in warns] == [0, 0, 0, 1, 0]
    assert "entropy explosion" in warns[3][0] and "3.50×" in warns[3][0]


def test_zero_signal_and_mixed_outcome_warnings() -> None:
    rows = [
        {"rollout/informative_groups": g, "reward/pass_at_group": p}
        for g, p in [(0.5, 0.75), (0.5, 0.75), (0.5, 0.75), (0.25, 0.5), (0.0, 0.0), (0.0, 0.0), (0.5, 0.5)]
    ]
    hist, warns = run(rows, MonitorThresholds(patience=2))
    assert hist[4]["monitor/all_fail_frac"] == 1.0 and hist[4]["monitor/zero_signal_frac"] == 1.0
    assert hist[3]["monitor/mixed_outcome_ratio"] == pytest.approx(0.5)
    (w,) = warns[4]  # no group with a signal at all: said at once (not after patience), with the remedy
    assert "100% of groups have no advantage signal" in w and "dynamic_sampling" in w
    assert any("100% of groups have no advantage signal (100% all fail, 0% all succeed)" in w for w in warns[5])
    assert any("mixed-outcome groups fell to 0.00×" in w for w in warns[5])
    assert warns[6] == [] and hist[6]["monitor/alert/zero_signal"] == 0


def test_saturation_is_not_called_a_failure() -> None:
    new, _ = check_step([], {"rollout/informative_groups": 0.0, "reward/pass_at_group": 1.0})
    assert new["monitor/all_success_frac"] == 1.0 and new["monitor/all_fail_frac"] == 0.0


def test_growing_logprob_gap() -> None:
    gaps = [0.001, 0.001, 0.001, 0.003, 0.01, 0.02, 0.06, 0.07]
    hist, warns = run([{"rollout/logprob_diff": g} for g in gaps], MonitorThresholds(patience=1, repeat_every=0))
    assert hist[3]["monitor/logprob_gap_ratio"] == pytest.approx(3.0)  # under 4×: quiet
    assert warns[3] == []
    assert len(warns[4]) == 1 and "10.0× its early level" in warns[4][0]  # 0.01 >= floor, 10×
    assert warns[5] == warns[6] == warns[7] == []  # repeat_every=0: once per episode
    assert "above 0.05" in check_step([], {"rollout/logprob_diff": 0.06}, MonitorThresholds(patience=1))[1][0]
    # a tiny gap growing 10× is float noise: under the floor, no warning
    _, w = run([{"rollout/logprob_diff": g} for g in (1e-4, 1e-4, 1e-4, 1e-3)], MonitorThresholds(patience=1))
    assert w[3] == []


def test_missing_series_are_skipped() -> None:
    new, warns = check_step([{"eval/success_greedy": 0.2}], {"reward/mean": 0.3, "time/update_s": 1.0})
    assert warns == []
    assert new == {"monitor/nonfinite": 0.0, "monitor/alert/nonfinite": 0.0}


def test_nonfinite_warns_at_once_and_names_the_keys() -> None:
    new, warns = check_step([], {"actor/loss": float("nan"), "actor/grad_norm": float("inf"), "reward/mean": 0.0})
    assert new["monitor/nonfinite"] == 2.0
    assert warns == ["warning: non-finite values in actor/grad_norm, actor/loss"]


def test_reward_unanswered_warning_text() -> None:
    rows = [{"reward/mean": 0.3, "rollout/answered_frac": 0.2}] * 2
    hist, warns = run(rows)
    assert hist[1]["monitor/reward_unanswered"] == 1.0
    assert warns[1] == [
        "warning: step 2: reward 0.300 while only 20% of trajectories answered (threshold 50%): check the reward (for 2 steps)"
    ]


def test_without_merged_history_every_step_counts_from_one() -> None:
    th = MonitorThresholds(patience=1, repeat_every=0)
    row = {"reward/mean": 0.3, "rollout/answered_frac": 0.2}
    for _ in range(3):
        assert len(check_step([row], row, th)[1]) == 1
