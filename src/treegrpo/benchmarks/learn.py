"""``treegrpo bench learn``: the paper's budget table in miniature — chain GRPO vs Tree-GRPO trained
from one starting policy at matched, measured budgets; ``--gigpo``: GiGPO beside them.

What each table runs, how runs are paired and how held-out EM is measured is written once, in
``benchmarks/README.md`` (sections ``bench learn`` and ``bench learn --gigpo``); the runs, the
regimes and the row keys are :mod:`.learn_spec`, the analysis :mod:`.learn_report`, the plots and
tables :mod:`.learn_plots`. This module runs them: one bootstrapped model per world
(``ensure_bootstrapped(preset, world_seed)``; ``--task sql``: the cached SQL agent), its held-out
evaluation shared by every run (:func:`start_eval`), every configuration trained by the one
trainer loop (:func:`treegrpo.training.trainer.train`) in a process of its own (``--jobs``), the
result JSON rewritten atomically after every finished run so ``--resume`` carries on from it.
Rows have exactly :data:`ROW_KEYS` (``--gigpo``: :data:`GIGPO_ROW_KEYS`, with GiGPO's anchor
diagnostic measured on the rollouts each run dumps, :func:`treegrpo.algos.gigpo.shared_anchor_stats`).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from treegrpo.benchmarks.learn_spec import (
    ABLATION,
    ABLATION_BUDGET,
    BUDGETS,
    EXPAND_MODES,
    GIGPO_BUDGETS,
    GIGPO_ROW_KEYS,
    QUICK_BUDGETS,
    REGIMES,
    ROW_KEYS,
    SQL_REGIME,
    TASKS,
    TOKEN_EXPAND_MODES,
    TOKEN_ROW_KEYS,
    Regime,
    RunSpec,
    plan_gigpo,
    plan_runs,
    plan_token_runs,
    spec_of,
)
from treegrpo.benchmarks.runner import make_console, option_flags, resume_rows, run_jobs, write_result

_PARTS: dict[tuple[str, str, Any], Any] = {}


def base_config(task: str, regime: Regime, model_dir: Path, world_seed: int, out_dir: str, dump: int = 0) -> dict[str, Any]:
    """Every run's config fields but the configuration's own (sampler, shape, advantage, seed);
    ``dump``: rollouts dumped every so many steps (0: none)."""
    where = {"preset": regime.preset, "world_seed": world_seed} if task == "search" else {"task": task}
    return {
        "model": str(model_dir), **where, "steps": regime.steps, "prompts_per_step": regime.prompts_per_step,
        "lr": regime.lr, "eval_every": regime.eval_every, "eval_prompts": regime.eval_prompts, "eval_sampled": True,
        "save_every": 0, "dump_rollouts_every": dump, "tensorboard": False, "threads": 1, "out_dir": out_dir,
        "gigpo_anchor": "state",  # the GiGPO table's exact anchors: the context, the SQL state (its README)
    }  # fmt: skip


def _parts(cfg: Any, cache: dict[tuple[str, str, Any], Any] = _PARTS) -> Any:
    """Run parts with a freshly loaded model; the world, env and questions are built once per
    ``cache`` (default: this process), model, task and world."""
    from treegrpo.models.loader import load_model
    from treegrpo.training.setup import build_run

    key = (str(cfg.model), cfg.task, cfg.world_seed)
    if key not in cache:
        cache[key] = build_run(cfg)
        return cache[key]
    cached = cache[key]
    return dataclasses.replace(cached, model=load_model(cached.model_dir).to(cfg.device))


def start_eval(task: str, regime: Regime, model_dir: Path, world_seed: int) -> dict[str, float]:
    """The starting policy's held-out evaluation (deterministic: every run of the world shares it)."""
    from treegrpo.rollout.agent import StepRunner
    from treegrpo.rollout.engine import make_engine
    from treegrpo.training.config import make_config
    from treegrpo.training.evaluate import evaluate

    cfg = make_config(base_config(task, regime, model_dir, world_seed, "unused"))
    parts = _parts(cfg)
    engine = make_engine("hf", parts.model, parts.tokenizer, device=cfg.device)
    return evaluate(StepRunner(engine, parts.env, parts.tokenizer, parts.agent_cfg), parts.eval_tasks, sampled=True)


