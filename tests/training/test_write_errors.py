"""One line instead of a traceback (issue 42): a run folder that cannot be written, a disk that
fills during a checkpoint save, a demonstration longer than the context, and a ConfigError from
the Python API raised from the call itself (no library frames, no chained exception)."""

from __future__ import annotations

import errno
import tempfile
import traceback
from pathlib import Path

import pytest
import torch
from test_trainer import small_cfg
from typer.testing import CliRunner

import treegrpo
from treegrpo.cli import app
from treegrpo.errors import ConfigError
from treegrpo.models.loader import load_model, load_tokenizer
from treegrpo.training import checkpoint as ck_mod
from treegrpo.training.trainer import train

ROWS = [{"question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(4)]


def _add(a: int, b: int) -> str:
    """Add.

    Args:
        a: the first
        b: the second
    """
    return str(a + b)


def test_a_run_folder_that_cannot_be_written_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a_file").write_text("x")
    res = CliRunner().invoke(app, ["train", "--out-dir", str(tmp_path / "a_file" / "run")])
    assert res.exit_code == 2, res.output
    (line,) = res.output.strip().splitlines()
    assert line.startswith(f"error: cannot write to the run folder {tmp_path / 'a_file' / 'run'}: ") and "writable --out-dir" in line

    def read_only(*a: object, **kw: object) -> None:
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", read_only)  # root ignores file modes: as a read-only folder answers
    with pytest.raises(ConfigError, match=r"train_data: cannot write .*train\.jsonl: PermissionError: .*Permission denied"):
        treegrpo.train(train_data=ROWS, tools=[_add], out_dir=str(tmp_path / "ro"))
    with pytest.raises(ConfigError, match=r"^cannot write to the run folder .*PermissionError.*writable --out-dir"):
        train(small_cfg(tmp_path / "ro2"))


def test_a_full_disk_during_a_checkpoint_save_is_one_line(tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.save on a full disk raises ``inline_container.cc:672 unexpected pos``; the save says
    no space left (with the free space) and the generation before it is kept."""
    model, tok = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    folder = tmp_path / "checkpoint"
    ck_mod.save_checkpoint(folder, model, tok, {"format": 2})
    before = sorted(p.name for p in folder.iterdir())

    def full(*a: object, **kw: object) -> None:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 5760 vs 5654")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(ConfigError, match=rf"^cannot save the checkpoint to {folder}: no space left on {tmp_path} \(\d+\.\d GB free\)"):
        ck_mod.save_checkpoint(folder, model, tok, {"format": 2})
    assert sorted(p.name for p in folder.iterdir()) == before and not list(tmp_path.glob(".checkpoint.*"))


def test_a_config_error_from_python_is_raised_from_the_call(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        treegrpo.train(steps=-1, out_dir=str(tmp_path / "r"))
    frames = traceback.extract_tb(e.value.__traceback__)
    assert [Path(f.filename).name for f in frames] == ["test_write_errors.py", "api.py"]  # the call, the raise
    assert e.value.__cause__ is None and e.value.__suppress_context__
    assert "\n" not in str(e.value) and "steps" in str(e.value)
    with pytest.raises(ConfigError) as e:
        treegrpo.warmup("nope-no-such-model", demos=[], out=tmp_path / "w", tools=[_add])
    assert Path(traceback.extract_tb(e.value.__traceback__)[-1].filename).name == "api.py"


def test_a_demo_longer_than_the_context_is_refused_naming_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    demos = [
        {"question": "What is 2 + 3?", "answer": "5", "steps": [{"tool": "_add", "arguments": {"a": 2, "b": 3}}, {"answer": "5"}]},
        {"question": "What is " + "2 + " * 600 + "3?", "answer": "5", "steps": [{"answer": "5"}]},
    ]  # fmt: skip
    with pytest.raises(ConfigError, match=r"^demos: demo 2 \('What is 2 \+ 2 .*is \d+ tokens, longer than max_context_tokens=512 .*max_context_tokens=N \(1 demo\(s\) over\)"):
        treegrpo.warmup(str(tiny_model_dir), demos=demos, out=tmp_path / "w", tools=[_add], max_context_tokens=1000,
                        max_step_tokens=64, eval_sampled=False, threads=1)  # fmt: skip
    assert not (tmp_path / "w").exists()
