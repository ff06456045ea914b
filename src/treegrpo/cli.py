"""The ``treegrpo`` command line."""

from __future__ import annotations

import typer

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Train LLM agents with RL from tree-search rollouts (Tree-GRPO, TreeRL) and chain GRPO.",
    pretty_exceptions_enable=False,
)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
