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

**Instrumentation**: the runner tags expansion cursors (:class:`PhaseRunner`) and the engine records
every request (:class:`RecordingEngine`), so the cost of the initial chains (``init``) and of the
expansions (``expand``) is kept apart even when one engine call serves both; a forward pre-hook
counts the model's work. The analysis (``phases``, ``checks``, ``targets``), the table and the plot
are :mod:`treegrpo.benchmarks.budget_report`.
"""

from __future__ import annotations

import contextlib
import gc
import json
import random
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from treegrpo.benchmarks.budget_report import Call, document, plot, print_table, summarize
from treegrpo.benchmarks.provenance import provenance
from treegrpo.envs.base import AgentEnv, Task
from treegrpo.rollout.agent import AgentConfig, Budget, Cursor, RolloutResult, StepRunner
from treegrpo.rollout.engine import Generation, SamplingParams, release_engine_cache
from treegrpo.rollout.planner import PAPER_PAIRS
from treegrpo.rollout.samplers import SamplerConfig, get_sampler
from treegrpo.tree import Forest

#: The keys of a result row, exactly.
ROW_KEYS: tuple[str, ...] = (
    "mode",
    "budget",
    "M",
    "N",
    "L",
    "expand_mode",
    "prefix_reuse",
    "prompts",
    "trajectories",
    "generated_tokens",
    "prefill_tokens",
    "tool_calls",
    "wall_s",
)
DEFAULT_BUDGETS: tuple[int, ...] = tuple(sorted(PAPER_PAIRS))  # 2, 4, 8, 16
DEFAULT_EXPAND_MODES: tuple[str, ...] = ("random", "nonroot")


# -- what is run ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunSpec:
    """One rollout configuration.

    Attributes:
        mode: ``chain`` or ``tree``.
        budget: the chain budget it is matched to (chains per prompt).
        m: initial chains per prompt (for ``chain``: the group size ``G``).
        n: expansions per tree per round (0 for ``chain``).
        l: expansion rounds (0 for ``chain``).
        expand_mode: the tree sampler's pick rule; ``None`` for ``chain``.
    """

    mode: Literal["chain", "tree"]
    budget: int
    m: int
    n: int
    l: int
    expand_mode: str | None

    @property
    def label(self) -> str:
        if self.mode == "chain":
            return f"chain {self.m}"
        return f"tree ({self.m},{self.n},{self.l}) {self.expand_mode}"

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
    m, n, l = shape
    return RunSpec("tree", budget, m, n, l, expand_mode)


def default_specs(
    budgets: Sequence[int] = DEFAULT_BUDGETS, expand_modes: Sequence[str] = DEFAULT_EXPAND_MODES
) -> list[RunSpec]:
    """Chain b, then the paper's matched tree for b in each expand mode, budget by budget."""
    specs: list[RunSpec] = []
    for b in budgets:
        specs.append(chain_spec(b))
        specs += [tree_spec(b, PAPER_PAIRS[b], mode) for mode in expand_modes]
    return specs


# -- the agent ------------------------------------------------------------------------------------


@dataclass
class AgentParts:
    """A model with its tokenizer, environment, agent settings and question pool."""

    model: torch.nn.Module
    tokenizer: Any
    env: AgentEnv
    agent_cfg: AgentConfig
    tasks: list[Task]
    model_dir: Path | None = None


def load_agent(model_dir: str | Path | None = None) -> AgentParts:
    """The bootstrapped agent in ``model_dir`` (default: ``ensure_bootstrapped("default")``), with
    the env and agent settings it was trained with and its world's ``train`` questions."""
    from treegrpo.models.loader import load_model, load_tokenizer
    from treegrpo.tasks.world.bootstrap import ensure_bootstrapped, load_setup

    folder = Path(model_dir) if model_dir is not None else ensure_bootstrapped("default")
    setup = load_setup(folder)
    model = load_model(folder).eval()
    return AgentParts(model, load_tokenizer(folder), setup.env, setup.agent, setup.world.tasks("train"), folder)


# -- instrumentation ------------------------------------------------------------------------------


