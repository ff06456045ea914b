"""``treegrpo bench tools``: a tool agent's wall per step against its tools' latency (issue 41).

Jobs (:data:`JOBS`): ``tiny`` — the default job (``treegrpo train``'s defaults: the tiny agent,
the synthetic world, Search-R1's tags) with its search as a per-query tool
(:class:`~treegrpo.benchmarks.tools_env.LatencySearchEnv`: one call per query, as a web search
API is); ``smollm2`` — SmolLM2-135M-Instruct cut to 2 layers (not warmed up) with its own tool
calls (``--protocol tools``, ``chatml-tools``, the ``search(query)`` tool)
(:func:`~treegrpo.benchmarks.tools_env.latency_search_tool` in a ``ToolEnv``). Tools
(``latency``): ``none``, ``constant`` 200 ms, ``heavy`` (lognormal, median 200 ms, p99 ≈ 2 s),
drawn per call from the query, spent as a sleep. Samplers: tree (2,2,1) and chain 4.

Modes (a row = job x sampler x latency x mode, :func:`plan_rows`): ``today`` (no latency, every
default: the baseline), ``serial`` (``tool_concurrency=1``), ``concurrent`` (the default
concurrency), ``pipelined`` (``rollout_pipeline``; with no latency: the default env pipelined),
and ``trl`` (TRL's ``GRPOTrainer(tools=[search])`` with the same function, G = 4 beside chain 4;
on the tiny job through a chat template and parser of the tags: :mod:`.tools_trl`). The latency
rows run with ``trajectory_streams`` on, so serial, concurrent and pipelined grow the same
forests (the same calls); the baseline keeps the batch stream (the default run).

Every row is a real training run in this process (``treegrpo.training.trainer.train``, start and
end evaluation on 1 question), ``warmup`` steps then ``steps`` measured steps; per step it records
wall (rollout + update) and the trainer's tool metrics (``tools/wall_s``,
``tools/peak_in_flight``, ``time/engine_idle_s``, ``time/engine_s``, ``tools/chain_latency_s``).
Rows run in :func:`plan_rows`'s order — the rows compared with each other (one job, latency and
sampler) back to back, so load drifting over the bench affects them alike — and are written as each finishes (``--resume`` keeps
the finished ones of the same settings).
"""

from __future__ import annotations

import dataclasses
import io
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from treegrpo.benchmarks.runner import Log, resume_rows, torch_threads, write_result
from treegrpo.benchmarks.tools_env import LATENCIES, LatencySearchEnv, latency_search_tool

JOBS: tuple[str, ...] = ("tiny", "smollm2")
SAMPLERS: tuple[str, ...] = ("tree", "chain")
MODES: tuple[str, ...] = ("today", "serial", "concurrent", "pipelined", "trl")
STEP_KEYS: tuple[str, ...] = (
    "wall_s", "rollout_s", "update_s", "tools_wall_s", "peak_in_flight", "engine_idle_s", "engine_s",
    "chain_latency_s", "tool_calls", "generated_tokens", "trajectories",
)  # fmt: skip
"""What a row records per step (a tool metric a run does not log is ``None``)."""
_METRICS = {
    "tools_wall_s": "tools/wall_s", "peak_in_flight": "tools/peak_in_flight", "engine_idle_s": "time/engine_idle_s",
    "engine_s": "time/engine_s", "chain_latency_s": "tools/chain_latency_s", "tool_calls": "budget/tool_calls",
    "generated_tokens": "budget/generated_tokens", "trajectories": "rollout/trajectories",
}  # fmt: skip


@dataclass(frozen=True)
class Row:
    """One configuration: ``job`` x ``sampler`` x ``latency`` x ``mode``."""

    job: str
    sampler: str
    latency: str
    mode: str

    @property
    def key(self) -> str:
        return f"{self.job}/{self.sampler}/{self.latency}/{self.mode}"


@dataclass(frozen=True)
class ToolsSpec:
    """The bench's settings (``--quick`` shrinks them). ``sets``: TrainConfig fields of every
    treegrpo row of the ``tiny`` job on top of the defaults; ``smollm2_model``: the warmed-up
    2-layer SmolLM2 folder (made into ``work`` when ``None``)."""

    jobs: tuple[str, ...] = JOBS
    samplers: tuple[str, ...] = SAMPLERS
    latencies: tuple[str, ...] = LATENCIES
    steps: int = 3
    warmup: int = 1
    seed: int = 0
    threads: int = 1
    tool_concurrency: int = 32
    prompts_per_step: int = 16
    smollm2_prompts_per_step: int = 4
    smollm2_model: str | None = None
    model: str | None = None
    sets: dict[str, Any] = field(default_factory=dict)
    trl: bool = True
    smollm2_sets: dict[str, Any] = field(default_factory=lambda: {"max_turns": 2, "max_step_tokens": 48, "max_context_tokens": 768})

    def identity(self) -> dict[str, Any]:
        """What makes rows comparable across sessions (``--resume`` keeps rows made with it)."""
        d = dataclasses.asdict(self)
        return {k: d[k] for k in ("steps", "warmup", "seed", "threads", "tool_concurrency", "prompts_per_step",
                                  "smollm2_prompts_per_step", "smollm2_model", "model", "sets", "smollm2_sets")}  # fmt: skip


