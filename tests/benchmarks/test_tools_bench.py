"""``treegrpo bench tools``: the latency draw, the per-query search env against the search env,
the summary's ratios on hand-made rows, and ``--quick`` end to end on the test model and the tiny
world (its JSON's schema, and every ratio recomputed from the recorded rows)."""

from __future__ import annotations

import json
import math
import shutil
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from treegrpo.benchmarks.tools import STEP_KEYS, Row, ToolsSpec, plan_rows
from treegrpo.benchmarks.tools_env import LatencySearchEnv, latency_s, latency_search_tool, unit_draw
from treegrpo.benchmarks.tools_report import median, summarize
from treegrpo.envs.search import SearchEnv
from treegrpo.tasks.world.world import PRESETS, build_world


def test_latency_draws() -> None:
    """none 0, constant 0.2 s; heavy: exp(ln 0.2 + 0.99 z(query)), fixed by the query, median 0.2 s
    and p99 ~2 s over many queries."""
    assert latency_s("none", "a") == 0.0 and latency_s("constant", "a") == 0.2
    u = unit_draw("who wrote x")
    assert 0 < u < 1 and u == unit_draw("who wrote x") != unit_draw("who wrote y")
    z = statistics.NormalDist().inv_cdf(u)
    assert latency_s("heavy", "who wrote x") == pytest.approx(0.2 * math.exp(0.99 * z))
    draws = sorted(latency_s("heavy", f"q{i}") for i in range(4000))
    assert statistics.median(draws) == pytest.approx(0.2, rel=0.05)
    assert draws[int(0.99 * len(draws))] == pytest.approx(2.0, rel=0.15)
    with pytest.raises(ValueError, match="unknown latency"):
        latency_s("slow", "a")


def test_per_query_env_answers_as_the_search_env() -> None:
    """Every kind of step (search, answer, invalid, refused search, a search past the last turn)
    gets the search env's outcome; a search its own call, with its latency recorded."""
    world = build_world(PRESETS["tiny"])
    plain = SearchEnv(world.retriever, topk=2, prompt_template="minimal")
    slow = LatencySearchEnv(world.retriever, topk=2, prompt_template="minimal", latency="none", tool_concurrency=1)
    task = world.tasks("train")[0]
    steps = ["<search> a </search>", "<answer> x </answer>", "hm", "<search> b </search>", "<search> </search>",
             f"<search> {task.question} </search>"]  # fmt: skip
    allowed = [True, True, True, False, True, True]
    want = plain.step([task] * len(steps), steps, allowed)
    got = slow.step([task] * len(steps), steps, allowed)
    for w, g in zip(want, got, strict=True):
        info = dict(g.info)
        lat = info.pop("tool_latency_s", None)
        assert (g.kind, g.done, g.reward, g.observation, g.tool_calls, g.retrieval_error, info) == (
            w.kind, w.done, w.reward, w.observation, w.tool_calls, w.retrieval_error, w.info)  # fmt: skip
        assert (lat is not None) == (g.tool_calls == 1)
    assert slow.tool_stats.take()["calls"] == 2
    search = latency_search_tool(world.retriever, 2, "none")
    assert search.__name__ == "search" and "Args:" in (search.__doc__ or "") and search("a")


def test_tags_as_trl_chat_format(tiny_model_dir: Path) -> None:
    """TRL's view of the tiny agent's tags: the template renders a conversation as the very text
    the agent loop holds, passes TRL's tool-calling check, and the parser finds a turn's first
    search (the text after it dropped)."""
    from trl.chat_template_utils import supports_tool_calling

    from treegrpo.benchmarks.tools_trl import TAGS_TEMPLATE, parse_tags
    from treegrpo.envs.search import information
    from treegrpo.models.loader import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    tok.chat_template = TAGS_TEMPLATE
    call = {"type": "function", "function": {"name": "search", "arguments": {"query": "who is x"}}}
    messages = [{"role": "user", "content": "Question: who?\n"},
                {"role": "assistant", "content": "<think> hm </think>\n", "tool_calls": [call]},
                {"role": "tool", "name": "search", "content": "Doc 1(Title: x) y\n"},
                {"role": "assistant", "content": "<answer> y </answer>"}]  # fmt: skip
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text == "Question: who?\n<think> hm </think>\n<search> who is x </search>" + information("Doc 1(Title: x) y") + "<answer> y </answer>"
    assert supports_tool_calling(tok)
    ids = tok.encode("<think> a </think> <search> who is x </search> <information> made up", add_special_tokens=False)
    got = parse_tags(tok, ids)
    assert got["tool_calls"] == [call] and "made up" not in got["content"] and "<search>" not in got["content"]
    assert "tool_calls" not in parse_tags(tok, tok.encode("<answer> y </answer>", add_special_tokens=False))