class ExpansionContext(list):
    """A context list tagged as an expansion's. It stays tagged as the runner extends it
    (``context + node.tokens``), so the engine can tell an expansion's requests from an initial
    chain's in the same call."""

    def __add__(self, other: list) -> ExpansionContext:  # type: ignore[override]
        return ExpansionContext(list.__add__(self, other))


class RecordingEngine:
    """Wraps an engine and records every call: ``(contexts, generations, phases)``, the phase of a
    request being ``expand`` when its context is an :class:`ExpansionContext`, else ``init``.

    Recording keeps references only (no copies, no computation) so it does not disturb timing.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[Call] = []

    @property
    def eos_token_id(self) -> int | None:
        return getattr(self.inner, "eos_token_id", None)

    def generate(
        self,
        contexts: Sequence[Sequence[int]],
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> list[Generation]:
        gens = self.inner.generate(contexts, params, generator)
        phases = ["expand" if isinstance(c, ExpansionContext) else "init" for c in contexts]
        self.calls.append((list(contexts), gens, phases))
        return gens

    def load_weights(self, model: torch.nn.Module) -> None:
        self.inner.load_weights(model)

    def release_cache(self) -> None:
        release_engine_cache(self.inner)


class PhaseRunner(StepRunner):
    """A :class:`StepRunner` that tags expansion cursors (:class:`ExpansionContext`): the cursors
    of every ``run_turns`` call after the first (a sampler that runs its rounds one after the
    other), and those an ``on_end`` hook adds (a sampler that starts a prompt's expansions as soon
    as its own trajectories end)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.turn_calls = 0

    def run_turns(
        self,
        cursors: Sequence[Cursor],
        budgets: Sequence[Budget],
        generator: torch.Generator | None = None,
        params: SamplingParams | None = None,
        **kwargs: Any,
    ) -> int:
        if self.turn_calls:
            for c in cursors:
                c.context = ExpansionContext(c.context)
        self.turn_calls += 1
        on_end = kwargs.get("on_end")
        if on_end is not None:

            def tagged(c: Cursor) -> Sequence[Cursor]:
                new = list(on_end(c))
                for n in new:
                    n.context = ExpansionContext(n.context)
                return new

            kwargs["on_end"] = tagged
        return super().run_turns(cursors, budgets, generator, params, **kwargs)


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
) -> Measurement:
    """Roll out ``spec`` on ``tasks`` with a fresh engine (prefix reuse ``reuse``) and fixed seed."""
    from treegrpo.rollout.engine import make_engine

    engine = RecordingEngine(
        make_engine(
            "hf",
            agent.model,
            agent.tokenizer,
            max_batch_size=max_batch_size,
            prefix_reuse=reuse,
            prefix_cache_mb=prefix_cache_mb,
        )
    )
    runner = PhaseRunner(engine, agent.env, agent.tokenizer, agent.agent_cfg)  # type: ignore[arg-type]
    sampler = get_sampler(spec.mode)
    work = dict.fromkeys(("forwards", "positions", "prefill_forward_positions"), 0)

    def count(_module: torch.nn.Module, _args: tuple, kwargs: dict[str, Any]) -> None:
        b, q = kwargs["input_ids"].shape
        work["forwards"] += 1
        work["positions"] += b * q
        if q > 1:
            work["prefill_forward_positions"] += b * q

    gc.collect()
    handle = agent.model.register_forward_pre_hook(count, with_kwargs=True)
    try:
        cpu0 = time.process_time()
        result = sampler(
            runner, list(tasks), spec.sampler_config(), random.Random(seed), torch.Generator().manual_seed(seed)
        )
        cpu = time.process_time() - cpu0
    finally:
        handle.remove()
    return Measurement(spec, reuse, len(tasks), result, engine.calls, [result.wall_s], [cpu], work)


