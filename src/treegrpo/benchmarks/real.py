"""``treegrpo bench real``: a real pretrained model end to end on this CPU, in one work folder
(``--work``), stage by stage: the **warm-up** (exactly ``treegrpo warmup``: held-out well-formed
rate and EM, greedy, before and after), **paired RL** from its output (Tree-GRPO (2,2,1) and
chain 4 with the same seed, prompts and held-out questions), the **step costs**
(:mod:`treegrpo.benchmarks.real_costs`). A stage already in the work folder with the same settings
is reused, so an interrupted run resumes at the stage it was in. ``--table``:
:mod:`treegrpo.benchmarks.real_table`. The figures: benchmarks/README.md.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from treegrpo.benchmarks.provenance import provenance
from treegrpo.benchmarks.real_costs import engine_vs_generate, step_costs
from treegrpo.benchmarks.runner import Log, pyplot, save_figure, write_result
from treegrpo.training.config import TrainConfig
from treegrpo.training.metrics import read_metrics
from treegrpo.training.trainer import TrainSummary, train
from treegrpo.training.warmup_run import REAL_MODEL_SFT, RECORD_FILE, WarmupRun, run_warmup

#: The issue's targets (this 2-core CPU).
TARGETS = {
    "warmup_well_formed_min": 0.8,
    "warmup_em_min": 0.3,
    "engine_vs_generate_min": 1.0,
    "peak_rss_paths_gb_max": 8.0,
    "peak_rss_packed_gb_max": 6.0,
    "peak_rss_lora_gb_max": 4.0,
}


@dataclass(frozen=True)
class RealSpec:
    """What ``bench real`` measures (every field is recorded in the results).

    Attributes:
        model: the starting model (a ``--model`` reference).
        data / corpus: questions and the in-process retriever's corpus.
        demos / sft_lr / sft_batch: the warm-up (demonstrations, AdamW lr, demos per step).
        eval_prompts: held-out questions (greedy) for every evaluation.
        rl_steps / prompts_per_step / rl_lr: each paired RL run (a few steps: a larger lr than the
            full fine-tuning default of 1e-6, which is meant for hundreds of steps).
        seed: prompt order and sampling streams, the same for both RL runs.
        cost_prompts: prompts of the engine-vs-``generate`` comparison.
        cost_modes: the one-step runs measured in their own processes (``paths``, ``packed``, ``lora``).
        overrides: further :class:`~treegrpo.training.config.TrainConfig` fields for every stage (agent
            limits, device, dtype), as ``--set key=value`` would give them.
    """

    model: str = "smollm2-135m"
    data: str = "wiki-vital-qa"
    corpus: str = "wiki-vital"
    demos: int = 96
    sft_lr: float = 1e-4
    sft_batch: int = 4
    eval_prompts: int = 16
    rl_steps: int = 4
    rl_lr: float = 1e-5
    prompts_per_step: int = 2
    seed: int = 0
    cost_prompts: int = 4
    cost_modes: tuple[str, ...] = ("paths", "packed", "lora")
    overrides: dict[str, Any] = field(default_factory=dict)


#: The paired RL runs: name -> TrainConfig fields.
RL_RUNS: dict[str, dict[str, Any]] = {
    "tree_2_2_1": {"sampler": "tree", "m": 2, "n": 2, "l": 1},
    "chain_4": {"sampler": "chain", "group_size": 4},
}


def base_config(spec: RealSpec, **fields: Any) -> TrainConfig:
    """The run config every stage shares: model, questions, corpus, greedy-only evaluation."""
    return TrainConfig(**{
        "model": spec.model, "data": spec.data, "corpus": spec.corpus, "eval_prompts": spec.eval_prompts,
        "eval_sampled": False, "seed": spec.seed, "tensorboard": False, "threads": 1, **spec.overrides, **fields,
    })  # fmt: skip


def warmup_stage(spec: RealSpec, work: Path, log: Log) -> dict[str, Any]:
    """Run (or reuse) the warm-up into ``work/warm``; returns its record."""
    out = work / "warm"
    sft = replace(REAL_MODEL_SFT, lr=spec.sft_lr, batch_size=spec.sft_batch)
    record_file = out / RECORD_FILE
    if record_file.is_file():
        rec = json.loads(record_file.read_text())
        asked = (asdict(sft), spec.data, spec.corpus, spec.demos, spec.eval_prompts)
        if (rec.get("sft_config"), rec.get("data"), rec.get("corpus"), rec.get("demos_asked"), rec.get("eval_prompts")) == asked:
            log(f"warm-up: reusing {out}")
            return rec
    return run_warmup(base_config(spec), WarmupRun(out=out, demos=spec.demos, sft=sft, eval_prompts=spec.eval_prompts, seed=spec.seed))


def rl_stage(spec: RealSpec, work: Path, warm: dict[str, Any], log: Log) -> dict[str, Any]:
    """The paired RL runs from the warm-up folder (each reused when it finished with the same settings)."""
    out: dict[str, Any] = {}
    for name, fields in RL_RUNS.items():
        run_dir = work / f"rl_{name}"
        cfg = base_config(
            spec, model=str(work / "warm"), out_dir=str(run_dir), steps=spec.rl_steps, prompts_per_step=spec.prompts_per_step,
            lr=spec.rl_lr, eval_every=spec.rl_steps, save_every=spec.rl_steps, **fields,
        )  # fmt: skip
        summary = TrainSummary.read(run_dir / "summary.json")
        if summary is None or not _same_run(run_dir, cfg):
            log(f"RL {name}: {spec.rl_steps} steps × {spec.prompts_per_step} prompts")
            summary = train(cfg, eval_start=warm["eval_after"])
        rows = read_metrics(run_dir / "metrics.jsonl")
        steps = [r for r in rows if r.get("step", 0) > 0 and "rollout/trajectories" in r]
        out[name] = {
            "config": fields, "eval_before": summary.eval_start, "eval_after": summary.eval_end,
            "trajectories": summary.trajectories, "generated_tokens": summary.generated_tokens,
            "prefill_tokens": summary.prefill_tokens, "tool_calls": summary.tool_calls,
            "rollout_s": summary.rollout_s, "update_s": summary.update_s,
            "reward_mean_per_step": [r.get("reward/mean") for r in steps],
            "informative_groups_per_step": [r.get("rollout/informative_groups") for r in steps],
            "well_formed_per_step": [r.get("rollout/answered_frac") for r in steps],
        }  # fmt: skip
    return out


#: The fields a finished RL run must share with the asked one to be reused.
_RUN_KEYS = ("model", "data", "corpus", "steps", "prompts_per_step", "lr", "seed", "eval_prompts", *dict.fromkeys(k for f in RL_RUNS.values() for k in f))


def _same_run(run_dir: Path, cfg: TrainConfig) -> bool:
    """Whether the run recorded in ``run_dir/config.json`` is the one ``cfg`` asks for."""
    try:
        done = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError):
        return False
    want = cfg.model_dump()
    return all(done.get(k) == want[k] for k in _RUN_KEYS)


def run_bench(spec: RealSpec, work: Path, out: Path, log: Log) -> dict[str, Any]:
    """All three stages; writes ``out`` (JSON) and its PNG; returns the results."""
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    warm = warmup_stage(spec, work, log)
    rl = rl_stage(spec, work, warm, log)
    log("costs: engine vs model.generate")
    gen = engine_vs_generate(base_config(spec, model=str(work / "warm")), spec.cost_prompts, log)
    log(f"costs: one step per mode {spec.cost_modes}")
    steps = step_costs(work / "warm", spec.data, spec.corpus, spec.seed, spec.overrides, spec.cost_modes, work / "costs", log)
    before, after = warm["eval_before"], warm["eval_after"]
    checks = {
        "warmup_well_formed": after["eval/well_formed_greedy"] >= TARGETS["warmup_well_formed_min"],
        "warmup_em": after["eval/success_greedy"] >= TARGETS["warmup_em_min"],
        "engine_vs_generate": gen["ratio"] >= TARGETS["engine_vs_generate_min"],
        **{
            f"peak_rss_{m}": steps[m]["peak_rss_gb"] <= TARGETS[f"peak_rss_{m}_gb_max"]
            for m in ("paths", "packed", "lora")
            if m in steps and "peak_rss_gb" in steps[m]
        },
        **{
            f"rl_em_above_warmup_{name}": r["eval_after"]["eval/success_greedy"] > r["eval_before"]["eval/success_greedy"]
            for name, r in rl.items()
        },
    }
    results = {
        "provenance": provenance(model_dir=spec.model, threads=base_config(spec).threads or None),
        "spec": asdict(spec),
        "warmup": {
            "demos": warm["demos"], "mean_tokens": warm["mean_tokens"], "sft": warm["sft"],
            "well_formed_before": before["eval/well_formed_greedy"], "well_formed_after": after["eval/well_formed_greedy"],
            "em_before": before["eval/success_greedy"], "em_after": after["eval/success_greedy"], "wall_s": warm["wall_s"],
        },
        "rl": rl,
        "engine_vs_generate": gen,
        "step_costs": steps,
        "targets": TARGETS,
        "checks": checks,
        "wall_s": time.perf_counter() - t0,
    }
    write_result(out, results, plot, log=log)
    return results


def table_bench(
    spec: RealSpec, work: Path, out: Path, budgets: tuple[int, ...], seeds: tuple[int, ...], eval_every: int, log: Log,
    matched: str = "nominal", eval_every_tokens: int = 0, probe_prompts: int = 0, select_prompts: int = 0, jobs: int = 1,
) -> dict[str, Any]:  # fmt: skip
    """``bench real --table``: the budget table (:mod:`treegrpo.benchmarks.real_table`) from
    ``spec.model`` when it is a warm-up folder, else from the warm-up stage's output (run or reused)."""
    from treegrpo.benchmarks.real_table import TableSpec, run_table

    start = Path(spec.model)
    if not (start / RECORD_FILE).is_file():
        warmup_stage(spec, work, log)
        start = work / "warm"
    table = TableSpec(
        model=str(start), data=spec.data, corpus=spec.corpus, budgets=budgets, seeds=seeds, steps=spec.rl_steps,
        prompts_per_step=spec.prompts_per_step, lr=spec.rl_lr, eval_prompts=spec.eval_prompts,
        eval_every=eval_every, matched=matched, eval_every_tokens=eval_every_tokens, probe_prompts=probe_prompts,
        select_prompts=select_prompts, overrides=spec.overrides, jobs=jobs,
    )  # fmt: skip
    return run_table(table, work / "table", out, log)