def train_row(spec: RunSpec, s: Any) -> dict[str, Any]:
    """A finished run's figures (``s``: the trainer's summary), in :data:`ROW_KEYS` order, then
    those of :data:`TOKEN_ROW_KEYS` (``tool_curve``: the same evaluations against tool calls)."""
    start, end = s.eval_start, s.eval_end
    return {
        "mode": spec.mode, "budget": spec.budget, "M": spec.m, "N": spec.n, "L": spec.l,
        "expand_mode": spec.expand_mode, "advantage": spec.advantage, "seed": spec.seed, "world_seed": spec.world_seed,
        "em_start": start["eval/success_sampled"], "em_end": end["eval/success_sampled"],
        "em_greedy_end": end["eval/success_greedy"], "em_curve": [[int(p[0]), float(p[1])] for p in s.em_curve],
        "generated_tokens": s.generated_tokens, "tool_calls": s.tool_calls, "trajectories": s.trajectories,
        "tool_calls_per_traj_start": start["eval/tool_calls_sampled"],
        "tool_calls_per_traj_end": end["eval/tool_calls_sampled"], "wall_s": round(s.wall_s, 2),
        "budget_tokens": spec.budget_tokens, "eval_every_tokens": spec.eval_every_tokens,
        "tool_curve": [[int(p[2]), float(p[1])] for p in s.em_curve if len(p) > 2],
        "em_greedy_start": start["eval/success_greedy"],
    }  # fmt: skip


def train_one(
    spec: RunSpec, task: str, regime: Regime, model_dir: Path, eval_start: dict[str, float] | None, gigpo: bool = False,
    cache: dict[tuple[str, str, Any], Any] = _PARTS,
) -> tuple[Any, dict[str, Any]]:  # fmt: skip
    """Train one configuration (one torch thread, a temporary run folder); the trainer's summary
    and every figure of its row (:func:`train_row`; with ``gigpo`` the rollouts dumped and GiGPO's
    anchor diagnostic measured on them)."""
    import torch
    from rich.console import Console

    from treegrpo.training.config import make_config
    from treegrpo.training.trainer import train

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix=f"treegrpo-bench-{'gigpo' if gigpo else 'learn'}-") as tmp:
        cfg = make_config({**base_config(task, regime, model_dir, spec.world_seed, tmp, int(gigpo)), **spec.overrides()})
        s = train(cfg, console=Console(quiet=True), parts=_parts(cfg, cache), eval_start=eval_start)
        row = train_row(spec, s)
        if gigpo:
            from treegrpo.algos.gigpo import shared_anchor_stats
            from treegrpo.tree import read_forests

            a = shared_anchor_stats([f for p in sorted((Path(tmp) / "rollouts").glob("step_*.jsonl")) for f in read_forests(p)])
            row.update(task=task, anchor_steps=int(a["steps"]), anchor_shared_frac=a["shared_frac"],
                       anchor_deep_shared_frac=a["deep_shared_frac"], anchor_group_size=a["group_size"])  # fmt: skip
    return s, row


def run_one(
    spec: RunSpec, regime: Regime, model_dir: Path, eval_start: dict[str, float], task: str = "search", gigpo: bool = False
) -> dict[str, Any]:
    """Train one configuration; its row (:data:`ROW_KEYS`; with ``gigpo`` :data:`GIGPO_ROW_KEYS`)."""
    _, row = train_one(spec, task, regime, model_dir, eval_start, gigpo)
    keys = GIGPO_ROW_KEYS if gigpo else TOKEN_ROW_KEYS if spec.budget_tokens or spec.eval_every_tokens else ROW_KEYS
    return {k: row[k] for k in keys}


def _tuned(reg: Regime, changes: dict[str, Any]) -> Regime:
    reg = dataclasses.replace(reg, **{k: v for k, v in changes.items() if v is not None})
    return dataclasses.replace(reg, eval_every=min(reg.eval_every, reg.steps))


