"""The benches' shared runner (``benchmarks/runner.py``): jobs in this process and in spawned ones,
resume from a result JSON and from a run's done file, atomic writes with the plot beside them,
torch threads restored, the small helpers by hand."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from treegrpo.benchmarks.runner import (
    Shape,
    digest,
    finished_row,
    keep_row,
    option_flags,
    resume_rows,
    run_jobs,
    run_measured,
    spread,
    torch_threads,
    without_timings,
    write_result,
)


@pytest.mark.parametrize("workers", [1, 2])
def test_run_jobs_hands_every_row_to_done_with_its_key(workers: int) -> None:
    got: dict[str, Any] = {}
    jobs = [(f"k{i}", ([("i", i), ("sq", i * i)],)) for i in range(4)]
    run_jobs(
        dict, jobs, workers, lambda key, row: got.__setitem__(key, row)
    )  # dict(pairs): picklable, spawnable
    assert got == {f"k{i}": {"i": i, "sq": i * i} for i in range(4)}


def test_run_jobs_in_order_when_serial() -> None:
    order: list[int] = []
    run_jobs(lambda x: {"x": x}, [(i, (i,)) for i in (3, 1, 2)], 1, lambda k, r: order.append(r["x"]))
    assert order == [3, 1, 2]


def test_resume_keeps_wanted_rows_of_the_same_meta(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    old = {
        "regime": {"a": 1},
        "rows": [{"k": "x"}, {"k": "y"}, {"k": "gone"}],
        "wall_s": 12.5,
        "provenance": {"c": 1},
    }
    out.write_text(json.dumps(old))
    logs: list[str] = []
    prov: dict[str, Any] = {}
    rows, wall = resume_rows(out, {"regime": {"a": 1}}, ["x", "y", "z"], lambda r: r["k"], prov, logs.append)
    assert rows == [{"k": "x"}, {"k": "y"}] and wall == 12.5 and prov == {"resumed_from": {"c": 1}}
    assert logs == [f"resuming: 2 runs already in {out}"]
    prov = {}
    rows, wall = resume_rows(out, {"regime": {"a": 2}}, ["x"], lambda r: r["k"], prov, logs.append, "task")
    assert (rows, wall, prov) == ([], 0.0, {}) and logs[
        -1
    ] == f"[yellow]not resuming[/]: {out} was made with another task"
    assert resume_rows(tmp_path / "none.json", {}, ["x"], lambda r: r["k"], {}, logs.append) == ([], 0.0)


def test_resume_ignores_timings_in_the_meta(tmp_path: Path) -> None:
    """A starting policy bootstrapped again (a new machine, the cache gone) records other wall
    seconds in its warm-up evaluation; the table still resumes. Any other difference refuses."""
    out = tmp_path / "r.json"
    model = {"hash": "abc", "warmup_eval": {"sampled": {"success": 0.5, "wall_s": 0.84}}}
    out.write_text(json.dumps({"models": {"0": model}, "rows": [{"k": "x"}], "wall_s": 3.0}))
    again = {"models": {"0": {"hash": "abc", "warmup_eval": {"sampled": {"success": 0.5, "wall_s": 0.52}}}}}
    rows, wall = resume_rows(out, again, ["x"], lambda r: r["k"], {}, print)
    assert (rows, wall) == ([{"k": "x"}], 3.0)
    other = {"models": {"0": {"hash": "abc", "warmup_eval": {"sampled": {"success": 0.6, "wall_s": 0.84}}}}}
    assert resume_rows(out, other, ["x"], lambda r: r["k"], {}, print) == ([], 0.0)
    assert without_timings([{"wall_s": 1, "n": [{"wall_s": 2, "m": 3}]}]) == [{"n": [{"m": 3}]}]


def test_done_files_are_reused_only_with_the_same_key(tmp_path: Path) -> None:
    done = tmp_path / "run" / "cost.json"
    assert finished_row(done, ["a"]) is None
    keep_row(done, ["a", 1], {"wall_s": 2.0}, field="command")
    assert json.loads(done.read_text()) == {"command": ["a", 1], "row": {"wall_s": 2.0}}
    assert finished_row(done, ["a", 1], field="command") == {"wall_s": 2.0}
    assert finished_row(done, ["a", 2], field="command") is None
    assert finished_row(done, ["a", 1]) is None  # another key field


def test_write_result_is_exact_json_and_draws_beside_it(tmp_path: Path) -> None:
    drawn: list[tuple[Any, Path]] = []
    out = tmp_path / "sub" / "x.json"
    png = write_result(
        out, {"rows": [1, 2], "b": None}, lambda part, p: drawn.append((part, p)), lambda d: d["rows"]
    )
    assert out.read_text() == json.dumps({"rows": [1, 2], "b": None}, indent=1)
    assert png == tmp_path / "sub" / "x.png" and drawn == [([1, 2], png)]
    write_result(out, {"a": 1}, indent=2, newline=True)
    assert out.read_text() == '{\n  "a": 1\n}\n' and [p.name for p in out.parent.iterdir()] == ["x.json"]
    said: list[str] = []
    write_result(out, {}, log=said.append)
    write_result(out, {}, lambda d, p: None, log=said.append)
    assert said == [f"wrote {out}", f"wrote {out} and {png}"]


def test_digest_is_sha256_of_json_then_file_bytes(tmp_path: Path) -> None:
    import hashlib

    (tmp_path / "f").write_bytes(b"xy")
    # '{"a": 1, "b": 2}' (sorted keys), then the file's bytes, hashed in turn
    want = hashlib.sha256(b'{"a": 1, "b": 2}' + b"xy").hexdigest()
    assert digest({"b": 2, "a": 1}, tmp_path / "f") == want[:16]
    assert digest("k", length=10) == hashlib.sha256(b'"k"').hexdigest()[:10]


def test_run_measured_reports_rc_peak_and_log(tmp_path: Path) -> None:
    import sys

    got = run_measured([sys.executable, "-c", "import sys; print('out'); sys.exit(3)"], log=tmp_path / "l.txt")
    assert got["rc"] == 3 and got["peak_rss_gb"] > 0 and got["wall_s"] > 0 and got["stderr"] == ""
    assert (tmp_path / "l.txt").read_text() == "out\n"  # the command's stdout joins its log
    assert run_measured([sys.executable, "-c", "import sys; sys.stderr.write('e')"])["stderr"] == "e"


def test_torch_threads_set_then_restored() -> None:
    before = torch.get_num_threads()
    with torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with torch_threads(None):
        assert torch.get_num_threads() == before


def test_small_helpers_by_hand() -> None:
    assert spread([1.0, 2.0, 6.0]) == {
        "mean": 3.0,
        "min": 1.0,
        "max": 6.0,
        "std": pytest.approx(7**0.5),
        "n": 3,
    }
    assert spread([0.5]) == {"mean": 0.5, "min": 0.5, "max": 0.5, "std": 0.0, "n": 1}
    assert option_flags({"steps": 3, "lr": None, "prompts_per_step": 2}) == " --steps 3 --prompts-per-step 2"
    assert Shape("tree", 4, 2, 2, 1, "random") == Shape("tree", 4, 2, 2, 1, "random")
