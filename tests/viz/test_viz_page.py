"""The viewer's data and page (viz/data.py, viz/page.py) and the `treegrpo view` command."""

from __future__ import annotations

import base64
import hashlib
import json
import re
from pathlib import Path

import pytest
from makerun import EVIL, known_forest, make_run, native_forest
from typer.testing import CliRunner

from treegrpo.cli import app
from treegrpo.errors import ConfigError
from treegrpo.rollout.eptree import ForkPoint, apply_forks
from treegrpo.tree import Forest, Node, Tree, write_forests
from treegrpo.viz import page as page_module
from treegrpo.viz.data import forest_budget, forest_doc, load_view
from treegrpo.viz.page import build_html, embed_json, write_view


def test_embed_json_cannot_close_its_script_element() -> None:
    obj = {"text": EVIL + "<!-- & \u2028 \u2029"}
    s = embed_json(obj)
    assert "<" not in s and ">" not in s and "&" not in s and "\u2028" not in s
    assert json.loads(s) == obj


def test_embed_json_turns_non_finite_free_fields_into_null() -> None:
    assert json.loads(embed_json({"extra": {"score": float("nan"), "xs": [1.0, float("inf")]}})) == {
        "extra": {"score": None, "xs": [1.0, None]}
    }


def test_known_forest_budget_line() -> None:
    b = forest_budget(known_forest())
    # policy tokens 2 + 2 + 1 (tree 0) + 2 (tree 1); one search answered with an observation;
    # context read per step: node 1: 3, node 2: 3 + 4, node 3: 3, tree 1 node 1: 3
    assert b == {"trajectories": 3, "generated_tokens": 7, "tool_calls": 1, "context_tokens": 16, "recorded": False}


def test_native_tool_calls_are_counted() -> None:
    """The model's own protocol (ToolEnv protocol="tools"): a step's calls that ran are tool calls
    (two adds; boom ran and raised; mul is no tool and never ran), as the rollout's budget counts them."""
    f = native_forest()
    assert forest_budget(f)["tool_calls"] == 2 + 1 + 0
    del f.trees[0].node(1).extra["tool_calls_ran"]  # a forest written before the env recorded it
    assert forest_budget(f)["tool_calls"] == 3  # a tool step had no error: each of its calls ran
    f.trees[0].node(1).extra["refused"] = True  # the last turn's calls are refused, never run
    assert forest_budget(f)["tool_calls"] == 1


def test_recorded_budget_wins() -> None:
    f = known_forest()
    f.extra["budget"] = {"generated_tokens": 9, "prefill_tokens": 5, "tool_calls": 1, "engine_requests": 4}
    b = forest_budget(f)
    assert b["recorded"] is True and b["prefill_tokens"] == 5 and b["generated_tokens"] == 9
    assert "context_tokens" not in b


def eptree_forest() -> Forest:
    """A round-0 chain of 6 generated tokens forked after 2 of them, two round-1 branches."""
    tree = Tree([Node(0, None, text="1+2=", tokens=[1, 2, 3], policy_mask=[0, 0, 0])])
    tree.add(Node(1, 0, text="abcdef", tokens=[10, 11, 12, 13, 14, 15], policy_mask=[1] * 6,
                  logprobs=[-0.5] * 6, reward=1.0, extra={"round": 0, "kind": "answer", "turn": 1}))
    (head,) = apply_forks(tree, [ForkPoint(1, 2, 0.5)])
    tree.extra["forks"] = [{"round": 1, "node": head, "offset": 2, "score": 0.5}]
    for k in range(2):
        tree.add(Node(tree.next_id(), head, text="xy", tokens=[20 + k, 21], policy_mask=[1, 1], logprobs=[-1.0, -1.0],
                      reward=0.0, extra={"round": 1, "kind": "answer", "turn": 1}))
    return Forest("arith-1", [tree], {"question": "1+2?"})


def test_eptree_budget_counts_one_request_per_branch() -> None:
    f = eptree_forest()
    tree = f.trees[0]
    assert len(tree.nodes) == 5 and tree.node(1).extra["round"] == 0
    b = forest_budget(f)
    # 6 + 2 + 2 generated; the chain read the prompt (3), each branch the prompt + 2 tokens (5)
    assert b["generated_tokens"] == 10 and b["context_tokens"] == 3 + 5 + 5 and b["tool_calls"] == 0


def test_forest_doc_keeps_policy_token_values_only() -> None:
    doc = forest_doc(known_forest())
    n1 = doc["trees"][0]["nodes"][1]
    assert n1["logprobs"] == [-0.1, -2.5] and n1["entropy"] == [0.3, 1.2]
    assert n1["n_tokens"] == 4 and n1["n_policy"] == 2 and n1["depth"] == 1
    assert "tokens" not in n1 and n1["extra"]["query"] == "author of X"
    assert doc["trees"][0]["nodes"][2]["depth"] == 2


