"""The viewer in a real browser: Debian's chromium, driven headless by playwright.

Skipped (with the reason) where /usr/bin/chromium or the playwright package is missing; CI
installs both with ``.ci/install_browser.sh``, so in CI (``CI=true``) their absence is a failure
(``tests/_optional.py``); to run them on your machine: ``bash .ci/install_browser.sh``.
Screenshots are test artifacts: they are written under the test's tmp dir and copied to
``$TREEGRPO_ARTIFACTS`` when that is set.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from makerun import EVIL, known_forest, make_run, native_forest

from _optional import require, require_package
from treegrpo.tree import write_forests
from treegrpo.viz.page import write_view

CHROMIUM = Path("/usr/bin/chromium")
ARGS = [
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]  # fmt: skip
OPEN_LIMIT_MS = 2000.0

require(CHROMIUM.exists(), str(CHROMIUM), "bash .ci/install_browser.sh", module_level=True)
require_package("playwright", module_level=True)
from playwright import sync_api  # noqa: E402  (installed: an import error is a failure)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    pg = browser.new_page(viewport={"width": 1400, "height": 760})
    pg.errors = []  # type: ignore[attr-defined]
    pg.on("pageerror", lambda e: pg.errors.append(str(e)))  # type: ignore[attr-defined]
    pg.on("console", lambda m: m.type == "error" and pg.errors.append(m.text))  # type: ignore[attr-defined]
    yield pg
    pg.close()


def artifact(src: Path) -> None:
    dest = os.environ.get("TREEGRPO_ARTIFACTS")
    if dest:
        Path(dest).mkdir(parents=True, exist_ok=True)
        shutil.copy(src, Path(dest) / src.name)


def open_view(page: Any, html: Path) -> float:
    page.goto(html.as_uri())
    page.wait_for_selector("body[data-ready='1']", timeout=20_000)
    return float(page.evaluate("window.treegrpoView.firstRenderMs"))


def node(page: Any, tree: int, node_id: int) -> Any:
    return page.locator(f'#canvas g.node[data-tree="{tree}"][data-node="{node_id}"]')


def test_known_forest_click_shows_the_node(page: Any, tmp_path: Path) -> None:
    src = tmp_path / "known.jsonl"
    write_forests([known_forest()], src)
    html, _ = write_view(src)
    open_view(page, html)
    assert page.locator("#canvas g.node").count() == 6  # 4 + 2 nodes, both trees drawn
    assert "generated 7 tok" in page.inner_text("#budget") and "tool calls 1" in page.inner_text("#budget")
    node(page, 0, 2).click()
    detail = page.inner_text("#detail")
    assert "tree 0 · node 2" in detail
    assert page.inner_text("#node-text") == "<answer>Y</answer>"
    assert "reward\t1.000" in detail and "advantage\t0.8660" in detail and "turn\t2" in detail
    assert "tokens\t2 policy / 2 total" in detail and "context before\t7 tok" in detail
    assert page.locator("#detail .strip span").count() == 2  # one heat cell per policy token
    assert page.locator("#canvas path.edge.on").count() == 2  # root → 1 → 2 highlighted
    shot = tmp_path / "viewer_known_forest.png"
    page.screenshot(path=str(shot))
    artifact(shot)
    # the search step: observation, tool call, log-prob and entropy strips
    node(page, 0, 1).click()
    assert page.inner_text("#node-obs") == "<information>Doc 1(Title: X) by Y</information>"
    assert "tool call\tyes (author of X)" in page.inner_text("#detail")
    assert page.locator("#detail .strip").count() == 2
    assert page.errors == []


def test_native_tool_steps_show_their_calls_and_results(page: Any, tmp_path: Path) -> None:
    """The model's own protocol: a tool step is labelled T with its tools' names beside it, counted
    in the budget line, and its calls and the results the model read are in the detail pane."""
    src = tmp_path / "native.jsonl"
    write_forests([native_forest()], src)
    html, _ = write_view(src)
    open_view(page, html)
    labels = page.eval_on_selector_all("#canvas g.node > text:not(.lbl):not(.tlbl)", "els => els.map(e => e.textContent)")
    assert labels == ["Q", "T", "A", "!", "A", "!", "A"]
    assert page.eval_on_selector_all("#canvas text.tlbl", "els => els.map(e => e.textContent)") == ["add,add", "boom", "mul"]
    assert "tool calls 3" in page.inner_text("#budget") and "T tool call" in page.inner_text("#legend")
    assert "null" not in page.inner_text("#legend")  # no anchor groups: no anchor legend (it printed "null")
    node(page, 0, 1).click()
    detail = page.inner_text("#detail")
    assert "tool calls\tadd, add (2 ran)" in detail
    assert page.inner_text("#node-calls") == 'add({"a":2,"b":3})\nadd({"a":4,"b":5})'
    assert page.inner_text("#node-results") == "add → 5\nadd → 9"
    node(page, 0, 3).click()
    assert "tool calls\tboom (1 ran)" in page.inner_text("#detail")
    assert "tool error\tboom raised ValueError: no luck with 7" in page.inner_text("#detail")
    assert page.inner_text("#node-results") == "boom → Error: boom raised ValueError: no luck with 7"
    node(page, 0, 2).click()  # an answer: no tool sections
    assert page.locator("#node-calls, #node-results").count() == 0
    shot = tmp_path / "viewer_native_forest.png"
    page.screenshot(path=str(shot))
    artifact(shot)
    assert page.errors == []


def test_a_tool_steps_latency_is_shown_with_its_paths(page: Any, tmp_path: Path) -> None:
    """Each call's latency (``extra.tool_latency_s``) is on its node, with the summed latency of the
    calls on the path root → node; the field is not repeated under "Other fields"."""
    forest = native_forest()
    tree = forest.trees[0]
    tree.node(1).extra["tool_latency_s"] = [0.2, 0.35]
    tree.node(2).extra["tool_latency_s"] = [1.5]  # (an answer step with a call, for the path sum)
    src = tmp_path / "latency.jsonl"
    write_forests([forest], src)
    html, _ = write_view(src)
    open_view(page, html)
    node(page, 0, 1).click()
    assert "tool latency\t0.200 s, 0.350 s · path 0.550 s" in page.inner_text("#detail")
    node(page, 0, 2).click()
    assert "tool latency\t1.500 s · path 2.050 s" in page.inner_text("#detail")
    assert "tool_latency_s" not in page.inner_text("#detail")
    node(page, 0, 3).click()  # no latency recorded: no row
    assert "tool latency" not in page.inner_text("#detail")
    assert page.errors == []


def test_model_output_is_text_not_html(page: Any, tmp_path: Path) -> None:
    src = tmp_path / "known.jsonl"
    write_forests([known_forest()], src)
    html, _ = write_view(src)
    open_view(page, html)
    node(page, 0, 3).click()
    assert page.inner_text("#node-text") == "<answer>" + EVIL + "</answer>"
    assert page.evaluate("window.__pwned") is None
    assert page.locator("#detail img, #detail script, #detail b").count() == 0
    node(page, 0, 0).click()  # the prompt's <b>X</b> is shown as text too
    assert page.inner_text("#node-text") == "Question: who wrote <b>X</b>?"
    assert page.errors == []


def test_csp_blocks_an_inline_script_that_is_not_the_viewers(page: Any, tmp_path: Path) -> None:
    """The page's policy names the viewer's script by its hash: the viewer runs (and no CSP error
    is logged), a script added to the page does not (with 'unsafe-inline' it ran)."""
    src = tmp_path / "known.jsonl"
    write_forests([known_forest()], src)
    html, _ = write_view(src)
    open_view(page, html)
    assert page.errors == []  # a blocked viewer script or style would be a console error
    assert page.evaluate("getComputedStyle(document.getElementById('app')).display") != "inline"  # styled
    tampered = tmp_path / "tampered.html"
    tampered.write_text(
        html.read_text(encoding="utf-8").replace("</body>", "<script>window.__injected = 1</script></body>"),
        encoding="utf-8",
    )
    open_view(page, tampered)
    assert page.evaluate("window.__injected") is None
    assert any("Content Security Policy" in e for e in page.errors)


def test_thousand_forests_open_under_two_seconds(page: Any, tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", steps=10, prompts=100)
    html, data = write_view(run)
    assert len(data.forests) == 1000
    t0 = time.perf_counter()
    first_ms = open_view(page, html)
    wall_ms = 1000 * (time.perf_counter() - t0)
    size_mb = html.stat().st_size / 1e6
    print(f"1000 forests ({size_mb:.1f} MB): first render {first_ms:.0f} ms (performance.now), goto+ready {wall_ms:.0f} ms")
    assert first_ms < OPEN_LIMIT_MS
    assert page.evaluate("window.treegrpoView.parsedForests()") == 1  # lazy: only the shown forest
    assert page.locator("#canvas svg").count() == 1
    assert page.locator("#prompts li").count() == 100
    page.keyboard.press("ArrowRight")  # next step, its first prompt
    assert page.input_value("#stepsel") == "1"
    assert page.evaluate("window.treegrpoView.parsedForests()") == 2
    page.keyboard.press("ArrowDown")
    assert page.locator("#prompts li.sel .pid").inner_text() == "p2-1"
    page.fill("#filter", "p2-17")
    assert page.locator("#prompts li").count() == 1
    shot = tmp_path / "viewer_1000_forests.png"
    page.screenshot(path=str(shot))
    artifact(shot)
    assert page.errors == []


def test_token_tree_shows_rounds_and_fork_points(page: Any, tmp_path: Path) -> None:
    from test_viz_page import eptree_forest

    src = tmp_path / "eptree.jsonl"
    write_forests([eptree_forest()], src)
    html, _ = write_view(src)
    open_view(page, html)
    labels = page.eval_on_selector_all("#canvas g.node > text:not(.lbl)", "els => els.map(e => e.textContent)")
    assert sorted(labels) == ["0", "0", "1", "1", "Q"]  # root, head + tail (round 0), two branches
    assert page.locator("#canvas circle.fork").count() == 1
    assert "fork point" in page.inner_text("#legend")
    node(page, 0, 3).click()
    assert "round\t1" in page.inner_text("#detail") and "context before\t5 tok" in page.inner_text("#detail")
    assert page.errors == []


def test_gigpo_anchor_groups_are_marked(page: Any, tmp_path: Path) -> None:
    from treegrpo.algos import score_forest

    src = tmp_path / "gigpo.jsonl"
    write_forests([score_forest(known_forest(), "gigpo")], src)
    html, _ = write_view(src)
    open_view(page, html)
    # the three first steps share the prompt: one group, ringed and labelled g0; node 2 is alone
    assert page.locator("#canvas circle.anchor").count() == 3
    labels = page.eval_on_selector_all("#canvas text.albl", "els => els.map(e => e.textContent)")
    assert labels == ["g0", "g0", "g0"]
    assert "GiGPO anchor group" in page.inner_text("#legend") and "anchor groups 1 shared" in page.inner_text("#budget")
    node(page, 1, 1).click()  # tree 1's first step marks its peers in tree 0 too
    assert page.locator("#canvas g.node.anchor-on").count() == 3
    assert "anchor group\tg0 · 3 steps from this state" in page.inner_text("#detail")
    node(page, 0, 2).click()
    assert page.locator("#canvas g.node.anchor-on").count() == 1
    assert "anchor group\tg1 · 1 step from this state" in page.inner_text("#detail")
    assert page.errors == []
