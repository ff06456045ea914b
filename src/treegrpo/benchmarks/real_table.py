"""``treegrpo bench real --table``: the paper's budget table on any model — chain GRPO vs Tree-GRPO
at matched budgets (chain 2 ↔ tree (1,2,1), chain 4 ↔ tree (2,2,1)), paired per seed (the same
starting folder, prompts in the same order and held-out questions), held-out EM greedy and sampled
at the start (once) and at the end of every run (and every ``eval_every`` steps: the EM curves).

Resumable: each run lives in ``work/runs/<label>-s<seed>-<digest of its settings>`` and checkpoints
every step; a finished run is reused only when its settings match. ``jobs`` runs train at once,
each in its own process (``--jobs``; scheduling only, in no digest). The rows are
:data:`~treegrpo.benchmarks.learn_spec.ROW_KEYS` plus :data:`EXTRA_KEYS`; ``paired`` holds
tree − chain per budget and seed.

``--matched tokens``: the tree is token-matched to its chain (``budget_tokens: chain:B``, the
paper shape's M and N), every run is evaluated every ``--eval-every-tokens`` generated tokens
(sampled only between the start and the end), the rows add :data:`TOKEN_KEYS`, ``equal_cost``
compares the pairs at equal generated tokens and tool calls (:mod:`.equal_cost`), and
``start_probe`` measures, before any run, how many of the first steps' groups are informative
(leaves that disagree) under each sampler from the starting folder (:func:`start_probe`).

``--select-prompts P``: before the runs, P training questions are each sampled
:data:`SELECT_SAMPLES` times from the starting folder; every run of the table then trains only on
the ones whose samples disagree (:func:`select_pool`), so a start that solves most questions still
gives groups with an advantage. Both samplers of a pair draw from the same pool in the same order.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from treegrpo.benchmarks.equal_cost import analyse
from treegrpo.benchmarks.learn_spec import RunSpec
from treegrpo.benchmarks.provenance import provenance
from treegrpo.benchmarks.runner import (
    Log,
    digest,
    held_out_eval,
    pyplot,
    run_jobs,
    save_figure,
    torch_threads,
    write_result,
)
from treegrpo.errors import ConfigError
from treegrpo.io import atomic_write_json
from treegrpo.rollout.planner import PAPER_PAIRS

FORMAT = "treegrpo.bench.real_table/v1"
#: Row keys beyond ``bench learn``'s.
EXTRA_KEYS: tuple[str, ...] = (
    "em_greedy_start", "eval_prompts", "prompt_ids", "informative_groups", "prefill_tokens", "rollout_s", "update_s", "run_dir",
)  # fmt: skip
#: Row keys of a token-matched table beyond :data:`EXTRA_KEYS`.
TOKEN_KEYS: tuple[str, ...] = ("budget_tokens", "eval_every_tokens", "tool_curve")
#: Samples per candidate question in :func:`select_pool` (one chain group from the start).
SELECT_SAMPLES = 4
#: Questions per rollout call of :func:`select_pool` and :func:`start_probe`: 64 questions × 4
#: samples in one batch took over 19 GB on SmolLM2-135M (observations of up to 600 tokens).
ROLLOUT_CHUNK = 16
#: The paper's figures (Qwen2.5-3B, multi-hop QA, EM × 100) the table is shown beside.
PAPER = {"chain 2": 14.9, "tree (1,2,1)": 31.6, "tree (2,2,1)": 36.8}


@dataclass(frozen=True)
class TableSpec:
    """What the table runs (every field is recorded in the results).

    Attributes:
        model: the starting folder every run loads (e.g. a ``treegrpo warmup`` output).
        data / corpus: training and held-out questions, and the in-process retriever's corpus.
        budgets: chain budgets; each is paired with the paper's tree (``PAPER_PAIRS``).
        seeds: one pair of runs per budget and seed (prompt order and sampling streams).
        steps / prompts_per_step / lr: each run (AdamW, constant lr).
        eval_prompts: held-out questions, greedy and sampled, at the start and end of every run.
        eval_every: steps between evaluations inside a run (the EM curve); 0 = the end only.
        matched: ``nominal`` (the paper's shapes) or ``tokens`` (the tree token-matched to its chain).
        eval_every_tokens: evaluations every this many generated tokens (sampled only; 0 = off).
        probe_prompts: ``tokens``: training prompts of the start probe (:func:`start_probe`; 0 = none).
        select_prompts: candidate training questions of :func:`select_pool` (0 = train on every
            training question); the runs train only on the candidates the start is unsure of.
        overrides: further :class:`~treegrpo.training.config.TrainConfig` fields of every run
            (``--set key=value``: LoRA, packing, threads, agent limits, engine), the same for both samplers.
        jobs: runs trained at once, each in its own process (one torch thread each by default); how
            the runs are scheduled, not what they are: no run folder or stage depends on it.
    """

    model: str
    data: str = "wiki-vital-qa"
    corpus: str = "wiki-vital"
    budgets: tuple[int, ...] = (2, 4)
    seeds: tuple[int, ...] = (0, 1)
    steps: int = 4
    prompts_per_step: int = 2
    lr: float = 1e-5
    eval_prompts: int = 128
    eval_every: int = 0
    matched: str = "nominal"
    eval_every_tokens: int = 0
    probe_prompts: int = 0
    select_prompts: int = 0
    overrides: dict[str, Any] = field(default_factory=dict)
    jobs: int = 1

    def __post_init__(self) -> None:
        if bad := [b for b in self.budgets if b not in PAPER_PAIRS]:
            raise ConfigError(f"--budgets {bad}: the table pairs the paper's budgets only; choose from {sorted(PAPER_PAIRS)}")
        if not self.seeds or min(self.steps, self.prompts_per_step, self.eval_prompts, self.jobs) < 1 or self.eval_every < 0:
            raise ConfigError("the table needs ≥ 1 seed, steps, prompts per step, eval prompts and jobs (and --eval-every ≥ 0)")
        if self.matched not in ("nominal", "tokens") or min(self.eval_every_tokens, self.probe_prompts, self.select_prompts) < 0:
            raise ConfigError(f"--matched {self.matched!r}: choose nominal or tokens (and --eval-every-tokens, --probe-prompts, --select-prompts ≥ 0)")

    def runs(self) -> list[RunSpec]:
        """Chain then tree for every budget and seed (the pairs next to each other)."""
        out = []
        dense = self.eval_every_tokens
        for b in self.budgets:
            m, n, l = PAPER_PAIRS[b]
            matched = f"chain:{b}" if self.matched == "tokens" else None
            for s in self.seeds:
                out.append(RunSpec("chain", b, b, 0, 0, None, "grpo", s, 0, None, dense))
                out.append(RunSpec("tree", b, m, n, l, "random", "tree_grpo", s, 0, matched, dense))
        return out

    def config(self, run: RunSpec, out_dir: str) -> dict[str, Any]:
        """The run's :class:`~treegrpo.training.config.TrainConfig` fields."""
        every = self.eval_every or self.steps
        return {
            "model": self.model, "data": self.data, "corpus": self.corpus, "steps": self.steps,
            "prompts_per_step": self.prompts_per_step, "lr": self.lr, "eval_prompts": self.eval_prompts,
            "eval_sampled": True, "eval_every": every, "save_every": 1, "tensorboard": False, "resume": True,
            "out_dir": out_dir, **self.overrides, **run.overrides(),
        }  # fmt: skip


def table_config(fields: dict[str, Any]) -> Any:
    """The :class:`~treegrpo.training.config.TrainConfig` of ``fields``, on one torch thread
    unless they set ``threads``: the table's committed runs were made so (``threads`` = auto would
    take every core for a real model, and parallel float sums can differ in the last bits)."""
    from treegrpo.training.config import TrainConfig

    return TrainConfig(**{"threads": 1, **fields})


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in label).strip("_")


