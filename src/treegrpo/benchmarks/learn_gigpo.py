"""``treegrpo bench learn --gigpo``: GiGPO beside chain GRPO and Tree-GRPO, trained from one
starting policy at matched budgets, on the default search world (``--task search``) or the
stateful SQL task (``--task sql``, where database states repeat across chains).

Per budget B in ``--budgets`` (default 2 and 4), on the same prompts, seeds and budget accounting
as ``bench learn`` (the same trainer, the same per-seed prompt order):

- ``chain B``: chain GRPO, B chains per prompt;
- ``chain B gigpo``: GiGPO on the same chains (episode term + anchor-state step term);
- ``tree (M,N,L) random``: Tree-GRPO at the paper's matched shape;
- ``tree (M,N,L) random tree_gigpo``: Tree-GRPO's advantage + GiGPO's step term on the same trees.

Every run dumps its rollouts (``dump_rollouts_every=1``, in a temporary folder) so that GiGPO's
own diagnostic is measured on every row alike, from the forests the run trained on
(:func:`treegrpo.algos.gigpo.shared_anchor_stats`, exact anchor keys): the fraction of steps whose
anchor state another step of the group shares (``anchor_shared_frac``), the same for the steps
after the first (``anchor_deep_shared_frac``: a first step always shares the prompt), and the
mean anchor-group size. Held-out EM is measured as in ``bench learn`` (sampled T=1 and greedy).
Rows have exactly :data:`GIGPO_ROW_KEYS`; the result is written after every finished run, so
``--resume`` carries on from an interrupted one. The analysis is :mod:`.learn_gigpo_report`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any

from treegrpo.benchmarks.learn import REGIMES, Regime, _base_config
from treegrpo.benchmarks.learn_spec import ROW_KEYS, RunSpec, spec_of
from treegrpo.rollout.planner import PAPER_PAIRS

GIGPO_ROW_KEYS: tuple[str, ...] = (
    *ROW_KEYS,
    "task",
    "em_greedy_start",
    "anchor_steps",
    "anchor_shared_frac",
    "anchor_deep_shared_frac",
    "anchor_group_size",
)
GIGPO_BUDGETS: tuple[int, ...] = (2, 4)
TASKS: tuple[str, ...] = ("search", "sql")

#: The SQL task's RL settings (``bench stateful``'s learning part: 10 steps × 8 prompts, lr 5e-4, 100
#: held-out questions; here evaluated every 5 steps). Its starting policy learns fast: longer runs saturate.
SQL_REGIME = Regime(
    name="sql",
    preset="",
    steps=10,
    prompts_per_step=8,
    lr=5e-4,
    eval_every=5,
    eval_prompts=100,
    about="the SQL agent (a stateful tool: UPDATE/INSERT then a read); its tiny starting policy succeeds about 40% of the time",
)


def plan_gigpo(budgets: Sequence[int], seeds: Sequence[int], world_seed: int) -> list[RunSpec]:
    """The four configurations per budget (module docstring), seeds innermost."""
    configs: list[tuple[Any, ...]] = []
    for b in budgets:
        if b not in PAPER_PAIRS:
            raise ValueError(f"budget {b} has no paper shape; choose from {sorted(PAPER_PAIRS)}")
        m, n, l = PAPER_PAIRS[b]
        configs += [
            ("chain", b, b, 0, 0, None, "grpo"),
            ("chain", b, b, 0, 0, None, "gigpo"),
            ("tree", b, m, n, l, "random", "tree_grpo"),
            ("tree", b, m, n, l, "random", "tree_gigpo"),
        ]
    return [RunSpec(*c, seed=s, world_seed=world_seed) for c in configs for s in seeds]  # type: ignore[arg-type]


def base_config(task: str, regime: Regime, model_dir: Path, world_seed: int, out_dir: str) -> dict[str, Any]:
    """Every run's config fields but the configuration's own (sampler, shape, advantage, seed)."""
    if task == "search":
        base = _base_config(regime, model_dir, world_seed, out_dir)
    else:
        base = {
            "task": "sql", "model": str(model_dir), "steps": regime.steps, "prompts_per_step": regime.prompts_per_step,
            "lr": regime.lr, "eval_every": regime.eval_every, "eval_prompts": regime.eval_prompts, "eval_sampled": True,
            "save_every": 0, "tensorboard": False, "threads": 1, "out_dir": out_dir,
        }  # fmt: skip
    return {**base, "dump_rollouts_every": 1}


_PARTS: dict[tuple[str, str, Any], Any] = {}


def _parts(cfg: Any) -> Any:
    """Run parts with a freshly loaded model; env and questions built once per process."""
    from treegrpo.models.loader import load_model
    from treegrpo.train.setup import build_run

    key = (str(cfg.model), cfg.task, cfg.world_seed)
    if key not in _PARTS:
        _PARTS[key] = build_run(cfg)
        return _PARTS[key]
    cached = _PARTS[key]
    return dataclasses.replace(cached, model=load_model(cached.model_dir).to(cfg.device))


def start_eval(task: str, regime: Regime, model_dir: Path, world_seed: int) -> dict[str, float]:
    """The starting policy's held-out evaluation (deterministic: every run shares it)."""
    from treegrpo.rollout.agent import StepRunner
    from treegrpo.rollout.engine import make_engine
    from treegrpo.train.config import make_config
    from treegrpo.train.evaluate import evaluate

    cfg = make_config(base_config(task, regime, model_dir, world_seed, "unused"))
    parts = _parts(cfg)
    engine = make_engine("hf", parts.model, parts.tokenizer, device=cfg.device)
    return evaluate(
        StepRunner(engine, parts.env, parts.tokenizer, parts.agent_cfg), parts.eval_tasks, sampled=True
    )