def plan_rows(spec: ToolsSpec) -> list[Row]:
    """The rows in running order: per job, per latency (``none`` first), per sampler its rows back
    to back — ``today`` then ``pipelined`` with no latency (adjacent: the no-latency comparison),
    else ``serial``, ``concurrent``, ``pipelined`` and (chain, unless ``trl`` is off) ``trl``."""
    rows: list[Row] = []
    for job in spec.jobs:
        for lat in ("none", *(x for x in spec.latencies if x != "none")):
            for sampler in spec.samplers:
                if lat == "none":
                    rows += [Row(job, sampler, lat, "today"), Row(job, sampler, lat, "pipelined")]
                    continue
                rows += [Row(job, sampler, lat, m) for m in ("serial", "concurrent", "pipelined")]
                if sampler == "chain" and spec.trl:
                    rows.append(Row(job, sampler, lat, "trl"))
    return rows


def row_config(spec: ToolsSpec, row: Row, out_dir: Path) -> dict[str, Any]:
    """The TrainConfig fields of ``row``'s run."""
    shape = {"sampler": "tree", "m": 2, "n": 2, "l": 1} if row.sampler == "tree" else {"sampler": "chain", "group_size": 4}
    cfg: dict[str, Any] = {
        **shape, "steps": spec.warmup + spec.steps, "seed": spec.seed, "threads": spec.threads, "eval_every": 0,
        "eval_prompts": 1, "dump_rollouts_every": 0, "tensorboard": False, "out_dir": str(out_dir),
        "tool_concurrency": 1 if row.mode == "serial" else spec.tool_concurrency,
    }  # fmt: skip
    if row.job == "tiny":
        cfg |= {"prompts_per_step": spec.prompts_per_step, **({"model": spec.model} if spec.model else {}), **spec.sets}
    else:
        cfg |= {"model": spec.smollm2_model, "data": "wiki-vital-qa", "corpus": "wiki-vital", "protocol": "tools",
                "chat_template": "chatml-tools", "prompts_per_step": spec.smollm2_prompts_per_step, "kl_coef": 0.0, "lr": 1e-5, **spec.smollm2_sets}  # fmt: skip
    if row.latency != "none":
        cfg["trajectory_streams"] = True
    if row.mode == "pipelined":
        cfg["rollout_pipeline"] = True
    return cfg


def latency_env(env: Any, cfg: Any, row: Row, tokenizer: Any) -> Any:
    """``row``'s env: the job's own (no latency) or its search as calls of ``row.latency``."""
    if row.latency == "none":
        return env
    from treegrpo.envs.search import SearchEnv

    if isinstance(env, SearchEnv):
        fields = {f.name: getattr(env, f.name) for f in dataclasses.fields(SearchEnv) if f.init}
        return LatencySearchEnv(**fields, latency=row.latency, tool_concurrency=cfg.tool_concurrency)
    from treegrpo.envs.tool_env import ToolEnv
    from treegrpo.retrieval.factory import make_retriever

    retriever = make_retriever(corpus=cfg.corpus, url=cfg.retriever_url, allow_offline=cfg.allow_offline_retriever)
    return ToolEnv(
        [latency_search_tool(retriever, cfg.topk, row.latency)], rewards=env.rewards, protocol="tools",
        timeout_s=cfg.tool_timeout_s, tool_concurrency=cfg.tool_concurrency, tokenizer=tokenizer,
        max_result_tokens=cfg.max_obs_tokens,
    )  # fmt: skip


def step_record(m: dict[str, Any]) -> dict[str, Any]:
    """One step's record (:data:`STEP_KEYS`) from its metrics.jsonl line."""
    rec: dict[str, Any] = {
        "wall_s": m["time/rollout_s"] + m["time/update_s"], "rollout_s": m["time/rollout_s"], "update_s": m["time/update_s"],
    }  # fmt: skip
    rec |= {k: (float(m[name]) if name in m else None) for k, name in _METRICS.items()}
    return rec


