"""``treegrpo bench learn``: the paper's budget table in miniature — chain GRPO vs Tree-GRPO trained
from one starting policy at matched, measured budgets.

From one bootstrapped model per world (``ensure_bootstrapped(preset, world_seed)``), the one trainer
loop (:func:`treegrpo.train.trainer.train`) runs, for the same number of RL steps on the same
prompts:

- ``chain`` GRPO at budgets 2 / 4 / 8 / 16 (``G`` chains per prompt; rows carry ``M = G``,
  ``N = L = 0``, ``advantage = grpo``);
- ``tree`` Tree-GRPO at the paper's matched shapes (M, N, L) = (1,2,1), (2,2,1), (2,6,1), (4,5,1)
  (:data:`~treegrpo.rollout.planner.PAPER_PAIRS`) with the official ``random`` picks and the guided
  pick modes ``nonroot`` and ``entropy`` (``advantage = tree_grpo``: intra-tree + inter-tree);
- the advantage ablation at budget 4: (2,2,1) ``random`` with ``intra_only`` and ``inter_only``.

``--quick`` keeps budgets 2 and 4 (and the ablation). Every configuration runs once per seed; a
seed fixes the prompt order (the trainer draws prompts and tree picks from separate streams), so
the runs of one seed see the same prompts and are compared in pairs. Held-out exact match is
measured on the world's ``eval`` split — one chain per question, sampled at T=1 and greedy — from
the evaluation's own RNG stream (:data:`~treegrpo.train.evaluate.EVAL_SEED`), at the start, every
``eval_every`` steps (``em_curve``: ``[generated tokens so far, sampled EM]``) and at the end.
``tool_calls_per_traj_start/end`` are the held-out sampled chains' tool calls per trajectory, so
every mode is measured the same way.

Rows (``rows`` in the JSON) have exactly :data:`ROW_KEYS`; the result is written after every
finished run, atomically, so an interrupted benchmark keeps what it finished and ``--resume``
carries on from it. ``targets`` holds the issue's comparisons with pass/fail; ``summary`` the mean
and spread per configuration; the analysis and the plots live in
:mod:`treegrpo.benchmarks.learn_report`.

**Regimes** (:data:`REGIMES`): a world preset (its world and its bootstrap recipe, see
:data:`treegrpo.tasks.world.world.PRESETS`) plus the RL settings. ``default`` is the embedded default
world and starting policy; see ``benchmarks/README.md`` for the others and why they are built as
they are.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from treegrpo.benchmarks.learn_spec import (
    ABLATION,
    ABLATION_BUDGET,
    BUDGETS,
    EXPAND_MODES,
    QUICK_BUDGETS,
    ROW_KEYS,
    RunSpec,
    spec_of,
)
from treegrpo.rollout.planner import PAPER_PAIRS


@dataclass(frozen=True)
class Regime:
    """A world preset (world + starting policy) and the RL settings every run of the table uses.

    Attributes:
        name: the regime's name (``--regime``).
        preset: world preset (:data:`treegrpo.tasks.world.world.PRESETS`); its bootstrap recipe is
            :meth:`treegrpo.tasks.world.bootstrap.BootstrapConfig.for_preset`.
        steps: RL steps of every run.
        prompts_per_step: prompts per RL step.
        lr: AdamW learning rate.
        eval_every: steps between held-out evaluations (the ``em_curve`` points).
        eval_prompts: held-out questions per evaluation.
        about: one line on what the regime is for.
    """

    name: str
    preset: str
    steps: int
    prompts_per_step: int
    lr: float
    eval_every: int
    eval_prompts: int
    about: str


REGIMES: dict[str, Regime] = {
    r.name: r
    for r in (
        Regime(
            name="default",
            preset="default",
            steps=40,
            prompts_per_step=8,
            lr=1e-4,
            eval_every=10,
            eval_prompts=200,
            about="the embedded default world and starting policy (answers after one search 80% of the time), "
            "a slow learning rate so the switch to multi-hop is not finished within the run",
        ),
        Regime(
            name="shortcut3",
            preset="shortcut3",
            steps=40,
            prompts_per_step=8,
            lr=1e-4,
            eval_every=10,
            eval_prompts=400,
            about="2- and 3-hop questions only; the starting policy answers after one search (sampled success "
            "about 9%, greedy 0): success hinges on a late choice, to search again",
        ),
        Regime(
            name="rare3",
            preset="rare3",
            steps=40,
            prompts_per_step=8,
            lr=3e-4,
            eval_every=10,
            eval_prompts=400,
            about="3-hop questions only; the starting policy almost never succeeds (sampled success about 3%, "
            "greedy 0): most small groups carry no signal at all",
        ),
    )
}




def plan_runs(
    budgets: Sequence[int],
    seeds: Sequence[int],
    world_seeds: Sequence[int],
    expand_modes: Sequence[str] = EXPAND_MODES,
    ablation: bool = True,
) -> list[RunSpec]:
    """Every run of the table, seeds innermost so paired runs finish close together."""
    configs: list[tuple[Any, ...]] = []
    for b in budgets:
        if b not in PAPER_PAIRS:
            raise ValueError(f"budget {b} has no paper shape; choose from {sorted(PAPER_PAIRS)}")
        configs.append(("chain", b, b, 0, 0, None, "grpo"))
        m, n, l = PAPER_PAIRS[b]
        configs += [("tree", b, m, n, l, mode, "tree_grpo") for mode in expand_modes]
        if ablation and b == ABLATION_BUDGET:
            configs += [("tree", b, m, n, l, "random", adv) for adv in ABLATION]
    return [RunSpec(*c, seed=s, world_seed=w) for w in world_seeds for c in configs for s in seeds]  # type: ignore[arg-type]


# -- running ---------------------------------------------------------------------------------------

_PARTS_CACHE: dict[tuple[str, int], Any] = {}


def _base_config(regime: Regime, model_dir: Path, world_seed: int, out_dir: str) -> dict[str, Any]:
    return {
        "model": str(model_dir),
        "preset": regime.preset,
        "world_seed": world_seed,
        "steps": regime.steps,
        "prompts_per_step": regime.prompts_per_step,
        "lr": regime.lr,
        "eval_every": regime.eval_every,
        "eval_prompts": regime.eval_prompts,
        "eval_sampled": True,
        "save_every": 0,
        "dump_rollouts_every": 0,
        "tensorboard": False,
        "threads": 1,
        "out_dir": out_dir,
    }


def _parts(cfg: Any) -> Any:
    """Run parts with a freshly loaded model; the world, env and questions are built once per
    process and world."""
    from treegrpo.models.loader import load_model
    from treegrpo.train.setup import build_run

    key = (str(cfg.model), int(cfg.world_seed))
    if key not in _PARTS_CACHE:
        _PARTS_CACHE[key] = build_run(cfg)
        return _PARTS_CACHE[key]
    cached = _PARTS_CACHE[key]
    return dataclasses.replace(cached, model=load_model(cached.model_dir).to(cfg.device))


def start_eval(regime: Regime, model_dir: Path, world_seed: int) -> dict[str, float]:
    """The starting policy's held-out evaluation (deterministic: every run of the world shares it)."""
    from treegrpo.rollout.agent import StepRunner
    from treegrpo.rollout.engine import make_engine
    from treegrpo.train.config import make_config
    from treegrpo.train.evaluate import evaluate

    cfg = make_config(_base_config(regime, model_dir, world_seed, "unused"))
    parts = _parts(cfg)
    runner = StepRunner(
        make_engine("hf", parts.model, parts.tokenizer, device=cfg.device), parts.env, parts.tokenizer, parts.agent_cfg
    )
    return evaluate(runner, parts.eval_tasks, sampled=True)