def run_gigpo_one(
    spec: RunSpec, task: str, regime: Regime, model_dir: Path, eval_start: dict[str, float]
) -> dict[str, Any]:
    """Train one configuration; its row (:data:`GIGPO_ROW_KEYS`)."""
    import torch
    from rich.console import Console

    from treegrpo.algos.gigpo import shared_anchor_stats
    from treegrpo.train.config import make_config
    from treegrpo.train.trainer import train
    from treegrpo.tree import read_forests

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="treegrpo-bench-gigpo-") as tmp:
        cfg = make_config({**base_config(task, regime, model_dir, spec.world_seed, tmp), **spec.overrides()})
        s = train(cfg, console=Console(quiet=True), parts=_parts(cfg), eval_start=eval_start)
        forests = [f for p in sorted((Path(tmp) / "rollouts").glob("step_*.jsonl")) for f in read_forests(p)]
        anchors = shared_anchor_stats(forests)
    return {
        "mode": spec.mode, "budget": spec.budget, "M": spec.m, "N": spec.n, "L": spec.l,
        "expand_mode": spec.expand_mode, "advantage": spec.advantage, "seed": spec.seed, "world_seed": spec.world_seed,
        "em_start": s.eval_start["eval/success_sampled"], "em_end": s.eval_end["eval/success_sampled"],
        "em_greedy_end": s.eval_end["eval/success_greedy"], "em_curve": [[int(t), float(e)] for t, e in s.em_curve],
        "generated_tokens": s.generated_tokens, "tool_calls": s.tool_calls, "trajectories": s.trajectories,
        "tool_calls_per_traj_start": s.eval_start["eval/tool_calls_sampled"],
        "tool_calls_per_traj_end": s.eval_end["eval/tool_calls_sampled"], "wall_s": round(s.wall_s, 2),
        "task": task, "em_greedy_start": s.eval_start["eval/success_greedy"], "anchor_steps": int(anchors["steps"]),
        "anchor_shared_frac": anchors["shared_frac"], "anchor_deep_shared_frac": anchors["deep_shared_frac"],
        "anchor_group_size": anchors["group_size"],
    }  # fmt: skip


def default_out(task: str) -> Path:
    return Path(
        "benchmarks/results/learn_gigpo.json"
        if task == "search"
        else f"benchmarks/results/learn_gigpo_{task}.json"
    )


