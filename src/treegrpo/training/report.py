"""What a run reports: per-step rollout statistics (:func:`rollout_metrics`, :func:`tool_metrics`) and the console
lines (:func:`run_shape`, :func:`fmt_eval`, :func:`step_line`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from treegrpo.retrieval.base import retrieval_error_warning
from treegrpo.rollout.agent import LoopStats, RolloutResult
from treegrpo.rollout.pipeline import chain_latency
from treegrpo.training.config import TrainConfig
from treegrpo.tree import Forest


def rollout_metrics(result: RolloutResult, n_traj: int) -> dict[str, float]:
    """Reward, trajectory shape and budget figures of one rollout batch, and the engine's model work
    (``engine/*``, :meth:`~treegrpo.rollout.engine.EngineStats.metrics`) when it was counted."""
    leaves = [leaf for f in result.forests for _, leaf in f.leaves()]
    rewards = [float(leaf.reward or 0.0) for leaf in leaves]
    b = result.total()
    turns = [int(leaf.extra.get("turn", 0)) for leaf in leaves]
    answered = [leaf.extra.get("kind") == "answer" for leaf in leaves]
    solved_prompts = sum(any((leaf.reward or 0) > 0 for _, leaf in f.leaves()) for f in result.forests)
    # groups with a non-zero advantage signal: forests whose leaves disagree
    informative = sum(len({leaf.reward for _, leaf in f.leaves()}) > 1 for f in result.forests)
    per_fn: dict[str, list[float]] = {}
    for leaf in leaves:  # reward functions, each by name (ToolEnv, reward_funcs=[...])
        for name, v in (leaf.extra.get("rewards") or {}).items():
            per_fn.setdefault(name, []).append(float(v))
    return {
        **{f"rewards/{name}": sum(v) / len(v) for name, v in per_fn.items()},  # TRL's key
        "reward/mean": sum(rewards) / max(1, len(rewards)),
        "reward/pass_at_group": solved_prompts / max(1, len(result.forests)),
        "rollout/trajectories": n_traj,
        "rollout/turns_mean": sum(turns) / max(1, len(turns)),
        "rollout/answered_frac": sum(answered) / max(1, len(answered)),
        "rollout/informative_groups": informative / max(1, len(result.forests)),
        "budget/generated_tokens": b.generated_tokens,
        "budget/prefill_tokens": b.prefill_tokens,
        "budget/tool_calls": b.tool_calls,
        "budget/engine_calls": result.engine_calls,
        "budget/invalid_actions": b.invalid_actions,
        "budget/retrieval_errors": b.retrieval_errors,
        "budget/context_overflows": b.context_overflows,
        "budget/tool_calls_per_traj": b.tool_calls / max(1, n_traj),
        "budget/traj_per_1k_tokens": 1000.0 * n_traj / max(1, b.generated_tokens),
        **(result.engine_stats.metrics() if result.engine_stats is not None else {}),  # engine/*: padding too
    }


def run_shape(cfg: TrainConfig) -> str:
    """The rollout shape of ``cfg`` in the paper's notation, for the run banner."""
    if cfg.sampler == "eptree":
        return f"(M,N,L,T)=({cfg.m},{cfg.n},{cfg.l},{cfg.t}) fork at {cfg.fork_score}"
    return (
        f"G={cfg.group_size}"
        if cfg.sampler == "chain"
        else f"(M,N,L)=({cfg.m},{cfg.n},{cfg.l}) {cfg.expand_mode}"
    )


def fmt_eval(ev: dict[str, float]) -> str:
    """Held-out success figures of an evaluation, for a console line."""
    parts = [f"greedy {ev['eval/success_greedy']:.3f}"] if "eval/success_greedy" in ev else []
    if "eval/success_sampled" in ev:
        parts.insert(0, f"sampled {ev['eval/success_sampled']:.3f}")
    return " · ".join(parts)


def eval_label(env: object) -> str:
    """What held-out figures are called: ``success`` when the env's rewards are 0/1
    (``binary_reward``), else ``reward`` (a mean of shaped rewards is not a success rate)."""
    return "success" if getattr(env, "binary_reward", False) else "reward"


def step_line(step: int, m: dict[str, float], label: str = "success") -> str:
    """The console line of one training step (with held-out figures on evaluation steps; ``label``:
    :func:`eval_label`)."""
    line = (
        f"step {step:4d} · reward {m['reward/mean']:.3f} · traj {int(m['rollout/trajectories'])} · "
        f"gen tok {int(m['budget/generated_tokens'])} · tools/traj {m['budget/tool_calls_per_traj']:.2f} · "
        f"turns {m['rollout/turns_mean']:.2f} · {m['time/rollout_s']:.1f}s+{m['time/update_s']:.1f}s"
    )
    if "tools/wall_s" in m:  # tools with latency: where the rollout's time went (tool_metrics)
        line += (
            f" · tools {m['tools/wall_s']:.1f}s peak {int(m['tools/peak_in_flight'])} "
            f"idle {m['time/engine_idle_s']:.1f}s chain {m['tools/chain_latency_s']:.1f}s"
        )
    if "eval/success_greedy" in m or "eval/success_sampled" in m:
        word = "" if label == "success" else f"{label} "
        line += f" · [bold]held-out {word}{fmt_eval(m)}[/]"
    return line


def tool_metrics(loop: LoopStats, tools: dict[str, Any] | None, forests: Sequence[Forest]) -> dict[str, float]:
    """What one rollout's tools cost in time: ``tools/wall_s`` (seconds with a call in flight: the
    env's ``tool_stats`` ``busy_s``, else the loop's seconds with an env step out),
    ``tools/peak_in_flight`` (the env's calls in flight at peak, else the loop's steps out at
    once), ``tools/calls`` and ``tools/abandoned`` (the env's, when it counts them),
    ``time/engine_idle_s`` (the engine waiting for tools), ``time/engine_s`` and
    ``tools/chain_latency_s`` (the longest chain of dependent calls:
    :func:`~treegrpo.rollout.pipeline.chain_latency`)."""
    out = {
        "tools/wall_s": float(tools["busy_s"]) if tools else loop.env_s,
        "tools/peak_in_flight": float(tools["peak_in_flight"]) if tools else float(loop.peak_in_flight),
        "time/engine_idle_s": loop.idle_s,
        "time/engine_s": loop.engine_s,
        "tools/chain_latency_s": chain_latency(forests),
    }
    if tools:
        out.update({"tools/calls": float(tools["calls"]), "tools/abandoned": float(tools["abandoned"])})
    return out


def step_warnings(m: dict[str, float]) -> list[str]:
    """Console warnings a step's metrics call for (plain text, one line each): searches failing
    (:func:`~treegrpo.retrieval.base.retrieval_error_warning`), prompts that did not fit the context."""
    out = []
    retrieval = retrieval_error_warning(int(m["budget/retrieval_errors"]), int(m["budget/tool_calls"]))
    if retrieval:
        out.append(retrieval)
    if m.get("update/skipped_steps"):
        out.append(
            f"warning: {int(m['update/skipped_steps'])} optimizer step(s) skipped: the loss or gradient was not "
            f"finite (loss/total={m.get('loss/total')}); the weights and optimizer state were left unchanged"
        )
    if m.get("budget/context_overflows"):
        out.append(
            f"warning: {int(m['budget/context_overflows'])} trajectories ended before their first step: the "
            "prompt leaves no room for a step within max_context_tokens (raise it or shorten the prompts)"
        )
    return out


__all__ = ["eval_label", "fmt_eval", "rollout_metrics", "run_shape", "step_line", "step_warnings", "tool_metrics"]
