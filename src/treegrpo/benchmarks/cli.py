"""``treegrpo bench ...``: the benchmark commands (results as JSON + PNG under benchmarks/results/).
The main command line (:mod:`treegrpo.cli`) mounts this sub-app."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import NoReturn

import typer

bench = typer.Typer(help="Reproducible measurements; results as JSON under benchmarks/results/.", no_args_is_help=True)


def _log(message: str) -> None:
    typer.echo(message, err=True)


def _fail(message: str, code: int = 2) -> NoReturn:
    """The one-line error of a bad option or a failed run (exit status ``code``)."""
    typer.echo(message, err=True)
    raise typer.Exit(code)


@bench.command("retrieval")
def bench_retrieval_cmd(
    queries: Path = typer.Option(Path("benchmarks/retrieval_queries.jsonl"), help="Query set (made from wiki-vital if missing)."),
    out: Path = typer.Option(Path("benchmarks/results/retrieval.json"), help="Results JSON."),
    retrievers: str = typer.Option("bm25,dense,hybrid", help="Comma-separated retriever kinds to serve and measure."),
    n: int = typer.Option(500, help="Queries per method when the query set is made."),
    load: bool = typer.Option(True, help="Also run the bounded loopback load test (throughput)."),
) -> None:
    """Recall@k on wiki-vital of each retriever through its server, plus server throughput."""
    from treegrpo.benchmarks.retrieval import run
    from treegrpo.training.config import ConfigError

    kinds = [k.strip() for k in retrievers.split(",") if k.strip()]
    bad = [k for k in kinds if k not in ("bm25", "dense", "hybrid")]
    if bad or not kinds:
        _fail(f"error: unknown retriever(s) {bad}; choose from bm25, dense, hybrid")
    try:
        run(queries, out, kinds, n=n, load=load, log=_log)
    except (ConfigError, RuntimeError) as e:
        _fail(f"error: {e}")


@bench.command("packing")
def bench_packing_cmd(
    out: Path = typer.Option(Path("benchmarks/results/packing.json"), help="Results JSON (plot next to it, .png)."),
    prompts: int = typer.Option(8, help="Training questions rolled out per tree shape."),
    repeats: int = typer.Option(5, help="Timed repeats per variant (median reported)."),
    seed: int = typer.Option(0, help="Rollout seed."),
    threads: int | None = typer.Option(None, help="torch CPU threads (default: torch's choice)."),
) -> None:
    """Per-path vs tree-packed training (tokens, forward+backward time, peak memory, exactness) on
    forests from real rollouts of the default tiny agent: tree (2,2,1) and tree (4,5,1)."""
    from treegrpo.benchmarks.packing import run_bench

    run_bench(out, prompts=prompts, repeats=repeats, seed=seed, threads=threads, log=_log)


@bench.command("budget")
def bench_budget_cmd(
    out: Path | None = typer.Option(None, help="Results JSON, plot next to it (.png) (default: benchmarks/results/budget.json, with --engine budget_ENGINE.json)."),
    prompts: int | None = typer.Option(None, help="Training questions rolled out by every configuration (default 32; with --engine 4)."),
    seed: int = typer.Option(0, help="Prompt sample and rollout seed (the same for every configuration)."),
    repeats: int | None = typer.Option(None, help="Timed runs of the timing-critical configurations (default 5; with --engine 2)."),
    threads: int = typer.Option(1, help="torch intra-op threads while measuring (0: leave as is); vLLM on CPU gets as many cores."),
    model: str | None = typer.Option(None, help="A bootstrapped agent or a checkpoint of one (default: the bootstrapped default agent); with --engine also a model reference (smollm2-135m) run on wiki-vital-qa."),
    engine: str | None = typer.Option(None, help="hf | vllm: only chain 4 vs tree (2,2,1) random/nonroot with this engine, to compare engines (see benchmarks/README.md)."),
    against: Path | None = typer.Option(None, help="With --engine: the other engine's results on the same prompts (adds the vLLM/HF ratio)."),
    max_turns: int = typer.Option(2, help="With --engine and a non-tiny --model: turns per trajectory."),
    max_step_tokens: int = typer.Option(48, help="With --engine and a non-tiny --model: tokens per step."),
) -> None:
    """Chain at budgets 2/4/8/16 vs Tree-GRPO at the paper's matched (M,N,L), random and nonroot
    picks, prefix reuse on and off, on the default tiny agent: trajectories, generated tokens,
    prefill tokens, tool calls, wall seconds; the issue's target ratios with pass/fail. With
    --engine: the timing-critical block with one engine (tokens per CPU second, prefix-cache hits)."""
    if (prompts is not None and prompts < 1) or (repeats is not None and repeats < 1) or threads < 0:
        _fail("error: --prompts and --repeats must be >= 1, --threads >= 0")
    if engine is not None:
        from treegrpo.rollout.engine import ENGINE_NAMES

        if engine not in ENGINE_NAMES:
            _fail(f"error: --engine {engine!r}: choose one of {', '.join(ENGINE_NAMES)}")
        if against is not None and not against.is_file():
            _fail(f"error: --against {against}: no such results file")
        from treegrpo.benchmarks.budget_engines import run_engine_bench
        from treegrpo.training.config import ConfigError

        try:
            run_engine_bench(
                out or Path(f"benchmarks/results/budget_{engine}.json"), engine=engine, model=model,
                prompts=prompts or 4, seed=seed, repeats=repeats or 2, threads=threads, max_turns=max_turns,
                max_step_tokens=max_step_tokens, against=against, log=_log,
            )  # fmt: skip
        except (ConfigError, ImportError, ValueError) as e:
            _fail(f"error: {str(e).splitlines()[0]}")
        return
    from treegrpo.benchmarks.budget import run_bench

    folder = Path(model) if model is not None else None
    if folder is not None and not (folder / "treegrpo_tiny.json").is_file():
        _fail(f"error: --model {model}: not a bootstrapped agent or a checkpoint of one (no treegrpo_tiny.json); other models need --engine")
    run_bench(
        out or Path("benchmarks/results/budget.json"), prompts=prompts or 32, seed=seed, repeats=repeats or 5,
        threads=threads or None, model_dir=folder,
    )  # fmt: skip


@bench.command("eptree")
def bench_eptree_cmd(
    out: Path = typer.Option(Path("benchmarks/results/eptree.json"), help="Results JSON (plot next to it, .png)."),
    prompts: int = typer.Option(96, help="Training problems rolled out by every sampling method, per seed."),
    seeds: str = typer.Option("0,1,2", help="Comma-separated sampling seeds (the first also seeds the RL runs)."),
    rl_steps: int = typer.Option(30, help="Steps of each RL run (0: sampling comparison only)."),
    rl_seeds: str = typer.Option("0,1", help="Comma-separated seeds: each RL configuration runs once per seed."),
    rl_prompts_per_step: int = typer.Option(8, help="Prompts per RL step."),
    rl_lr: float = typer.Option(3e-4, help="RL learning rate."),
    eval_prompts: int = typer.Option(256, help="Held-out problems evaluated before and after each RL run."),
    threads: int = typer.Option(1, help="torch intra-op threads (0: leave as is)."),
) -> None:
    """EPTree (6,2,1,2) forking at -log p vs random fork points vs 16 (and token-matched) chains on
    the single-turn arithmetic task: PassRate, distinct correct responses, tokens; then short RL runs
    with treerl vs grpo advantages and their held-out accuracy."""
    from treegrpo.benchmarks.eptree import run_bench

    try:
        seed_list = [int(x) for x in seeds.split(",") if x.strip()]
        rl_seed_list = [int(x) for x in rl_seeds.split(",") if x.strip()]
    except ValueError:
        seed_list = rl_seed_list = []
    if not seed_list or not rl_seed_list or prompts < 1 or rl_steps < 0 or rl_prompts_per_step < 1 or eval_prompts < 1 or threads < 0:
        _fail("error: --seeds/--rl-seeds must be integers; --prompts, --rl-prompts-per-step, --eval-prompts >= 1")
    run_bench(
        out, prompts=prompts, seeds=seed_list, rl_steps=rl_steps, rl_seeds=rl_seed_list, rl_prompts_per_step=rl_prompts_per_step,
        rl_lr=rl_lr, eval_prompts=eval_prompts, threads=threads or None, log=_log,
    )  # fmt: skip


@bench.command("learn")
def bench_learn_cmd(
    out: Path | None = typer.Option(None, help="Results JSON, plot next to it (.png) (default: benchmarks/results/learn.json; --gigpo: learn_gigpo.json, learn_gigpo_sql.json)."),
    quick: bool = typer.Option(False, "--quick", help="Budgets 2 and 4 (and the advantage ablation) only."),
    gigpo: bool = typer.Option(False, "--gigpo", help="The GiGPO table instead: chain GRPO, chain GiGPO, Tree-GRPO, Tree-GRPO + GiGPO's step term at budgets 2 and 4, with GiGPO's anchor-group fractions."),
    task: str = typer.Option("search", help="With --gigpo: search (the --regime world) | sql (the stateful SQL task)."),
    eval_prompts: int | None = typer.Option(None, help="With --gigpo: override the held-out questions per evaluation."),
    regime: str = typer.Option("default", help="World preset + RL settings (see benchmarks/README.md)."),
    world_seed: str = typer.Option("", "--world-seed", help="Comma-separated world seeds (default: the preset's world); each gets its own starting policy."),
    seeds: int = typer.Option(3, help="RL seeds per configuration (0..K-1), paired across configurations."),
    jobs: int = typer.Option(2, help="Runs in parallel (one torch thread each)."),
    steps: int | None = typer.Option(None, help="Override the regime's RL steps."),
    lr: float | None = typer.Option(None, help="Override the regime's learning rate."),
    prompts_per_step: int | None = typer.Option(None, help="Override the regime's prompts per step."),
    eval_every: int | None = typer.Option(None, help="Override the regime's steps between evaluations."),
    expand_modes: str = typer.Option("", help="Comma-separated tree pick modes to train (default: random,nonroot,entropy; --matched tokens: random,nonroot)."),
    budgets: str = typer.Option("", help="Comma-separated budgets out of 2,4,8,16 (default: all, or 2,4 with --quick)."),
    matched: str = typer.Option("nominal", help="nominal: trees at the paper's (M,N,L) | tokens: token-matched trees (budget_tokens chain:B) against chain B, compared at equal generated tokens and tool calls, every run evaluated at token checkpoints (default --out: benchmarks/results/learn_tokens_<regime>.json)."),
    resume: bool = typer.Option(False, "--resume", help="Keep the finished runs of --out (same regime and starting policy)."),
) -> None:
    """Chain GRPO at budgets 2/4/8/16 vs Tree-GRPO at the paper's matched (M,N,L) with random and
    guided picks, plus the intra/inter advantage ablation, trained from one starting policy:
    held-out EM (sampled and greedy) per seed, EM vs budget and vs generated tokens. --gigpo: the
    GiGPO table (chain GiGPO and Tree-GRPO + GiGPO's step term beside them), --task search | sql.
    --matched tokens: the same budgets at equal generated tokens (token-matched trees)."""
    from treegrpo.benchmarks.learn import BUDGETS, EXPAND_MODES, REGIMES, run_bench

    try:
        worlds = [int(x) for x in world_seed.split(",") if x.strip()]
    except ValueError:
        _fail(f"error: --world-seed {world_seed!r}: give integers, e.g. --world-seed 0,1")
    modes = [m.strip() for m in expand_modes.split(",") if m.strip()]
    problems = []
    try:
        budget_list = [int(x) for x in budgets.split(",") if x.strip()]
    except ValueError:
        budget_list = [0]
    if any(b not in BUDGETS for b in budget_list):
        problems.append(f"--budgets {budgets!r}: choose among {','.join(map(str, BUDGETS))}")
    if regime not in REGIMES:
        problems.append(f"--regime {regime!r}: choose one of {', '.join(sorted(REGIMES))}")
    if bad := [m for m in modes if m not in EXPAND_MODES]:
        problems.append(f"--expand-modes: unknown {', '.join(bad)}; choose from {', '.join(EXPAND_MODES)}")
    if any(v is not None and v < 1 for v in (steps, prompts_per_step, eval_every)) or seeds < 1 or jobs < 1:
        problems.append("--seeds, --jobs, --steps, --prompts-per-step and --eval-every must be >= 1")
    if lr is not None and not lr > 0:
        problems.append("--lr must be > 0")
    if task not in ("search", "sql"):
        problems.append(f"--task {task!r}: choose search or sql")
    elif task != "search" and not gigpo:
        problems.append("--task sql needs --gigpo (the chain vs tree table on SQL is `treegrpo bench stateful`)")
    if eval_prompts is not None and (eval_prompts < 1 or not gigpo):
        problems.append("--eval-prompts needs --gigpo and must be >= 1")
    if matched not in ("nominal", "tokens"):
        problems.append(f"--matched {matched!r}: choose nominal or tokens")
    elif matched == "tokens" and gigpo:
        problems.append("--matched tokens is the chain vs tree table: drop --gigpo")
    if gigpo and (quick or worlds or (modes and tuple(modes) != EXPAND_MODES)):
        problems.append("--gigpo runs budgets 2,4 (or --budgets) with random picks on the regime's world: drop --quick, --world-seed and --expand-modes")
    if problems:
        _fail("error: " + "; ".join(problems))
    if gigpo:
        from treegrpo.benchmarks.learn import run_gigpo_bench

        run_gigpo_bench(
            out, task=task, regime=regime, seeds=seeds, jobs=jobs, steps=steps, lr=lr, prompts_per_step=prompts_per_step,
            eval_every=eval_every, eval_prompts=eval_prompts, budgets=budget_list or None, resume=resume,
        )  # fmt: skip
        return
    default = Path(f"benchmarks/results/learn_tokens_{regime}.json" if matched == "tokens" else "benchmarks/results/learn.json")
    run_bench(
        out or default, regime=regime, quick=quick, world_seeds=worlds or None, seeds=seeds, jobs=jobs, steps=steps,
        lr=lr, prompts_per_step=prompts_per_step, eval_every=eval_every, expand_modes=modes or None,
        budgets=budget_list or None, resume=resume, matched=matched,
    )


@bench.command("default")
def bench_default_cmd(
    out: Path = typer.Option(Path("benchmarks/results/default_run.json"), help="Results JSON (plot next to it, .png)."),
    seeds: str = typer.Option("0,1,2,3,4", help="Comma-separated RL seeds (--seed of each run)."),
    kernels: str = typer.Option("native,default", help="Comma-separated torch CPU kernel sets (ATEN_CPU_CAPABILITY; native: the CPU's own), each from a clean cache of its own."),
    other_seeds: str = typer.Option("", help="Seeds of the kernel sets after the first (default: --seeds)."),
    work: Path = typer.Option(Path("runs/bench-default"), help="Work folder: the runs, their logs and each kernel set's cache (finished runs are kept)."),
    jobs: int = typer.Option(2, help="Runs in parallel (one torch thread each)."),
    label: str = typer.Option("current", help="The spread's name in the results JSON (other spreads there are kept)."),
    about: str = typer.Option("", help="One line on what this spread is (default: the code it ran)."),
    headline: bool = typer.Option(True, help="Make this spread the one the README shows."),
    source: Path | None = typer.Option(None, help="A checkout whose src/ the runs import (default: this treegrpo)."),
) -> None:
    """The spread of the default run (`treegrpo train` with no arguments) over RL seeds and CPU
    kernel sets: held-out success at the start and the end of every run, each kernel set
    bootstrapping its own tiny agent as a fresh machine would."""
    from treegrpo.benchmarks.default_run import plot_spreads, run_spread, write_spread
    from treegrpo.benchmarks.provenance import invocation
    from treegrpo.errors import ConfigError

    seed_list = _ints(seeds, "--seeds")
    others = _ints(other_seeds, "--other-seeds") if other_seeds.strip() else None
    kernel_list = [k.strip() for k in kernels.split(",") if k.strip()]
    if jobs < 1 or any(len(set(x)) != len(x) for x in (seed_list, others or ())):
        _fail("error: --jobs must be >= 1 and --seeds, --other-seeds distinct")
    if source is not None and not (source / "src" / "treegrpo").is_dir():
        _fail(f"error: --source {source}: no src/treegrpo there; give a treegrpo checkout")
    try:
        rows = run_spread(work, seed_list, kernel_list, jobs=jobs, source=source, log=_log, other_seeds=others)
        text = about or f"the default run at commit {rows[0]['code']['commit']}"
        write_spread(out, label, rows, text, shlex.join(invocation()), headline=headline, plot=plot_spreads, log=_log)
    except ConfigError as e:
        _fail(f"error: {e}")
    except RuntimeError as e:
        _fail(f"error: {e}", code=1)


@bench.command("stateful")
def bench_stateful_cmd(
    out: Path = typer.Option(Path("benchmarks/results/stateful.json"), help="Results JSON (plot next to it, .png)."),
    quick: bool = typer.Option(False, "--quick", help="A few seconds of every part (a smoke test)."),
    seeds: int = typer.Option(2, help="RL seeds per configuration, paired across chain and tree."),
    steps: int = typer.Option(10, help="RL steps per learning run."),
    prompts_per_step: int = typer.Option(8, help="Prompts per RL step."),
    lr: float = typer.Option(5e-4, help="Learning rate (the train default)."),
    eval_prompts: int = typer.Option(100, help="Held-out questions per evaluation."),
    skip_learn: bool = typer.Option(False, "--skip-learn", help="Cost and exactness only (no training runs)."),
) -> None:
    """Stateful tools: restore vs replay cost per expansion (SQL env, by depth), exactness over
    random trees of mutating actions (mismatches), chain vs Tree-GRPO learning on --task sql at
    budgets 2 and 4."""
    from treegrpo.benchmarks.stateful import run_bench

    if min(seeds, steps, prompts_per_step, eval_prompts) < 1 or not lr > 0:
        _fail("error: --seeds, --steps, --prompts-per-step and --eval-prompts must be >= 1 and --lr > 0")
    run_bench(
        out, quick=quick, seeds=seeds, steps=steps, prompts_per_step=prompts_per_step, lr=lr,
        eval_prompts=eval_prompts, skip_learn=skip_learn, log=_log,
    )


@bench.command("real")
def bench_real_cmd(
    out: Path | None = typer.Option(None, help="Results JSON, plot next to it (.png) [default: benchmarks/results/real.json; with --table real_table.json]."),
    work: Path = typer.Option(Path("runs/bench-real"), help="Work folder: warm-up model, RL runs, step runs (a finished stage is reused)."),
    model: str = typer.Option("smollm2-135m", help="Starting model (a --model reference). With --table, a folder with a warm-up record is the table's start as it is; any other model is warmed up first (the warm-up stage)."),
    table: bool = typer.Option(False, "--table", help="The budget table instead of the three stages: chain vs Tree-GRPO at the paper's matched budgets, paired per seed, greedy and sampled held-out EM (resumable run by run)."),
    budgets: str = typer.Option("2,4", help="--table: chain budgets, each paired with the paper's tree (2: (1,2,1), 4: (2,2,1), 8: (2,6,1), 16: (4,5,1))."),
    seeds: str = typer.Option("0,1", help="--table: seeds; one chain/tree pair per budget and seed."),
    eval_every: int = typer.Option(0, help="--table: steps between held-out evaluations inside a run (the EM curve); 0 = the end only."),
    matched: str = typer.Option("nominal", help="--table: nominal (the paper's tree shapes) | tokens (the tree token-matched to its chain: budget_tokens chain:B; compared at equal generated tokens and tool calls)."),
    eval_every_tokens: int = typer.Option(0, help="--table: also evaluate every this many generated tokens (sampled only; the EM-per-token curve)."),
    probe_prompts: int = typer.Option(0, help="--table --matched tokens: before the runs, the fraction of informative groups (leaves that disagree) at the start on this many training prompts, per sampler."),
    select_prompts: int = typer.Option(0, help="--table: before the runs, sample this many training questions 4 times each from the start and train every run only on those whose samples disagree (the questions the start is unsure of); 0 = every training question."),
    jobs: int = typer.Option(1, help="--table: runs trained at once, each in its own process (one torch thread each; an evaluation of 128 questions peaks near 10 GB, so 2 on a 24 GB machine)."),
    data: str = typer.Option("wiki-vital-qa", help="Questions (a --data reference)."),
    corpus: str = typer.Option("wiki-vital", help="Retriever corpus (BM25, in process)."),
    demos: int = typer.Option(96, help="Warm-up demonstrations."),
    sft_lr: float = typer.Option(1e-4, help="Warm-up AdamW learning rate."),
    sft_batch: int = typer.Option(4, help="Warm-up demonstrations per optimizer step."),
    eval_prompts: int | None = typer.Option(None, help="Held-out questions per evaluation [default: 16 greedy; with --table 128, greedy and sampled]."),
    rl_steps: int = typer.Option(4, help="Steps of each paired RL run (tree (2,2,1) and chain 4)."),
    prompts_per_step: int = typer.Option(2, help="Prompts per RL step."),
    rl_lr: float = typer.Option(1e-5, help="RL learning rate (a few steps: above the 1e-6 full fine-tuning default)."),
    seed: int = typer.Option(0, help="Seed of both RL runs (prompt order, sampling)."),
    cost_prompts: int = typer.Option(4, help="Prompts of the engine vs model.generate comparison."),
    modes: str = typer.Option("paths,packed,lora", help="One-step runs measured in their own processes."),
    sets: list[str] = typer.Option([], "--set", help="Any TrainConfig field for every stage: --set key=value."),
) -> None:
    """A real pretrained model end to end (SmolLM2-135M-Instruct on wiki-vital-qa): warm-up
    well-formed rate and EM before/after, paired tree (2,2,1) vs chain 4 RL, engine vs
    model.generate tokens per CPU-second, update seconds and peak RSS per path / packed / LoRA."""
    from treegrpo.benchmarks.real import RealSpec, run_bench
    from treegrpo.benchmarks.real_costs import MODES
    from treegrpo.errors import ConfigError
    from treegrpo.training.config_files import parse_set

    mode_list = tuple(m.strip() for m in modes.split(",") if m.strip())
    eval_prompts = eval_prompts or (128 if table else 16)
    if bad := [m for m in mode_list if m not in MODES]:
        _fail(f"error: unknown --modes {bad}; choose from {', '.join(MODES)}")
    if min(demos, sft_batch, eval_prompts, rl_steps, prompts_per_step, cost_prompts, jobs) < 1 or not (sft_lr > 0 and rl_lr > 0):
        _fail("error: counts must be >= 1 and --sft-lr, --rl-lr > 0")
    try:
        overrides = parse_set(sets)
    except ConfigError as e:
        _fail(f"error: {e}")
    spec = RealSpec(
        model=model, data=data, corpus=corpus, demos=demos, sft_lr=sft_lr, sft_batch=sft_batch,
        eval_prompts=eval_prompts, rl_steps=rl_steps, prompts_per_step=prompts_per_step, rl_lr=rl_lr, seed=seed,
        cost_prompts=cost_prompts, cost_modes=mode_list, overrides=overrides,
    )  # fmt: skip
    try:
        if table:
            from treegrpo.benchmarks.real import table_bench

            table_bench(spec, work, out or Path("benchmarks/results/real_table.json"), _ints(budgets, "--budgets"),
                        _ints(seeds, "--seeds"), eval_every, _log, matched, eval_every_tokens, probe_prompts,
                        select_prompts, jobs)  # fmt: skip
            return
        run_bench(spec, work, out or Path("benchmarks/results/real.json"), log=_log)
    except ConfigError as e:
        _fail(f"error: {e}")


@bench.command("scale")
def bench_scale_cmd(
    out: Path = typer.Option(Path("benchmarks/results/scale.json"), help="Results JSON (plot next to it, .png)."),
    steps: int = typer.Option(6, help="RL steps per world size (the first is dropped as warm-up)."),
    nproc: int = typer.Option(2, help="Processes to compare with one."),
    model: str | None = typer.Option(None, help="--model of the runs (default: the bootstrapped default agent)."),
    set_: list[str] = typer.Option([], "--set", help="Extra TrainConfig fields of the runs (key=value, repeatable)."),
) -> None:
    """1 vs K data-parallel processes on the default run: CPU seconds per step of the slowest
    rank, scaling efficiency, rollout/update split."""
    from treegrpo.benchmarks.scale import run_bench

    extra = [x for kv in set_ for x in ("--set", kv)]
    try:
        run_bench(out, steps=steps, worlds=(1, nproc), model=model, extra=extra, log=_log)
    except RuntimeError as e:
        _fail(f"error: {e}")


@bench.command("peers")
def bench_peers_cmd(
    model: str | None = typer.Option(None, help="Required (but with --write-docs): the single-turn job's starting folder both sides load: a `treegrpo warmup --demos WORK/job/single_turn_demos.jsonl` output (docs/benchmarks.md)."),
    tools_model: str | None = typer.Option(None, help="The multi-turn job's starting folder: a `treegrpo warmup --protocol tools --chat-template chatml-tools` output (default: --model)."),
    out: Path = typer.Option(Path("benchmarks/results/peers.json"), help="Results JSON (plot next to it, .png)."),
    work: Path = typer.Option(Path("runs/bench-peers"), help="Work folder: the job files and one folder per row (a finished row is reused)."),
    steps: int = typer.Option(8, help="RL steps K of every row (the table: medians over steps 2..K)."),
    repeats: int = typer.Option(2, help="Runs of every row, interleaved (repeat r: seed + r on every row); the table gives the median and spread."),
    malloc_mmap_threshold: int = typer.Option(1 << 20, help="glibc MALLOC_MMAP_THRESHOLD_ (bytes) in every row's environment, the same on both sides (0: unset)."),
    eval_prompts: int = typer.Option(64, help="Held-out questions (greedy EM) before and after."),
    prompts_per_step: int = typer.Option(2, help="Prompts per step."),
    group_size: int = typer.Option(4, help="Completions per prompt (TRL num_generations, treegrpo chain group_size)."),
    max_new_tokens: int = typer.Option(48, help="Cap on tokens per completion / agent step."),
    lr: float = typer.Option(1e-5, help="AdamW learning rate (constant) of both sides."),
    loss: str = typer.Option("token-mean", help="treegrpo agg_mode; TRL gets the loss_type computing the same loss (token-mean=dapo, seq-mean-token-mean=grpo, seq-mean-token-sum-norm=dr_grpo)."),
    seed: int = typer.Option(0, help="Seed of every row's first repeat (prompt order, sampling)."),
    threads: int = typer.Option(0, help="torch CPU threads of every row (0: torch's default)."),
    data: str = typer.Option("wiki-vital-qa", help="Questions (a --data reference)."),
    eval_data: str | None = typer.Option(None, help="Held-out questions (default: the set's own held-out split)."),
    corpus: str = typer.Option("wiki-vital", help="Retriever corpus (BM25, in process)."),
    topk: int = typer.Option(3, help="Passages per search, and in the single-turn prompt."),
    max_turns: int = typer.Option(4, help="Multi-turn job: turns with search allowed (then one final turn)."),
    max_obs_tokens: int = typer.Option(600, help="Multi-turn job: observation tokens kept per step."),
    max_context_tokens: int = typer.Option(3072, help="Longest context of a treegrpo trajectory."),
    jobs: str = typer.Option("single_turn,multi_turn", help="Comma-separated jobs: single_turn, multi_turn, long_completion (opt-in: short prompts, ~256-token completions)."),
    rows: str = typer.Option("", help="Comma-separated rows (default: all of the jobs'): single_turn/trl, single_turn/chain, single_turn/chain_no_sharing, single_turn/chain_no_packing, multi_turn/trl, multi_turn/chain, multi_turn/tree_2_2_1, multi_turn/tree_2_2_1_no_sharing, multi_turn/tree_2_2_1_no_packing, long_completion/trl, long_completion/chain."),
    sets: list[str] = typer.Option([], "--set", help="Any TrainConfig field of the treegrpo rows and every evaluation: --set key=value."),
    write_docs: bool = typer.Option(False, "--write-docs", help="No run: rewrite the tables of docs/benchmarks.md and the README's row from --out's results."),
    prepare_only: bool = typer.Option(False, "--prepare-only", help="Only write the single-turn job's files into WORK/job (its questions with their passages and the warm-up demonstrations) and print the warm-up command."),
) -> None:
    """TRL's GRPOTrainer vs treegrpo on the same jobs (same starting folder, prompts and order, G,
    token cap, lr, no KL, the same loss, the same allocator setting; the multi-turn job through
    TRL's tools=): CPU-seconds per trajectory, work per phase, completion lengths, peak RSS per row
    (each in its own process, repeats interleaved), held-out EM before/after, paired by seed."""
    from treegrpo.benchmarks.peers import ROWS, PeersSpec, prepare_single_turn, run_bench
    from treegrpo.errors import ConfigError
    from treegrpo.training.config_files import parse_set

    if model is None and not write_docs:
        _fail("error: --model is required: the single-turn job's starting folder (docs/benchmarks.md)", code=2)
    try:
        spec = PeersSpec(
            model=model or "", tools_model=tools_model, repeats=repeats, malloc_mmap_threshold=malloc_mmap_threshold,
            data=data, eval_data=eval_data, corpus=corpus, topk=topk, max_turns=max_turns,
            max_obs_tokens=max_obs_tokens, max_context_tokens=max_context_tokens, steps=steps, eval_prompts=eval_prompts,
            prompts_per_step=prompts_per_step, group_size=group_size, max_new_tokens=max_new_tokens, lr=lr,
            loss=loss, seed=seed, threads=threads, jobs=tuple(j.strip() for j in jobs.split(",") if j.strip()),
            rows=tuple(r.strip() for r in rows.split(",") if r.strip()) or tuple(ROWS), overrides=parse_set(sets),
        )  # fmt: skip
        if write_docs:
            import json

            from treegrpo.benchmarks.peers_report import write_docs as rewrite

            rewrite(json.loads(out.read_text()), Path("docs/benchmarks.md"), Path("README.md"))
            _log(f"rewrote the bench peers tables of docs/benchmarks.md and README.md from {out}")
        elif prepare_only:
            prepare_single_turn(spec, work, log=_log)
        else:
            run_bench(spec, work, out, log=_log)
    except ConfigError as e:
        _fail(f"error: {e}")
    except RuntimeError as e:  # a row failed: its log's tail under the one-line error
        first, *rest = str(e).splitlines() or [""]
        _fail(f"error: {first}\n" + "\n".join(rest), code=1)


@bench.command("tools")
def bench_tools_cmd(
    out: Path = typer.Option(Path("benchmarks/results/tools.json"), help="Results JSON (plot next to it, .png)."),
    work: Path = typer.Option(Path("runs/bench-tools"), help="Work folder: one run folder per row, the warmed-up SmolLM2."),
    quick: bool = typer.Option(False, "--quick", help="A smoke test: the tiny job, 2 prompts per step, 1 warm-up and 1 measured step."),
    jobs: str = typer.Option("tiny,smollm2", help="Comma-separated jobs: tiny (the default job, search per query) | smollm2 (its own tool calls; TRL's row)."),
    samplers: str = typer.Option("tree,chain", help="Comma-separated samplers: tree (2,2,1) | chain 4."),
    latencies: str = typer.Option("none,constant,heavy", help="Comma-separated tool latencies (none is the baseline, always run)."),
    steps: int = typer.Option(3, help="Measured steps per row (after --warmup steps)."),
    warmup: int = typer.Option(1, help="Unmeasured steps at the start of each row."),
    prompts_per_step: int | None = typer.Option(None, help="Prompts per step of the tiny job (default: train's 16; --quick 2)."),
    smollm2_model: str | None = typer.Option(None, help="The smollm2 job's starting folder (default: made once in --work)."),
    model: str | None = typer.Option(None, help="The tiny job's --model (default: the bootstrapped default agent)."),
    sets: list[str] = typer.Option([], "--set", help="TrainConfig fields of the tiny job's rows: --set key=value."),
    trl: bool = typer.Option(True, "--trl/--no-trl", help="TRL's tools= rows beside chain 4."),
    resume: bool = typer.Option(False, "--resume", help="Keep the finished rows of --out (same settings)."),
) -> None:
    """Wall per step of a tool agent against its tools' latency: the default job with its search as
    a per-query tool and SmolLM2 with its own tool calls; constant 200 ms and heavy-tailed tools;
    tool_concurrency=1, concurrent, pipelined, the no-latency baseline and TRL's tools= loop."""
    from treegrpo.benchmarks.tools import JOBS, SAMPLERS, ToolsSpec, run_bench
    from treegrpo.benchmarks.tools_env import LATENCIES
    from treegrpo.errors import ConfigError
    from treegrpo.training.config_files import parse_set

    given = {"jobs": jobs, "samplers": samplers, "latencies": latencies}
    lists = {n: tuple(x.strip() for x in v.split(",") if x.strip()) for n, v in given.items()}
    for name, allowed in (("jobs", JOBS), ("samplers", SAMPLERS), ("latencies", LATENCIES)):
        if not lists[name] or any(x not in allowed for x in lists[name]):
            _fail(f"error: --{name} {given[name]!r}: choose among {','.join(allowed)}")
    if steps < 1 or warmup < 0 or (prompts_per_step is not None and prompts_per_step < 1):
        _fail("error: --steps and --prompts-per-step must be >= 1, --warmup >= 0")
    try:
        spec = ToolsSpec(
            jobs=("tiny",) if quick else lists["jobs"], samplers=lists["samplers"],
            latencies=tuple(dict.fromkeys(("none", *lists["latencies"]))), steps=1 if quick else steps,
            warmup=min(warmup, 1) if quick else warmup, prompts_per_step=prompts_per_step or (2 if quick else 16),
            smollm2_model=smollm2_model, model=model, sets=parse_set(sets), trl=trl,
        )  # fmt: skip
        run_bench(spec, out, work, resume, _log)
    except ConfigError as e:
        _fail(f"error: {e}")


def _ints(text: str, flag: str) -> tuple[int, ...]:
    """A comma-separated list of integers, or a one-line error naming ``flag``."""
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        out = ()
    if not out:
        _fail(f"error: {flag} {text!r}: give comma-separated integers, e.g. {flag} 0,1")
    return out