def run_gigpo_bench(
    out: Path | None = None,
    task: str = "search",
    regime: str = "default",
    seeds: int = 3,
    jobs: int = 2,
    steps: int | None = None,
    lr: float | None = None,
    prompts_per_step: int | None = None,
    eval_every: int | None = None,
    eval_prompts: int | None = None,
    budgets: Sequence[int] | None = None,
    resume: bool = False,
    console: Any = None,
) -> dict[str, Any]:
    """The whole GiGPO table (module docstring); writes ``out`` (JSON) and ``out`` with ``.png``."""
    from rich.console import Console

    from treegrpo.benchmarks.learn_gigpo_report import plot, print_table, summarize_gigpo
    from treegrpo.benchmarks.provenance import provenance
    from treegrpo.io import atomic_write_text
    from treegrpo.models.loader import tiny_info

    console = console or Console(soft_wrap=True, width=None if Console().is_terminal else 150)
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {list(TASKS)}")
    if task == "search" and regime not in REGIMES:
        raise ValueError(f"unknown regime {regime!r}; choose one of {sorted(REGIMES)}")
    reg = REGIMES[regime] if task == "search" else SQL_REGIME
    changes = {
        "steps": steps,
        "lr": lr,
        "prompts_per_step": prompts_per_step,
        "eval_every": eval_every,
        "eval_prompts": eval_prompts,
    }
    reg = dataclasses.replace(reg, **{k: v for k, v in changes.items() if v is not None})
    reg = dataclasses.replace(reg, eval_every=min(reg.eval_every, reg.steps))
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

        world = 0
        model_dir = ensure_sql_bootstrapped()
    specs = plan_gigpo(budgets, list(range(seeds)), world)
    start = start_eval(task, reg, model_dir, world)
    console.print(
        f"[bold]bench learn --gigpo[/] task {task}: {model_dir.name}: held-out sampled {start['eval/success_sampled']:.3f} · "
        f"greedy {start['eval/success_greedy']:.3f}"
    )
    meta = {
        "task": task,
        "regime": dataclasses.asdict(reg),
        "model": {"folder": str(model_dir), "config_hash": tiny_info(model_dir).get("config_hash")},
    }
    rows: list[dict[str, Any]] = []
    prior_wall = 0.0
    prov = provenance(model_dir={"0": model_dir})
    if resume and out.is_file():
        old = json.loads(out.read_text())
        if {k: old.get(k) for k in meta} == meta:
            wanted = {s.key for s in specs}
            rows = [r for r in old.get("rows", []) if spec_of(r).key in wanted]
            prior_wall = float(old.get("wall_s", 0.0))
            if rows and "provenance" in old:
                prov["resumed_from"] = old["provenance"]
            console.print(f"resuming: {len(rows)} runs already in {out}")
        else:
            console.print(
                f"[yellow]not resuming[/]: {out} was made with another task, regime or starting policy"
            )
    done = {spec_of(r).key for r in rows}
    todo = [s for s in specs if s.key not in done]
    command = (
        f"treegrpo bench learn --gigpo --task {task}" + (f" --regime {regime}" if task == "search" else "")
        + f" --seeds {seeds} --jobs {jobs}"
        + "".join(f" --{k.replace('_', '-')} {v}" for k, v in changes.items() if v is not None)
        + (f" --budgets {','.join(map(str, budgets))}" if budgets != GIGPO_BUDGETS else "")
        + f" --out {out}"
    )  # fmt: skip

    def result_of(complete: bool) -> dict[str, Any]:
        order = {s.key: i for i, s in enumerate(specs)}
        ordered = sorted(rows, key=lambda r: order.get(spec_of(r).key, 1 << 30))
        return {
            "bench": "learn_gigpo",
            **meta,
            "budgets": list(budgets),
            "seeds": list(range(seeds)),
            "world_seeds": [world],
            "start": start,
            "complete": complete,
            "rows": ordered,
            **(summarize_gigpo(ordered) if ordered else {"summary": {}, "compare": {}}),
            "command": command,
            "wall_s": round(prior_wall + time.perf_counter() - t0, 1),
            "jobs": jobs,
            "cpu_count": os.cpu_count(),
            "provenance": prov,
        }

    console.print(
        f"[bold]bench learn --gigpo[/] {task}: {len(todo)} runs to go ({len(specs)} in all), "
        f"{reg.steps} steps × {reg.prompts_per_step} prompts, lr {reg.lr}, eval {reg.eval_prompts} every {reg.eval_every}, "
        f"{jobs} worker(s)"
    )

    def finished(spec: RunSpec, row: dict[str, Any]) -> None:
        rows.append(row)
        atomic_write_text(out, json.dumps(result_of(False), indent=1))
        console.print(
            f"  [{len(rows)}/{len(specs)}] {spec.key:52s} EM {row['em_start']:.3f} → {row['em_end']:.3f} "
            f"(greedy {row['em_greedy_end']:.3f}) · shared anchors {row['anchor_shared_frac']:.2f} "
            f"(after the first step {row['anchor_deep_shared_frac']:.2f}) · {row['wall_s']:.0f}s"
        )

    if jobs <= 1:
        for spec in todo:
            finished(spec, run_gigpo_one(spec, task, reg, model_dir, start))
    else:
        import multiprocessing as mp

        with ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as pool:
            pending: dict[Future[dict[str, Any]], RunSpec] = {
                pool.submit(run_gigpo_one, s, task, reg, model_dir, start): s for s in todo
            }
            while pending:
                ready, _ = wait(pending, return_when=FIRST_COMPLETED)
                for fut in ready:
                    finished(pending.pop(fut), fut.result())
    result = result_of(True)
    atomic_write_text(out, json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    print_table(result, console)
    console.print(
        f"[bold]bench learn --gigpo[/]: wrote {out} and {out.with_suffix('.png')} in {result['wall_s']:.0f}s"
    )
    return result


__all__ = [
    "GIGPO_BUDGETS",
    "GIGPO_ROW_KEYS",
    "SQL_REGIME",
    "TASKS",
    "base_config",
    "default_out",
    "plan_gigpo",
    "run_gigpo_bench",
    "run_gigpo_one",
    "start_eval",
]
