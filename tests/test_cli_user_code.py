"""The CLI with the user's own code, importable from the working directory: ``treegrpo warmup
--demos … --tools mod:fn,…`` and ``treegrpo train --env mod:Class`` (docs/tools.md,
docs/stateful-tools.md). Each module is written into ``tmp_path`` under a name of its own, and the
commands run in-process with ``tmp_path`` as the working directory."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from treegrpo.cli import app

TOOLS = '''
def add(a: int, b: int) -> str:
    """Add two whole numbers.

    Args:
        a: the first
        b: the second
    """
    return str(a + b)


def mul(a: int, b: int) -> str:
    """Multiply two whole numbers.

    Args:
        a: the first
        b: the second
    """
    return str(a * b)


def reward(completions, answer, **kwargs):
    return [float(c[-1]["content"].strip() == str(a)) for c, a in zip(completions, answer)]
'''

ENVS = '''
from treegrpo import StepOutcome


class GoodEnv:
    """Answers in <answer> tags, rewarded 1 for the gold answer."""

    stop_strings = ("</answer>",)

    def prompt(self, task):
        return f"Question: {task.question}\\nAnswer in <answer> </answer>.\\n"

    def step(self, tasks, steps, allowed):
        return [StepOutcome("answer", True, reward=float(t.answers[0] in s)) for t, s in zip(tasks, steps)]

    def score(self, task, step):
        return 0.0


class BadEnv(GoodEnv):
    stop_strings = ("</answer>")  # a string, not a tuple: it would stop at every character
'''

ROWS = [{"id": f"q{i}", "question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(6)]
SMALL = ["--set", "eval_sampled=false", "--set", "threads=1", "--set", "max_turns=2"]


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> tuple[Path, str]:
    """``tmp_path`` as the working directory, holding the user's modules (``<name>_tools``,
    ``<name>_envs``: names of their own, so no test imports another's) and the questions."""
    name = f"user31_{request.node.name.replace('[', '_').replace(']', '')}"
    (tmp_path / f"{name}_tools.py").write_text(TOOLS)
    (tmp_path / f"{name}_envs.py").write_text(ENVS)
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    return tmp_path, name


def test_warmup_with_demos_and_tools_from_the_working_directory(tiny_model_dir: Path, workdir: tuple[Path, str]) -> None:
    folder, name = workdir
    demos = [
        {"question": "What is 2 + 3?", "answer": "5", "steps": [{"tool": "add", "arguments": {"a": 2, "b": 3}}, {"answer": "5"}]},
        {"messages": [{"role": "user", "content": "What is 4 * 5?"},
                      {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "mul", "arguments": {"a": 4, "b": 5}}}]},
                      {"role": "assistant", "content": "20"}], "answer": "20"},
    ]  # fmt: skip
    (folder / "demos.jsonl").write_text("".join(json.dumps(d) + "\n" for d in demos))
    out = folder / "warm"
    res = CliRunner().invoke(app, [
        "warmup", "--model", str(tiny_model_dir), "--demos", "demos.jsonl", "--tools", f"{name}_tools:add,{name}_tools:mul",
        "--reward", f"{name}_tools:reward", "--eval-data", "rows.jsonl", "--eval-prompts", "1", "--epochs", "1",
        "--batch-size", "2", "--out", str(out), "--set", "max_step_tokens=160", *SMALL,
    ])  # fmt: skip
    assert res.exit_code == 0, res.output
    record = json.loads((out / "treegrpo_warmup.json").read_text())
    assert record["demos"] == 2 and record["demos_file"] == "demos.jsonl" and record["sft"]["steps"] == 1
    assert "before: reward_greedy " in res.output  # the user's reward is not marked 0/1: a mean reward
    assert (out / "config.json").exists()  # a --model for treegrpo train

    bad = folder / "bad.jsonl"
    bad.write_text(json.dumps({"question": "x", "answer": "1", "steps": [{"tool": "sub", "arguments": {}}, {"answer": "1"}]}) + "\n")
    res = CliRunner().invoke(app, [
        "warmup", "--model", str(tiny_model_dir), "--demos", "bad.jsonl", "--tools", f"{name}_tools:add",
        "--out", str(folder / "never"), "--set", "max_step_tokens=160", *SMALL,
    ])  # fmt: skip
    assert res.exit_code == 2 and not (folder / "never").exists()
    (line,) = res.output.strip().splitlines()
    assert line.startswith("error: bad.jsonl: demo 1: step 1 is not a valid action"), line


def test_train_with_an_env_from_the_working_directory(tiny_model_dir: Path, workdir: tuple[Path, str]) -> None:
    folder, name = workdir
    res = CliRunner().invoke(app, [
        "train", "--model", str(tiny_model_dir), "--env", f"{name}_envs:GoodEnv", "--data", "rows.jsonl",
        "--sampler", "chain", "--group-size", "2", "--steps", "1", "--prompts-per-step", "1", "--out-dir", "run",
        "--set", "eval_prompts=1", "--set", "max_step_tokens=8", *SMALL,
    ])  # fmt: skip
    assert res.exit_code == 0, res.output
    cfg = json.loads((folder / "run" / "config.json").read_text())
    assert cfg["env"] == f"{name}_envs:GoodEnv" and cfg["sampler"] == "chain"
    assert json.loads((folder / "run" / "summary.json").read_text())["steps"] == 1
    forest = json.loads((folder / "run" / "rollouts" / "step_00001.jsonl").read_text().splitlines()[0])
    assert "Answer in <answer> </answer>." in forest["trees"][0]["nodes"][0]["text"]  # the env's own prompt ran


def test_a_bad_env_is_one_line_naming_it(tiny_model_dir: Path, workdir: tuple[Path, str]) -> None:
    folder, name = workdir
    res = CliRunner().invoke(app, [
        "train", "--model", str(tiny_model_dir), "--env", f"{name}_envs:BadEnv", "--data", "rows.jsonl",
        "--sampler", "chain", "--group-size", "2", "--steps", "1", "--out-dir", "bad", *SMALL,
    ])  # fmt: skip
    assert res.exit_code == 2
    (line,) = res.output.strip().splitlines()
    assert line.startswith("error: env BadEnv.stop_strings is the string '</answer>', not a tuple"), line
    assert not (folder / "bad" / "metrics.jsonl").exists()  # refused before anything ran
    res = CliRunner().invoke(app, ["train", "--model", str(tiny_model_dir), "--env", f"{name}_envs:NoSuchEnv", "--data", "rows.jsonl", *SMALL])
    assert res.exit_code == 2 and f"--env '{name}_envs:NoSuchEnv': module {name}_envs has no 'NoSuchEnv'" in res.output
