"""``treegrpo bench budget --engine hf|vllm [--model M]``: the timing-critical block of the budget
benchmark (chain 4 vs Tree-GRPO (2,2,1) random / nonroot) rolled out by one engine, to compare
engines on the same prompts and model (the method and the figures: benchmarks/README.md). A
bootstrapped tiny agent runs on its world; any other model on ``wiki-vital-qa`` over ``wiki-vital``
with the trainer's own set-up (:func:`treegrpo.training.setup.build_run`). Rows have the budget
benchmark's :data:`~treegrpo.benchmarks.budget.ROW_KEYS` (``prefill_tokens``: what the engine
computed), ``engine_figures`` the per-engine figures; :func:`compare` checks the targets against
the other engine's document. vLLM-on-CPU gets as many cores as the HF engine's torch threads
(``VLLM_CPU_OMP_THREADS_BIND=0-{threads-1}`` unless set).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from treegrpo.benchmarks.budget import (
    DEFAULT_EXPAND_MODES,
    Measurement,
    RunSpec,
    chain_spec,
    critical_specs,
    run_once,
    summarize,
    tree_spec,
)
from treegrpo.benchmarks.budget_parts import AgentParts, load_agent
from treegrpo.benchmarks.provenance import provenance
from treegrpo.benchmarks.runner import pyplot, save_figure, torch_threads, write_result
from treegrpo.rollout.planner import PAPER_PAIRS

FORMAT = "treegrpo.bench.budget_engine/v1"


def engine_specs() -> list[RunSpec]:
    """chain 4, tree (2,2,1) random, tree (2,2,1) nonroot."""
    return critical_specs()


def load_any_agent(model: str | None, max_turns: int, max_step_tokens: int) -> AgentParts:
    """A bootstrapped tiny agent (its own settings), or another model on wiki-vital-qa."""
    if model is None or (Path(model) / "treegrpo_tiny.json").is_file():
        return load_agent(model)
    from treegrpo.training.config import make_config
    from treegrpo.training.setup import build_run

    cfg = make_config(
        {"model": model, "data": "wiki-vital-qa", "corpus": "wiki-vital", "max_turns": max_turns,
         "max_step_tokens": max_step_tokens, "eval_prompts": 1}
    )  # fmt: skip
    parts = build_run(cfg)
    return AgentParts(parts.model.eval(), parts.tokenizer, parts.env, parts.agent_cfg, parts.train_tasks, parts.model_dir)


def run_with(agent: AgentParts, tasks: Sequence[Any], spec: RunSpec, make: Callable[[], Any], seed: int) -> Measurement:
    """Roll out ``spec`` on ``tasks`` with the engine ``make()`` returns (prefix cache emptied)."""
    return run_once(agent, tasks, spec, True, seed, engine=make())


def engine_figures(meas: Measurement, detail: dict[str, Any]) -> dict[str, Any]:
    """The per-configuration figures of the module docstring (medians over the repeats)."""
    tot = meas.total
    # rounded once, as recorded: every figure below is derived from the values the JSON holds
    wall, cpu = round(statistics.median(meas.walls), 4), round(statistics.median(meas.cpus), 4)
    traj = sum(f.n_trajectories() for f in meas.forests)
    cached = sum(int(g.extra.get("cached_tokens", 0)) for _, gens, _ in meas.calls for g in gens)
    context = sum(p["context_tokens"] for p in detail["phases"].values())
    uncached = sum(p.get("uncached_tokens", 0) for p in detail["phases"].values())
    return {
        "config": meas.spec.label, "wall_s": wall, "cpu_s": cpu,
        "walls": [round(w, 4) for w in meas.walls], "cpus": [round(c, 4) for c in meas.cpus], "trajectories": traj,
        "generated_tokens": tot.generated_tokens, "prefill_tokens": tot.prefill_tokens, "context_tokens": context,
        "uncached_tokens": uncached, "prefix_cache_hit_tokens": context - tot.prefill_tokens,
        "engine_cached_tokens": cached, "gen_tokens_per_cpu_s": round(tot.generated_tokens / cpu, 3) if cpu else None,
        "wall_per_traj_s": round(wall / max(1, traj), 5),
        "wall_per_gen_token_ms": round(1000 * wall / max(1, tot.generated_tokens), 4),
        "repeats_reproduce_counts": not meas.repeat_mismatches,
    }  # fmt: skip


def tree_vs_chain(figures: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Tree (2,2,1) wall per generated token over chain 4's, per expand mode (target ≤ 1.1)."""
    by = {f["config"]: f for f in figures}
    chain = by[chain_spec(4).label]
    out = {}
    for mode in DEFAULT_EXPAND_MODES:
        tree = by[tree_spec(4, PAPER_PAIRS[4], mode).label]
        ratio = tree["wall_per_gen_token_ms"] / chain["wall_per_gen_token_ms"]
        out[f"wall_per_gen_token_tree_{mode}_vs_chain"] = {"measured": round(ratio, 4), "target": "<= 1.1", "met": ratio <= 1.1}
    return out


