"""Bad input from a user gets one error line naming the problem and the fix, never a traceback:
config values, ``--set`` values, config/data files that are not UTF-8, broken model folders."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from treegrpo.cli import app
from treegrpo.errors import ConfigError
from treegrpo.models.loader import ModelLoadError, load_pretrained
from treegrpo.tasks.datafile import DataError, load_tasks
from treegrpo.training.config import make_config
from treegrpo.training.config_files import load_config, parse_set


def _cli_error(*args: str) -> str:
    res = CliRunner().invoke(app, list(args))
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert len(lines) == 1, res.output
    return lines[0]


@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_non_finite_float_is_refused(value: str) -> None:
    line = _cli_error("train", "--lr", value)
    assert "lr" in line and "finite" in line


def test_unknown_advantage_names_the_choices() -> None:
    line = _cli_error("train", "--advantage", "tree_grp")
    assert "tree_grp" in line and "tree_grpo" in line


def test_unknown_preset_is_one_line(tmp_path: Path) -> None:
    line = _cli_error("train", "--preset", "nope", "--out-dir", str(tmp_path / "r"))
    assert "unknown world preset 'nope'" in line and "default" in line


def test_set_value_with_a_colon_is_a_string() -> None:
    assert parse_set(["prompt_template=Q: {question}"]) == {"prompt_template": "Q: {question}"}
    assert parse_set(["prompt_template=a: b: c"]) == {"prompt_template": "a: b: c"}
    assert parse_set(["steps=3", "eval_sampled=false", "model=null"]) == {
        "steps": 3,
        "eval_sampled": False,
        "model": None,
    }
    cfg = make_config(overrides=parse_set(["prompt_template=Q: {question}"]))
    assert cfg.prompt_template == "Q: {question}"


def test_set_a_mapping_field_keeps_the_mapping() -> None:
    """A field that is a mapping (engine_options) takes a YAML mapping; other fields keep the text."""
    sets = parse_set(["engine_options={max_batch_size: 64}", "prompt_template=a: b"])
    assert sets == {"engine_options": {"max_batch_size": 64}, "prompt_template": "a: b"}
    assert make_config(overrides=sets).engine_options == {"max_batch_size": 64}


def test_bench_real_set_is_parsed_like_train(tmp_path: Path) -> None:
    """``bench real --set`` reads values as ``train --set`` does, and names a pair without ``=``."""
    line = _cli_error("bench", "real", "--table", "--set", "max_step_tokens", "--work", str(tmp_path))
    assert "--set 'max_step_tokens': expected key=value" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_on_a_cpu_build_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"device.*cuda.*device=cpu"):
        make_config(overrides={"device": "cuda"})
    line = _cli_error("train", "--set", "device=cuda")
    assert "device" in line and "cpu" in line


def test_bad_device_string() -> None:
    with pytest.raises(ConfigError, match="not a torch device"):
        make_config(overrides={"device": "gpu0"})


def test_non_utf8_yaml_config(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_bytes("lr: 1e-4\nprompt_template: 'Q\xe9 {question}'\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(p)
    assert "not UTF-8" in _cli_error("train", "--config", str(p))


def test_invalid_yaml_is_one_line(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("lr: [1\nsteps: 3\n")
    with pytest.raises(ConfigError, match=r"not valid YAML.*line") as e:
        load_config(p)
    assert "\n" not in str(e.value)


def test_non_utf8_jsonl_data(tmp_path: Path) -> None:
    p = tmp_path / "q.jsonl"
    good = json.dumps({"id": "a", "question": "q?", "answers": ["x"]})
    p.write_bytes(good.encode() + b"\n" + b'{"id": "b", "question": "caf\xe9?", "answers": ["y"]}\n')
    with pytest.raises(DataError, match=r"row 2: not UTF-8"):
        load_tasks(p)


def test_jsonl_with_a_bom_reads(tmp_path: Path) -> None:
    p = tmp_path / "q.jsonl"
    p.write_bytes(b"\xef\xbb\xbf" + json.dumps({"id": "a", "question": "q?", "answers": ["x"]}).encode() + b"\n")
    assert [t.id for t in load_tasks(p)] == ["a"]


# -- model folders ---------------------------------------------------------------------------------


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_model_folder_without_tokenizer(tiny_model_dir: Path, tmp_path: Path) -> None:
    d = _copy(tiny_model_dir, tmp_path / "m")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (d / name).unlink(missing_ok=True)
    with pytest.raises(ModelLoadError, match="no tokenizer files") as e:
        load_pretrained(d)
    assert "sentencepiece" not in str(e.value)


def test_model_folder_without_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    d = _copy(tiny_model_dir, tmp_path / "m")
    for w in d.glob("*.safetensors"):
        w.unlink()
    with pytest.raises(ModelLoadError, match="no weights"):
        load_pretrained(d)


@pytest.mark.parametrize("text", ["{not json", "", "[1, 2]", '{"hidden_size": 3}'])
def test_model_folder_with_a_broken_config(tiny_model_dir: Path, tmp_path: Path, text: str) -> None:
    d = _copy(tiny_model_dir, tmp_path / "m")
    (d / "config.json").write_text(text)
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        load_pretrained(d)


def test_model_folder_with_truncated_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    d = _copy(tiny_model_dir, tmp_path / "m")
    (w,) = d.glob("*.safetensors")
    w.write_bytes(w.read_bytes()[:100])
    with pytest.raises(ModelLoadError, match="cannot load its weights") as e:
        load_pretrained(d)
    assert "\n" not in str(e.value)


def test_model_errors_reach_the_cli_as_one_line(tiny_model_dir: Path, tmp_path: Path) -> None:
    d = _copy(tiny_model_dir, tmp_path / "m")
    for w in d.glob("*.safetensors"):
        w.unlink()
    line = _cli_error("train", "--model", str(d), "--out-dir", str(tmp_path / "r"), "--steps", "1")
    assert "no weights" in line


def test_missing_model_folder(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such folder"):
        load_pretrained(tmp_path / "nope")


def test_a_real_model_without_data_says_what_to_pass(tiny_model_dir: Path, tmp_path: Path) -> None:
    d = _copy(tiny_model_dir, tmp_path / "m")
    (d / "treegrpo_tiny.json").unlink()  # no longer a bootstrapped tiny agent: a "real" model
    line = _cli_error("train", "--model", str(d), "--out-dir", str(tmp_path / "r"), "--steps", "1")
    assert "--data" in line and "wiki-vital" in line


# -- None settings (issue 42) ----------------------------------------------------------------------


def test_none_setting_means_none_from_python_set_and_yaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``tool_timeout_s=None`` (no limit) from Python keywords, ``--set tool_timeout_s=null`` and a
    YAML null all record None; a flag not given keeps the default."""
    import treegrpo.api as api
    import treegrpo.training.run as run_mod

    assert make_config(overrides={"tool_timeout_s": None}).tool_timeout_s is None
    assert make_config(overrides=parse_set(["tool_timeout_s=null"])).tool_timeout_s is None
    assert make_config(overrides={}).tool_timeout_s == 30.0
    seen: list[object] = []

    def capture(cfg: object, *a: object, **kw: object) -> None:
        seen.append(cfg)

    monkeypatch.setattr(run_mod, "run_training", capture)
    res = CliRunner().invoke(app, ["train", "--set", "tool_timeout_s=null", "--out-dir", str(tmp_path / "c")])
    assert res.exit_code == 0, res.output
    assert seen[-1].tool_timeout_s is None  # type: ignore[attr-defined]
    res = CliRunner().invoke(app, ["train", "--out-dir", str(tmp_path / "d")])
    assert res.exit_code == 0 and seen[-1].tool_timeout_s == 30.0  # type: ignore[attr-defined]
    monkeypatch.setattr(api, "run_training", capture)
    api.train(tool_timeout_s=None, out_dir=str(tmp_path / "p"))
    assert seen[-1].tool_timeout_s is None and seen[-1].out_dir == str(tmp_path / "p")  # type: ignore[attr-defined]
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("tool_timeout_s: null\n")
    assert load_config(yaml_file).tool_timeout_s is None


