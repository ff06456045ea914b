"""A prompt longer than the context budget trains through the whole loop: its leaves carry no
policy tokens, so they add nothing to the loss, and nothing is NaN."""

from __future__ import annotations

import json
import math
from pathlib import Path

from treegrpo.envs.base import Task
from treegrpo.envs.search import SearchEnv
from treegrpo.models.loader import MARKER_FILE, load_model, load_tokenizer
from treegrpo.retrieval.base import Doc
from treegrpo.retrieval.bm25 import BM25Retriever
from treegrpo.rollout.agent import AgentConfig
from treegrpo.training.config import make_config
from treegrpo.training.setup import RunParts
from treegrpo.training.trainer import train

DOCS = [Doc(str(i), f"city{i}\ncity{i} is in country{i % 3}.") for i in range(4)]


def test_overlong_prompt_trains_without_nan(tiny_model_dir: Path, tmp_path: Path) -> None:
    long = Task("long", "where is " + "city1 " * 300 + "?", ["country1"])
    short = Task("short", "where is city2?", ["country2"])
    parts = RunParts(
        model_dir=tiny_model_dir,
        model=load_model(tiny_model_dir),
        tokenizer=load_tokenizer(tiny_model_dir),
        env=SearchEnv(BM25Retriever(DOCS), topk=1, prompt_template="minimal"),
        train_tasks=[long, short],
        eval_tasks=[long, short],
        agent_cfg=AgentConfig(max_turns=2, max_step_tokens=12, max_obs_tokens=24, max_context_tokens=200),
        extra_files={MARKER_FILE: (tiny_model_dir / MARKER_FILE).read_text()},
        info={},
    )
    for packing in ("on", "off"):
        out = tmp_path / packing
        cfg = make_config(
            {"steps": 1, "prompts_per_step": 2, "eval_every": 0, "out_dir": str(out), "tensorboard": False, "packing": packing}
        )
        train(cfg, parts=parts)
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        assert all(math.isfinite(v) for r in rows for v in r.values() if isinstance(v, float))
        forests = [json.loads(x) for x in next((out / "rollouts").glob("*.jsonl")).read_text().splitlines()]
        (lf,) = [f for f in forests if f["prompt_id"] == "long"]
        assert all(n["extra"]["finish_reason"] == "length" if "extra" in n else n.get("finish_reason") == "length"
                   for t in lf["trees"] for n in t["nodes"][1:])


def test_failing_searches_and_overflows_are_warned(tiny_model_dir: Path, tmp_path: Path) -> None:
    import io

    from rich.console import Console

    from treegrpo.retrieval.base import RetrievalError

    class DeadRetriever:
        def retrieve(self, queries, topk):
            raise RetrievalError("connection refused")

    long = Task("long", "where is " + "city1 " * 300 + "?", ["country1"])
    tasks = [Task(f"q{i}", f"where is city{i}?", [f"country{i % 3}"]) for i in range(3)]
    parts = RunParts(
        model_dir=tiny_model_dir,
        model=load_model(tiny_model_dir),
        tokenizer=load_tokenizer(tiny_model_dir),
        env=SearchEnv(DeadRetriever(), topk=1, prompt_template="minimal"),  # type: ignore[arg-type]
        train_tasks=[long, *tasks],
        eval_tasks=tasks[:1],
        agent_cfg=AgentConfig(max_turns=2, max_step_tokens=12, max_obs_tokens=24, max_context_tokens=200),
        extra_files={MARKER_FILE: (tiny_model_dir / MARKER_FILE).read_text()},
        info={},
    )
    buf = io.StringIO()
    cfg = make_config({"steps": 2, "prompts_per_step": 4, "eval_every": 0, "out_dir": str(tmp_path / "r"), "tensorboard": False})
    train(cfg, console=Console(file=buf, width=300), parts=parts)
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert rows[1]["budget/context_overflows"] == 2 * (1 + 2)  # M trees x (1 + N·L) leaves of the long prompt
    text = buf.getvalue()
    assert "ended before their first step" in text
    searches_failed = any(r.get("budget/retrieval_errors", 0) > 0.05 * r.get("budget/tool_calls", 0) > 0 for r in rows)
    assert ("searches failed this step" in text) == searches_failed


