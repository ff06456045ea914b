"""`treegrpo train`: run the trainer and print the closing summary."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from treegrpo.models.loader import LoadedModel
from treegrpo.tasks.custom import UserObjects
from treegrpo.training.config import TrainConfig
from treegrpo.training.distributed import global_rank
from treegrpo.training.trainer import TrainSummary, train


def summary_table(s: TrainSummary) -> Table:
    """Start vs end held-out success (or mean reward, for rewards that are not 0/1) and the measured
    budget of the run."""
    t = Table(title="treegrpo run summary", show_header=True)
    t.add_column("")
    t.add_column("start", justify="right")
    t.add_column("end", justify="right")
    word = s.eval_label
    for key, label in (("eval/success_sampled", f"held-out {word}, sampled T=1"), ("eval/success_greedy", f"held-out {word}, greedy")):
        if key in s.eval_start:
            t.add_row(label, f"{s.eval_start[key]:.3f}", f"{s.eval_end.get(key, float('nan')):.3f}")
    for key, label in (("eval/tool_calls_sampled", "tool calls / trajectory (eval, sampled)"), ("eval/tool_calls_greedy", "tool calls / trajectory (eval, greedy)")):
        if key in s.eval_start:
            t.add_row(label, f"{s.eval_start[key]:.2f}", f"{s.eval_end.get(key, float('nan')):.2f}")
    t.add_section()
    t.add_row("trajectories trained", "", f"{s.trajectories}")
    t.add_row("generated tokens", "", f"{s.generated_tokens}")
    t.add_row("prefill tokens computed", "", f"{s.prefill_tokens}")
    t.add_row("tool calls", "", f"{s.tool_calls}")
    t.add_row("trajectories per 1k generated tokens", "", f"{s.trajectories_per_1k_tokens:.2f}")
    t.add_row("tool calls per trajectory (training)", "", f"{s.tool_calls_per_trajectory:.2f}")
    t.add_row("wall time (rollout + update)", "", f"{s.wall_s:.0f}s ({s.rollout_s:.0f}s + {s.update_s:.0f}s)")
    return t


def run_training(
    cfg: TrainConfig, console: Console | None = None, user: UserObjects | None = None, loaded: LoadedModel | None = None
) -> TrainSummary:
    """:func:`~treegrpo.training.trainer.train`, then the closing summary — printed by the process of
    global rank 0 only, the one that wrote the outputs (every rank of a torchrun job returns the
    summary; a second node has a local rank 0 too). ``user``/``loaded``: a Python caller's objects
    (:func:`treegrpo.train`)."""
    console = console or Console(soft_wrap=True)
    s = train(cfg, console, user=user, loaded=loaded)
    if global_rank() != 0:
        return s
    console.print(summary_table(s))
    console.print(
        f"outputs in [bold]{s.out_dir}[/]: metrics.jsonl, summary.json, checkpoint/ (a from_pretrained folder), rollouts/*.jsonl"
    )
    return s
