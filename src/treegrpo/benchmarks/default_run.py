"""``treegrpo bench default``: the spread of the default run — ``treegrpo train`` with no
arguments — over RL seeds and torch CPU kernel sets, each kernel set from a clean cache of its own.

Why kernel sets: torch picks its CPU kernels by the CPU's capability (``AVX512``, ``AVX2``, or the
unvectorized ``DEFAULT``); float sums then differ in their last bits, so the same versions and the
same recipe bootstrap a slightly different tiny agent on another machine, and the run goes
elsewhere from there. ``ATEN_CPU_CAPABILITY`` forces a lower set than the CPU's, which stands in
for another machine on this one. Each kernel set gets its own cache folder (``TREEGRPO_CACHE``),
so its first run bootstraps its own agent, as on a fresh machine (the cache key does not hold the
kernel set).

Every run is ``treegrpo train --seed S --out-dir WORK/<kernels>-s<S>``, nothing else given, in a
process of its own (one torch thread: the default), its output in ``WORK/<kernels>-s<S>.log``.
The first run of each kernel set goes first (it bootstraps; the others reuse its cache). A run
folder that holds a finished run made the same way (its ``launch.json``) is kept, so a session
can be carried on. The results JSON holds one *spread* per ``--label`` (another label's spread
in the file is kept): every run's start and end held-out success (sampled, greedy), its curve,
its wall time and its bootstrap, with the code and versions that made them.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import treegrpo
from treegrpo.benchmarks.provenance import library_versions, model_hash, source_commit, torch_machine
from treegrpo.benchmarks.runner import Log, spread, write_result
from treegrpo.errors import ConfigError
from treegrpo.io import atomic_write_json
from treegrpo.training.metrics import read_metrics

#: What each kernel set needs from the CPU (``/proc/cpuinfo`` flags); ``native`` is the CPU's own
#: choice (no ``ATEN_CPU_CAPABILITY``), ``default`` the unvectorized kernels every CPU runs.
KERNEL_FLAGS: dict[str, tuple[str, ...]] = {
    "native": (),
    "default": (),
    "avx2": ("avx2", "fma"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
}
#: The fields of a run's config that vary per run of a spread (the rest is the default's).
PER_RUN = ("seed", "out_dir")
WHAT = (
    "treegrpo train with no arguments: held-out success at the start and the end over RL seeds x torch CPU "
    "kernel sets, each kernel set from a clean cache (its own bootstrap)"
)
#: What every run of a spread shares, kept once for the spread (:func:`spread_doc`).
SHARED = ("config", "code", "bootstrap_config")
#: The figures of one evaluation, as a row holds them.
EVAL_KEYS = {"sampled": "eval/success_sampled", "greedy": "eval/success_greedy", "tool_calls": "eval/tool_calls_sampled"}


def cpu_flags() -> set[str]:
    """This CPU's feature flags (``/proc/cpuinfo``; empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {f for line in text.splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split()}


def check_kernels(kernels: Sequence[str]) -> None:
    """A :class:`ConfigError` for a kernel set that is unknown or that this CPU cannot run (torch
    would die on an illegal instruction)."""
    if not kernels or len(set(kernels)) != len(kernels):
        raise ConfigError(f"--kernels {','.join(kernels)!r}: give distinct names, e.g. --kernels native,default")
    unknown = [k for k in kernels if k not in KERNEL_FLAGS]
    if unknown:
        raise ConfigError(f"unknown kernel set(s) {', '.join(unknown)}; choose from {', '.join(KERNEL_FLAGS)}")
    flags = cpu_flags()
    if platform.machine().lower() not in ("x86_64", "amd64"):
        lacking = [k for k in kernels if KERNEL_FLAGS[k]]
    else:
        lacking = [k for k in kernels if not set(KERNEL_FLAGS[k]) <= flags]
    if lacking:
        raise ConfigError(f"this CPU cannot run the {', '.join(lacking)} kernels; choose from native, default")


def run_dir(work: Path, kernels: str, seed: int) -> Path:
    return Path(work) / f"{kernels}-s{seed}"


def run_env(work: Path, kernels: str, source: Path | None = None) -> dict[str, str]:
    """The variables a run of ``kernels`` sets: its own cache folder, the forced kernel set, and
    ``PYTHONPATH`` when the runs import ``source``'s ``src/`` instead of this package."""
    env = {"TREEGRPO_CACHE": str(Path(work) / f"cache-{kernels}")}
    if kernels != "native":
        env["ATEN_CPU_CAPABILITY"] = kernels
    if source is not None:
        env["PYTHONPATH"] = str(Path(source) / "src")
    return env