def test_step_warnings() -> None:
    from treegrpo.training.report import step_warnings

    quiet = {"budget/retrieval_errors": 0, "budget/tool_calls": 10, "budget/context_overflows": 0}
    assert step_warnings(quiet) == []
    (w,) = step_warnings({**quiet, "budget/retrieval_errors": 3})
    assert "3 of 10 searches failed" in w
    (w,) = step_warnings({**quiet, "budget/context_overflows": 2})
    assert "2 trajectories ended before their first step" in w


def test_non_finite_reward_stops_with_the_prompt_and_reward_function(tiny_model_dir: Path, tmp_path: Path) -> None:
    import pytest

    from treegrpo.errors import ConfigError

    class NaNEnv(SearchEnv):
        def score(self, task, step):  # every trajectory that ends without an answer
            return float("nan")

        def answer_reward(self, task, step, answer, history):
            return float("nan")

    parts = RunParts(
        model_dir=tiny_model_dir,
        model=load_model(tiny_model_dir),
        tokenizer=load_tokenizer(tiny_model_dir),
        env=NaNEnv(BM25Retriever(DOCS), topk=1, prompt_template="minimal", metric="f1"),
        train_tasks=[Task("q1", "where is city1?", ["country1"])],
        eval_tasks=[Task("q2", "where is city2?", ["country2"])],
        agent_cfg=AgentConfig(max_turns=1, max_step_tokens=8, max_obs_tokens=16, max_context_tokens=200),
        extra_files={MARKER_FILE: (tiny_model_dir / MARKER_FILE).read_text()},
        info={},
    )
    cfg = make_config({"steps": 1, "prompts_per_step": 1, "eval_every": 0, "out_dir": str(tmp_path / "r"), "tensorboard": False, "eval_sampled": False})
    with pytest.raises(ConfigError, match=r"prompt 'q1'.*not finite.*reward function: f1"):
        train(cfg, parts=parts)


def test_a_prompt_longer_than_the_context_is_skipped_before_any_forward(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The update (and the packing probe) never runs the model over a prompt that overflowed: the
    longest sequence any forward sees is within the context; the skip is counted and said."""
    import io

    from rich.console import Console

    from treegrpo.training.packing import probe

    long = Task("long", "where is " + "city1 " * 300 + "?", ["country1"])
    short = Task("short", "where is city2?", ["country2"])
    model, tok = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    long_ids = tok(long.question)["input_ids"]
    city = max(set(long_ids), key=long_ids.count)  # a token the long prompt repeats ~300 times
    copies: list[int] = []  # per forward, the most copies of it in one row
    model.register_forward_pre_hook(lambda m, a, kw: copies.append(int((kw["input_ids"] == city).sum(-1).max())), with_kwargs=True)
    parts = RunParts(
        model_dir=tiny_model_dir, model=model, tokenizer=tok,
        env=SearchEnv(BM25Retriever(DOCS), topk=1, prompt_template="minimal"),
        train_tasks=[long, short], eval_tasks=[short],
        agent_cfg=AgentConfig(max_turns=2, max_step_tokens=12, max_obs_tokens=24, max_context_tokens=200),
        extra_files={MARKER_FILE: (tiny_model_dir / MARKER_FILE).read_text()}, info={},
    )  # fmt: skip
    for packing in ("on", "off"):
        probe._PACKING_CHECKED.pop(model, None)  # the probe runs again, on this batch
        copies.clear()
        out, buf = tmp_path / packing, io.StringIO()
        cfg = make_config({"steps": 1, "prompts_per_step": 2, "eval_every": 0, "out_dir": str(out), "tensorboard": False,
                           "packing": packing, "eval_sampled": False})  # fmt: skip
        train(cfg, console=Console(file=buf, width=300), parts=parts)
        row = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][1]
        assert row["update/skipped_prompts"] == 1.0
        assert copies and max(copies) < 50 <= long_ids.count(city) // 4  # no forward over the long prompt
        assert "1 such prompt(s) skipped by the update (no forward over them)" in buf.getvalue()
