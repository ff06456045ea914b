"""``treegrpo bench budget``: chain vs Tree-GRPO rollouts at the paper's matched budgets.

On the same prompts (a fixed sample of the world's ``train`` split), the same model (the default
bootstrapped tiny agent, ``ensure_bootstrapped("default")``, with the env and agent settings it was
trained with) and the same seed, every configuration is rolled out through the library's own
samplers and engine (:class:`~treegrpo.rollout.hf_engine.HFEngine`, default settings), with prefix
KV reuse on and off:

- ``chain`` at budgets 2 / 4 / 8 / 16 (``G`` chains per prompt; rows carry ``M = G, N = L = 0``);
- ``tree`` at the paper's matched shapes (M, N, L) = (1,2,1), (2,2,1), (2,6,1), (4,5,1) (DESIGN.md
  §5.3), each with ``expand_mode`` ``random`` (official: the root is eligible, a root pick is a
  whole new chain) and ``nonroot``.

One row per (configuration, prefix reuse) with exactly :data:`ROW_KEYS`: trajectories, generated
tokens, prefill tokens computed, tool calls (sums over all prompts) and wall seconds (the
sampler's own ``RolloutResult.wall_s``; for the timing-critical configurations the median of the
repeats).

**Side by side.** Every configuration runs with both reuse settings back to back (alternating
which goes first), configurations interleaved by budget (chain b, tree random, tree nonroot, …);
then the timing-critical block (chain 4, tree (2,2,1) random / nonroot, both reuse settings) is
run ``repeats`` more times in rotated order (their run in the sweep is their warm-up: it sits
between other configurations, and first runs were measured up to 40 % slower than repeats). The
wall-time target is the median over these repeats of the *paired* ratio (tree and chain timed in
the same repeat, close in time). Process CPU seconds are recorded too (``cpu_s``; less sensitive
to other processes on a shared machine). torch runs with one intra-op thread by default
(``threads``). Counts do not depend on timing: the same seed
gives the same forests on every repeat (checked).

The agent and the instrumentation (init vs expansion cost, the model's work) are
:mod:`.budget_parts`; the analysis (``phases``, ``checks``, ``targets``), the table and the plot :mod:`.budget_report`.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from treegrpo.benchmarks.budget_parts import (
    AgentParts,
    PhaseRunner,
    RecordingEngine,
    count_forwards,
    load_agent,
)
from treegrpo.benchmarks.budget_report import (
    Call,
    document,
    expected_fractions,
    forest_counts,
    phase_costs,
    pick_stats,
    plot,
    print_table,
)
from treegrpo.benchmarks.provenance import provenance
from treegrpo.benchmarks.runner import Shape, torch_threads, write_result
from treegrpo.envs.base import Task
from treegrpo.rollout.agent import Budget, RolloutResult
from treegrpo.rollout.planner import PAPER_PAIRS
from treegrpo.rollout.samplers import SamplerConfig, get_sampler
from treegrpo.tree import Forest

#: The keys of a result row, exactly.
ROW_KEYS: tuple[str, ...] = (
    "mode", "budget", "M", "N", "L", "expand_mode", "prefix_reuse", "prompts", "trajectories", "generated_tokens",
    "prefill_tokens", "tool_calls", "wall_s",
)  # fmt: skip
DEFAULT_BUDGETS: tuple[int, ...] = tuple(sorted(PAPER_PAIRS))  # 2, 4, 8, 16
DEFAULT_EXPAND_MODES: tuple[str, ...] = ("random", "nonroot")


# -- what is run ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunSpec(Shape):
    """One rollout configuration (:class:`~treegrpo.benchmarks.runner.Shape`)."""
    @property
    def label(self) -> str:
        return f"chain {self.m}" if self.mode == "chain" else f"tree ({self.m},{self.n},{self.l}) {self.expand_mode}"

    def sampler_config(self) -> SamplerConfig:
        if self.mode == "chain":
            return SamplerConfig(name="chain", group_size=self.m)
        return SamplerConfig(name="tree", m=self.m, n=self.n, l=self.l, expand_mode=self.expand_mode)  # type: ignore[arg-type]

    def trajectories_per_prompt(self) -> int:
        return self.sampler_config().trajectories_per_prompt()


def chain_spec(budget: int) -> RunSpec:
    """Plain chains: ``budget`` per prompt."""
    return RunSpec("chain", budget, budget, 0, 0, None)


def tree_spec(budget: int, shape: tuple[int, int, int], expand_mode: str) -> RunSpec:
    """Tree-GRPO ``shape`` matched to chain ``budget``."""
    return RunSpec("tree", budget, *shape, expand_mode)


def default_specs(
    budgets: Sequence[int] = DEFAULT_BUDGETS, expand_modes: Sequence[str] = DEFAULT_EXPAND_MODES
) -> list[RunSpec]:
    """Chain b, then the paper's matched tree for b in each expand mode, budget by budget."""
    return [s for b in budgets for s in (chain_spec(b), *(tree_spec(b, PAPER_PAIRS[b], m) for m in expand_modes))]