def counts_key(meas: Measurement) -> tuple[int, ...]:
    """The counts a repeat must reproduce exactly (same seed, same forests)."""
    t = meas.total
    return (t.generated_tokens, t.prefill_tokens, t.tool_calls, t.engine_requests)


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

    Returns one :class:`Measurement` per (spec, reuse), in ``specs`` order, summarized
    (:func:`summarize`) right after its first run; ``walls`` holds its timed runs. With ``keep``
    false the forests and call records are dropped once summarized (they are large). A repeat must
    reproduce the counts of the first run exactly (same seed); a mismatch is logged and kept in
    ``repeat_mismatches`` (the ``repeats_reproduce_counts`` check).
    """
    by_key: dict[tuple[RunSpec, bool], Measurement] = {}

    def first(spec: RunSpec, reuse: bool) -> None:
        meas = run_once(agent, tasks, spec, reuse, seed)
        meas.summary = summarize(meas)
        if not keep:
            meas.drop_records()
        by_key[(spec, reuse)] = meas
        r = meas.summary["row"]
        log(
            f"{spec.label:<24} reuse={'on ' if reuse else 'off'} {meas.walls[0]:7.2f}s  traj {r['trajectories']}  "
            f"gen {r['generated_tokens']}  prefill {r['prefill_tokens']}  tools {r['tool_calls']}"
        )

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
                base = by_key[(spec, reuse)]
                if counts_key(again) != base.counts:  # same seed, same batches: should not happen
                    base.repeat_mismatches.append(list(counts_key(again)))
                    log(f"warning: {spec.label} reuse={reuse}: a repeat gave other counts {counts_key(again)}")
                base.walls.append(again.result.wall_s)
                base.cpus.extend(again.cpus)
            i += 1
        log(
            f"repeat {r}: "
            + "  ".join(f"{s.label} {by_key[(s, reuse_modes[0])].walls[-1]:.2f}s" for s in order)
        )
    return [by_key[(s, r)] for s in specs for r in reuse_modes]


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """torch's intra-op threads set to ``threads`` meanwhile, restored after (``None`` / 0: left)."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


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
    from rich.console import Console

    if console is None:
        console = Console()
        if not console.is_terminal:  # a pipe or file: don't squeeze the tables into 80 columns
            console = Console(width=150)
    log = log or (lambda m: console.print(m, highlight=False))
    with torch_threads(threads):
        t0 = time.perf_counter()
        agent = load_agent(model_dir)
        prov = provenance(model_dir=agent.model_dir)
        tasks = random.Random(seed).sample(agent.tasks, min(prompts, len(agent.tasks)))
        specs = list(specs) if specs is not None else default_specs()
        critical = [chain_spec(4), *(tree_spec(4, PAPER_PAIRS[4], m) for m in DEFAULT_EXPAND_MODES)]
        # warm-up (untimed): first forwards allocate, import lazily, fill allocator pools
        for reuse in (True, False):
            run_once(agent, tasks[:4], chain_spec(2), reuse, seed)
        measurements = measure_all(agent, tasks, specs, seed, repeats, critical, keep=False, log=log)
        meta = {
            "model": str(agent.model_dir),
            "prompts": len(tasks),
            "task_ids": [t.id for t in tasks],
            "seed": seed,
            "repeats_critical": repeats,
            "critical": [s.label for s in critical],
            "agent": {k: getattr(agent.agent_cfg, k) for k in vars(agent.agent_cfg)},
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "wall_s": "sampler RolloutResult.wall_s (engine + env + bookkeeping); median over repeats for critical configs",
            "row_M_N_L_for_chain": "M = chains per prompt, N = L = 0",
            "bench_wall_s": None,
        }
        doc = document([summarize(m) for m in measurements], specs, meta)
        doc["meta"]["bench_wall_s"] = round(time.perf_counter() - t0, 1)
        doc["provenance"] = prov
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1))
        plot(doc["rows"], out.with_suffix(".png"))
        print_table(doc["rows"], doc["targets"], console)
        log(f"wrote {out} and {out.with_suffix('.png')} in {doc['meta']['bench_wall_s']:.0f}s")
        return doc


__all__ = [
    "ROW_KEYS",
    "AgentParts",
    "ExpansionContext",
    "Measurement",
    "PhaseRunner",
    "RecordingEngine",
    "RunSpec",
    "chain_spec",
    "counts_key",
    "default_specs",
    "load_agent",
    "measure_all",
    "run_bench",
    "run_once",
    "torch_threads",
    "tree_spec",
]