def train_command(seed: int, out_dir: Path) -> list[str]:
    """The default run: only the seed and the output folder are given."""
    return [sys.executable, "-m", "treegrpo", "train", "--seed", str(seed), "--out-dir", str(out_dir)]


def torch_kernels(env: dict[str, str]) -> str:
    """The kernel set torch reports under ``env`` (``torch.backends.cpu.get_cpu_capability()``)."""
    code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    res = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True)
    return res.stdout.strip() or f"error: {res.stderr.strip().splitlines()[-1:]}"


def source_provenance(source: Path | None = None) -> dict[str, Any]:
    """The commit (and whether it was dirty) of the code the runs import, its version and the
    library versions."""
    pkg = Path(source) / "src" / "treegrpo" if source is not None else Path(treegrpo.__file__).resolve().parent
    commit, dirty = source_commit(pkg)
    return {"commit": commit, "dirty": dirty, "treegrpo": treegrpo.__version__, "versions": library_versions()}


def launch_record(work: Path, kernels: str, seed: int, source: Path | None = None) -> dict[str, Any]:
    """What ``launch.json`` holds about how a run was started: the exact command with its
    variables (shell-quoted), the kernel set torch reported under them, the code and versions."""
    out = run_dir(work, kernels, seed)
    env = run_env(work, kernels, source)
    argv = train_command(seed, out)
    cached = sorted(p.parent.name for p in (Path(env["TREEGRPO_CACHE"]) / "models").glob("*/treegrpo_tiny.json"))
    return {
        "seed": seed,
        "kernels": kernels,
        "torch_kernels": torch_kernels(env),
        "cached_agents": cached,  # what the cache held before the run (none: the run bootstraps)
        "command": shlex.join(["env", *(f"{k}={v}" for k, v in env.items()), "python", *argv[1:]]),
        "env": env,
        **source_provenance(source),
    }


# Runs under a run's own variables (its kernels, the code it ran): the held-out evaluation of the
# run's start and end models, as the trainer evaluates (its config, one chain per question, greedy
# and sampled from the evaluation stream), success summed per question chain.
_BY_CHAIN = """
import dataclasses, json, random, sys
import torch
from treegrpo.rollout.agent import StepRunner
from treegrpo.rollout.engine import make_engine
from treegrpo.rollout.samplers import SamplerConfig, get_sampler
from treegrpo.training.config import make_config
from treegrpo.training.evaluate import EVAL_SEED
from treegrpo.training.setup import build_run

run, out, models = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
torch.set_num_threads(1)
skip = ("out_dir", "resume", "resume_override")
base = {k: v for k, v in json.load(open(run + "/config.json")).items() if k not in skip}
res = {}
for when, model in models.items():
    parts = build_run(make_config({**base, "model": model}))
    engine = make_engine("hf", parts.model, parts.tokenizer)
    res[when] = {}
    for mode, temp in (("greedy", 0.0), ("sampled", 1.0)):
        cfg = dataclasses.replace(parts.agent_cfg, temperature=temp, top_p=1.0)
        runner = StepRunner(engine, parts.env, parts.tokenizer, cfg)
        chains = get_sampler("chain")(runner, parts.eval_tasks, SamplerConfig("chain", group_size=1),
                                      random.Random(EVAL_SEED), torch.Generator().manual_seed(EVAL_SEED))
        by = {}
        for task, forest in zip(parts.eval_tasks, chains.forests):
            for _, leaf in forest.leaves():
                k = by.setdefault("/".join(task.meta["relations"]), [0.0, 0])
                k[0] += float(leaf.reward or 0.0)
                k[1] += 1
        res[when][mode] = by
json.dump(res, open(out, "w"), indent=1)
"""


def start_model(folder: Path) -> Path:
    """The model a finished run started from: its ``--model``, else (the default run) the agent
    its kernel set's cache bootstrapped."""
    if (given := json.loads((Path(folder) / "config.json").read_text()).get("model")) is not None:
        return Path(given)
    launch = json.loads((Path(folder) / "launch.json").read_text())
    boot = json.loads((Path(folder) / "checkpoint" / "treegrpo_tiny.json").read_text())
    return Path(launch["env"]["TREEGRPO_CACHE"]) / "models" / f"{boot['config']['preset']}-{boot['config_hash']}"