def start_eval(spec: TableSpec, work: Path, log: Log) -> dict[str, Any]:
    """The starting folder's held-out evaluation (greedy and sampled) and the questions' ids,
    computed once and kept in ``work``."""

    probe = spec.config(spec.runs()[0], str(work / "unused"))
    keep = {k: probe[k] for k in ("model", "data", "corpus", "eval_prompts")} | spec.overrides
    path = work / f"eval_start-{digest(keep, length=10)}.json"
    if path.is_file():
        log(f"start evaluation: reusing {path}")
        return json.loads(path.read_text())
    cfg = table_config(probe)
    log(f"start evaluation: {spec.eval_prompts} held-out questions, greedy and sampled")
    with torch_threads(cfg.threads):
        done = {"settings": keep, **held_out_eval(cfg, sampled=True)}
    atomic_write_json(path, done)
    return done


def train_prompt_ids(spec: TableSpec) -> list[str]:
    """The ids of the training questions the runs draw from, in the task's order."""
    from treegrpo.training.setup import build_run

    return [t.id for t in build_run(table_config(spec.config(spec.runs()[0], ""))).train_tasks]


def prompt_order(spec: TableSpec, seed: int, task_ids: list[str]) -> list[str]:
    """Every step's prompts of a run at ``seed``, in order (the trainer's own prompt stream,
    replayed: the same for both samplers)."""
    from treegrpo.training.checkpoint import RunState

    state = RunState.fresh(seed)
    return [i for _ in range(spec.steps) for i in state.draw_prompts(task_ids, spec.prompts_per_step)]


