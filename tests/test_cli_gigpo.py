"""`treegrpo advantages -e gigpo`: a forest file scored by GiGPO from the command line, with its
anchor groups written per node, GiGPO's options, and one-line errors for bad ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_cli_advantages import FOREST, advantages_of, invoke, write


def test_gigpo_scores_every_step_and_writes_anchor_groups(tmp_path: Path) -> None:
    f = write(tmp_path / "f.jsonl", [FOREST])
    res = invoke("-e", "gigpo", str(f))
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    adv = advantages_of(doc)
    # rows (R, G), gamma .95: t0 (l2, n1) (1, .95), (l2, n2) (1, 1), (l3, n1) (0, 0), (l3, n3) (0, 0); t1 n1 (1, 1)
    # E: R - .6; prompt group G [.95, 0, 1]: mean .65; siblings n2, n3: G [1, 0], mean .5
    assert adv[(0, 1)] == pytest.approx(((0.4 + 0.3) + (-0.6 - 0.65)) / 2, abs=1e-9)
    assert adv[(0, 2)] == pytest.approx(0.9, abs=1e-9) and adv[(0, 3)] == pytest.approx(-1.1, abs=1e-9)
    assert adv[(1, 1)] == pytest.approx(0.4 + 0.35, abs=1e-9)
    assert adv[(0, 0)] is None and adv[(1, 0)] is None
    groups = {
        (ti, n["id"]): (n.get("anchor_group"), n.get("anchor_size"))
        for ti, t in enumerate(doc["trees"])
        for n in t["nodes"]
    }
    assert groups == {
        (0, 0): (None, None),
        (0, 1): (0, 2),
        (0, 2): (1, 2),
        (0, 3): (1, 2),
        (1, 0): (None, None),
        (1, 1): (0, 2),
    }


def test_gigpo_options(tmp_path: Path) -> None:
    f = write(tmp_path / "f.jsonl", [FOREST])
    res = invoke("-e", "gigpo", "--gamma", "0.5", "--step-advantage-w", "2", str(f))
    assert res.exit_code == 0, res.output
    adv = advantages_of(json.loads(res.stdout))
    # prompt group G [.5, 0, 1]: mean .5 -> S 0, -.5, .5; siblings ±.5; the step term doubled
    assert adv[(0, 1)] == pytest.approx(((0.4 + 0) + (-0.6 - 1.0)) / 2, abs=1e-9)
    assert adv[(1, 1)] == pytest.approx(0.4 + 1.0, abs=1e-9) and adv[(0, 3)] == pytest.approx(-1.6, abs=1e-9)
    res = invoke(
        "-e", "gigpo", "--mode", "mean_std_norm", "--enable-similarity", "--similarity-thresh", "0.9", str(f)
    )
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--mode", "std"], "mode must be one of"),
        (["--similarity-thresh", "1"], "similarity_thresh"),
        (["--gamma", "2"], "gamma"),
    ],
)
def test_bad_gigpo_options_are_one_line(tmp_path: Path, args: list[str], needle: str) -> None:
    f = write(tmp_path / "f.jsonl", [FOREST])
    res = invoke("-e", "gigpo", *args, str(f))
    assert res.exit_code == 2 and needle in res.output and len(res.output.strip().splitlines()) == 1


TWO_PATHS: dict = {
    "format": "treegrpo.forest/v1",
    "prompt_id": "q-2",
    "trees": [
        {
            "nodes": [
                {"id": 0, "parent": None, "text": "Q"},
                {"id": 1, "parent": 0, "text": "<search>a</search>", "observation": "<information>i</information>"},
                {"id": 2, "parent": 1, "text": "<answer>y</answer>", "reward": 1.0},
            ]
        },
        {
            "nodes": [
                {"id": 0, "parent": None, "text": "Q"},
                {"id": 1, "parent": 0, "text": "<search>b</search>", "observation": "<information>i</information>"},
                {"id": 2, "parent": 1, "text": "<answer>z</answer>", "reward": 0.0},
            ]
        },
    ],
}


def test_the_anchor_option(tmp_path: Path) -> None:
    """Two searches that get the same reply: one anchor group under the default (the observation),
    two under --anchor context (different histories)."""
    f = write(tmp_path / "f.jsonl", [TWO_PATHS])
    sizes = {}
    for args in ([], ["--anchor", "observation"], ["--anchor", "context"], ["--anchor", "state"]):
        res = invoke("-e", "gigpo", "--gamma", "0.5", *args, str(f))
        assert res.exit_code == 0, res.output
        doc = json.loads(res.stdout)
        sizes[tuple(args)] = [t["nodes"][2]["anchor_size"] for t in doc["trees"]]
        adv = advantages_of(doc)
        # E = ±.5; second steps G [1, 0]: S = ±.5 when they share a group, else 0
        expected = 1.0 if sizes[tuple(args)] == [2, 2] else 0.5
        assert adv[(0, 2)] == pytest.approx(expected, abs=1e-9) and adv[(1, 2)] == pytest.approx(-expected, abs=1e-9)
    assert sizes[()] == sizes[("--anchor", "observation")] == [2, 2]
    assert sizes[("--anchor", "context")] == sizes[("--anchor", "state")] == [1, 1]  # no state keys: the context
    res = invoke("-e", "gigpo", "--anchor", "history", str(f))
    assert res.exit_code == 2 and "anchor must be one of" in res.output and len(res.output.strip().splitlines()) == 1