def _run_table(
    out: Path, bench: str, title: str, specs: list[RunSpec], rows: list[dict[str, Any]], wall0: float,
    head: dict[str, Any], analysis: Callable[[list[dict[str, Any]]], dict[str, Any]],
    job: Callable[[RunSpec], tuple[Any, ...]], line: Callable[[RunSpec, dict[str, Any], int], str],
    command: str, jobs: int, prov: dict[str, Any], console: Any, progress: bool,
) -> dict[str, Any]:  # fmt: skip
    """Run the specs not yet in ``rows`` (``run_one(*job(spec))``, ``jobs`` in parallel), writing
    the document after every finished run and once complete (JSON and plot). ``wall0``: the
    ``perf_counter`` the bench's wall time counts from, less the seconds of the kept rows."""
    from treegrpo.benchmarks import learn_tokens
    from treegrpo.benchmarks.learn_plots import plot, plot_gigpo, print_gigpo_table, print_table

    draw, show = {"learn_gigpo": (plot_gigpo, print_gigpo_table), "learn_tokens": (learn_tokens.plot, learn_tokens.print_table)}.get(
        bench, (plot, print_table))  # fmt: skip

    done = {spec_of(r).key for r in rows}
    todo = [s for s in specs if s.key not in done]
    order = {s.key: i for i, s in enumerate(specs)}

    def result_of(complete: bool) -> dict[str, Any]:
        ordered = sorted(rows, key=lambda r: order.get(spec_of(r).key, 1 << 30))
        return {
            "bench": bench, **head, "complete": complete, "rows": ordered, **analysis(ordered), "command": command,
            "wall_s": round(time.perf_counter() - wall0, 1),  # all sessions of a resumed run
            "jobs": jobs, "cpu_count": os.cpu_count(), "provenance": prov,
        }  # fmt: skip

    console.print(title.format(todo=len(todo), all=len(specs)))
    bar = None
    if progress:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console)
        bar.start()
        task = bar.add_task("runs", total=len(specs), completed=len(rows))

    def finished(spec: RunSpec, row: dict[str, Any]) -> None:
        rows.append(row)
        write_result(out, result_of(False))
        if bar is not None:
            bar.advance(task)
        (bar.console if bar is not None else console).print(line(spec, row, len(rows)))

    try:
        run_jobs(run_one, [(s, job(s)) for s in todo], jobs, finished)
    finally:
        if bar is not None:
            bar.stop()
    result = result_of(True)
    write_result(out, result, draw)
    show(result, console)
    name = {"learn_gigpo": "bench learn --gigpo", "learn_tokens": "bench learn --matched tokens"}.get(bench, "bench learn")
    console.print(f"[bold]{name}[/]: wrote {out} and {out.with_suffix('.png')} in {result['wall_s']:.0f}s")
    return result


