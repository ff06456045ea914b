"""Resume end to end on a tiny run: verified checkpoints with a fallback generation, plain-data
state (a crafted pickle is refused), refusal when nothing valid is left, finished runs left alone,
changed config refused unless overridden, torn metrics lines, atomic and durable run files."""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import shutil
from pathlib import Path

import pytest
import torch
from rich.console import Console
from test_trainer import parts_for, small_cfg

from treegrpo.training.config import ConfigError, make_config
from treegrpo.training.metrics import MetricsLogger
from treegrpo.training.trainer import TrainSummary, train

RUN = dict(kl_coef=0.0)  # no reference model: faster, and nothing changes about resume


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """A finished 2-step run checkpointed every step (checkpoint/ at step 2, checkpoint.prev/ at
    step 1) and the straight 3-step run of the same seed to compare resumed runs with."""
    root = tmp_path_factory.mktemp("resume")
    train(small_cfg(root / "base", **RUN), parts=parts_for(tiny_model_dir), console=_console()[0])
    straight = train(
        small_cfg(root / "straight", steps=3, **RUN), parts=parts_for(tiny_model_dir), console=_console()[0]
    )
    return {"base": root / "base", "straight": straight}


def _console() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, soft_wrap=True, width=300), buf


@pytest.fixture
def run_dir(runs: dict[str, object], tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(runs["base"], out)  # type: ignore[arg-type]
    return out


def _resume(out: Path, model_dir: Path, **kw: object) -> tuple[TrainSummary, str]:
    console, buf = _console()
    cfg = small_cfg(out, **{"steps": 3, "resume": True, **RUN, **kw})
    s = train(cfg, parts=parts_for(model_dir), console=console)
    return s, buf.getvalue()


def _rehash(folder: Path) -> None:
    """Rewrite checksums.json for the files as they are now (an attacker can do that too)."""
    files = {
        p.name: {"bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
        for p in folder.iterdir()
        if p.name != "checksums.json"
    }
    (folder / "checksums.json").write_text(json.dumps({"files": files}))


def _generations(out: Path) -> list[Path]:
    return [p for p in out.glob("checkpoint*") if p.is_dir()]


def _steps(out: Path) -> list[int]:
    return [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()]


class _Evil:
    """Unpickling this calls ``open(path, "w")``: creates a file, as a stand-in for any code."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (self.path, "w"))


# -- verified generations and fallback -------------------------------------------------------------


def _truncate_weights(ck: Path) -> None:
    p = ck / "model.safetensors"
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _empty_state(ck: Path) -> None:
    (ck / "trainer_state.pt").write_bytes(b"")


def _delete_state(ck: Path) -> None:
    (ck / "trainer_state.pt").unlink()


def _flip_a_byte(ck: Path) -> None:
    p = ck / "model.safetensors"
    data = bytearray(p.read_bytes())
    data[-5] ^= 0xFF
    p.write_bytes(bytes(data))


def _killed_mid_rotation(ck: Path) -> None:
    """A save killed between its two renames: no checkpoint/, only checkpoint.prev/ and the temp folder."""
    shutil.move(str(ck), str(ck.with_name(".checkpoint.killed")))


@pytest.mark.parametrize(
    "damage", [_truncate_weights, _empty_state, _delete_state, _flip_a_byte, _killed_mid_rotation]
)
def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_generation(
    damage, runs: dict[str, object], run_dir: Path, tiny_model_dir: Path
) -> None:
    from treegrpo.training.checkpoint import read_checkpoint

    damage(run_dir / "checkpoint")
    s, log = _resume(run_dir, tiny_model_dir)
    if damage is not _killed_mid_rotation:
        assert f"checkpoint {run_dir / 'checkpoint'} is unusable" in log
        assert "falling back to the previous checkpoint" in log
    assert f"resumed from {run_dir / 'checkpoint.prev'} at step 1" in log
    assert _steps(run_dir) == [0, 1, 2, 3]
    straight = runs["straight"]
    assert (s.generated_tokens, s.trajectories) == (straight.generated_tokens, straight.trajectories)  # type: ignore[attr-defined]
    # both generations are sound again, and no temp folder is left
    assert read_checkpoint(run_dir / "checkpoint").step == 3
    assert read_checkpoint(run_dir / "checkpoint.prev").step == 2
    assert not list(run_dir.glob(".checkpoint*"))


@pytest.mark.parametrize("damage", [None, _flip_a_byte, _truncate_weights])
def test_drop_previous_deletes_the_older_generation_only_under_a_sound_latest(damage, run_dir: Path) -> None:
    from treegrpo.training.checkpoint import drop_previous, read_checkpoint

    if damage is not None:
        damage(run_dir / "checkpoint")
    assert drop_previous(run_dir / "checkpoint") is (damage is None)
    assert (run_dir / "checkpoint.prev").exists() is (damage is not None)  # a broken latest keeps its fallback
    if damage is None:
        assert read_checkpoint(run_dir / "checkpoint").step == 2 and not drop_previous(run_dir / "checkpoint")


@pytest.mark.parametrize("damage", [_empty_state, _delete_state, _truncate_weights])
def test_resume_refuses_with_one_line_when_no_valid_checkpoint_is_left(
    damage, run_dir: Path, tiny_model_dir: Path
) -> None:
    for ck in _generations(run_dir):
        damage(ck)
    before = (run_dir / "metrics.jsonl").read_bytes()
    with pytest.raises(ConfigError, match="no valid checkpoint left") as e:
        _resume(run_dir, tiny_model_dir)
    assert "\n" not in str(e.value) and "run without --resume" in str(e.value)
    assert (run_dir / "metrics.jsonl").read_bytes() == before  # nothing cut


def test_resume_refuses_when_the_checkpoints_are_gone_but_the_run_is_not(
    run_dir: Path, tiny_model_dir: Path
) -> None:
    for ck in _generations(run_dir):
        shutil.rmtree(ck)
    with pytest.raises(ConfigError, match=r"no checkpoint/ folder, but metrics\.jsonl holds an earlier run"):
        _resume(run_dir, tiny_model_dir)


def test_resume_in_an_empty_folder_starts_a_new_run(tmp_path: Path, tiny_model_dir: Path) -> None:
    s, log = _resume(tmp_path / "new", tiny_model_dir, steps=1)
    assert "nothing to resume" in log and s.steps == 1 and _steps(tmp_path / "new") == [0, 1]


def test_a_crafted_state_pickle_is_refused_not_run(
    run_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    marker = tmp_path / "pwned"
    for ck in _generations(run_dir):
        torch.save({"step": 2, "payload": _Evil(marker)}, ck / "trainer_state.pt")
        _rehash(ck)  # checksums cannot stop this: the attacker rewrites them too
    with pytest.raises(Exception) as e:  # which error is checked below, after the marker
        _resume(run_dir, tiny_model_dir)
    assert not marker.exists()  # the pickle did not run
    assert e.type is ConfigError
    assert "trainer_state.pt refused: it holds more than tensors and plain data" in str(e.value)


def test_stale_temp_files_of_a_killed_run_are_removed(run_dir: Path, tiny_model_dir: Path) -> None:
    (run_dir / ".checkpoint.k1ll3d").mkdir()
    (run_dir / ".checkpoint.k1ll3d" / "model.safetensors").write_bytes(b"half")
    (run_dir / ".summary.json.abc123.tmp").write_text("{")
    _resume(run_dir, tiny_model_dir)
    assert not list(run_dir.glob(".*"))


# -- finished runs, config changes ----------------------------------------------------------------


def _files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_resuming_a_finished_run_changes_nothing(run_dir: Path, tiny_model_dir: Path) -> None:
    before = _files(run_dir)
    console, buf = _console()
    # only --resume and the folder: the rest (steps=2 included) comes from the recorded config
    s = train(
        make_config({"out_dir": str(run_dir), "resume": True}),
        parts=parts_for(tiny_model_dir),
        console=console,
    )
    assert "is finished (step 2 of 2); nothing to do" in buf.getvalue()
    assert _files(run_dir) == before
    assert s.to_dict() == json.loads((run_dir / "summary.json").read_text())


def test_a_finished_run_killed_before_its_summary_gets_it_from_the_checkpoint(
    run_dir: Path, tiny_model_dir: Path
) -> None:
    written = json.loads((run_dir / "summary.json").read_text())
    (run_dir / "summary.json").unlink()
    s, _ = _resume(run_dir, tiny_model_dir, steps=2)
    again = json.loads((run_dir / "summary.json").read_text())
    for key in (
        "eval_start",
        "eval_end",
        "em_curve",
        "trajectories",
        "generated_tokens",
        "tool_calls",
        "rollout_s",
    ):
        assert again[key] == written[key], key
    assert s.eval_end == written["eval_end"]


def test_resume_takes_the_recorded_config_and_continues_exactly(
    runs: dict[str, object], run_dir: Path, tiny_model_dir: Path
) -> None:
    """A resume that names only the folder and the new step count continues the same run (prompts
    per step, tree shape, ... from config.json), exactly as the straight run."""
    cfg = make_config({"out_dir": str(run_dir), "resume": True, "steps": 3})
    s = train(cfg, parts=parts_for(tiny_model_dir), console=_console()[0])
    straight = runs["straight"]
    assert (s.generated_tokens, s.trajectories) == (straight.generated_tokens, straight.trajectories)  # type: ignore[attr-defined]
    assert json.loads((run_dir / "config.json").read_text())["prompts_per_step"] == 2


@pytest.mark.parametrize(("field", "value"), [("lr", 1e-3), ("sampler", "chain"), ("seed", 7)])
def test_resume_refuses_a_changed_field(
    field: str, value: object, run_dir: Path, tiny_model_dir: Path
) -> None:
    before = _files(run_dir)
    with pytest.raises(
        ConfigError, match=f"was run with {field}=.*asks for {field}=.*--resume-override {field}"
    ):
        _resume(run_dir, tiny_model_dir, **{field: value})
    assert _files(run_dir) == before


def test_resume_refuses_fewer_steps_than_done(run_dir: Path, tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match="at step 2 already; give --steps 2 or more"):
        _resume(run_dir, tiny_model_dir, steps=1)


def test_an_overridden_lr_is_applied_and_recorded(run_dir: Path, tiny_model_dir: Path) -> None:
    _, log = _resume(run_dir, tiny_model_dir, lr=1e-3, resume_override="lr")
    assert "lr changed from 0.0005 to 0.001" in log
    assert json.loads((run_dir / "config.json").read_text())["lr"] == 1e-3
    state = torch.load(run_dir / "checkpoint" / "trainer_state.pt", weights_only=True)
    assert [g["lr"] for g in state["optimizer"]["param_groups"]] == [1e-3]  # the optimizer ran with it
    assert state["config"]["lr"] == 1e-3
    # the next resume compares against the new value: no override needed to keep it, one needed
    # to change it again (an override is not carried over)
    _resume(run_dir, tiny_model_dir, steps=4, lr=1e-3)
    with pytest.raises(ConfigError, match=r"lr=0\.001, this one asks for lr=0\.002"):
        train(
            make_config({"out_dir": str(run_dir), "resume": True, "steps": 5, "lr": 2e-3}),
            parts=parts_for(tiny_model_dir),
        )


def test_an_overridden_seed_restarts_the_streams(run_dir: Path, tiny_model_dir: Path) -> None:
    from treegrpo.training.checkpoint import RunState

    _resume(run_dir, tiny_model_dir, seed=7, resume_override=["seed"])
    assert _steps(run_dir) == [0, 1, 2, 3]
    state = torch.load(run_dir / "checkpoint" / "trainer_state.pt", weights_only=True)
    fresh = RunState.fresh(7)
    fresh.rng.sample(range(4), 2)  # what one step draws from the prompt stream (prompts_per_step=2 of 4)
    assert RunState.from_state(state["run"]).rng.getstate() == fresh.rng.getstate()


def test_unknown_override_fields_are_refused(run_dir: Path, tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match="unknown config field"):
        _resume(run_dir, tiny_model_dir, resume_override="lrr")


# -- metrics.jsonl, summary.json, config.json --------------------------------------------------------


def test_a_torn_last_metrics_line_is_dropped_on_resume(run_dir: Path, tiny_model_dir: Path) -> None:
    with (run_dir / "metrics.jsonl").open("a") as fh:
        fh.write('{"step": 3, "reward/me')  # killed mid-write
    _, log = _resume(run_dir, tiny_model_dir)
    assert "dropped its torn last line" in log
    assert _steps(run_dir) == [0, 1, 2, 3]


def test_metrics_rows_after_the_checkpoint_are_dropped_on_resume(run_dir: Path, tiny_model_dir: Path) -> None:
    shutil.rmtree(run_dir / "checkpoint")  # as if killed after step 2 was logged but before it was saved
    _, log = _resume(run_dir, tiny_model_dir)
    assert "dropped 1 row(s) after step 1" in log and _steps(run_dir) == [0, 1, 2, 3]


def test_each_metrics_row_is_one_fsynced_append(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
    log = MetricsLogger(tmp_path, tensorboard=False)
    synced.clear()
    log.log(1, {"reward/mean": 0.5})
    assert len(synced) == 1
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "reward/mean": 0.5}\n'


@pytest.mark.parametrize("name", ["summary.json", "config.json"])
def test_a_failed_run_file_write_leaves_the_previous_file(
    name: str, run_dir: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write that fails half-way (disk full) must not leave a half-written summary/config."""
    before = (run_dir / name).read_text()
    real = Path.write_text

    def half_then_fail(self: Path, text: str, *a: object, **kw: object) -> int:
        if self.parent == run_dir and name in self.name:
            real(self, text[: len(text) // 2], *a, **kw)  # type: ignore[arg-type]
            raise OSError(28, "No space left on device")
        return real(self, text, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "write_text", half_then_fail)
    with pytest.raises(OSError, match="No space left"):
        _resume(run_dir, tiny_model_dir)
    assert (run_dir / name).read_text() == before


def test_run_state_survives_a_weights_only_round_trip(tmp_path: Path) -> None:
    from treegrpo.training.checkpoint import RunState

    run = RunState.fresh(3, {"eval/success_greedy": 0.25})
    run.rng.random(), run.pick_rng.random(), torch.rand(3, generator=run.gen)
    run.rng.gauss(0, 1)  # leaves a cached second normal in the state (gauss_next)
    run.account(4, 100, 50, 3, 1.5, 2.5)
    run.em_curve.append([100, 0.5])
    torch.save(run.to_state(), tmp_path / "s.pt")
    back = RunState.from_state(torch.load(tmp_path / "s.pt", weights_only=True))
    assert back.rng.getstate() == run.rng.getstate() and back.pick_rng.getstate() == run.pick_rng.getstate()
    assert torch.equal(torch.rand(5, generator=back.gen), torch.rand(5, generator=run.gen))
    assert (back.totals, back.times, back.eval_start, back.em_curve) == (
        {"trajectories": 4, "generated_tokens": 100, "prefill_tokens": 50, "tool_calls": 3},
        {"rollout_s": 1.5, "update_s": 2.5},
        {"eval/success_greedy": 0.25},
        [[100, 0.5]],
    )
    assert isinstance(back.rng, random.Random)