def run_one(spec: RunSpec, regime: Regime, model_dir: Path, eval_start: dict[str, float]) -> dict[str, Any]:
    """Train one configuration; the row (:data:`ROW_KEYS`)."""
    import torch
    from rich.console import Console

    from treegrpo.train.config import make_config
    from treegrpo.train.trainer import train

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="treegrpo-bench-learn-") as tmp:
        cfg = make_config({**_base_config(regime, model_dir, spec.world_seed, tmp), **spec.overrides()})
        s = train(cfg, console=Console(quiet=True), parts=_parts(cfg), eval_start=eval_start)
    return {
        "mode": spec.mode,
        "budget": spec.budget,
        "M": spec.m,
        "N": spec.n,
        "L": spec.l,
        "expand_mode": spec.expand_mode,
        "advantage": spec.advantage,
        "seed": spec.seed,
        "world_seed": spec.world_seed,
        "em_start": s.eval_start["eval/success_sampled"],
        "em_end": s.eval_end["eval/success_sampled"],
        "em_greedy_end": s.eval_end["eval/success_greedy"],
        "em_curve": [[int(t), float(e)] for t, e in s.em_curve],
        "generated_tokens": s.generated_tokens,
        "tool_calls": s.tool_calls,
        "trajectories": s.trajectories,
        "tool_calls_per_traj_start": s.eval_start["eval/tool_calls_sampled"],
        "tool_calls_per_traj_end": s.eval_end["eval/tool_calls_sampled"],
        "wall_s": round(s.wall_s, 2),
    }