def plot(results: dict[str, Any], png: Path) -> None:
    """Warm-up before/after, RL tree vs chain before/after, and step costs, side by side."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    w = results["warmup"]
    ax = axes[0]
    xs = [0, 1]
    ax.bar([x - 0.2 for x in xs], [w["well_formed_before"], w["em_before"]], 0.4, label="before")
    ax.bar([x + 0.2 for x in xs], [w["well_formed_after"], w["em_after"]], 0.4, label="after")
    ax.axhline(TARGETS["warmup_well_formed_min"], color="grey", ls=":", lw=1)
    ax.axhline(TARGETS["warmup_em_min"], color="grey", ls="--", lw=1)
    ax.set_xticks(xs, ["well-formed", "EM"])
    ax.set_ylim(0, 1)
    ax.set_title(f"warm-up: {w['demos']} demos (held-out, greedy)")
    ax.legend()
    ax = axes[1]
    names = list(results["rl"])
    for i, name in enumerate(names):
        r = results["rl"][name]
        ax.bar(i - 0.2, r["eval_before"]["eval/success_greedy"], 0.4, color="C0", label="before" if i == 0 else None)
        ax.bar(i + 0.2, r["eval_after"]["eval/success_greedy"], 0.4, color="C1", label="after" if i == 0 else None)
    ax.set_xticks(range(len(names)), [f"{n}\n{results['rl'][n]['trajectories']} traj" for n in names])
    ax.set_ylim(0, 1)
    ax.set_title(f"RL: held-out EM, {results['spec']['rl_steps']} steps, paired")
    ax.legend()
    ax = axes[2]
    steps = results["step_costs"]
    modes = [m for m in steps if "peak_rss_gb" in steps[m]]
    ax.bar(range(len(modes)), [steps[m]["peak_rss_gb"] for m in modes], color="C2")
    for i, m in enumerate(modes):
        ax.text(i, steps[m]["peak_rss_gb"], f"upd {steps[m].get('update_s', float('nan')):.0f}s", ha="center", va="bottom")
    ax.set_xticks(range(len(modes)), modes)
    ax.set_ylabel("peak RSS of one (2,2,1) step, GB")
    g = results["engine_vs_generate"]
    ax.set_title(f"step costs · engine {g['ratio']:.2f}× generate (tok/CPU-s)")
    save_figure(fig, png)