def run_folder(spec: TableSpec, run: RunSpec, work: Path, pool: list[str] | None = None) -> Path:
    """The run's folder: its label, seed and a digest of every setting, the training pool included
    (another setting, another folder)."""
    settings = spec.config(run, "") | ({"train_pool": pool} if pool else {})
    return work / "runs" / f"{_slug(run.label)}-s{run.seed}-{digest(settings, length=10)}"


def run_one(
    spec: TableSpec, run: RunSpec, work: Path, eval_start: dict[str, float], task_ids: list[str], log: Log,
    pool: list[str] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Train (or resume, or reuse) one run; its row. ``pool``: the training questions the run
    draws from (:func:`select_pool`; ``None``: all of them, ``task_ids``)."""
    from treegrpo.training.checkpoint import CHECKPOINT_DIR, drop_previous
    from treegrpo.training.metrics import read_metrics
    from treegrpo.training.trainer import TrainSummary, train
    from treegrpo.tree import read_forests

    run_dir = run_folder(spec, run, work, pool)
    summary = TrainSummary.read(run_dir / "summary.json")
    if summary is None or summary.steps < spec.steps:
        log(f"{run.key}: {spec.steps} steps × {spec.prompts_per_step} prompts → {run_dir}")
        cfg = table_config(spec.config(run, str(run_dir)))
        summary = train(cfg, eval_start=eval_start, parts=_pooled_parts(cfg, pool) if pool else None)
    drop_previous(run_dir / CHECKPOINT_DIR)  # a finished run is never resumed: its last checkpoint is enough
    s = summary
    metrics = read_metrics(run_dir / "metrics.jsonl")
    steps = [m["rollout/prompt_ids"] for m in metrics if "rollout/prompt_ids" in m]
    # what the run trained on, as the trainer logged it; a run from before it did: the stream replayed
    prompt_ids = [i for ids in steps for i in ids] if len(steps) == spec.steps else prompt_order(spec, run.seed, pool or task_ids)
    dumped = run_dir / "rollouts" / f"step_{spec.steps:05d}.jsonl"  # the last step's forests (unless switched off)
    last = [f.prompt_id for f in read_forests(dumped)] if dumped.is_file() else []
    if last and last != prompt_ids[-len(last) :]:  # the record must be what the run trained on
        raise RuntimeError(f"{run_dir}: its last step trained on {last}; its prompt record says {prompt_ids[-len(last) :]}")
    informative = [round(m["rollout/informative_groups"], 4) for m in metrics if "rollout/informative_groups" in m]
    row = {
        "mode": run.mode, "budget": run.budget, "M": run.m, "N": run.n, "L": run.l, "expand_mode": run.expand_mode,
        "advantage": run.advantage, "seed": run.seed, "world_seed": run.world_seed,
        "em_start": s.eval_start["eval/success_sampled"], "em_end": s.eval_end["eval/success_sampled"],
        "em_greedy_end": s.eval_end["eval/success_greedy"], "em_curve": [[int(p[0]), float(p[1])] for p in s.em_curve],
        "generated_tokens": s.generated_tokens, "tool_calls": s.tool_calls, "trajectories": s.trajectories,
        "tool_calls_per_traj_start": s.eval_start["eval/tool_calls_sampled"],
        "tool_calls_per_traj_end": s.eval_end["eval/tool_calls_sampled"], "wall_s": round(s.wall_s, 2),
        "em_greedy_start": s.eval_start["eval/success_greedy"], "eval_prompts": spec.eval_prompts,
        "prompt_ids": prompt_ids, "informative_groups": informative, "prefill_tokens": s.prefill_tokens, "rollout_s": round(s.rollout_s, 2),
        "update_s": round(s.update_s, 2), "run_dir": str(run_dir),
    }  # fmt: skip
    if spec.matched == "tokens":
        row.update(budget_tokens=run.budget_tokens, eval_every_tokens=run.eval_every_tokens,
                   tool_curve=[[int(p[2]), float(p[1])] for p in s.em_curve if len(p) > 2])  # fmt: skip
    return row


def _pooled_parts(cfg: Any, pool: list[str]) -> Any:
    """``cfg``'s run parts with the training questions cut to ``pool`` (in the pool's order)."""
    import dataclasses

    from treegrpo.training.setup import build_run

    parts = build_run(cfg)
    by_id = {t.id: t for t in parts.train_tasks}
    if missing := [i for i in pool if i not in by_id]:
        raise ConfigError(f"the training pool names {len(missing)} questions the data does not hold (e.g. {missing[0]!r})")
    return dataclasses.replace(parts, train_tasks=[by_id[i] for i in pool])


def _rollout_from_start(spec: TableSpec, work: Path, tasks_of: Any, samplers: list[tuple[str, Any]]) -> dict[str, Any]:
    """Roll out from the starting folder without an update: ``tasks_of(parts)`` questions under each
    ``(label, SamplerConfig)``, :data:`ROLLOUT_CHUNK` questions per call (one random stream per
    sampler); per label, every forest's leaf rewards by prompt id, and the generated tokens."""
    import random

    import torch

    from treegrpo.rollout.agent import StepRunner
    from treegrpo.rollout.engine import make_engine
    from treegrpo.rollout.samplers import get_sampler
    from treegrpo.training.setup import build_run

    cfg = table_config(spec.config(spec.runs()[0], str(work / "unused")))
    out: dict[str, Any] = {}
    with torch_threads(cfg.threads):
        parts = build_run(cfg)
        engine = make_engine(cfg.engine, parts.model, parts.tokenizer, device=cfg.device, **cfg.engine_options)
        runner = StepRunner(engine, parts.env, parts.tokenizer, parts.agent_cfg)
        tasks = tasks_of(parts)
        for label, scfg in samplers:
            rng, gen = random.Random(0), torch.Generator().manual_seed(0)
            rewards: dict[str, list[float]] = {}
            tokens = 0
            for i in range(0, len(tasks), ROLLOUT_CHUNK):  # one batch of every leaf at once does not fit in memory
                res = get_sampler(scfg.name)(runner, tasks[i : i + ROLLOUT_CHUNK], scfg, rng, gen)
                rewards |= {f.prompt_id: [float(leaf.reward or 0) for _, leaf in f.leaves()] for f in res.forests}
                tokens += res.total().generated_tokens
            out[label] = {"rewards": rewards, "generated_tokens": tokens, "prompts": len(tasks)}
    return out