def ensure_by_chain(folder: Path) -> dict[str, Any]:
    """A finished run's held-out success per question chain at its start and its end
    (``by_chain.json`` in its folder, made once): ``{"start"|"end": {"greedy"|"sampled": {chain:
    [successes, questions]}}}``, re-evaluated under the run's own variables with its config, so the
    sums are the run's own start and end figures."""
    folder = Path(folder)
    out = folder / "by_chain.json"
    if not out.is_file():
        launch = json.loads((folder / "launch.json").read_text())
        models = {"start": str(start_model(folder)), "end": str(folder / "checkpoint")}
        tmp = folder / "by_chain.json.tmp"
        res = subprocess.run(
            [sys.executable, "-c", _BY_CHAIN, str(folder), str(tmp), json.dumps(models)],
            env={**os.environ, **launch["env"]}, capture_output=True, text=True,
        )  # fmt: skip
        if res.returncode != 0:
            raise RuntimeError(f"the per-chain evaluation of {folder.name} failed: {res.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    return json.loads(out.read_text())


def _eval_of(ev: dict[str, float]) -> dict[str, float]:
    return {k: ev[name] for k, name in EVAL_KEYS.items()}


def collect_run(folder: Path) -> dict[str, Any]:
    """One finished run's row: how it was launched, its held-out start and end, its curve
    (``[step, sampled, greedy, tool calls]`` at every evaluation), its cost and its bootstrap."""
    folder = Path(folder)
    launch = json.loads((folder / "launch.json").read_text())
    summary = json.loads((folder / "summary.json").read_text())
    config = json.loads((folder / "config.json").read_text())
    boot = json.loads((folder / "checkpoint" / "treegrpo_tiny.json").read_text())
    model = Path(launch["env"]["TREEGRPO_CACHE"]) / "models" / f"{boot['config']['preset']}-{boot['config_hash']}"
    bootstrapped = model.name not in launch["cached_agents"]  # then the run's wall includes the bootstrap
    metrics = read_metrics(folder / "metrics.jsonl")
    curve = [[int(r["step"]), *(r[name] for name in EVAL_KEYS.values())] for r in metrics if "eval/success_greedy" in r]
    step_cpu = sum(r.get("time/rollout_cpu_s", 0.0) + r.get("time/update_cpu_s", 0.0) for r in metrics)
    return {
        "seed": launch["seed"],
        "kernels": launch["kernels"],
        "torch_kernels": launch["torch_kernels"],
        "start": _eval_of(summary["eval_start"]),
        "end": _eval_of(summary["eval_end"]),
        "curve": curve,
        "wall_s": summary["wall_s"],
        "train_wall_s": summary["wall_s"] - (boot["timings"]["total_s"] if bootstrapped else 0.0),
        "step_cpu_s": step_cpu,  # CPU seconds of the steps' rollouts and updates (not the evaluations)
        "rollout_s": summary["rollout_s"],
        "update_s": summary["update_s"],
        "trajectories": summary["trajectories"],
        "generated_tokens": summary["generated_tokens"],
        "tool_calls_per_trajectory": summary["tool_calls_per_trajectory"],
        "trajectories_per_1k_tokens": summary["trajectories_per_1k_tokens"],
        "bootstrap": {
            "model": model.name,
            "built_by_this_run": bootstrapped,
            "model_hash": model_hash(model) if model.is_dir() else None,
            "warmup_success_sampled": boot["warmup_eval"]["sampled"]["success"],
            "warmup_success_greedy": boot["warmup_eval"]["greedy"]["success"],
            "wall_s": boot["timings"]["total_s"],
        },
        "by_chain": json.loads((folder / "by_chain.json").read_text()) if (folder / "by_chain.json").is_file() else None,
        "command": launch["command"],
        "code": {k: launch[k] for k in ("commit", "dirty", "treegrpo", "versions")},
        "config": {k: v for k, v in config.items() if k not in PER_RUN},
        "bootstrap_config": boot["config"],
    }


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Mean, sd, min and max over the runs of the start and end held-out success (sampled,
    greedy), of the training's wall time (the bootstrap left out) and of its steps' CPU seconds
    (a shared machine stretches the wall, much less the CPU time); with every run's ``by_chain``,
    ``by_final_relation``: the spread of the start's and the end's sampled success per final
    relation of the questions (:func:`by_final`); ``end_sampled_range``: the spread max − min of the end."""
    out: dict[str, Any] = {
        f"{when}_{mode}": spread(r[when][mode] for r in rows) for when in ("start", "end") for mode in ("sampled", "greedy")
    }
    if all(r.get("by_chain") for r in rows):  # held-out success per final relation, start and end
        finals = sorted({c.rsplit("/", 1)[-1] for r in rows for c in r["by_chain"]["end"]["sampled"]})
        out["by_final_relation"] = {
            rel: {when: spread(by_final(r, when)[rel] for r in rows) for when in ("start", "end")} for rel in finals
        }
    out["train_wall_s"] = spread(r["train_wall_s"] for r in rows)
    out["step_cpu_s"] = spread(r["step_cpu_s"] for r in rows)
    out["end_sampled_range"] = out["end_sampled"]["max"] - out["end_sampled"]["min"]
    return out


def by_final(row: dict[str, Any], when: str, mode: str = "sampled") -> dict[str, float]:
    """A row's held-out success at ``when`` (start, end) per final relation of the question chain
    (``ruled_by``: the questions that ask for a ruler)."""
    sums: dict[str, list[float]] = {}
    for chain, (ok, n) in row["by_chain"][when][mode].items():
        acc = sums.setdefault(chain.rsplit("/", 1)[-1], [0.0, 0])
        acc[0] += ok
        acc[1] += n
    return {rel: ok / n for rel, (ok, n) in sums.items()}


def plan(
    seeds: Sequence[int], kernels: Sequence[str], other_seeds: Sequence[int] | None = None
) -> list[tuple[str, int]]:
    """The runs: ``seeds`` on the first kernel set, ``other_seeds`` (default: ``seeds``) on the
    others; the first seed of every kernel set first (each bootstraps its set's cache)."""
    per = {k: list(seeds if i == 0 or other_seeds is None else other_seeds) for i, k in enumerate(kernels)}
    firsts = [(k, per[k][0]) for k in kernels]
    rest = [(k, s) for i in range(1, max(map(len, per.values()))) for k in kernels if i < len(per[k]) for s in [per[k][i]]]
    return firsts + rest


def _finished(folder: Path, launch: dict[str, Any]) -> bool:
    """``folder`` holds a finished run launched exactly as ``launch`` says."""
    try:
        old = json.loads((folder / "launch.json").read_text())
    except (OSError, ValueError):
        return False
    same = {k: old.get(k) for k in ("command", "commit", "dirty")} == {k: launch[k] for k in ("command", "commit", "dirty")}
    return same and (folder / "summary.json").is_file() and (folder / "checkpoint" / "treegrpo_tiny.json").is_file()


def _run_one(work: Path, kernels: str, seed: int, source: Path | None, log: Log) -> None:
    folder = run_dir(work, kernels, seed)
    launch = launch_record(work, kernels, seed, source)
    if _finished(folder, launch):
        log(f"kept {folder.name} (finished earlier)")
        ensure_by_chain(folder)
        return
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_json(folder / "launch.json", launch)
    log(f"run {folder.name}: {launch['command']}")
    with (Path(work) / f"{folder.name}.log").open("w") as fh:
        rc = subprocess.run(
            train_command(seed, folder), env={**os.environ, **launch["env"]}, stdout=fh, stderr=subprocess.STDOUT
        ).returncode
    if rc != 0:
        raise RuntimeError(f"run {folder.name} failed (exit status {rc}); its output: {work}/{folder.name}.log")
    ensure_by_chain(folder)
    log(f"done {folder.name}")


def run_spread(
    work: Path,
    seeds: Sequence[int],
    kernels: Sequence[str],
    jobs: int = 2,
    source: Path | None = None,
    log: Log = print,
    other_seeds: Sequence[int] | None = None,
) -> list[dict[str, Any]]:
    """Run (or keep) every run of :func:`plan` in ``work``, ``jobs`` at a time (the kernel sets'
    first runs before the others start), and return their rows."""
    check_kernels(kernels)
    todo = plan(seeds, kernels, other_seeds)
    firsts, rest = todo[: len(kernels)], todo[len(kernels) :]
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for batch in (firsts, rest):  # every kernel set bootstrapped before its other seeds run
            for fut in [pool.submit(_run_one, Path(work), k, s, source, log) for k, s in batch]:
                fut.result()
    return [collect_run(run_dir(work, k, s)) for k, s in sorted(todo, key=lambda ks: (kernels.index(ks[0]), ks[1]))]


def spread_doc(rows: Sequence[dict[str, Any]], about: str, command: str) -> dict[str, Any]:
    """One spread of the results JSON: what it is, what every run shares (:data:`SHARED`: the
    train config but for the seed, the code and versions, the bootstrap recipe), the rows without
    those, their summary and the provenance (``command``: the bench's own). Refused when the runs
    differ in one of the shared parts."""
    if not rows:
        raise ConfigError("a spread needs at least one run")
    for what in SHARED:
        if len({json.dumps(r[what], sort_keys=True) for r in rows}) != 1:
            raise ConfigError(f"the runs of a spread must share their {what} (but for the seed): they differ")
    return {
        "about": about,
        "config": rows[0]["config"],
        "bootstrap_config": rows[0]["bootstrap_config"],
        "rows": [{k: v for k, v in r.items() if k not in SHARED} for r in rows],
        "summary": summarize(rows),
        # the machine (its CPU model, its own kernel set; each row's torch_kernels is what it ran) and
        # the runs' torch threads (their config's)
        "provenance": {"command": command, **rows[0]["code"], **torch_machine(rows[0]["config"].get("threads") or 1)},
    }


def write_spread(
    out: Path,
    label: str,
    rows: Sequence[dict[str, Any]],
    about: str,
    command: str,
    headline: bool = True,
    plot: Callable[[Any, Path], None] | None = None,
    log: Log | None = None,
) -> dict[str, Any]:
    """Put the spread ``label`` into the results JSON ``out`` (the file's other spreads are kept)
    and, with ``headline``, make it the one the README shows."""
    doc: dict[str, Any] = json.loads(Path(out).read_text()) if Path(out).is_file() else {}
    if "spreads" not in doc:  # a file of the older one-run format holds no spread to keep
        doc = {}
    doc["what"] = WHAT
    doc.setdefault("spreads", {})
    doc["spreads"][label] = spread_doc(rows, about, command)
    if headline or "headline" not in doc:
        doc["headline"] = label
    write_result(out, doc, plot=plot, log=log)
    return doc


def plot_spreads(doc: dict[str, Any], png: Path) -> None:
    """One panel per spread: every run's held-out success (sampled, T=1) against the RL step, a
    colour per kernel set."""
    from treegrpo.benchmarks.runner import pyplot, save_figure

    plt = pyplot()
    spreads = doc["spreads"]
    fig, axes = plt.subplots(1, len(spreads), figsize=(5.5 * len(spreads), 4), sharey=True, squeeze=False)
    for ax, (label, sp) in zip(axes[0], spreads.items(), strict=True):
        kernels = sorted({r["kernels"] for r in sp["rows"]})
        for r in sp["rows"]:
            steps, sampled = [c[0] for c in r["curve"]], [c[1] for c in r["curve"]]
            ax.plot(steps, sampled, color=f"C{kernels.index(r['kernels'])}", alpha=0.7, marker=".")
        for i, k in enumerate(kernels):  # "native" is the measuring CPU's own set: name it
            ran = sorted({str(r["torch_kernels"]) for r in sp["rows"] if r["kernels"] == k})
            ax.plot([], [], color=f"C{i}", label=f"{k} kernels ({', '.join(ran)})")
        e = sp["summary"]["end_sampled"]
        ax.set_title(f"{label}: end {e['mean']:.2f} ± {e['std']:.2f} ({e['n']} runs)")
        ax.set_xlabel("RL step")
        ax.axhline(0.8, color="grey", lw=0.8, ls="--")
        ax.legend(loc="lower right")
    axes[0][0].set_ylabel("held-out success, sampled T=1")
    axes[0][0].set_ylim(0, 1)
    save_figure(fig, png)


def figure(summary: dict[str, Any], mode: str = "sampled") -> str:
    """The README's figure of a spread: ``0.242–0.328 → 0.852–0.922 (0.89 ± 0.03)`` —
    the start's range, the end's range (one value where every run had it), the end's mean ± sd."""
    s, e = summary[f"start_{mode}"], summary[f"end_{mode}"]

    def span(x: dict[str, float]) -> str:
        return f"{x['min']:.3f}" if f"{x['min']:.3f}" == f"{x['max']:.3f}" else f"{x['min']:.3f}–{x['max']:.3f}"

    return f"{span(s)} → {span(e)} ({e['mean']:.2f} ± {e['std']:.2f})"


__all__ = [
    "EVAL_KEYS",
    "KERNEL_FLAGS",
    "by_final",
    "check_kernels",
    "collect_run",
    "cpu_flags",
    "ensure_by_chain",
    "figure",
    "launch_record",
    "plan",
    "run_dir",
    "run_env",
    "run_spread",
    "source_provenance",
    "spread_doc",
    "start_model",
    "summarize",
    "torch_kernels",
    "train_command",
    "write_spread",
]