def critical_specs() -> list[RunSpec]:
    """The timing-critical block: chain 4, tree (2,2,1) random, tree (2,2,1) nonroot."""
    return default_specs((4,))


@dataclass
class Measurement:
    """One rollout of one configuration, with its instrumentation."""

    spec: RunSpec
    reuse: bool
    prompts: int
    result: RolloutResult
    calls: list[Call]
    walls: list[float] = field(default_factory=list)
    cpus: list[float] = field(default_factory=list)
    model_work: dict[str, int] = field(default_factory=dict)
    repeat_mismatches: list[list[int]] = field(default_factory=list)
    summary: dict[str, Any] | None = None
    counts: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.counts = counts_key(self)

    @property
    def forests(self) -> list[Forest]:
        return self.result.forests

    def drop_records(self) -> None:
        """Free the forests and call records (after :func:`summarize`); budgets and walls stay."""
        self.result.forests = []
        self.calls = []

    @property
    def total(self) -> Budget:
        return self.result.total()

    def add_repeat(self, again: Measurement) -> bool:
        """Take a repeat's wall and CPU seconds; whether it reproduced the counts (else they are kept
        in ``repeat_mismatches``: same seed, same batches, it should not happen)."""
        same = counts_key(again) == self.counts
        if not same:
            self.repeat_mismatches.append(list(counts_key(again)))
        self.walls.append(again.result.wall_s)
        self.cpus.extend(again.cpus)
        return same

    @property
    def wall_s(self) -> float:
        """Median wall seconds over the runs of this configuration (the first alone if one)."""
        return statistics.median(self.walls) if self.walls else self.result.wall_s


def run_once(
    agent: AgentParts,
    tasks: Sequence[Task],
    spec: RunSpec,
    reuse: bool,
    seed: int = 0,
    prefix_cache_mb: float = 1024.0,
    max_batch_size: int | None = None,
    engine: Any = None,
) -> Measurement:
    """Roll out ``spec`` on ``tasks`` with a fresh HF engine (prefix reuse ``reuse``) and fixed seed.
    ``engine``: that engine instead (its prefix cache emptied first), the model's work not counted."""
    from treegrpo.rollout.engine import make_engine

    if engine is None:
        inner = make_engine("hf", agent.model, agent.tokenizer, max_batch_size=max_batch_size, prefix_reuse=reuse,
                            prefix_cache_mb=prefix_cache_mb)  # fmt: skip
    else:
        inner = engine
        reset = getattr(getattr(engine, "llm", None), "reset_prefix_cache", None)  # vLLM's outlives a run
        if callable(reset):
            reset()
    recording = RecordingEngine(inner)
    runner = PhaseRunner(recording, agent.env, agent.tokenizer, agent.agent_cfg)  # type: ignore[arg-type]
    sampler = get_sampler(spec.mode)
    if engine is None:
        gc.collect()
    with count_forwards(agent.model if engine is None else None) as work:
        cpu0 = time.process_time()
        result = sampler(
            runner, list(tasks), spec.sampler_config(), random.Random(seed), torch.Generator().manual_seed(seed)
        )
        cpu = time.process_time() - cpu0
    return Measurement(spec, reuse, len(tasks), result, recording.calls, [result.wall_s], [cpu], work)


def counts_key(meas: Measurement) -> tuple[int, ...]:
    """The counts a repeat must reproduce exactly (same seed, same forests)."""
    t = meas.total
    return (t.generated_tokens, t.prefill_tokens, t.tool_calls, t.engine_requests)