def select_pool(spec: TableSpec, work: Path, log: Log) -> dict[str, Any] | None:
    """The training pool of ``spec.select_prompts`` (``None`` when 0): that many training questions
    (a fixed draw) each sampled :data:`SELECT_SAMPLES` times from the starting folder (one chain
    group, no update); the pool keeps the ones whose samples disagree. Why: a group has an advantage
    only when its leaves' rewards differ; a chain-2 group on a question the start solves with
    probability p does so with probability 2p(1-p) ≤ ½, so from a start that solves most questions
    (or none) most groups carry nothing. The pool is the questions the start is unsure of; both
    samplers train on it. Computed once and kept in ``work``."""
    import random

    from treegrpo.rollout.sampling import SamplerConfig

    if not spec.select_prompts:
        return None
    keep = {"model": spec.model, "data": spec.data, "corpus": spec.corpus, "candidates": spec.select_prompts,
            "samples": SELECT_SAMPLES, **spec.overrides}  # fmt: skip
    path = work / f"pool-{digest(keep, length=10)}.json"
    if path.is_file():
        log(f"training pool: reusing {path}")
        return json.loads(path.read_text())
    t0 = time.perf_counter()
    log(f"training pool: {spec.select_prompts} training questions × {SELECT_SAMPLES} samples from the start")
    picked: list[str] = []

    def candidates(parts: Any) -> list[Any]:
        tasks = random.Random(0).sample(parts.train_tasks, min(spec.select_prompts, len(parts.train_tasks)))
        picked.extend(t.id for t in tasks)
        return tasks

    res = _rollout_from_start(spec, work, candidates, [("select", SamplerConfig("chain", SELECT_SAMPLES))])["select"]
    rewards = res["rewards"]
    success = {i: sum(rewards[i]) / len(rewards[i]) for i in picked}
    pool = [i for i in picked if len(set(rewards[i])) > 1]
    if not pool:
        raise ConfigError(f"--select-prompts {spec.select_prompts}: the start's samples agree on every candidate "
                          "(all solved or all failed); choose another start or more candidates")  # fmt: skip
    out = {"settings": keep, "candidates": picked, "success": success, "pool": pool,
           "kept_fraction": len(pool) / len(picked), "start_success": sum(success.values()) / len(success),
           "pool_success": sum(success[i] for i in pool) / len(pool),
           "generated_tokens": res["generated_tokens"], "wall_s": time.perf_counter() - t0}  # fmt: skip
    atomic_write_json(path, out)
    log(f"training pool: {len(pool)} of {len(picked)} questions (start success {out['start_success']:.2f}, "
        f"in the pool {out['pool_success']:.2f})")  # fmt: skip
    return out


