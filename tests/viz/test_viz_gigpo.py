"""The viewer's data for a forest scored with GiGPO: each step's anchor group reaches the page
(node ``extra``), the index row counts the shared groups, and the page's script marks them."""

from __future__ import annotations

import json
import re
from pathlib import Path

from makerun import known_forest

from treegrpo.algos import score_forest
from treegrpo.tree import write_forests
from treegrpo.viz.data import load_view
from treegrpo.viz.page import build_html, write_view


def test_gigpo_scored_forest_carries_anchor_groups_to_the_page(tmp_path: Path) -> None:
    src = tmp_path / "gigpo.jsonl"
    write_forests([score_forest(known_forest(), "gigpo")], src)
    data = load_view(src)
    (row,) = data.index["steps"][0]["prompts"]
    # the three first steps share the prompt (group 0); tree 0's node 2 follows the search alone
    assert row["anchor_groups"] == 1 and row["anchor_shared"] == 0.75
    nodes = {
        (ti, n["id"]): n.get("extra", {}) for ti, t in enumerate(data.forests[0]["trees"]) for n in t["nodes"]
    }
    assert {k: (v.get("anchor_group"), v.get("anchor_size")) for k, v in nodes.items()} == {
        (0, 0): (None, None), (0, 1): (0, 3), (0, 2): (1, 1), (0, 3): (0, 3), (1, 0): (None, None), (1, 1): (0, 3),
    }  # fmt: skip
    html = build_html(data)
    forest_json = re.search(r'id="tg-f0">(.*?)</script>', html, re.S).group(1)  # type: ignore[union-attr]
    assert json.loads(forest_json)["trees"][0]["nodes"][1]["extra"]["anchor_group"] == 0
    for needle in (
        "data-anchor",
        "anchor-on",
        "anchor-legend",
        "anchor group",
    ):  # the script marks the groups
        assert needle in html


def test_other_forests_have_no_anchor_fields(tmp_path: Path) -> None:
    src = tmp_path / "grpo.jsonl"
    write_forests([score_forest(score_forest(known_forest(), "gigpo"), "grpo")], src)  # rescored: groups gone
    out, data = write_view(src)
    (row,) = data.index["steps"][0]["prompts"]
    assert "anchor_groups" not in row and "anchor_shared" not in row
    assert not any("anchor_group" in n.get("extra", {}) for t in data.forests[0]["trees"] for n in t["nodes"])
    assert out.is_file()
