"""``treegrpo plan --measure``: run a :class:`~treegrpo.rollout.planner.Plan` and the matched chains
on the bootstrapped agent and compare the planner's predicted cost with the measured one.

The planning itself (cost model, shape choice) is the library's :mod:`treegrpo.rollout.planner`;
this module only measures, through the budget benchmark's runner
(:func:`treegrpo.benchmarks.budget.run_once`).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from treegrpo.benchmarks.budget import AgentParts, RunSpec, load_agent, run_once
from treegrpo.benchmarks.runner import torch_threads
from treegrpo.rollout.planner import Plan


def measure_plan(
    plan: Plan,
    model_dir: str | Path | None = None,
    prompts: int = 16,
    seed: int = 0,
    agent: AgentParts | None = None,
    threads: int | None = 1,
) -> dict[str, Any]:
    """Run the plan's tree rollout and the matched chain rollout (``⌊B⌋`` chains) on the default
    agent (prefix reuse on) for ``prompts`` training questions and compare predicted with measured
    cost. ``agent`` replaces the default agent (``model_dir`` is then ignored); ``threads`` sets
    torch's intra-op threads meanwhile (restored after; ``None`` leaves them).

    Returns a dict with the measured chain cost (``chain_tokens`` per chain), the tree's measured
    generated tokens per prompt, its measured cost in chain units, the predicted cost in chain
    units (with the plan's ``f``), ``f_measured`` (the ``f`` that would have predicted the measured
    cost exactly; ``None`` for a chain plan), ``ratio`` (measured / predicted), and per-prompt tool
    calls and wall seconds of both rollouts.
    """
    with torch_threads(threads):
        return _measure(plan, agent or load_agent(model_dir), prompts, seed)


def _measure(plan: Plan, agent: AgentParts, prompts: int, seed: int) -> dict[str, Any]:
    tasks = random.Random(seed).sample(agent.tasks, min(prompts, len(agent.tasks)))
    g = plan.chain_trajectories
    chain = run_once(agent, tasks, RunSpec("chain", g, g, 0, 0, None), reuse=True, seed=seed)
    plan_spec = (
        RunSpec("tree", g, plan.m, plan.n, plan.l, "random")
        if plan.mode == "tree"
        else RunSpec("chain", g, plan.m, 0, 0, None)
    )
    tree = run_once(agent, tasks, plan_spec, reuse=True, seed=seed)
    k = len(tasks)
    chain_tok = chain.total.generated_tokens / (k * g)
    measured_chains = tree.total.generated_tokens / k / chain_tok if chain_tok else float("nan")
    f_measured = None
    if plan.mode == "tree" and chain_tok:
        f_measured = (measured_chains / plan.m - 1) / (plan.l * plan.n)
    return {
        "prompts": k,
        "seed": seed,
        "chain": {"chains": g, "generated_tokens_per_prompt": chain.total.generated_tokens / k,
                  "tool_calls_per_prompt": chain.total.tool_calls / k, "wall_s": chain.wall_s},
        "tree": {"shape": [plan.m, plan.n, plan.l], "trajectories_per_prompt": plan.trajectories,
                 "generated_tokens_per_prompt": tree.total.generated_tokens / k,
                 "tool_calls_per_prompt": tree.total.tool_calls / k, "wall_s": tree.wall_s},
        "chain_tokens": chain_tok,
        "predicted_cost_chains": plan.predicted_cost_chains,
        "predicted_tokens_per_prompt": plan.predicted_cost_chains * chain_tok,
        "measured_cost_chains": measured_chains,
        "ratio": measured_chains / plan.predicted_cost_chains,
        "f_measured": f_measured,
    }  # fmt: skip


__all__ = ["measure_plan"]