def _row(job: str, sampler: str, latency: str, mode: str, walls: list[float], chain: float | None = None,
         engine: float | None = None, idle: float | None = None, update: float = 0.1) -> dict[str, Any]:  # fmt: skip
    steps = [{k: None for k in STEP_KEYS} | {"wall_s": w, "update_s": update, "chain_latency_s": chain,
             "engine_s": engine, "engine_idle_s": idle} for w in walls]  # fmt: skip
    return {**asdict(Row(job, sampler, latency, mode)), "key": f"{job}/{sampler}/{latency}/{mode}", "steps": steps}


def test_summary_ratios_by_hand() -> None:
    rows = [
        _row("tiny", "tree", "none", "today", [1.0, 1.2, 1.1]),  # baseline median 1.1
        _row("tiny", "tree", "none", "pipelined", [1.1, 1.2, 1.0], engine=0.5),  # 1.1: 1.0x
        _row("tiny", "tree", "constant", "serial", [30.0, 28.0, 29.0], chain=0.8),  # the chain as timed alone
        _row("tiny", "tree", "constant", "pipelined", [2.0, 2.2, 2.1], chain=0.9, engine=0.7, idle=1.0, update=0.2),
    ]
    s = summarize(rows)
    g = s["groups"]["tiny/tree"]
    assert g["baseline_wall_s"] == pytest.approx(1.1)
    p = g["rows"]["constant/pipelined"]
    assert p["limit_s"] == pytest.approx(1.9) and p["over_limit"] == pytest.approx(2.1 / 1.9)
    assert [x["limit_s"] for x in p["per_step"]] == pytest.approx([1.8, 2.0, 1.9])
    assert [x["over_limit"] for x in p["per_step"]] == pytest.approx([2.0 / 1.8, 2.2 / 2.0, 2.1 / 1.9])
    assert p["speedup_vs_serial"] == pytest.approx(29.0 / 2.1) and p["over_baseline"] == pytest.approx(2.1 / 1.1)
    assert p["gap"]["total_s"] == pytest.approx(0.2) and p["gap"]["engine_extra_s"] == pytest.approx(0.2)
    assert p["limit_chain_from"] == "constant/serial" and g["rows"]["constant/serial"]["limit_s"] == pytest.approx(1.9)
    assert p["gap"]["idle_over_chain_s"] == pytest.approx(0.2) and p["gap"]["update_extra_s"] == pytest.approx(0.1)
    assert p["gap"]["other_s"] == pytest.approx(-0.3) and p["gap"]["own_chain_stretch_s"] == pytest.approx(0.1)
    met = {t["target"]: (t["value"], t["met"]) for t in s["targets"]}
    assert met["constant: pipelined wall <= 1.2x the limit"] == (pytest.approx(2.1 / 1.9), True)
    assert met["constant: pipelined >= 10x faster than tool_concurrency=1"] == (pytest.approx(29 / 2.1), True)
    assert met["no latency: pipelined wall <= 1.05x today's"] == (pytest.approx(1.0), True)
    assert median([None, 1.0, 3.0]) == 2.0 and median([None]) is None


def test_plan_puts_trl_beside_chain_4() -> None:
    keys = [r.key for r in plan_rows(ToolsSpec())]
    assert [k for k in keys if k.endswith("/trl")] == [f"{j}/chain/{x}/trl" for j in ("tiny", "smollm2") for x in ("constant", "heavy")]
    assert keys[:2] == ["tiny/tree/none/today", "tiny/tree/none/pipelined"] and len(keys) == len(set(keys)) == 36
    assert not any(k.endswith("/trl") for k in (r.key for r in plan_rows(ToolsSpec(trl=False))))