def start_probe(spec: TableSpec, work: Path, log: Log, pool: list[str] | None = None) -> dict[str, Any]:
    """How many groups are informative (their leaves' rewards differ: the only groups with an
    advantage) at the start, under each sampler of the smallest budget: ``probe_prompts`` training
    prompts (of ``pool`` when given), in the order seed ``spec.seeds[0]``'s runs draw them, rolled
    out from the starting folder without an update. Computed once and kept in ``work``."""
    from treegrpo.rollout.sampling import SamplerConfig
    from treegrpo.training.checkpoint import RunState

    runs = [r for r in spec.runs() if r.budget == min(spec.budgets) and r.seed == spec.seeds[0]]
    keep = {"model": spec.model, "data": spec.data, "corpus": spec.corpus, "prompts": spec.probe_prompts,
            "runs": [r.overrides() for r in runs], **spec.overrides, **({"train_pool": pool} if pool else {})}  # fmt: skip
    path = work / f"probe-{digest(keep, length=10)}.json"
    if path.is_file():
        log(f"start probe: reusing {path}")
        return json.loads(path.read_text())
    t0 = time.perf_counter()
    samplers = []
    for run in runs:
        o = run.overrides()
        samplers.append((run.label, SamplerConfig(o["sampler"], o.get("group_size", 4), o.get("m", 2), o.get("n", 2), o.get("l", 1),
                                                  o.get("expand_mode", "random"), budget_tokens=o.get("budget_tokens"))))  # fmt: skip
    log(f"start probe: {', '.join(label for label, _ in samplers)} on {spec.probe_prompts} training prompts")

    def tasks_of(parts: Any) -> list[Any]:
        by_id = {t.id: t for t in parts.train_tasks}
        tasks = [by_id[i] for i in pool] if pool else parts.train_tasks
        return RunState.fresh(spec.seeds[0]).draw_prompts(tasks, spec.probe_prompts)

    out: dict[str, Any] = {"settings": keep}
    for label, res in _rollout_from_start(spec, work, tasks_of, samplers).items():
        rewards = list(res["rewards"].values())
        out[label] = {
            "prompts": res["prompts"], "informative": sum(len(set(r)) > 1 for r in rewards) / len(rewards),
            "success": sum(sum(r) for r in rewards) / sum(len(r) for r in rewards),
            "leaves_per_prompt": sum(len(r) for r in rewards) / len(rewards),
            "generated_tokens_per_prompt": res["generated_tokens"] / res["prompts"],
        }  # fmt: skip
    out["wall_s"] = time.perf_counter() - t0
    atomic_write_json(path, out)
    return out