# -- the whole benchmark -----------------------------------------------------------------------------


def run_bench(
    out: Path,
    regime: str = "default",
    quick: bool = False,
    world_seeds: Sequence[int] | None = None,
    seeds: int = 3,
    jobs: int = 2,
    steps: int | None = None,
    lr: float | None = None,
    prompts_per_step: int | None = None,
    eval_every: int | None = None,
    expand_modes: Sequence[str] = EXPAND_MODES,
    budgets: Sequence[int] | None = None,
    resume: bool = False,
    console: Any = None,
) -> dict[str, Any]:
    """The whole benchmark (module docstring); writes ``out`` (JSON) and ``out`` with ``.png``."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from treegrpo.benchmarks.learn_report import plot, print_table, summarize, targets
    from treegrpo.benchmarks.provenance import provenance
    from treegrpo.io import atomic_write_text
    from treegrpo.models.loader import tiny_info
    from treegrpo.tasks.world.bootstrap import ensure_bootstrapped
    from treegrpo.tasks.world.world import get_preset

    console = console or Console(soft_wrap=True, width=None if Console().is_terminal else 150)
    if regime not in REGIMES:
        raise ValueError(f"unknown regime {regime!r}; choose one of {sorted(REGIMES)}")
    reg = REGIMES[regime]
    changes = {"steps": steps, "lr": lr, "prompts_per_step": prompts_per_step, "eval_every": eval_every}
    reg = dataclasses.replace(reg, **{k: v for k, v in changes.items() if v is not None})
    reg = dataclasses.replace(reg, eval_every=min(reg.eval_every, reg.steps))
    for mode in expand_modes:
        if mode not in EXPAND_MODES:
            raise ValueError(f"unknown expand mode {mode!r}; choose from {list(EXPAND_MODES)}")
    worlds = list(world_seeds) if world_seeds else [get_preset(reg.preset).seed]
    seed_list = list(range(seeds))
    budgets = tuple(budgets) if budgets else QUICK_BUDGETS if quick else BUDGETS
    specs = plan_runs(budgets, seed_list, worlds, expand_modes)
    t0 = time.perf_counter()

    models: dict[int, Path] = {}
    starts: dict[int, dict[str, float]] = {}
    for w in worlds:
        console.print(
            f"[bold]bench learn[/] world {w}: starting policy (bootstrapped and cached on first use)"
        )
        models[w] = ensure_bootstrapped(reg.preset, world_seed=w)
        starts[w] = start_eval(reg, models[w], w)
        console.print(
            f"  {models[w].name}: held-out sampled {starts[w]['eval/success_sampled']:.3f} · greedy "
            f"{starts[w]['eval/success_greedy']:.3f} · tool calls/traj {starts[w]['eval/tool_calls_sampled']:.2f}"
        )
    meta = {
        "regime": dataclasses.asdict(reg),
        "models": {
            str(w): {"folder": str(p), "config_hash": tiny_info(p).get("config_hash")}
            for w, p in models.items()
        },
    }
    prov = provenance(model_dir={str(w): p for w, p in models.items()})
    rows: list[dict[str, Any]] = []
    prior_wall = 0.0  # time already spent on the rows kept by --resume
    if resume and Path(out).is_file():
        old = json.loads(Path(out).read_text())
        if {k: old.get(k) for k in meta} == meta:
            wanted = {s.key for s in specs}
            rows = [r for r in old.get("rows", []) if spec_of(r).key in wanted]
            prior_wall = float(old.get("wall_s", 0.0))
            if rows and "provenance" in old:  # the kept rows were made by that session
                prov["resumed_from"] = old["provenance"]
            console.print(f"resuming: {len(rows)} runs already in {out}")
        else:
            console.print(f"[yellow]not resuming[/]: {out} was made with another regime or starting policy")
    done = {spec_of(r).key for r in rows}
    todo = [s for s in specs if s.key not in done]
    command = (
        f"treegrpo bench learn --regime {regime}{' --quick' if quick else ''} --world-seed {','.join(map(str, worlds))} "
        f"--seeds {seeds} --jobs {jobs}"
        + "".join(f" --{k.replace('_', '-')} {v}" for k, v in changes.items() if v is not None)
        + (f" --expand-modes {','.join(expand_modes)}" if tuple(expand_modes) != EXPAND_MODES else "")
        + (f" --budgets {','.join(map(str, budgets))}" if budgets not in (QUICK_BUDGETS, BUDGETS) else "")
        + f" --out {out}"
    )

    def result_of(complete: bool) -> dict[str, Any]:
        order = {s.key: i for i, s in enumerate(specs)}
        ordered = sorted(rows, key=lambda r: order.get(spec_of(r).key, 1 << 30))
        return {
            "bench": "learn",
            **meta,
            "quick": quick,
            "budgets": list(budgets),
            "expand_modes": list(expand_modes),
            "seeds": seed_list,
            "world_seeds": worlds,
            "start": {str(w): starts[w] for w in worlds},
            "complete": complete,
            "rows": ordered,
            "summary": summarize(ordered) if ordered else {},
            "targets": targets(ordered) if ordered else {},
            "command": command,
            "wall_s": round(prior_wall + time.perf_counter() - t0, 1),  # all sessions of a resumed run
            "jobs": jobs,
            "cpu_count": os.cpu_count(),
            "provenance": prov,
        }

    out = Path(out)
    console.print(
        f"[bold]bench learn[/] regime {reg.name}: {len(todo)} runs to go ({len(specs)} in all), "
        f"{reg.steps} steps × {reg.prompts_per_step} prompts, lr {reg.lr}, {jobs} worker(s)"
    )
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    )
    with progress:
        bar = progress.add_task("runs", total=len(specs), completed=len(rows))

        def finished(spec: RunSpec, row: dict[str, Any]) -> None:
            rows.append(row)
            atomic_write_text(out, json.dumps(result_of(False), indent=1))
            progress.advance(bar)
            progress.console.print(
                f"  {spec.key:48s} EM {row['em_start']:.3f} → {row['em_end']:.3f} (greedy {row['em_greedy_end']:.3f}) · "
                f"gen tok {row['generated_tokens']} · tools/traj {row['tool_calls_per_traj_end']:.2f} · {row['wall_s']:.0f}s"
            )

        if jobs <= 1:
            for spec in todo:
                finished(spec, run_one(spec, reg, models[spec.world_seed], starts[spec.world_seed]))
        else:
            import multiprocessing as mp

            with ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as pool:
                pending: dict[Future[dict[str, Any]], RunSpec] = {
                    pool.submit(run_one, s, reg, models[s.world_seed], starts[s.world_seed]): s for s in todo
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
        f"[bold]bench learn[/]: wrote {out} and {out.with_suffix('.png')} in {result['wall_s']:.0f}s"
    )
    return result


__all__ = [
    "ABLATION",
    "ABLATION_BUDGET",
    "BUDGETS",
    "EXPAND_MODES",
    "QUICK_BUDGETS",
    "REGIMES",
    "ROW_KEYS",
    "Regime",
    "RunSpec",
    "plan_runs",
    "run_bench",
    "run_one",
    "spec_of",
    "start_eval",
]
