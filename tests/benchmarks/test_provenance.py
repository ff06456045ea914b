"""Results provenance: the model hash follows the model's files, the command is quoted exactly, the
commit and dirty flag come from git, and a bench writer records them."""

from __future__ import annotations

import importlib.metadata
import io
import json
import platform
import shlex
import shutil
import subprocess
from dataclasses import asdict
from pathlib import Path

import pytest

from treegrpo.benchmarks.provenance import cpu_model, invocation, model_hash, provenance, source_commit


def _model_folder(root: Path) -> Path:
    root.mkdir()
    (root / "config.json").write_text('{"hidden_size": 8}')
    (root / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    (root / "tokenizer.json").write_text('{"vocab": {"a": 0}}')
    (root / "trainer_state.pt").write_bytes(b"optimizer")
    (root / "metrics.jsonl").write_text('{"step": 1}\n')
    return root


def test_model_hash_follows_weights_config_and_tokenizer(tmp_path: Path) -> None:
    folder = _model_folder(tmp_path / "m")
    h0 = model_hash(folder)
    assert h0 is not None and h0.startswith("sha256:") and len(h0) == len("sha256:") + 64
    assert model_hash(folder) == h0 and model_hash(str(folder)) == h0
    # a copy elsewhere is the same model
    assert model_hash(shutil.copytree(folder, tmp_path / "copy")) == h0
    # training state and run records are not the model
    (folder / "trainer_state.pt").write_bytes(b"other optimizer state")
    (folder / "metrics.jsonl").write_text('{"step": 2}\n')
    assert model_hash(folder) == h0
    # one changed weight byte, the config, the tokenizer: another hash each
    w = bytearray((folder / "model.safetensors").read_bytes())
    w[1000] ^= 1
    (folder / "model.safetensors").write_bytes(bytes(w))
    h1 = model_hash(folder)
    assert h1 != h0
    (folder / "config.json").write_text('{"hidden_size": 9}')
    h2 = model_hash(folder)
    assert h2 not in (h0, h1)
    (folder / "tokenizer.json").write_text('{"vocab": {"b": 0}}')
    assert model_hash(folder) not in (h0, h1, h2)
    # a renamed weight file is another model folder
    before = model_hash(folder)
    (folder / "model.safetensors").rename(folder / "model-00001.safetensors")
    assert model_hash(folder) != before


def test_model_hash_none_for_ids_and_empty_folders(tmp_path: Path) -> None:
    assert model_hash(None) is None
    assert model_hash("Qwen/Qwen2.5-0.5B-Instruct") is None  # a hub id, not a local path
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("no model here")
    assert model_hash(tmp_path / "empty") is None
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 100)
    h = model_hash(gguf)
    assert h is not None and h != model_hash(tmp_path / "empty")


def test_command_is_shell_quoted_exactly(tmp_path: Path) -> None:
    argv = ["treegrpo", "train", "--set", "prompt_template=Q: {question}", "--out-dir", "my runs/it's", "--steps", "3"]
    p = provenance(argv)
    assert p["command"] == "treegrpo train --set 'prompt_template=Q: {question}' --out-dir 'my runs/it'\"'\"'s' --steps 3"
    assert shlex.split(p["command"]) == argv
    assert provenance(["treegrpo", "bench", "budget"])["command"] == "treegrpo bench budget"
    assert provenance()["command"] == shlex.join(invocation())
    assert set(p) == {"command", "model", "model_hash", "commit", "dirty", "treegrpo", "versions", "cpu",
                      "torch_cpu_capability", "torch_threads"}  # fmt: skip
    v = p["versions"]
    assert set(v) == {"python", "torch", "transformers", "tokenizers", "numpy", "bm25s", "peft", "vllm", "trl", "accelerate"}
    assert v["torch"] == importlib.metadata.version("torch") and v["numpy"] == importlib.metadata.version("numpy")
    assert v["python"] == platform.python_version()
    assert p["model"] is None and p["model_hash"] is None
    json.dumps(p)