def paired(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Tree − chain per budget and seed (sampled and greedy EM at the end), with mean, spread and
    wins over seeds, and the measured budget ratios (tree / chain)."""
    out: dict[str, Any] = {}
    for b in sorted({r["budget"] for r in rows}):
        pairs = []
        for s in sorted({r["seed"] for r in rows if r["budget"] == b}):
            by = {r["mode"]: r for r in rows if r["budget"] == b and r["seed"] == s}
            if set(by) != {"chain", "tree"}:
                continue
            c, t = by["chain"], by["tree"]
            if c["prompt_ids"] != t["prompt_ids"]:
                raise ValueError(f"budget {b} seed {s}: the pair saw different prompts")
            pairs.append({
                "seed": s, "diff_sampled": t["em_end"] - c["em_end"], "diff_greedy": t["em_greedy_end"] - c["em_greedy_end"],
                **{f"{k}_ratio": t[k] / max(1, c[k]) for k in ("generated_tokens", "tool_calls", "trajectories")},
            })  # fmt: skip
        if not pairs:
            continue
        summary: dict[str, Any] = {"pairs": pairs}
        for k in ("diff_sampled", "diff_greedy", "generated_tokens_ratio", "trajectories_ratio"):
            xs = [p[k] for p in pairs]
            sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
            summary[k] = {"mean": statistics.fmean(xs), "sd": sd, "min": min(xs), "max": max(xs)}
        summary["tree_wins_sampled"] = sum(p["diff_sampled"] > 0 for p in pairs)
        out[str(b)] = summary
    return out


def run_table(spec: TableSpec, work: Path, out: Path, log: Log) -> dict[str, Any]:
    """Every run of the table (resuming), then ``out`` (JSON) and its PNG; returns the results."""

    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    start = start_eval(spec, work, log)
    selection = select_pool(spec, work, log)
    pool = selection["pool"] if selection else None
    probe = start_probe(spec, work, log, pool) if spec.matched == "tokens" and spec.probe_prompts else None
    task_ids = train_prompt_ids(spec)
    rows_of: dict[int, dict[str, Any]] = {}
    jobs = [(i, (spec, r, work, start["eval"], task_ids, log if spec.jobs <= 1 else print, pool)) for i, r in enumerate(spec.runs())]
    run_jobs(run_one, jobs, spec.jobs, rows_of.__setitem__)
    rows = [rows_of[i] for i in range(len(jobs))]
    runs_s = sum(r["wall_s"] for r in rows)
    results = {
        "format": FORMAT,
        "provenance": provenance(model_dir=spec.model, threads=table_config(spec.config(spec.runs()[0], str(work))).threads or None),
        "spec": asdict(spec),
        "eval_start": start["eval"],
        "eval_ids": start["eval_ids"],
        "rows": rows,
        "paired": paired(rows),
        **({"start_probe": probe} if probe else {}),
        **({"selection": selection} if selection else {}),
        **({"equal_cost": analyse(rows, ["random"])} if spec.matched == "tokens" else {}),
        "paper": PAPER,
        "compute_s": {  # what the table cost, over every session that built it
            "start_eval": round(start["wall_s"], 2),
            "start_probe": round(probe["wall_s"], 2) if probe else 0.0,
            "selection": round(selection["wall_s"], 2) if selection else 0.0,
            "runs": round(runs_s, 2),
            "total": round(start["wall_s"] + sum(x["wall_s"] for x in (probe, selection) if x) + runs_s, 2),
        },
        "wall_s": time.perf_counter() - t0,  # this invocation's (reused runs cost nothing)
    }
    write_result(out, results, plot, log=log)
    return results


def plot(results: dict[str, Any], png: Path) -> None:
    """Held-out EM (sampled) against generated tokens per run, and the paired differences per budget."""
    plt = pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.2))
    for r in results["rows"]:
        xs, ys = zip(*r["em_curve"], strict=True) if r["em_curve"] else ((), ())
        color = "C0" if r["mode"] == "chain" else "C1"
        ls = "-" if r["budget"] == min(x["budget"] for x in results["rows"]) else "--"
        name = f"chain {r['budget']}" if r["mode"] == "chain" else RunSpec("tree", r["budget"], r["M"], r["N"], r["L"], "random",
                                                                           "tree_grpo", 0, 0, r.get("budget_tokens")).label
        label = name if r["seed"] == results["rows"][0]["seed"] else None
        ax.plot([x / 1000 for x in xs], ys, marker="o", color=color, ls=ls, label=label)
    ax.set_xlabel("generated tokens (thousands)")
    ax.set_ylabel(f"held-out EM, sampled ({results['spec']['eval_prompts']} questions)")
    ax.set_title("EM per generated token, every run")
    ax.legend()
    budgets = sorted(results["paired"], key=int)
    for i, b in enumerate(budgets):
        p = results["paired"][b]
        for j, q in enumerate(p["pairs"]):
            bx.scatter(i - 0.1, q["diff_sampled"], color="C1", label="sampled, per seed" if i == j == 0 else None)
            bx.scatter(i + 0.1, q["diff_greedy"], color="C2", label="greedy, per seed" if i == j == 0 else None)
        bx.errorbar(i - 0.1, p["diff_sampled"]["mean"], yerr=p["diff_sampled"]["sd"], color="k", capsize=4)
        bx.errorbar(i + 0.1, p["diff_greedy"]["mean"], yerr=p["diff_greedy"]["sd"], color="grey", capsize=4)
    bx.axhline(0, color="grey", lw=1)
    ratios = [results["paired"][b]["generated_tokens_ratio"]["mean"] for b in budgets]
    bx.set_xticks(range(len(budgets)), [f"budget {b}\ntree/chain tokens {r:.2f}×" for b, r in zip(budgets, ratios, strict=True)])
    bx.set_ylabel("tree − chain held-out EM at the end")
    bx.legend()
    bx.set_title("paired differences per seed (mean ± sd)")
    save_figure(fig, png)