def test_load_view_of_a_run_orders_steps_and_reads_metrics(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", steps=3, prompts=2)
    (run / "rollouts" / "step_00010.jsonl").write_text((run / "rollouts" / "step_00001.jsonl").read_text())
    data = load_view(run)
    assert [s["step"] for s in data.index["steps"]] == [1, 2, 3, 10]
    assert len(data.forests) == 8
    assert [p["i"] for s in data.index["steps"] for p in s["prompts"]] == list(range(8))
    assert data.index["run"]["config"]["sampler"] == "tree"
    assert data.index["run"]["metrics"]["2"]["reward/mean"] == 0.5


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda p: None, "no such file or folder"),
        (lambda p: p.mkdir(), "no rollouts/step_*.jsonl here"),
        (lambda p: p.write_text('{"format": "treegrpo.forest/v1", "prompt_id": "a", "trees": []}'), "not a forest file"),
        (lambda p: p.write_bytes(b"\xff\xfe{"), "not a forest file"),
    ],
)
def test_load_view_errors_are_one_line(tmp_path: Path, setup, message: str) -> None:
    p = tmp_path / "x"
    setup(p)
    with pytest.raises(ConfigError, match=re.escape(message)) as e:
        load_view(p)
    assert "\n" not in str(e.value)


def test_page_is_self_contained_and_escapes_text(tmp_path: Path) -> None:
    html = build_html(load_view(_known_file(tmp_path)))
    assert not re.search(r"(src|href)\s*=\s*[\"']?(https?:)?//", html)
    assert "<link" not in html and "@import" not in html and "url(" not in html
    assert "default-src 'none'" in html  # CSP: the page may not fetch anything
    # the untrusted text is present only in escaped form; the one real </script> per element
    assert "window.__pwned" in html and EVIL not in html
    n_scripts = html.count("<script")
    assert n_scripts == html.count("</script>") == 3  # index, one forest, the viewer


def _policy(html: str) -> dict[str, list[str]]:
    (content,) = re.findall(r'<meta http-equiv="Content-Security-Policy" content="([^"]*)">', html)
    directives = [d.split() for d in content.split(";") if d.strip()]
    return {d[0]: d[1:] for d in directives}


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


def test_csp_runs_only_the_viewers_own_script_and_style(tmp_path: Path) -> None:
    """No 'unsafe-inline': the one executable inline script and the one style element are allowed
    by their SHA-256 hashes, and the hashes are of exactly the texts in the page."""
    html = build_html(load_view(_known_file(tmp_path)))
    policy = _policy(html)
    assert policy["default-src"] == ["'none'"] and policy["img-src"] == ["data:"]
    assert all("'unsafe-inline'" not in srcs and "'unsafe-eval'" not in srcs for srcs in policy.values())
    scripts = re.findall(r"<script>(.*?)</script>", html, re.DOTALL)  # executable: no type attribute
    styles = re.findall(r"<style>(.*?)</style>", html, re.DOTALL)
    assert len(scripts) == 1 and len(styles) == 1 and "treegrpoView" in scripts[0]
    assert policy["script-src"] == [_sha256(scripts[0])]
    assert policy["style-src"] == [_sha256(styles[0])]
    assert "\r" not in html  # the browser hashes the text as parsed: CR LF would be LF there


def test_csp_hash_is_of_the_text_as_the_browser_parses_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """An asset checked out with CR LF line ends: the page holds (and hashes) LF text."""
    real = page_module._asset
    monkeypatch.setattr(page_module, "_asset", lambda name: real(name).replace("\n", "\r\n"))
    html = build_html(load_view(_known_file(tmp_path)))
    (script,) = re.findall(r"<script>(.*?)</script>", html, re.DOTALL)
    assert "\r" not in html and _policy(html)["script-src"] == [_sha256(script)]
    assert script == real("viewer.js")


def _known_file(tmp_path: Path) -> Path:
    p = tmp_path / "known.jsonl"
    write_forests([known_forest()], p)
    return p


def test_view_command_writes_beside_the_run(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", steps=2, prompts=3)
    res = CliRunner().invoke(app, ["view", str(run)])
    assert res.exit_code == 0, res.output
    assert (run / "view.html").is_file() and "6 forests, 2 step files" in res.output
    out = tmp_path / "sub" / "v.html"
    assert CliRunner().invoke(app, ["view", str(_known_file(tmp_path)), "--out", str(out)]).exit_code == 0
    assert out.is_file()
    bad = CliRunner().invoke(app, ["view", str(tmp_path / "nope")])
    assert bad.exit_code == 2 and "error:" in bad.output and "Traceback" not in bad.output


def test_write_view_default_name_for_a_file(tmp_path: Path) -> None:
    path, data = write_view(_known_file(tmp_path))
    assert path == tmp_path / "known.html" and len(data.forests) == 1
    assert data.index["steps"][0]["step"] is None
