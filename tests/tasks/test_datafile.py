"""Question files: Search-R1/verl parquet and JSONL into Tasks, with errors naming file, row, field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from treegrpo.envs.search import SEARCH_R1_PROMPT
from treegrpo.tasks.datafile import DataError, extract_question, load_tasks
from treegrpo.training.config import ConfigError


def search_r1_row(i: int, question: str, answers: list[str], source: str = "nq") -> dict[str, Any]:
    """One row exactly as Search-R1's scripts/data_process/qa_search_train_merge.py writes it."""
    return {
        "id": f"train_{i}",
        "question": question,
        "golden_answers": answers,
        "data_source": source,
        "prompt": [{"role": "user", "content": SEARCH_R1_PROMPT.format(question=question)}],
        "ability": "fact-reasoning",
        "reward_model": {"style": "rule", "ground_truth": {"target": answers}},
        "extra_info": {"split": "train", "index": i},
    }


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_search_r1_parquet(tmp_path: Path) -> None:
    rows = [
        search_r1_row(0, "who painted a sunday afternoon on the island of la grande jatte?", ["Georges Seurat"]),
        search_r1_row(1, "what is the capital of france?", ["Paris", "paris, france"], source="hotpotqa"),
    ]
    tasks = load_tasks(write_parquet(tmp_path / "train.parquet", rows))
    assert [t.id for t in tasks] == ["nq-0", "hotpotqa-1"]
    assert tasks[0].question == "who painted a sunday afternoon on the island of la grande jatte?"
    assert tasks[1].answers == ["Paris", "paris, france"]
    assert tasks[1].data_source == "hotpotqa"
    assert tasks[0].meta["ability"] == "fact-reasoning" and tasks[0].meta["extra_info"]["index"] == 0
    assert tasks[0].meta["prompt"][0]["role"] == "user"


def test_question_extraction_is_robust() -> None:
    assert extract_question([{"role": "user", "content": "just the question?"}], "x") == "just the question?"
    msgs = [
        {"role": "system", "content": "You are helpful. Question: not this one"},
        {"role": "user", "content": "Instructions... Question: the real one?\n"},
    ]
    assert extract_question(msgs, "x") == "the real one?"
    assert extract_question("Question: plain string prompt\n", "x") == "plain string prompt"
    with pytest.raises(DataError, match="no question"):
        extract_question([{"role": "user", "content": "Question:   \n"}], "f: row 3")


def test_parquet_without_search_r1_columns_or_with_scalar_target(tmp_path: Path) -> None:
    rows = [
        {
            "data_source": "custom",
            "prompt": [{"role": "user", "content": "Who wrote Hamlet?"}],
            "reward_model": {"ground_truth": {"target": "William Shakespeare"}},
        }
    ]
    (t,) = load_tasks(write_parquet(tmp_path / "custom.parquet", rows))
    assert t.id == "custom-0" and t.question == "Who wrote Hamlet?" and t.answers == ["William Shakespeare"]


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": [{"role": "user", "content": "q"}], "reward_model": {"style": "rule"}}, "row 1: field 'reward_model.ground_truth'"),
        ({"prompt": [{"role": "user", "content": "q"}], "reward_model": {"ground_truth": {"target": []}}}, "row 1: field 'reward_model.ground_truth.target'"),
        ({"prompt": [], "reward_model": {"ground_truth": {"target": ["a"]}}}, "row 1: field 'prompt'"),
    ],
)
def test_parquet_errors_name_file_row_field(tmp_path: Path, row: dict, message: str) -> None:
    good = search_r1_row(0, "q?", ["a"])
    path = tmp_path / "bad.parquet"
    # the bad row is written alone (a mixed table would need a unified schema)
    write_parquet(path, [row])
    with pytest.raises(DataError) as e:
        load_tasks(path)
    assert str(path) in str(e.value) and message in str(e.value)
    assert isinstance(e.value, ConfigError)  # the CLI prints ConfigError as one line
    assert "\n" not in str(e.value)
    assert load_tasks(write_parquet(tmp_path / "good.parquet", [good]))


def test_parquet_missing_columns(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "x.parquet", [{"prompt": [{"role": "user", "content": "q"}]}])
    with pytest.raises(DataError, match="missing column 'reward_model'"):
        load_tasks(path)


def test_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "qs.jsonl"
    lines = [
        {"id": "a", "question": " Who? ", "answers": ["x", "y"]},
        {"question": "What?", "answers": "z", "data_source": "mine"},
        {"id": "a", "question": "Dup id?", "golden_answers": ["w"]},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    tasks = load_tasks(path)
    assert [t.question for t in tasks] == ["Who?", "What?", "Dup id?"]
    assert tasks[1].answers == ["z"] and tasks[1].data_source == "mine" and tasks[1].id == "qs-1"
    assert tasks[2].id == "a#3"  # repeated ids are made unique (they become forest prompt ids)
    assert tasks[2].answers == ["w"]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "row 2: not valid JSON"),
        ('{"id": 1, "answers": ["a"]}', "row 2: field 'question'"),
        ('{"question": "q"}', "row 2: field 'answers' is missing"),
        ('{"question": "q", "answers": [1.5, null]}', "row 2: field 'answers' must hold strings"),
        ('["q", "a"]', "row 2: each line must be a JSON object"),
    ],
)
def test_jsonl_errors(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"question": "ok", "answers": ["a"]}\n' + line + "\n")
    with pytest.raises(DataError, match="bad.jsonl: " + message.replace("(", r"\(")):
        load_tasks(path)


def test_missing_and_empty_files(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no such data file"):
        load_tasks(tmp_path / "nope.parquet")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="holds no questions"):
        load_tasks(tmp_path / "empty.jsonl")
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match="not a readable parquet file"):
        load_tasks(tmp_path / "junk.parquet")