def summarize(meas: Measurement) -> dict[str, Any]:
    """The row (exactly :data:`ROW_KEYS`) and the details of one measurement. Computed once from
    the forests and records (kept in ``meas.summary``); later calls refresh the wall times only."""
    if meas.summary is not None:
        meas.summary["row"]["wall_s"] = round(meas.wall_s, 4)
        d = meas.summary["detail"]
        d["walls"], d["cpu_s"] = [round(w, 4) for w in meas.walls], [round(c, 4) for c in meas.cpus]
        d["checks"]["repeats_reproduce_counts"] = not meas.repeat_mismatches
        return meas.summary
    s = meas.spec
    tot = meas.total
    row = {
        "mode": s.mode, "budget": s.budget, "M": s.m, "N": s.n, "L": s.l, "expand_mode": s.expand_mode,
        "prefix_reuse": meas.reuse, "prompts": meas.prompts, "trajectories": sum(f.n_trajectories() for f in meas.forests),
        "generated_tokens": tot.generated_tokens, "prefill_tokens": tot.prefill_tokens, "tool_calls": tot.tool_calls,
        "wall_s": round(meas.wall_s, 4),
    }  # fmt: skip
    phases: dict[str, dict[str, Any]] = phase_costs(meas.calls)
    fc = forest_counts(meas.forests)
    for name, p in phases.items():
        p["tool_calls"] = fc["phases"][name]["tool_calls"]
    detail: dict[str, Any] = {"config": s.label, "prefix_reuse": meas.reuse, "engine_calls": meas.result.engine_calls, "phases": phases}
    if s.mode == "tree":
        k, init, exp = meas.prompts, phases.get("init", {}), phases.get("expand", {})
        chains, expansions = k * s.m, k * s.m * s.n * s.l
        per_chain = init.get("generated_tokens", 0) / max(1, chains)
        per_exp = exp.get("generated_tokens", 0) / max(1, expansions)
        detail.update(
            pick_stats(meas.forests), gen_tokens_per_chain=per_chain, gen_tokens_per_expansion=per_exp,
            f_measured=per_exp / per_chain if per_chain else None,
            tool_calls_per_chain=init.get("tool_calls", 0) / max(1, chains),
            tool_calls_per_expansion=exp.get("tool_calls", 0) / max(1, expansions),
        )  # fmt: skip
        if s.l == 1:
            detail.update(expected_fractions(meas.forests, s.expand_mode))
            fe, te = detail["f_expected"], detail["tool_fraction_expected"]
            tc = detail["tool_calls_per_chain"]
            detail["tool_fraction_measured"] = detail["tool_calls_per_expansion"] / tc if tc else None
            # vs chains like these initial ones: (1 + N) trajectories for (1 + N·f) chains of tokens
            detail["traj_per_token_gain_expected"] = (1 + s.n) / (1 + s.n * fe) if fe is not None else None
            detail["tool_calls_per_traj_ratio_expected"] = (1 + s.n * te) / (1 + s.n) if te is not None else None
    checks = {
        "trajectories": row["trajectories"] == fc["trajectories"] == meas.prompts * s.trajectories_per_prompt(),
        "generated_tokens": row["generated_tokens"] == fc["generated_tokens"],
        "tool_calls": row["tool_calls"] == fc["tool_calls"],
        "requests": tot.engine_requests == fc["steps"],
        "context_tokens": sum(p["context_tokens"] for p in phases.values()) == fc["context_tokens"],
        "phases": all(
            p["requests"] == fc["phases"][n]["steps"] and p["generated_tokens"] == fc["phases"][n]["generated_tokens"]
            for n, p in phases.items()
        ),
    }
    if meas.reuse:
        checks["prefill_equals_uncached"] = row["prefill_tokens"] == sum(p["uncached_tokens"] for p in phases.values())
    else:
        checks["prefill_equals_context"] = row["prefill_tokens"] == fc["context_tokens"]
    checks["repeats_reproduce_counts"] = not meas.repeat_mismatches
    detail["checks"] = checks
    detail["walls"] = [round(w, 4) for w in meas.walls]
    detail["cpu_s"] = [round(c, 4) for c in meas.cpus]
    if meas.model_work:
        # positions the model really had to run: prefill tokens + every sampled token fed back
        # (all but the last of each step); the rest of what it ran is padding.
        real = tot.prefill_tokens + tot.generated_tokens - tot.engine_requests
        w = meas.model_work
        pad = round(1 - real / w["positions"], 4) if w["positions"] else None
        detail["model_work"] = {**w, "real_positions": real, "padding_fraction": pad}
    return {"row": row, "detail": detail}


# -- the command ----------------------------------------------------------------------------------


