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
from treegrpo.train.config import make_config
from treegrpo.train.setup import RunParts
from treegrpo.train.trainer import train

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
