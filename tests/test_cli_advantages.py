"""`treegrpo advantages`: score forest JSON/JSONL files from the command line."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from treegrpo.cli import app

EPS = 1e-6

# Tree 0 leaves [1 (node 2), 0 (node 3)] under node 1; tree 1 one leaf [1 (node 1)].
FOREST: dict[str, Any] = {
    "format": "treegrpo.forest/v1",
    "prompt_id": "q-1",
    "source": "unit-test",
    "trees": [
        {
            "nodes": [
                {"id": 0, "parent": None},
                {
                    "id": 1,
                    "parent": 0,
                    "text": "<search>x</search>",
                    "observation": "<information>i</information>",
                },
                {"id": 2, "parent": 1, "text": "<answer>y</answer>", "reward": 1.0, "finish": "answer"},
                {"id": 3, "parent": 1, "text": "<answer>z</answer>", "reward": 0.0},
            ]
        },
        {"nodes": [{"id": 0, "parent": None}, {"id": 1, "parent": 0, "reward": 1.0}]},
    ],
}


def invoke(*args: str) -> Any:
    return CliRunner().invoke(app, ["advantages", *args])


def write(path: Path, docs: list[dict[str, Any]], jsonl: bool = True) -> Path:
    path.write_text("".join(json.dumps(d) + "\n" for d in docs) if jsonl else json.dumps(docs[0]))
    return path


def advantages_of(doc: dict[str, Any]) -> dict[tuple[int, int], float | None]:
    return {(ti, n["id"]): n.get("advantage") for ti, t in enumerate(doc["trees"]) for n in t["nodes"]}


def test_grpo_on_a_json_file(tmp_path: Path) -> None:
    f = write(tmp_path / "f.json", [FOREST], jsonl=False)
    res = invoke("--estimator", "grpo", str(f))
    assert res.exit_code == 0, res.output
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 1
    doc = json.loads(lines[0])
    # leaves [1, 0, 1]: mean 2/3, std sqrt(1/3)
    s = math.sqrt(1 / 3)
    adv = advantages_of(doc)
    assert adv[(0, 2)] == pytest.approx((1 / 3) / (s + EPS), abs=1e-6)
    assert adv[(0, 3)] == pytest.approx((-2 / 3) / (s + EPS), abs=1e-6)
    assert adv[(1, 1)] == pytest.approx((1 / 3) / (s + EPS), abs=1e-6)
    assert adv[(0, 0)] is None and adv[(0, 1)] is None and adv[(1, 0)] is None
    # everything else is carried through
    assert (
        doc["format"] == "treegrpo.forest/v1" and doc["prompt_id"] == "q-1" and doc["source"] == "unit-test"
    )
    assert doc["trees"][0]["nodes"][2]["finish"] == "answer"
    assert doc["trees"][0]["nodes"][1]["observation"] == "<information>i</information>"


def test_treerl_scores_every_non_root_node_jsonl(tmp_path: Path) -> None:
    other = json.loads(json.dumps(FOREST)) | {"prompt_id": "q-2"}
    f = write(tmp_path / "f.jsonl", [FOREST, other])
    res = invoke("--estimator", "treerl", str(f))
    assert res.exit_code == 0, res.output
    docs = [json.loads(x) for x in res.stdout.strip().splitlines()]
    assert [d["prompt_id"] for d in docs] == ["q-1", "q-2"]
    adv = advantages_of(docs[0])
    # V(vroot) = 2/3; tree0 n1: V=.5 -> 2(.5-2/3)/sqrt2; n2: (1-2/3)+(1-.5) = 5/6; n3: -2/3-.5
    # tree1 n1: V=1 -> 2(1-2/3) = 2/3
    assert adv[(0, 1)] == pytest.approx(-1 / (3 * math.sqrt(2)), abs=1e-6)
    assert adv[(0, 2)] == pytest.approx(5 / 6, abs=1e-6)
    assert adv[(0, 3)] == pytest.approx(-7 / 6, abs=1e-6)
    assert adv[(1, 1)] == pytest.approx(2 / 3, abs=1e-6)
    assert adv[(0, 0)] is None and adv[(1, 0)] is None


def test_scale_none_and_out_file(tmp_path: Path) -> None:
    f = write(tmp_path / "f.jsonl", [FOREST])
    out = tmp_path / "sub" / "scored.jsonl"
    res = invoke("--estimator", "tree_grpo", "--scale", "none", "--out", str(out), str(f))
    assert res.exit_code == 0, res.output
    assert res.stdout == ""
    docs = [json.loads(x) for x in out.read_text().splitlines()]
    adv = advantages_of(docs[0])
    # inter: r - 2/3; intra: tree 0 r - 0.5, tree 1 singleton r - 0
    assert adv[(0, 2)] == pytest.approx(1 / 3 + 0.5, abs=1e-6)
    assert adv[(0, 3)] == pytest.approx(-2 / 3 - 0.5, abs=1e-6)
    assert adv[(1, 1)] == pytest.approx(1 / 3 + 1.0, abs=1e-6)
    # the output reads back as forests
    from treegrpo.tree import read_forests

    assert read_forests(out)[0].trees[0].node(2).advantage == pytest.approx(1 / 3 + 0.5, abs=1e-6)


def test_rescoring_drops_stale_advantages(tmp_path: Path) -> None:
    f = write(tmp_path / "f.jsonl", [FOREST])
    scored = tmp_path / "treerl.jsonl"
    assert invoke("-e", "treerl", "-o", str(scored), str(f)).exit_code == 0
    res = invoke("-e", "grpo", str(scored))
    assert res.exit_code == 0, res.output
    adv = advantages_of(json.loads(res.stdout))
    assert adv[(0, 1)] is None  # internal node: treerl value removed


def _assert_one_line_error(res: Any, *needles: str) -> None:
    assert res.exit_code == 2, res.output
    err = res.stderr.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("error: ")
    assert "Traceback" not in res.output
    for n in needles:
        assert n in err, err
    assert res.stdout == ""


def test_unknown_estimator(tmp_path: Path) -> None:
    f = write(tmp_path / "f.jsonl", [FOREST])
    res = invoke("--estimator", "nope", str(f))
    _assert_one_line_error(res, "unknown advantage estimator 'nope'", "grpo", "tree_grpo", "treerl")


def test_bad_scale(tmp_path: Path) -> None:
    f = write(tmp_path / "f.jsonl", [FOREST])
    _assert_one_line_error(invoke("--estimator", "grpo", "--scale", "max", str(f)), "scale")


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (
            '{"prompt_id": "a", "trees": [{"nodes": [{"id": 0, "parent": null}, {"id": 1, "parent": 0}]}]}',
            "reward",
        ),
        (
            '{"prompt_id": "a", "trees": [{"nodes": [{"id": 0, "parent": null}, {"id": 1, "parent": 7, "reward": 1}]}]}',
            "parent 7",
        ),
        ("this is not json\n", "not valid JSON"),
        ('{"trees": []}', "prompt_id"),
        ("", "no forest"),
    ],
)
def test_malformed_forest(tmp_path: Path, content: str, needle: str) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_text(content)
    _assert_one_line_error(invoke("--estimator", "grpo", str(f)), needle)


def test_missing_file(tmp_path: Path) -> None:
    _assert_one_line_error(invoke("--estimator", "grpo", str(tmp_path / "nope.json")), "no such file")


def test_bad_out_path_leaves_no_file(tmp_path: Path) -> None:
    f = write(tmp_path / "f.jsonl", [FOREST])
    blocker = tmp_path / "file"
    blocker.write_text("x")
    res = invoke("--estimator", "grpo", "--out", str(blocker / "out.jsonl"), str(f))
    _assert_one_line_error(res, "cannot write")
