"""Observation truncation keeps the structure: the block stays closed, whole passages first."""

from __future__ import annotations

from pathlib import Path

from treegrpo.envs.base import Task
from treegrpo.envs.search import SearchEnv, fit_observation, information
from treegrpo.models.loader import load_tokenizer
from treegrpo.retrieval.base import Doc
from treegrpo.retrieval.bm25 import BM25Retriever
from treegrpo.rollout.agent import AgentConfig, StepRunner

OBS = information("Doc 1(Title: A) aa aa aa aa\nDoc 2(Title: B) bb bb bb bb\nDoc 3(Title: C) cc cc cc cc")


def words(t: str) -> int:
    return len(t.split())


def test_fitting_observation_is_unchanged() -> None:
    assert fit_observation(OBS, words, 100) == OBS


def test_whole_passages_are_kept_while_they_fit() -> None:
    out = fit_observation(OBS, words, 14)
    assert out is not None and out.rstrip().endswith("</information>") and "<information>" in out
    assert "Doc 2(Title: B) bb bb bb bb" in out and "Doc 3" not in out and words(out) <= 14


def test_a_first_passage_too_long_is_cut_at_a_word_with_a_mark() -> None:
    out = fit_observation(OBS, words, 5)
    assert out is not None and out.rstrip().endswith("…</information>") and "Doc 2" not in out
    assert words(out) <= 5


def test_no_room_for_the_block_gives_none() -> None:
    assert fit_observation(OBS, lambda t: len(t), 3) is None
    assert fit_observation("plain text " * 50, words, 10) is None  # not an information block


def test_agent_keeps_the_block_closed_and_ids_within_the_cap(tiny_model_dir: Path) -> None:
    tok = load_tokenizer(tiny_model_dir)
    docs = [Doc(str(i), f"city{i}\n" + " ".join(f"city{i} is a place in country{i}." for _ in range(6))) for i in range(3)]
    env = SearchEnv(BM25Retriever(docs), topk=3, prompt_template="minimal")
    runner = StepRunner(None, env, tok, AgentConfig(max_obs_tokens=90))  # type: ignore[arg-type]
    (out,) = env.step([Task("q", "x", ["y"])], ["<search> city1 </search>"], [True])
    assert len(tok.encode(out.observation, add_special_tokens=False)) > 90
    text, ids = runner.observation_ids(out.observation)
    assert len(ids) <= 90 and ids == tok.encode(text, add_special_tokens=False)
    assert text.rstrip().endswith("</information>") and text.count("Doc ") >= 1