def measure_all(
    agent: AgentParts,
    tasks: Sequence[Task],
    specs: Sequence[RunSpec],
    seed: int = 0,
    repeats: int = 1,
    critical: Sequence[RunSpec] = (),
    reuse_modes: Sequence[bool] = (True, False),
    keep: bool = True,
    log: Callable[[str], object] = print,
) -> list[Measurement]:
    """Measure every spec with every reuse setting, side by side (module doc); the ``critical``
    specs are then run ``repeats`` more times as one block (rotated order, reuse order
    alternating), so that the i-th wall time of every critical configuration was taken close in
    time. Their first run, among the other configurations, is their warm-up: only the block's
    runs are their ``walls``.

    Returns one :class:`Measurement` per (spec, reuse), in ``specs`` order, summarized right after
    its first run; ``walls`` holds its timed runs. With ``keep`` false the forests and call records
    are dropped once summarized (they are large). A repeat must reproduce the first run's counts
    (same seed); a mismatch is logged and kept in ``repeat_mismatches``.
    """
    by_key: dict[tuple[RunSpec, bool], Measurement] = {}

    def first(spec: RunSpec, reuse: bool) -> None:
        meas = run_once(agent, tasks, spec, reuse, seed)
        meas.summary = summarize(meas)
        if not keep:
            meas.drop_records()
        by_key[(spec, reuse)] = meas
        r = meas.summary["row"]
        log(f"{spec.label:<24} reuse={'on ' if reuse else 'off'} {meas.walls[0]:7.2f}s  traj {r['trajectories']}  "
            f"gen {r['generated_tokens']}  prefill {r['prefill_tokens']}  tools {r['tool_calls']}")  # fmt: skip

    i = 0
    for spec in specs:
        for reuse in reuse_modes if i % 2 == 0 else tuple(reversed(reuse_modes)):
            first(spec, reuse)
        i += 1
    crit = [s for s in critical if s in specs]
    for spec in crit:
        for reuse in reuse_modes:
            by_key[(spec, reuse)].walls, by_key[(spec, reuse)].cpus = [], []
    for r in range(1, repeats + 1):
        order = crit[r % len(crit) :] + crit[: r % len(crit)] if crit else []
        for spec in order:
            for reuse in reuse_modes if (i + r) % 2 == 0 else tuple(reversed(reuse_modes)):
                again = run_once(agent, tasks, spec, reuse, seed)
                if not by_key[(spec, reuse)].add_repeat(again):
                    log(f"warning: {spec.label} reuse={reuse}: a repeat gave other counts {counts_key(again)}")
            i += 1
        log(f"repeat {r}: " + "  ".join(f"{s.label} {by_key[(s, reuse_modes[0])].walls[-1]:.2f}s" for s in order))
    return [by_key[(s, r)] for s in specs for r in reuse_modes]


def run_bench(
    out: Path = Path("benchmarks/results/budget.json"),
    prompts: int = 32,
    seed: int = 0,
    repeats: int = 5,
    model_dir: Path | None = None,
    specs: Sequence[RunSpec] | None = None,
    threads: int | None = 1,
    console: Any = None,
    log: Callable[[str], object] | None = None,
) -> dict[str, Any]:
    """Run the whole benchmark, write ``out`` (JSON) and the plot beside it (``.png``), print the
    tables. Returns the JSON document.

    ``threads``: torch intra-op threads while measuring (restored afterwards; ``None`` leaves the
    setting alone). One is the default: on a shared 2-core machine two OpenMP threads make the tiny
    model's small matmuls orders of magnitude slower whenever another process holds a core.
    """
    if console is None:
        from rich.console import Console

        console = Console() if Console().is_terminal else Console(width=150)  # a pipe: no 80 columns
    log = log or (lambda m: console.print(m, highlight=False))
    with torch_threads(threads):
        t0 = time.perf_counter()
        agent = load_agent(model_dir)
        prov = provenance(model_dir=agent.model_dir)
        tasks = random.Random(seed).sample(agent.tasks, min(prompts, len(agent.tasks)))
        specs = list(specs) if specs is not None else default_specs()
        critical = critical_specs()
        # warm-up (untimed): first forwards allocate, import lazily, fill allocator pools
        for reuse in (True, False):
            run_once(agent, tasks[:4], chain_spec(2), reuse, seed)
        measurements = measure_all(agent, tasks, specs, seed, repeats, critical, keep=False, log=log)
        meta = {
            "model": str(agent.model_dir), "prompts": len(tasks), "task_ids": [t.id for t in tasks], "seed": seed,
            "repeats_critical": repeats, "critical": [s.label for s in critical],
            "agent": {k: getattr(agent.agent_cfg, k) for k in vars(agent.agent_cfg)}, "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "wall_s": "sampler RolloutResult.wall_s (engine + env + bookkeeping); median over repeats for critical configs",
            "row_M_N_L_for_chain": "M = chains per prompt, N = L = 0", "bench_wall_s": None,
        }  # fmt: skip
        doc = document([summarize(m) for m in measurements], specs, meta)
        doc["meta"]["bench_wall_s"] = round(time.perf_counter() - t0, 1)
        doc["provenance"] = prov
        write_result(out, doc, plot, lambda d: d["rows"])
        print_table(doc["rows"], doc["targets"], console)
        log(f"wrote {out} and {out.with_suffix('.png')} in {doc['meta']['bench_wall_s']:.0f}s")
        return doc


__all__ = [
    "ROW_KEYS", "AgentParts", "Measurement", "PhaseRunner", "RecordingEngine", "RunSpec",
    "chain_spec", "counts_key", "critical_specs", "default_specs", "load_agent", "measure_all", "run_bench", "run_once",
    "summarize", "torch_threads", "tree_spec",
]  # fmt: skip