def treegrpo_row(spec: ToolsSpec, row: Row, out_dir: Path) -> dict[str, Any]:
    """Train ``row`` (:func:`row_config`) and read its steps back from metrics.jsonl."""
    from rich.console import Console

    from treegrpo.training.config import TrainConfig
    from treegrpo.training.setup import build_run
    from treegrpo.training.trainer import train

    cfg = TrainConfig(**row_config(spec, row, out_dir))
    parts = build_run(cfg)
    parts = dataclasses.replace(parts, env=latency_env(parts.env, cfg, row, parts.tokenizer))
    printed = io.StringIO()
    train(cfg, Console(file=printed, soft_wrap=True, width=200), parts=parts)
    runner = getattr(parts.env, "_runner", None)
    if runner is not None:
        runner.close()
    lines = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [step_record(m) for m in lines if m.get("step", 0) >= 1 and "time/rollout_s" in m]
    return {"steps": steps[spec.warmup :], "warmup_steps": steps[: spec.warmup], "config": row_config(spec, row, out_dir),
            "printed_tail": printed.getvalue().splitlines()[-3:]}  # fmt: skip


def run_row(spec: ToolsSpec, row: Row, work: Path) -> dict[str, Any]:
    """``row`` measured: its record (``key``, ``job``, ``sampler``, ``latency``, ``mode``,
    ``steps`` — one :data:`STEP_KEYS` dict per measured step — and what it ran with)."""
    out_dir = work / row.key.replace("/", "-")
    t0 = time.perf_counter()
    with torch_threads(spec.threads):
        if row.mode == "trl":
            from treegrpo.benchmarks.tools_trl import trl_tools_row

            body = trl_tools_row(spec, row, out_dir, row_config(spec, row, out_dir))
        else:
            body = treegrpo_row(spec, row, out_dir)
    return {"key": row.key, **dataclasses.asdict(row), **body, "row_wall_s": time.perf_counter() - t0}


def smollm2_start(work: Path, log: Log) -> str:
    """The ``smollm2`` job's starting folder: SmolLM2-135M-Instruct cut to its first 2 layers
    (``treegrpo.cut_layers``), made once in ``work``. Not warmed up: a wall-clock benchmark needs no
    skill, and a 16-step ``--protocol tools`` warm-up of the cut (64 demonstrations) did not teach it
    to call the tool either (held-out well-formed 0.000 after, measured in this session)."""
    cut = work / "smollm2-2layer"
    if (cut / "config.json").is_file():
        return str(cut)
    from treegrpo.models.loader import resolve_model_ref
    from treegrpo.models.tiny import cut_layers

    log(f"bench tools: cutting smollm2-135m to 2 layers into {cut} (once)")
    return str(cut_layers(resolve_model_ref("smollm2-135m"), 2, cut))


def _default_agent(spec: ToolsSpec) -> str:
    """The tiny job's starting folder when no ``model`` is given: the bootstrapped default agent
    (of ``sets``' preset), as its run finds it."""
    from treegrpo.tasks.registry import task_family
    from treegrpo.training.config import TrainConfig

    cfg = TrainConfig(**spec.sets)
    return str(task_family(cfg).starting_model(cfg))


def run_bench(spec: ToolsSpec, out: Path, work: Path, resume: bool, log: Log) -> dict[str, Any]:
    """Measure every row of :func:`plan_rows` (skipping those kept by ``resume``), writing the
    result after each, and return the document (:mod:`treegrpo.benchmarks.tools_report`)."""
    from treegrpo.benchmarks.provenance import provenance
    from treegrpo.benchmarks.tools_report import document, plot

    work.mkdir(parents=True, exist_ok=True)
    if spec.smollm2_model is None:  # the same identity whether or not this session runs the job
        spec = dataclasses.replace(spec, smollm2_model=smollm2_start(work, log) if "smollm2" in spec.jobs else str(work / "smollm2-2layer"))
    rows_planned = plan_rows(spec)
    prov = provenance(model_dir={"tiny": spec.model or _default_agent(spec), **(
        {"smollm2": spec.smollm2_model} if "smollm2" in spec.jobs else {})}, threads=spec.threads)  # fmt: skip
    meta = {"identity": spec.identity()}
    kept, _ = (
        resume_rows(out, meta, [r.key for r in rows_planned], lambda r: r["key"], prov, log, "bench tools settings")
        if resume else ([], 0.0)
    )
    done = {r["key"]: r for r in kept}
    doc: dict[str, Any] = {}
    for i, row in enumerate(rows_planned):
        if row.key not in done:
            log(f"bench tools: row {i + 1}/{len(rows_planned)} {row.key}")
            try:
                done[row.key] = run_row(spec, row, work)
            except Exception as e:  # one failed row is reported and left out; --resume runs it again
                log(f"  {row.key} failed, left out: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                continue
            walls = [s["wall_s"] for s in done[row.key]["steps"]]
            log(f"  {row.key}: wall per step {', '.join(f'{w:.2f}' for w in walls)} s")
        rows = [done[r.key] for r in rows_planned if r.key in done]
        doc = document(rows, meta, prov, spec)
        write_result(out, doc, plot)
    log(f"wrote {out} and {out.with_suffix('.png')}")
    return doc


__all__ = ["JOBS", "MODES", "SAMPLERS", "STEP_KEYS", "Row", "ToolsSpec", "plan_rows", "row_config", "run_bench",
           "run_row", "step_record"]  # fmt: skip