def run_bench(
    out: Path, regime: str = "default", quick: bool = False, world_seeds: Sequence[int] | None = None, seeds: int = 3,
    jobs: int = 2, steps: int | None = None, lr: float | None = None, prompts_per_step: int | None = None,
    eval_every: int | None = None, expand_modes: Sequence[str] | None = None, budgets: Sequence[int] | None = None,
    resume: bool = False, console: Any = None, matched: str = "nominal",
) -> dict[str, Any]:  # fmt: skip
    """The whole benchmark (module docstring); writes ``out`` (JSON) and ``out`` with ``.png``.
    ``matched``: ``nominal`` (the trees at the paper's shapes) or ``tokens`` (the token-matched
    trees, :func:`~treegrpo.benchmarks.learn_spec.plan_token_runs`, analysed at equal cost)."""
    from treegrpo.benchmarks.equal_cost import analyse
    from treegrpo.benchmarks.learn_report import summarize, targets
    from treegrpo.benchmarks.provenance import provenance
    from treegrpo.models.loader import tiny_info
    from treegrpo.tasks.world.bootstrap import ensure_bootstrapped
    from treegrpo.tasks.world.world import get_preset

    console = console or make_console()
    if regime not in REGIMES:
        raise ValueError(f"unknown regime {regime!r}; choose one of {sorted(REGIMES)}")
    changes = {"steps": steps, "lr": lr, "prompts_per_step": prompts_per_step, "eval_every": eval_every}
    reg = _tuned(REGIMES[regime], changes)
    if matched not in ("nominal", "tokens"):
        raise ValueError(f"unknown matching {matched!r}; choose nominal or tokens")
    tokens = matched == "tokens"
    default_modes = TOKEN_EXPAND_MODES if tokens else EXPAND_MODES
    expand_modes = tuple(expand_modes) if expand_modes else default_modes
    for mode in expand_modes:
        if mode not in EXPAND_MODES:
            raise ValueError(f"unknown expand mode {mode!r}; choose from {list(EXPAND_MODES)}")
    worlds = list(world_seeds) if world_seeds else [get_preset(reg.preset).seed]
    budgets = tuple(budgets) if budgets else QUICK_BUDGETS if quick else BUDGETS
    plan = plan_token_runs if tokens else plan_runs
    specs = plan(budgets, list(range(seeds)), worlds, expand_modes)
    t0 = time.perf_counter()
    models: dict[int, Path] = {}
    starts: dict[int, dict[str, float]] = {}
    for w in worlds:
        console.print(f"[bold]bench learn[/] world {w}: starting policy (bootstrapped and cached on first use)")
        models[w] = ensure_bootstrapped(reg.preset, world_seed=w)
        starts[w] = start_eval("search", reg, models[w], w)
        console.print(
            f"  {models[w].name}: held-out sampled {starts[w]['eval/success_sampled']:.3f} · greedy "
            f"{starts[w]['eval/success_greedy']:.3f} · tool calls/traj {starts[w]['eval/tool_calls_sampled']:.2f}"
        )
    meta = {
        "regime": dataclasses.asdict(reg),
        "models": {str(w): bootstrap_record(p) if tokens else {"folder": str(p), "config_hash": tiny_info(p).get("config_hash")}
                   for w, p in models.items()},
        **({"matched": "tokens", "eval_every_tokens_per_budget": specs[0].eval_every_tokens // specs[0].budget} if tokens else {}),
    }
    prov = provenance(model_dir={str(w): p for w, p in models.items()}, threads=1)  # every row trains on one thread
    rows, prior = resume_rows(out, same_start({**meta, "provenance": prov}), (s.key for s in specs), lambda r: spec_of(r).key,
                              prov, console.print, identity=same_start) if resume else ([], 0.0)  # fmt: skip
    command = (
        f"treegrpo bench learn --regime {regime}{' --quick' if quick else ''}{' --matched tokens' if tokens else ''} "
        f"--world-seed {','.join(map(str, worlds))} --seeds {seeds} --jobs {jobs}" + option_flags(changes)
        + (f" --expand-modes {','.join(expand_modes)}" if tuple(expand_modes) != default_modes else "")
        + (f" --budgets {','.join(map(str, budgets))}" if budgets not in (QUICK_BUDGETS, BUDGETS) else "")
        + f" --out {out}"
    )  # fmt: skip
    head = {**meta, "quick": quick, "budgets": list(budgets), "expand_modes": list(expand_modes),
            "seeds": list(range(seeds)), "world_seeds": worlds, "start": {str(w): starts[w] for w in worlds}}  # fmt: skip
    title = (f"[bold]bench learn[/] regime {reg.name}: {{todo}} runs to go ({{all}} in all), "
             f"{reg.steps} steps × {reg.prompts_per_step} prompts, lr {reg.lr}, {jobs} worker(s)")  # fmt: skip

    def line(spec: RunSpec, row: dict[str, Any], n: int) -> str:
        return (f"  {spec.key:48s} EM {row['em_start']:.3f} → {row['em_end']:.3f} (greedy {row['em_greedy_end']:.3f}) · "
                f"gen tok {row['generated_tokens']} · tools/traj {row['tool_calls_per_traj_end']:.2f} · {row['wall_s']:.0f}s")  # fmt: skip

    def analysis(o: list[dict[str, Any]]) -> dict[str, Any]:
        if tokens:
            return {"summary": summarize(o) if o else {}, "equal_cost": analyse(o, expand_modes) if o else {}}
        return {"summary": summarize(o) if o else {}, "targets": targets(o) if o else {},
                "equal_cost": analyse(o, expand_modes, tokens=False) if o else {}}  # fmt: skip

    return _run_table(
        Path(out), "learn_tokens" if tokens else "learn", title, specs, rows, t0 - prior, head, analysis,
        lambda s: (s, reg, models[s.world_seed], starts[s.world_seed]), line, command, jobs, prov, console, True,
    )  # fmt: skip


def restate_at_equal_cost(path: Path) -> dict[str, Any]:
    """Add ``equal_cost`` (:func:`~treegrpo.benchmarks.equal_cost.analyse`, the nominal trees read
    off their EM curves at the chain's tokens) to a finished nominal ``bench learn`` result, its rows
    unchanged; ``equal_cost_restated`` records the commit that did it. Returns the document."""
    import json

    from treegrpo.benchmarks.equal_cost import analyse
    from treegrpo.benchmarks.provenance import provenance

    doc = json.loads(Path(path).read_text())
    if doc.get("bench") != "learn":
        raise ValueError(f"{path}: not a nominal bench learn result")
    doc["equal_cost"] = analyse(doc["rows"], doc["expand_modes"], tokens=False)
    prov = provenance()
    doc["equal_cost_restated"] = {k: prov.get(k) for k in ("commit", "dirty", "treegrpo")}
    write_result(Path(path), doc)
    return doc


def same_start(doc: dict[str, Any]) -> dict[str, Any]:
    """What a table's rows depend on, read off its document (``--resume`` keeps rows only when it is
    equal): its task, regime and token checkpoints, and its starting policies by the hash of their weights
    (``provenance.model_hash``), not by their cache folder or bootstrap-code fingerprint — a policy
    bootstrapped again after a code change that leaves its weights bit for bit the same is the same
    start (seen on ``rare3``: the fingerprint moved, the three worlds' weights did not)."""
    keep = ("task", "regime", "matched", "eval_every_tokens_per_budget")
    return {**{k: doc.get(k) for k in keep}, "model_hash": doc.get("provenance", {}).get("model_hash")}


def bootstrap_record(folder: Path) -> dict[str, Any]:
    """Which bootstrapped starting policy a table's rows used: its folder, config hash, the
    bootstrap recipe's settings and the held-out figures it measured after its warm-up."""
    from treegrpo.models.loader import tiny_info

    info = tiny_info(folder)
    return {"folder": str(folder), "config_hash": info.get("config_hash"), "code_fingerprint": info.get("code_fingerprint"),
            "bootstrap": info.get("config"), "demos": info.get("demos"), "warmup_eval": info.get("warmup_eval")}  # fmt: skip


def default_out(task: str) -> Path:
    return Path("benchmarks/results/learn_gigpo.json" if task == "search" else f"benchmarks/results/learn_gigpo_{task}.json")


def run_gigpo_bench(
    out: Path | None = None, task: str = "search", regime: str = "default", seeds: int = 3, jobs: int = 2,
    steps: int | None = None, lr: float | None = None, prompts_per_step: int | None = None, eval_every: int | None = None,
    eval_prompts: int | None = None, budgets: Sequence[int] | None = None, resume: bool = False, console: Any = None,
) -> dict[str, Any]:  # fmt: skip
    """The whole GiGPO table (module docstring); writes ``out`` (JSON) and ``out`` with ``.png``."""
    from treegrpo.benchmarks.learn_report import summarize_gigpo
    from treegrpo.benchmarks.provenance import provenance
    from treegrpo.models.loader import tiny_info

    console = console or make_console()
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {list(TASKS)}")
    if task == "search" and regime not in REGIMES:
        raise ValueError(f"unknown regime {regime!r}; choose one of {sorted(REGIMES)}")
    changes = {"steps": steps, "lr": lr, "prompts_per_step": prompts_per_step, "eval_every": eval_every,
               "eval_prompts": eval_prompts}  # fmt: skip
    reg = _tuned(REGIMES[regime] if task == "search" else SQL_REGIME, changes)
    budgets = tuple(budgets) if budgets else GIGPO_BUDGETS
    out = Path(out) if out is not None else default_out(task)
    t0 = time.perf_counter()
    if task == "search":
        from treegrpo.tasks.world.bootstrap import ensure_bootstrapped
        from treegrpo.tasks.world.world import get_preset

        world = get_preset(reg.preset).seed
        model_dir = ensure_bootstrapped(reg.preset, world_seed=world)
    else:
        from treegrpo.tasks.sql.bootstrap import ensure_sql_bootstrapped

        world, model_dir = 0, ensure_sql_bootstrapped()
    specs = plan_gigpo(budgets, list(range(seeds)), world)
    start = start_eval(task, reg, model_dir, world)
    console.print(
        f"[bold]bench learn --gigpo[/] task {task}: {model_dir.name}: held-out sampled {start['eval/success_sampled']:.3f} · "
        f"greedy {start['eval/success_greedy']:.3f}"
    )
    meta = {"task": task, "regime": dataclasses.asdict(reg),
            "model": {"folder": str(model_dir), "config_hash": tiny_info(model_dir).get("config_hash")}}  # fmt: skip
    prov = provenance(model_dir={"0": model_dir}, threads=1)  # every row trains on one thread
    rows, prior = (
        resume_rows(out, same_start({**meta, "provenance": prov}), (s.key for s in specs), lambda r: spec_of(r).key, prov,
                    console.print, "task, regime or starting policy", identity=same_start)
        if resume else ([], 0.0)
    )  # fmt: skip
    command = (
        f"treegrpo bench learn --gigpo --task {task}" + (f" --regime {regime}" if task == "search" else "")
        + f" --seeds {seeds} --jobs {jobs}" + option_flags(changes)
        + (f" --budgets {','.join(map(str, budgets))}" if budgets != GIGPO_BUDGETS else "") + f" --out {out}"
    )  # fmt: skip
    head = {**meta, "budgets": list(budgets), "seeds": list(range(seeds)), "world_seeds": [world], "start": start}
    title = (f"[bold]bench learn --gigpo[/] {task}: {{todo}} runs to go ({{all}} in all), {reg.steps} steps × "
             f"{reg.prompts_per_step} prompts, lr {reg.lr}, eval {reg.eval_prompts} every {reg.eval_every}, {jobs} worker(s)")  # fmt: skip

    def line(spec: RunSpec, row: dict[str, Any], n: int) -> str:
        return (f"  [{n}/{len(specs)}] {spec.key:52s} EM {row['em_start']:.3f} → {row['em_end']:.3f} "
                f"(greedy {row['em_greedy_end']:.3f}) · shared anchors {row['anchor_shared_frac']:.2f} "
                f"(after the first step {row['anchor_deep_shared_frac']:.2f}) · {row['wall_s']:.0f}s")  # fmt: skip

    return _run_table(
        out, "learn_gigpo", title, specs, rows, t0 - prior, head,
        lambda o: summarize_gigpo(o) if o else {"summary": {}, "compare": {}},
        lambda s: (s, reg, model_dir, start, task, True), line, command, jobs, prov, console, False,
    )  # fmt: skip


__all__ = [
    "ABLATION", "ABLATION_BUDGET", "BUDGETS", "EXPAND_MODES", "GIGPO_BUDGETS", "GIGPO_ROW_KEYS", "QUICK_BUDGETS",
    "REGIMES", "ROW_KEYS", "SQL_REGIME", "Regime", "RunSpec", "base_config", "bootstrap_record", "default_out",
    "plan_gigpo", "plan_runs", "restate_at_equal_cost", "run_bench", "run_gigpo_bench", "run_one", "same_start",
    "spec_of", "start_eval",
    "train_one", "train_row",
]  # fmt: skip