@pytest.fixture(scope="module")
def agent(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test model with the record of a bootstrapped agent of the tiny world."""
    from treegrpo.rollout.agent import AgentConfig

    folder = Path(shutil.copytree(tiny_model_dir, tmp_path_factory.mktemp("agent") / "agent"))
    limits = AgentConfig(max_turns=2, max_step_tokens=16, max_obs_tokens=32, max_context_tokens=400, use_chat_template=False)
    record = {"tokenizer": "PreTrainedTokenizerFast", "world": PRESETS["tiny"].to_dict(),
              "env": {"topk": 2, "prompt_template": "minimal"}, "agent": asdict(limits),
              "config": {"preset": "tiny"}, "config_hash": "0123456789ab"}  # fmt: skip
    (folder / "treegrpo_tiny.json").write_text(json.dumps(record))
    return folder


def _searches_once(context: str, draw: float) -> str:
    """A scripted agent: one search (two different queries), then an answer."""
    return "<answer> x </answer>" if "<information>" in context else f"<search> {'ab'[draw < 0.5]} </search>"


def test_quick_end_to_end(agent: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench tools --quick`` on the tiny world (the rollouts scripted: every trajectory searches
    once): every planned row, its steps with the documented keys, latency rows that called the tool,
    the same calls with and without concurrency, and a summary equal to one recomputed from the
    recorded rows."""
    from fakes import ScriptedEngine
    from treegrpo.benchmarks.cli import bench

    monkeypatch.setattr("treegrpo.training.trainer.make_engine", lambda name, model, tok, **kw: ScriptedEngine(tok, _searches_once))

    out = tmp_path / "tools.json"
    args = ["tools", "--quick", "--out", str(out), "--work", str(tmp_path / "work"), "--model", str(agent),
            "--set", "preset=tiny", "--samplers", "chain", "--latencies", "constant"]  # fmt: skip
    res = CliRunner().invoke(bench, args)
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    assert set(doc) == {"what", "identity", "settings", "summary", "rows", "provenance"}
    assert "bench" in doc["provenance"]["command"] or "pytest" in doc["provenance"]["command"]
    rows = {r["key"]: r for r in doc["rows"]}
    assert list(rows) == ["tiny/chain/none/today", "tiny/chain/none/pipelined", "tiny/chain/constant/serial",
                          "tiny/chain/constant/concurrent", "tiny/chain/constant/pipelined", "tiny/chain/constant/trl"]  # fmt: skip
    for r in rows.values():
        assert len(r["steps"]) == 1 and len(r["warmup_steps"]) == 1
        assert all(set(s) == set(STEP_KEYS) and s["wall_s"] > 0 for s in r["steps"])
    for mode in ("serial", "concurrent", "pipelined"):
        s = rows[f"tiny/chain/constant/{mode}"]["steps"][0]
        assert s["tool_calls"] > 0 and s["chain_latency_s"] >= 0.2 and s["tools_wall_s"] >= 0.2
    serial, concurrent = rows["tiny/chain/constant/serial"], rows["tiny/chain/constant/concurrent"]
    assert serial["steps"][0]["peak_in_flight"] == 1
    for key in ("tool_calls", "generated_tokens", "trajectories"):  # the same forests: the same calls
        assert serial["steps"][0][key] == concurrent["steps"][0][key]
    assert doc["summary"] == json.loads(json.dumps(summarize(doc["rows"])))
    g = doc["summary"]["groups"]["tiny/chain"]
    base = rows["tiny/chain/none/today"]["steps"][0]["wall_s"]
    p = rows["tiny/chain/constant/pipelined"]["steps"][0]
    chain = serial["steps"][0]["chain_latency_s"]  # the limit's chain: the same calls, timed one at a time
    assert g["rows"]["constant/pipelined"]["over_limit"] == pytest.approx(p["wall_s"] / (base + chain))
    t = g["rows"]["constant/trl"]
    assert t["over_pipelined"] == pytest.approx(rows["tiny/chain/constant/trl"]["steps"][0]["wall_s"] / p["wall_s"])
    again = CliRunner().invoke(bench, [*args, "--resume"])
    assert again.exit_code == 0 and "resuming: 6 runs" in again.output


def test_bad_options_are_one_line() -> None:
    from treegrpo.benchmarks.cli import bench

    res = CliRunner().invoke(bench, ["tools", "--jobs", "huge"])
    assert res.exit_code == 2 and "--jobs 'huge': choose among tiny,smollm2" in res.output
