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


def test_warmup_with_demos_and_tools_from_the_working_directory(smollm2_2layer_dir: Path, workdir: tuple[Path, str]) -> None:
    # a real BPE tokenizer: with the tiny fixture's (512 positions) the prompt with these tool
    # schemas alone is longer than the context, and such demos are refused (issue 42)
    folder, name = workdir
    tiny_model_dir = smollm2_2layer_dir
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


# -- resume and the user's code (issue 42) --------------------------------------------------------

RUN_ARGS = ["--sampler", "chain", "--group-size", "2", "--prompts-per-step", "1", "--set", "eval_prompts=1",
            "--set", "max_step_tokens=8", *SMALL]  # fmt: skip


def _one_line(res: object) -> str:
    assert res.exit_code == 2, res.output  # type: ignore[attr-defined]
    (line,) = res.output.strip().splitlines()  # type: ignore[attr-defined]
    return line


def test_resume_refuses_a_changed_user_module(tiny_model_dir: Path, workdir: tuple[Path, str]) -> None:
    """The env's module is recorded (user_code.json, sha256); edited before a resume, the resume
    names it and the fix; --resume-override user_code continues and records the new source."""
    folder, name = workdir
    args = ["train", "--model", str(tiny_model_dir), "--env", f"{name}_envs:GoodEnv", "--data", "rows.jsonl", "--out-dir", "run", *RUN_ARGS]
    assert CliRunner().invoke(app, [*args, "--steps", "1"]).exit_code == 0
    record = json.loads((folder / "run" / "user_code.json").read_text())["modules"]
    assert list(record) == [f"{name}_envs"] and record[f"{name}_envs"]["file"].endswith(f"{name}_envs.py")
    src = folder / f"{name}_envs.py"
    src.write_text(src.read_text() + "\n# edited\n")
    line = _one_line(CliRunner().invoke(app, [*args, "--steps", "2", "--resume"]))
    assert line.startswith(f"error: --resume: your code changed since the run in run started: {name}_envs ({name}_envs.py)"), line
    assert "--resume-override user_code" in line
    res = CliRunner().invoke(app, [*args, "--steps", "2", "--resume", "--resume-override", "user_code"])
    assert res.exit_code == 0, res.output
    assert json.loads((folder / "run" / "user_code.json").read_text())["modules"] != record


def test_resume_of_tools_defined_in_main_names_the_fix(tiny_model_dir: Path, workdir: tuple[Path, str]) -> None:
    """A script's run records its tools as ``__main__:name``; resumed from the command line they
    cannot be imported back, and the refusal says how to make them importable."""
    import treegrpo

    folder, name = workdir
    tools_mod = importlib.import_module(f"{name}_tools")

    def add(a: int, b: int) -> str:
        """Add two whole numbers.

        Args:
            a: the first
            b: the second
        """
        return str(a + b)

    add.__module__, add.__qualname__ = "__main__", "add"  # as a function defined in a script
    treegrpo.train(
        str(tiny_model_dir), train_data=ROWS, tools=[add], reward_funcs=[tools_mod.reward], out_dir="main_run",
        sampler="chain", group_size=2, prompts_per_step=1, steps=1, eval_prompts=1, max_step_tokens=8,
        eval_sampled=False, threads=1, max_turns=2,
    )  # fmt: skip
    assert json.loads((folder / "main_run" / "config.json").read_text())["tools"] == ["__main__:add"]
    line = _one_line(CliRunner().invoke(app, ["train", "--out-dir", "main_run", "--resume", "--steps", "2"]))
    assert "'__main__:add' was defined in the script that started the run" in line
    assert "move it into a module of its own" in line


def test_resume_from_python_refuses_other_rows(tiny_model_dir: Path, workdir: tuple[Path, str]) -> None:
    """``train(..., resume=True)`` with rows other than the run's leaves ``data/train.jsonl`` as it
    was and refuses in one line; the same rows resume."""
    import treegrpo
    from treegrpo.errors import ConfigError

    folder, name = workdir
    tools_mod = importlib.import_module(f"{name}_tools")
    kw = dict(tools=[tools_mod.add], reward_funcs=[tools_mod.reward], out_dir="py_run", sampler="chain", group_size=2,
              prompts_per_step=1, eval_prompts=1, max_step_tokens=8, eval_sampled=False, threads=1, max_turns=2)  # fmt: skip
    treegrpo.train(str(tiny_model_dir), train_data=ROWS, steps=1, **kw)  # type: ignore[arg-type]
    written = (folder / "py_run" / "data" / "train.jsonl").read_text()
    other = [dict(r, question=r["question"].replace("+", "plus")) for r in ROWS]
    with pytest.raises(ConfigError, match=r"train_data: resume=True, but these are not the rows the run trained on .*6 rows, given 6, row 1 differs"):
        treegrpo.train(str(tiny_model_dir), train_data=other, steps=2, resume=True, **kw)  # type: ignore[arg-type]
    assert (folder / "py_run" / "data" / "train.jsonl").read_text() == written
    s = treegrpo.train(str(tiny_model_dir), train_data=ROWS, steps=2, resume=True, **kw)  # type: ignore[arg-type]
    assert s.steps == 2