def test_home_paths_are_expanded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``out_dir="~/x"`` (and every path setting) is the user's home, not a literal ``./~/x``."""
    import treegrpo.api as api

    home = tmp_path / "home"
    (home / "q").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    cfg = make_config(overrides={"out_dir": "~/x", "model": "~/m", "data": "~/q/a.jsonl", "eval_data": "~/q/b.jsonl", "tools": ["m:f"]})
    assert (cfg.out_dir, cfg.model, cfg.data, cfg.eval_data) == (
        str(home / "x"), str(home / "m"), str(home / "q/a.jsonl"), str(home / "q/b.jsonl")
    )
    (home / "c.yaml").write_text("out_dir: ~/y\n")
    assert load_config("~/c.yaml").out_dir == str(home / "y")
    seen: list[object] = []
    monkeypatch.setattr(api, "run_training", lambda cfg, *a, **kw: seen.append(cfg))
    api.train(train_data=[{"question": "q?", "answer": "a"}], tools=[_a_tool], out_dir="~/run")
    assert (home / "run" / "data" / "train.jsonl").is_file() and not (tmp_path / "~").exists()
    assert seen[-1].data == str(home / "run" / "data" / "train.jsonl")  # type: ignore[attr-defined]


def _a_tool(x: str) -> str:
    """Echo.

    Args:
        x: the text
    """
    return x


def test_train_help_says_what_model_and_data_take() -> None:
    out = " ".join(CliRunner().invoke(app, ["train", "--help"], env={"COLUMNS": "400"}).output.split())
    assert "a .gguf file, a built-in name (smollm2-135m) or a Hugging Face hub id" in out
    assert "Local causal-LM folder" not in out
    assert "a JSONL file (one row a line: question or prompt, answers or answer" in out and "parquet" in out
