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


def main() -> None:
    app()


if __name__ == "__main__":
    main()