def test_cpu_model_from_cpuinfo_else_the_platform(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9R14 96-Core Processor  \n"
                    "\nprocessor\t: 1\nmodel name\t: another\n")  # fmt: skip
    assert cpu_model(info) == "AMD EPYC 9R14 96-Core Processor"  # the first one, stripped
    monkeypatch.setattr(platform, "processor", lambda: "aarch64")
    info.write_text("processor\t: 0\nCPU part\t: 0xd0c\n")  # no model name (an ARM kernel)
    assert cpu_model(info) == "aarch64"
    assert cpu_model(tmp_path / "absent") == "aarch64"
    monkeypatch.setattr(platform, "processor", lambda: "")
    assert cpu_model(info) is None


def test_the_cpu_torch_runs_on_and_its_threads_are_recorded() -> None:
    """The CPU model, torch's CPU capability and thread count, beside the versions: the current
    count, or the one the caller measured with."""
    import torch

    p = provenance(["x"])
    assert p["cpu"] == cpu_model() and (p["cpu"] is None or p["cpu"].strip() == p["cpu"] != "")
    assert p["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert provenance(["x"])["torch_threads"] == 1
        assert provenance(["x"], threads=3)["torch_threads"] == 3  # the workers' count, given
    finally:
        torch.set_num_threads(before)


def test_several_models_are_recorded_by_name(tmp_path: Path) -> None:
    a, b = _model_folder(tmp_path / "a"), _model_folder(tmp_path / "b")
    (b / "config.json").write_text('{"hidden_size": 16}')
    p = provenance(["x"], {0: a, 1: b})
    assert p["model"] == {"0": str(a), "1": str(b)}
    assert p["model_hash"] == {"0": model_hash(a), "1": model_hash(b)} and model_hash(a) != model_hash(b)


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_commit_and_dirty_from_git(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    pkg = repo / "src" / "pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("x = 1\n")
    (repo / "README").write_text("r\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "init")
    head = _git(repo, "rev-parse", "HEAD")
    assert source_commit(pkg) == (head, False)
    (repo / "notes.txt").write_text("untracked outside the package: not a code change\n")
    assert source_commit(pkg) == (head, False)
    (pkg / "new_module.py").write_text("y = 2\n")  # untracked code inside the package
    assert source_commit(pkg) == (head, True)
    (pkg / "new_module.py").unlink()
    (repo / "README").write_text("changed\n")  # a tracked file changed anywhere
    assert source_commit(pkg) == (head, True)
    # a package folder that is not in a checkout
    plain = tmp_path / "plain" / "pkg"
    plain.mkdir(parents=True)
    (plain / "__init__.py").write_text("")
    assert source_commit(plain) == (None, None)


def test_no_git_gives_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no git executable to be found
    assert source_commit() == (None, None)
    p = provenance(["treegrpo"])
    assert p["commit"] is None and p["dirty"] is None


def test_bench_budget_writes_provenance(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A minimal ``bench budget`` run (one chain configuration, two prompts) on the fixture model,
    given the bootstrap record the runner reads its env and agent settings from."""
    from rich.console import Console

    from treegrpo.benchmarks.budget import chain_spec, run_bench
    from treegrpo.rollout.agent import AgentConfig
    from treegrpo.tasks.world.world import PRESETS

    folder = shutil.copytree(tiny_model_dir, tmp_path / "agent")
    agent = AgentConfig(max_turns=2, max_step_tokens=8, max_obs_tokens=32, max_context_tokens=400, use_chat_template=False)
    record = {
        "tokenizer": "PreTrainedTokenizerFast",
        "world": PRESETS["tiny"].to_dict(),
        "env": {"topk": 2, "prompt_template": "minimal"},
        "agent": asdict(agent),
    }
    (folder / "treegrpo_tiny.json").write_text(json.dumps(record))
    out = tmp_path / "budget.json"
    run_bench(out, prompts=2, repeats=1, model_dir=folder, specs=[chain_spec(2)], console=Console(file=io.StringIO()), log=lambda m: None)
    doc = json.loads(out.read_text())
    p = doc["provenance"]
    assert p["command"] == shlex.join(invocation())
    assert p["model"] == str(folder) == doc["meta"]["model"]
    assert p["model_hash"] == model_hash(folder) == model_hash(tiny_model_dir)
    assert (p["commit"], p["dirty"]) == source_commit()
    assert [r["mode"] for r in doc["rows"]] == ["chain", "chain"]  # the run itself is unchanged
    assert p["torch_threads"] == doc["meta"]["torch_threads"] == 1  # measured on one thread (the default)
    assert p["cpu"] == cpu_model()