def compare(vllm_doc: dict[str, Any], hf_doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """vLLM over HF generated tokens per CPU second, per configuration (target ≥ 1.3 on the tree
    rows); the documents must be of the same model and prompts."""
    if vllm_doc["meta"]["task_ids"] != hf_doc["meta"]["task_ids"] or vllm_doc["meta"]["model"] != hf_doc["meta"]["model"]:
        raise ValueError("the two documents are not of the same model and prompts: rerun one with the other's settings")
    hf = {f["config"]: f for f in hf_doc["engine_figures"]}
    out = {}
    for f in vllm_doc["engine_figures"]:
        ratio = f["gen_tokens_per_cpu_s"] / hf[f["config"]]["gen_tokens_per_cpu_s"]
        key = f"vllm_vs_hf_gen_tokens_per_cpu_s[{f['config']}]"
        tree = f["config"].startswith("tree")
        out[key] = {"measured": round(ratio, 4), "target": ">= 1.3" if tree else None, "met": ratio >= 1.3 if tree else None}
    return out


def run_engine_bench(
    out: Path, engine: str = "vllm", model: str | None = None, prompts: int = 4, seed: int = 0, repeats: int = 2,
    threads: int = 1, max_turns: int = 2, max_step_tokens: int = 48, against: Path | None = None,
    engine_options: dict[str, Any] | None = None, log: Callable[[str], object] = print, agent: AgentParts | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Run the block with ``engine``, write ``out`` (JSON) and the plot beside it (``.png``);
    with ``against`` (the other engine's document) the engine comparison goes in too. ``agent``
    replaces the one ``model`` names (tests)."""
    from treegrpo.rollout.engine import make_engine

    if engine == "vllm" and threads:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}" if threads > 1 else "0")
    t0 = time.perf_counter()
    with torch_threads(threads):
        agent = agent or load_any_agent(model, max_turns, max_step_tokens)
        tasks = random.Random(seed).sample(agent.tasks, min(prompts, len(agent.tasks)))
        opts = dict(engine_options or {})
        if engine == "hf":
            opts.setdefault("prefix_reuse", True)

            def make() -> Any:
                return make_engine("hf", agent.model, agent.tokenizer, **opts)
        else:
            shared = make_engine(engine, agent.model, agent.tokenizer, device="cpu", **opts)

            def make() -> Any:
                return shared

        specs = engine_specs()
        meas = {s: run_with(agent, tasks, s, make, seed) for s in specs}  # warm-up runs: counts, records
        for s, m in meas.items():
            m.walls, m.cpus = [], []
            log(f"{engine} {s.label:<24} gen {m.total.generated_tokens}  prefill {m.total.prefill_tokens}")
        for r in range(repeats):
            for s in specs[r % len(specs) :] + specs[: r % len(specs)]:
                meas[s].add_repeat(run_with(agent, tasks, s, make, seed))
            log(f"repeat {r + 1}: " + "  ".join(f"{s.label} {meas[s].walls[-1]:.2f}s" for s in specs))
    summaries = [summarize(meas[s]) for s in specs]
    figures = [engine_figures(meas[s], sm["detail"]) for s, sm in zip(specs, summaries, strict=True)]
    doc: dict[str, Any] = {
        "format": FORMAT,
        "meta": {
            "engine": engine, "model": str(agent.model_dir), "prompts": len(tasks), "task_ids": [t.id for t in tasks],
            "seed": seed, "repeats": repeats, "threads": threads, "engine_options": opts,
            "agent": {k: getattr(agent.agent_cfg, k) for k in vars(agent.agent_cfg)},
            "torch": torch.__version__, "bench_wall_s": None,
        },
        "rows": [sm["row"] for sm in summaries],
        "details": [sm["detail"] for sm in summaries],
        "engine_figures": figures,
        "targets": tree_vs_chain(figures),
    }
    if engine == "vllm":
        import vllm

        doc["meta"]["vllm"] = vllm.__version__
    if against is not None:
        other = json.loads(Path(against).read_text())
        pair = (doc, other) if engine == "vllm" else (other, doc)
        doc["targets"].update(compare(*pair))
        doc["against"] = {"file": str(against), "engine_figures": other["engine_figures"]}
    doc["meta"]["bench_wall_s"] = round(time.perf_counter() - t0, 1)
    doc["provenance"] = provenance(model_dir=agent.model_dir)
    write_result(out, doc, plot_engines)
    for f in figures:
        log(
            f"{f['config']:<24} wall {f['wall_s']:7.2f}s  cpu {f['cpu_s']:7.2f}s  gen/cpu-s {f['gen_tokens_per_cpu_s']}  "
            f"ms/gen-token {f['wall_per_gen_token_ms']}  cache hits {f['prefix_cache_hit_tokens']}"
        )
    for name, t in doc["targets"].items():
        log(f"target {name}: {t['measured']} {t['target'] or ''} {'' if t['met'] is None else ('met' if t['met'] else 'MISSED')}")
    log(f"wrote {out} and {out.with_suffix('.png')}")
    return doc


def plot_engines(doc: dict[str, Any], png: Path) -> None:
    """Generated tokens per CPU second and wall ms per generated token, per configuration, for
    this engine (and the compared one when present)."""
    plt = pyplot()
    sets = [(doc["meta"]["engine"], doc["engine_figures"])]
    if "against" in doc:
        other = "hf" if doc["meta"]["engine"] == "vllm" else "vllm"
        sets.append((other, doc["against"]["engine_figures"]))
    configs = [f["config"] for f in doc["engine_figures"]]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(sets)
    for ax, key, title in zip(
        axes, ("gen_tokens_per_cpu_s", "wall_per_gen_token_ms"), ("generated tokens / CPU s", "wall ms / generated token"), strict=True
    ):
        for i, (name, figs) in enumerate(sets):
            by = {f["config"]: f[key] for f in figs}
            ax.bar([j + i * width for j in range(len(configs))], [by.get(c) or 0 for c in configs], width, label=name)
        ax.set_xticks([j + width * (len(sets) - 1) / 2 for j in range(len(configs))], configs, rotation=15, fontsize=8)
        ax.set_title(title)
        ax.legend()
    fig.suptitle(f"{Path(doc['meta']['model']).name}: {doc['meta']['prompts']} prompts, {doc['meta']['threads']} thread(s)")
    save_figure(fig, png)


__all__ = ["compare", "engine_figures", "engine_specs", "load_any_agent", "run_engine_bench", "run_with", "tree_vs_chain"]
