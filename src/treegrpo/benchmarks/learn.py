"""``treegrpo bench learn``: the paper's budget table in miniature — chain GRPO vs Tree-GRPO trained
from one starting policy at matched, measured budgets.

From one bootstrapped model per world (``ensure_bootstrapped(preset, world_seed)``), the one trainer
loop (:func:`treegrpo.train.trainer.train`) runs, for the same number of RL steps on the same
prompts:

- ``chain`` GRPO at budgets 2 / 4 / 8 / 16 (``G`` chains per prompt; rows carry ``M = G``,
  ``N = L = 0``, ``advantage = grpo``);
- ``tree`` Tree-GRPO at the paper's matched shapes (M, N, L) = (1,2,1), (2,2,1), (2,6,1), (4,5,1)
  (:data:`~treegrpo.rollout.planner.PAPER_PAIRS`) with the official ``random`` picks and the guided
  pick modes ``nonroot`` and ``entropy`` (``advantage = tree_grpo``: intra-tree + inter-tree);
- the advantage ablation at budget 4: (2,2,1) ``random`` with ``intra_only`` and ``inter_only``.

``--quick`` keeps budgets 2 and 4 (and the ablation). Every configuration runs once per seed; a
seed fixes the prompt order (the trainer draws prompts and tree picks from separate streams), so
the runs of one seed see the same prompts and are compared in pairs. Held-out exact match is
measured on the world's ``eval`` split — one chain per question, sampled at T=1 and greedy — from
the evaluation's own RNG stream (:data:`~treegrpo.train.trainer.EVAL_SEED`), at the start, every
``eval_every`` steps (``em_curve``: ``[generated tokens so far, sampled EM]``) and at the end.
``tool_calls_per_traj_start/end`` are the held-out sampled chains' tool calls per trajectory, so
every mode is measured the same way.

Rows (``rows`` in the JSON) have exactly :data:`ROW_KEYS`; the result is written after every
finished run, atomically, so an interrupted benchmark keeps what it finished and ``--resume``
carries on from it. ``targets`` holds the issue's comparisons with pass/fail; ``summary`` the mean
and spread per configuration. Plots (PNG beside the JSON): held-out EM vs budget (the paper's
table as a figure) and EM vs generated tokens spent.

**Regimes** (:data:`REGIMES`): a world preset (its world and its bootstrap recipe, see
:data:`treegrpo.envs.world.PRESETS`) plus the RL settings. ``default`` is the embedded default
world and starting policy; see ``benchmarks/README.md`` for the others and why they are built as
they are.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from treegrpo.rollout.planner import PAPER_PAIRS

#: The keys of a result row, exactly.
ROW_KEYS: tuple[str, ...] = (
    "mode",
    "budget",
    "M",
    "N",
    "L",
    "expand_mode",
    "advantage",
    "seed",
    "world_seed",
    "em_start",
    "em_end",
    "em_greedy_end",
    "em_curve",
    "generated_tokens",
    "tool_calls",
    "trajectories",
    "tool_calls_per_traj_start",
    "tool_calls_per_traj_end",
    "wall_s",
)

BUDGETS: tuple[int, ...] = (2, 4, 8, 16)
QUICK_BUDGETS: tuple[int, ...] = (2, 4)
EXPAND_MODES: tuple[str, ...] = ("random", "nonroot", "entropy")
ABLATION_BUDGET = 4
ABLATION: tuple[str, ...] = ("intra_only", "inter_only")


@dataclass(frozen=True)
class Regime:
    """A world preset (world + starting policy) and the RL settings every run of the table uses.

    Attributes:
        name: the regime's name (``--regime``).
        preset: world preset (:data:`treegrpo.envs.world.PRESETS`); its bootstrap recipe is
            :meth:`treegrpo.models.bootstrap.BootstrapConfig.for_preset`.
        steps: RL steps of every run.
        prompts_per_step: prompts per RL step.
        lr: AdamW learning rate.
        eval_every: steps between held-out evaluations (the ``em_curve`` points).
        eval_prompts: held-out questions per evaluation.
        about: one line on what the regime is for.
    """

    name: str
    preset: str
    steps: int
    prompts_per_step: int
    lr: float
    eval_every: int
    eval_prompts: int
    about: str


REGIMES: dict[str, Regime] = {
    r.name: r
    for r in (
        Regime(
            name="default",
            preset="default",
            steps=40,
            prompts_per_step=8,
            lr=1e-4,
            eval_every=10,
            eval_prompts=200,
            about="the embedded default world and starting policy (answers after one search 80% of the time), "
            "a slow learning rate so the switch to multi-hop is not finished within the run",
        ),
        Regime(
            name="shortcut3",
            preset="shortcut3",
            steps=40,
            prompts_per_step=8,
            lr=1e-4,
            eval_every=10,
            eval_prompts=400,
            about="2- and 3-hop questions only; the starting policy answers after one search (sampled success "
            "about 9%, greedy 0): success hinges on a late choice, to search again",
        ),
        Regime(
            name="rare3",
            preset="rare3",
            steps=40,
            prompts_per_step=8,
            lr=3e-4,
            eval_every=10,
            eval_prompts=400,
            about="3-hop questions only; the starting policy almost never succeeds (sampled success about 3%, "
            "greedy 0): most small groups carry no signal at all",
        ),
    )
}


@dataclass(frozen=True)
class RunSpec:
    """One training run of the table."""

    mode: Literal["chain", "tree"]
    budget: int
    m: int
    n: int
    l: int
    expand_mode: str | None
    advantage: str
    seed: int
    world_seed: int

    @property
    def label(self) -> str:
        """The configuration, without seeds: ``chain 4``, ``tree (2,2,1) random``, ``… intra_only``."""
        if self.mode == "chain":
            return f"chain {self.budget}"
        s = f"tree ({self.m},{self.n},{self.l}) {self.expand_mode}"
        return s if self.advantage == "tree_grpo" else f"{s} {self.advantage}"

    @property
    def key(self) -> str:
        return f"{self.label} | seed {self.seed} | world {self.world_seed}"

    def overrides(self) -> dict[str, Any]:
        """The :class:`~treegrpo.train.config.TrainConfig` fields of this run."""
        if self.mode == "chain":
            return {"sampler": "chain", "group_size": self.budget, "advantage": "grpo", "seed": self.seed}
        return {
            "sampler": "tree",
            "m": self.m,
            "n": self.n,
            "l": self.l,
            "expand_mode": self.expand_mode,
            "advantage": self.advantage,
            "seed": self.seed,
        }


def plan_runs(
    budgets: Sequence[int],
    seeds: Sequence[int],
    world_seeds: Sequence[int],
    expand_modes: Sequence[str] = EXPAND_MODES,
    ablation: bool = True,
) -> list[RunSpec]:
    """Every run of the table, seeds innermost so paired runs finish close together."""
    configs: list[tuple[Any, ...]] = []
    for b in budgets:
        if b not in PAPER_PAIRS:
            raise ValueError(f"budget {b} has no paper shape; choose from {sorted(PAPER_PAIRS)}")
        configs.append(("chain", b, b, 0, 0, None, "grpo"))
        m, n, l = PAPER_PAIRS[b]
        configs += [("tree", b, m, n, l, mode, "tree_grpo") for mode in expand_modes]
        if ablation and b == ABLATION_BUDGET:
            configs += [("tree", b, m, n, l, "random", adv) for adv in ABLATION]
    return [RunSpec(*c, seed=s, world_seed=w) for w in world_seeds for c in configs for s in seeds]  # type: ignore[arg-type]


# -- running ---------------------------------------------------------------------------------------

_PARTS_CACHE: dict[tuple[str, int], Any] = {}


def _base_config(regime: Regime, model_dir: Path, world_seed: int, out_dir: str) -> dict[str, Any]:
    return {
        "model": str(model_dir),
        "preset": regime.preset,
        "world_seed": world_seed,
        "steps": regime.steps,
        "prompts_per_step": regime.prompts_per_step,
        "lr": regime.lr,
        "eval_every": regime.eval_every,
        "eval_prompts": regime.eval_prompts,
        "eval_sampled": True,
        "save_every": 0,
        "dump_rollouts_every": 0,
        "tensorboard": False,
        "threads": 1,
        "out_dir": out_dir,
    }


def _parts(cfg: Any) -> Any:
    """Run parts with a freshly loaded model; the world, env and questions are built once per
    process and world."""
    from treegrpo.models.tiny import load_model
    from treegrpo.train.setup import build_run

    key = (str(cfg.model), int(cfg.world_seed))
    if key not in _PARTS_CACHE:
        _PARTS_CACHE[key] = build_run(cfg)
        return _PARTS_CACHE[key]
    cached = _PARTS_CACHE[key]
    return dataclasses.replace(cached, model=load_model(cached.model_dir).to(cfg.device))


def start_eval(regime: Regime, model_dir: Path, world_seed: int) -> dict[str, float]:
    """The starting policy's held-out evaluation (deterministic: every run of the world shares it)."""
    from treegrpo.rollout.agent import StepRunner
    from treegrpo.rollout.hf_engine import HFEngine
    from treegrpo.train.config import make_config
    from treegrpo.train.trainer import evaluate

    cfg = make_config(_base_config(regime, model_dir, world_seed, "unused"))
    parts = _parts(cfg)
    runner = StepRunner(
        HFEngine(parts.model, parts.tokenizer, device=cfg.device), parts.env, parts.tokenizer, parts.agent_cfg
    )
    return evaluate(runner, parts.eval_tasks, sampled=True)


def run_one(spec: RunSpec, regime: Regime, model_dir: Path, eval_start: dict[str, float]) -> dict[str, Any]:
    """Train one configuration; the row (:data:`ROW_KEYS`)."""
    import torch
    from rich.console import Console

    from treegrpo.train.config import make_config
    from treegrpo.train.trainer import train

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="treegrpo-bench-learn-") as tmp:
        cfg = make_config({**_base_config(regime, model_dir, spec.world_seed, tmp), **spec.overrides()})
        s = train(cfg, console=Console(quiet=True), parts=_parts(cfg), eval_start=eval_start)
    return {
        "mode": spec.mode,
        "budget": spec.budget,
        "M": spec.m,
        "N": spec.n,
        "L": spec.l,
        "expand_mode": spec.expand_mode,
        "advantage": spec.advantage,
        "seed": spec.seed,
        "world_seed": spec.world_seed,
        "em_start": s.eval_start["eval/success_sampled"],
        "em_end": s.eval_end["eval/success_sampled"],
        "em_greedy_end": s.eval_end["eval/success_greedy"],
        "em_curve": [[int(t), float(e)] for t, e in s.em_curve],
        "generated_tokens": s.generated_tokens,
        "tool_calls": s.tool_calls,
        "trajectories": s.trajectories,
        "tool_calls_per_traj_start": s.eval_start["eval/tool_calls_sampled"],
        "tool_calls_per_traj_end": s.eval_end["eval/tool_calls_sampled"],
        "wall_s": round(s.wall_s, 2),
    }


def _spec_of(row: dict[str, Any]) -> RunSpec:
    return RunSpec(
        row["mode"],
        row["budget"],
        row["M"],
        row["N"],
        row["L"],
        row["expand_mode"],
        row["advantage"],
        row["seed"],
        row["world_seed"],
    )


# -- analysis ----------------------------------------------------------------------------------------


def em_at(curve: Sequence[Sequence[float]], tokens: float) -> float | None:
    """Linear interpolation of an ``em_curve`` (``[tokens, em]`` points, tokens increasing) at
    ``tokens``; ``None`` beyond its last point."""
    pts = sorted((float(t), float(e)) for t, e in curve)
    if not pts or tokens > pts[-1][0] + 1e-9 or tokens < pts[0][0] - 1e-9:
        return None
    for (t0, e0), (t1, e1) in itertools.pairwise(pts):
        if t0 <= tokens <= t1:
            return e0 if t1 == t0 else e0 + (e1 - e0) * (tokens - t0) / (t1 - t0)
    return pts[-1][1]


def _stats(values: Sequence[float]) -> dict[str, float]:
    v = list(values)
    return {
        "mean": statistics.fmean(v),
        "min": min(v),
        "max": max(v),
        "std": statistics.stdev(v) if len(v) > 1 else 0.0,
        "n": len(v),
    }


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per configuration label (all seeds and worlds pooled): mean / min / max / std of the end EMs,
    tokens, trajectories and tool calls per trajectory."""
    out: dict[str, dict[str, Any]] = {}
    for label in dict.fromkeys(_spec_of(r).label for r in rows):
        mine = [r for r in rows if _spec_of(r).label == label]
        out[label] = {
            "mode": mine[0]["mode"],
            "budget": mine[0]["budget"],
            "expand_mode": mine[0]["expand_mode"],
            "advantage": mine[0]["advantage"],
            "runs": len(mine),
            "em_start": statistics.fmean(r["em_start"] for r in mine),
            "em_end": _stats([r["em_end"] for r in mine]),
            "em_greedy_end": _stats([r["em_greedy_end"] for r in mine]),
            "generated_tokens": statistics.fmean(r["generated_tokens"] for r in mine),
            "trajectories": statistics.fmean(r["trajectories"] for r in mine),
            "tool_calls_per_traj_start": statistics.fmean(r["tool_calls_per_traj_start"] for r in mine),
            "tool_calls_per_traj_end": statistics.fmean(r["tool_calls_per_traj_end"] for r in mine),
            "wall_s": statistics.fmean(r["wall_s"] for r in mine),
        }
    return out


def _pairs(rows: Sequence[dict[str, Any]], a: str, b: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Rows of configurations ``a`` and ``b`` with the same seed and world seed."""
    by = {(_spec_of(r).label, r["seed"], r["world_seed"]): r for r in rows}
    return [(by[(a, s, w)], by[(b, s, w)]) for (lab, s, w) in by if lab == a and (b, s, w) in by]


def _curve_mean(row: dict[str, Any]) -> float:
    """Mean held-out EM over a run's evaluations after the start."""
    points = [e for _, e in row["em_curve"][1:]] or [row["em_end"]]
    return statistics.fmean(points)


def compare(rows: Sequence[dict[str, Any]], tree: str, chain: str) -> dict[str, Any] | None:
    """Paired comparison of two configurations: end EMs (ratio of means, per-pair ratios and
    differences), the ratio of EMs averaged over each run's evaluations (``curve_mean_ratio``), and
    EM at equal generated tokens (both curves interpolated at the smaller of the two runs' total
    tokens)."""
    pairs = _pairs(rows, tree, chain)
    if not pairs:
        return None
    t_end = [p[0]["em_end"] for p in pairs]
    c_end = [p[1]["em_end"] for p in pairs]
    eq_t, eq_c = [], []
    for t, c in pairs:
        tokens = min(t["generated_tokens"], c["generated_tokens"])
        et, ec = em_at(t["em_curve"], tokens), em_at(c["em_curve"], tokens)
        if et is not None and ec is not None:
            eq_t.append(et)
            eq_c.append(ec)
    out: dict[str, Any] = {
        "pairs": len(pairs),
        "tree": tree,
        "chain": chain,
        "tree_em_end": statistics.fmean(t_end),
        "chain_em_end": statistics.fmean(c_end),
        "ratio": statistics.fmean(t_end) / max(statistics.fmean(c_end), 1e-9),
        "pair_ratios": [round(t / max(c, 1e-9), 3) for t, c in zip(t_end, c_end, strict=True)],
        "pair_diffs": [round(t - c, 4) for t, c in zip(t_end, c_end, strict=True)],
        "tree_wins": sum(t > c for t, c in zip(t_end, c_end, strict=True)),
        # learning speed over the whole run: EM averaged over the evaluations after the start
        # (both runs evaluate at the same steps), less sensitive to where the run stops
        "curve_mean_ratio": statistics.fmean(_curve_mean(p[0]) for p in pairs)
        / max(statistics.fmean(_curve_mean(p[1]) for p in pairs), 1e-9),
        "tree_tokens": statistics.fmean(p[0]["generated_tokens"] for p in pairs),
        "chain_tokens": statistics.fmean(p[1]["generated_tokens"] for p in pairs),
    }
    if eq_t:
        out["equal_tokens_tree_em"] = statistics.fmean(eq_t)
        out["equal_tokens_chain_em"] = statistics.fmean(eq_c)
    return out


def _tree_label(budget: int, mode: str, advantage: str = "tree_grpo") -> str:
    m, n, l = PAPER_PAIRS[budget]
    return _spec_of(
        {
            "mode": "tree",
            "budget": budget,
            "M": m,
            "N": n,
            "L": l,
            "expand_mode": mode,
            "advantage": advantage,
            "seed": 0,
            "world_seed": 0,
        }
    ).label


def targets(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The issue's comparisons, per world seed and pooled, with pass/fail where the issue sets a bar."""
    out: dict[str, Any] = {}
    worlds = sorted({r["world_seed"] for r in rows})
    scopes: list[tuple[str, list[dict[str, Any]]]] = [
        (f"world {w}", [r for r in rows if r["world_seed"] == w]) for w in worlds
    ]
    if len(worlds) > 1:
        scopes.append(("pooled", list(rows)))
    budgets = sorted({r["budget"] for r in rows})
    for scope, rs in scopes:
        t: dict[str, Any] = {}
        c2 = compare(rs, _tree_label(2, "random"), "chain 2") if 2 in budgets else None
        if c2:
            t["budget2_tree_vs_chain_em"] = {**c2, "op": ">=", "threshold": 1.15, "pass": c2["ratio"] >= 1.15}
        for b in (x for x in budgets if x <= 4):
            for mode in EXPAND_MODES:
                c = compare(rs, _tree_label(b, mode), f"chain {b}")
                if c and "equal_tokens_tree_em" in c:
                    t[f"budget{b}_{mode}_equal_tokens"] = {
                        "tree_em": c["equal_tokens_tree_em"],
                        "chain_em": c["equal_tokens_chain_em"],
                        "op": ">=",
                        "pass": c["equal_tokens_tree_em"] >= c["equal_tokens_chain_em"],
                        **(
                            {}
                            if mode == "random"
                            else {"note": "guided picks (reported; the target is on random)"}
                        ),
                    }
        for b in budgets:
            base = compare(rs, _tree_label(b, "random"), f"chain {b}")
            for mode in EXPAND_MODES[1:]:
                g = compare(rs, _tree_label(b, mode), f"chain {b}")
                if base and g:
                    t[f"budget{b}_{mode}_vs_random"] = {
                        "random_ratio_to_chain": base["ratio"],
                        f"{mode}_ratio_to_chain": g["ratio"],
                        "widens_gap": g["ratio"] > base["ratio"],
                        "em_end_diff_vs_random": g["tree_em_end"] - base["tree_em_end"],
                    }
        if ABLATION_BUDGET in budgets:
            ems = {}
            for adv in ("tree_grpo", *ABLATION):
                mine = [r for r in rs if _spec_of(r).label == _tree_label(ABLATION_BUDGET, "random", adv)]
                if mine:
                    ems[adv] = statistics.fmean(r["em_end"] for r in mine)
            if len(ems) == 3:
                t["ablation_order"] = {
                    "both": ems["tree_grpo"],
                    "inter_only": ems["inter_only"],
                    "intra_only": ems["intra_only"],
                    "op": "both > inter_only >= intra_only",
                    "pass": ems["tree_grpo"] > ems["inter_only"] >= ems["intra_only"],
                }
        rise = {}
        for label, s in summarize(rs).items():
            rise[label] = [round(s["tool_calls_per_traj_start"], 3), round(s["tool_calls_per_traj_end"], 3)]
        t["tool_calls_per_traj_start_end"] = rise
        if 16 in budgets and 4 in budgets:
            h = compare(rs, _tree_label(4, "random"), "chain 16")
            if h:
                t["headline_tree4_vs_chain16"] = {
                    **h,
                    "op": ">=",
                    "threshold": 1.0,
                    "pass": h["ratio"] >= 1.0,
                }
        out[scope] = t
    return out


# -- plots -------------------------------------------------------------------------------------------


def plot(result: dict[str, Any], path: Path) -> None:
    """Two panels: held-out EM vs budget (mean, min–max over seeds) and EM vs generated tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    summary = summarize(rows)
    fig, (ax, cx, bx) = plt.subplots(1, 3, figsize=(19, 4.8), gridspec_kw={"width_ratios": [1.1, 0.9, 1.1]})
    colors = {"chain": "black", "random": "tab:blue", "nonroot": "tab:orange", "entropy": "tab:green"}
    budgets = sorted({r["budget"] for r in rows})
    series: list[tuple[str, str, list[str]]] = [("chain", "chain GRPO", [f"chain {b}" for b in budgets])]
    series += [(m, f"Tree-GRPO {m}", [_tree_label(b, m) for b in budgets]) for m in EXPAND_MODES]
    for i, (key, name, labels) in enumerate(series):
        xs, ys, lo, hi = [], [], [], []
        for b, lab in zip(budgets, labels, strict=True):
            if lab in summary:
                s = summary[lab]["em_end"]
                xs.append(b * (1 + 0.03 * (i - 1.5)))
                ys.append(s["mean"])
                lo.append(s["mean"] - s["min"])
                hi.append(s["max"] - s["mean"])
        if xs:
            ax.errorbar(
                xs,
                ys,
                yerr=[lo, hi],
                marker="o",
                capsize=3,
                color=colors[key],
                label=name,
                linestyle="-" if key == "chain" else "--",
            )
    for adv, marker in (("intra_only", "v"), ("inter_only", "^")):
        lab = _tree_label(ABLATION_BUDGET, "random", adv) if ABLATION_BUDGET in PAPER_PAIRS else ""
        if lab in summary:
            s = summary[lab]["em_end"]
            ax.errorbar(
                [ABLATION_BUDGET * 1.08],
                [s["mean"]],
                yerr=[[s["mean"] - s["min"]], [s["max"] - s["mean"]]],
                marker=marker,
                color="tab:purple",
                capsize=3,
                linestyle="none",
                label=f"tree random, {adv}",
            )
    if rows:
        ax.axhline(statistics.fmean(r["em_start"] for r in rows), color="gray", linestyle=":", label="start")
    ax.set_xscale("log", base=2)
    ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.set_xlabel("budget (chains per prompt; tree at the paper's matched (M,N,L))")
    ax.set_ylabel("held-out EM, sampled T=1 (end of run)")
    ax.set_title("EM vs budget: mean, min–max over seeds")
    ax.legend(fontsize=7)
    # paired ratios tree / chain at each budget, per world (dots) and pooled (bars)
    worlds = sorted({r["world_seed"] for r in rows})
    width = 0.8 / len(EXPAND_MODES)
    for j, mode in enumerate(EXPAND_MODES):
        for i, b in enumerate(budgets):
            per_world = [compare([r for r in rows if r["world_seed"] == w], _tree_label(b, mode), f"chain {b}") for w in worlds]
            pooled = compare(rows, _tree_label(b, mode), f"chain {b}")
            if pooled is None:
                continue
            x = i + (j - 1) * width
            cx.bar(x, pooled["ratio"], width=width * 0.9, color=colors[mode], alpha=0.6, label=mode if i == 0 else None)
            ys = [c["ratio"] for c in per_world if c is not None]
            cx.scatter([x] * len(ys), ys, color="k", s=10, zorder=3)
    cx.set_ylim(bottom=0.8)
    cx.axhline(1.0, color="gray", linewidth=0.8)
    cx.axhline(1.15, color="tab:red", linestyle=":", linewidth=0.8, label="budget-2 target 1.15")
    cx.set_xticks(range(len(budgets)), [str(b) for b in budgets])
    cx.set_xlabel("budget")
    cx.set_ylabel("tree EM / chain EM (end, paired seeds)")
    cx.set_title("tree ÷ chain: pooled (bars), per world (dots)")
    cx.legend(fontsize=7)
    for lab, s in summary.items():
        if s["advantage"] not in ("grpo", "tree_grpo") or (
            s["mode"] == "tree" and s["expand_mode"] not in ("random",)
        ):
            continue
        curves = [r["em_curve"] for r in rows if _spec_of(r).label == lab]
        top = min(c[-1][0] for c in curves)
        grid = [top * k / 20 for k in range(21)]
        ys = [statistics.fmean(v for v in (em_at(c, g) for c in curves) if v is not None) for g in grid]
        bx.plot(
            [g / 1000 for g in grid],
            ys,
            linestyle="-" if s["mode"] == "chain" else "--",
            color=plt.cm.viridis(math.log2(s["budget"]) / 4.2),
            label=lab,
        )
    bx.set_xlabel("generated tokens spent (thousands)")
    bx.set_ylabel("held-out EM, sampled (mean over seeds)")
    bx.set_title("EM vs generated tokens: chain (solid), tree random (dashed)")
    bx.legend(fontsize=7)
    reg = result["regime"]
    fig.suptitle(
        f"bench learn · regime {reg['name']} · {reg['steps']} steps × {reg['prompts_per_step']} prompts, lr {reg['lr']} · "
        f"seeds {result['seeds']} · worlds {result['world_seeds']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(result: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    t = Table(title="held-out EM (sampled T=1): mean ± std [min, max] over seeds and worlds")
    for col in (
        "config",
        "runs",
        "EM start",
        "EM end",
        "greedy end",
        "gen tokens",
        "traj",
        "tools/traj",
        "wall s",
    ):
        t.add_column(col, justify="left" if col == "config" else "right")
    for lab, s in result["summary"].items():
        e, g = s["em_end"], s["em_greedy_end"]
        t.add_row(
            lab,
            str(s["runs"]),
            f"{s['em_start']:.3f}",
            f"{e['mean']:.3f} ± {e['std']:.3f} [{e['min']:.2f}, {e['max']:.2f}]",
            f"{g['mean']:.3f}",
            f"{s['generated_tokens']:.0f}",
            f"{s['trajectories']:.0f}",
            f"{s['tool_calls_per_traj_start']:.2f} → {s['tool_calls_per_traj_end']:.2f}",
            f"{s['wall_s']:.0f}",
        )
    console.print(t)
    for scope, ts in result["targets"].items():
        for name, v in ts.items():
            if isinstance(v, dict) and "pass" in v:
                verdict = "[green]pass[/]" if v["pass"] else "[red]FAIL[/]"
                detail = (
                    f"ratio {v['ratio']:.3f} (pairs {v['pair_ratios']}; over the run {v['curve_mean_ratio']:.3f})"
                    if "ratio" in v
                    else f"tree {v['tree_em']:.3f} vs chain {v['chain_em']:.3f}"
                    if "tree_em" in v
                    else f"both {v['both']:.3f} · inter {v['inter_only']:.3f} · intra {v['intra_only']:.3f}"
                )
                console.print(f"{scope:8s} {name:34s} {detail} {verdict}")


# -- the whole benchmark -----------------------------------------------------------------------------


def run_bench(
    out: Path,
    regime: str = "default",
    quick: bool = False,
    world_seeds: Sequence[int] | None = None,
    seeds: int = 3,
    jobs: int = 2,
    steps: int | None = None,
    lr: float | None = None,
    prompts_per_step: int | None = None,
    eval_every: int | None = None,
    expand_modes: Sequence[str] = EXPAND_MODES,
    budgets: Sequence[int] | None = None,
    resume: bool = False,
    console: Any = None,
) -> dict[str, Any]:
    """The whole benchmark (module docstring); writes ``out`` (JSON) and ``out`` with ``.png``."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from treegrpo.envs.world import get_preset
    from treegrpo.io import atomic_write_text
    from treegrpo.models.bootstrap import ensure_bootstrapped
    from treegrpo.models.tiny import tiny_info

    console = console or Console(soft_wrap=True, width=None if Console().is_terminal else 150)
    if regime not in REGIMES:
        raise ValueError(f"unknown regime {regime!r}; choose one of {sorted(REGIMES)}")
    reg = REGIMES[regime]
    changes = {"steps": steps, "lr": lr, "prompts_per_step": prompts_per_step, "eval_every": eval_every}
    reg = dataclasses.replace(reg, **{k: v for k, v in changes.items() if v is not None})
    reg = dataclasses.replace(reg, eval_every=min(reg.eval_every, reg.steps))
    for mode in expand_modes:
        if mode not in EXPAND_MODES:
            raise ValueError(f"unknown expand mode {mode!r}; choose from {list(EXPAND_MODES)}")
    worlds = list(world_seeds) if world_seeds else [get_preset(reg.preset).seed]
    seed_list = list(range(seeds))
    budgets = tuple(budgets) if budgets else QUICK_BUDGETS if quick else BUDGETS
    specs = plan_runs(budgets, seed_list, worlds, expand_modes)
    t0 = time.perf_counter()

    models: dict[int, Path] = {}
    starts: dict[int, dict[str, float]] = {}
    for w in worlds:
        console.print(
            f"[bold]bench learn[/] world {w}: starting policy (bootstrapped and cached on first use)"
        )
        models[w] = ensure_bootstrapped(reg.preset, world_seed=w)
        starts[w] = start_eval(reg, models[w], w)
        console.print(
            f"  {models[w].name}: held-out sampled {starts[w]['eval/success_sampled']:.3f} · greedy "
            f"{starts[w]['eval/success_greedy']:.3f} · tool calls/traj {starts[w]['eval/tool_calls_sampled']:.2f}"
        )
    meta = {
        "regime": dataclasses.asdict(reg),
        "models": {
            str(w): {"folder": str(p), "config_hash": tiny_info(p).get("config_hash")}
            for w, p in models.items()
        },
    }
    rows: list[dict[str, Any]] = []
    prior_wall = 0.0  # time already spent on the rows kept by --resume
    if resume and Path(out).is_file():
        old = json.loads(Path(out).read_text())
        if {k: old.get(k) for k in meta} == meta:
            wanted = {s.key for s in specs}
            rows = [r for r in old.get("rows", []) if _spec_of(r).key in wanted]
            prior_wall = float(old.get("wall_s", 0.0))
            console.print(f"resuming: {len(rows)} runs already in {out}")
        else:
            console.print(f"[yellow]not resuming[/]: {out} was made with another regime or starting policy")
    done = {_spec_of(r).key for r in rows}
    todo = [s for s in specs if s.key not in done]
    command = (
        f"treegrpo bench learn --regime {regime}{' --quick' if quick else ''} --world-seed {','.join(map(str, worlds))} "
        f"--seeds {seeds} --jobs {jobs}"
        + (f" --steps {steps}" if steps is not None else "")
        + (f" --expand-modes {','.join(expand_modes)}" if tuple(expand_modes) != EXPAND_MODES else "")
        + (f" --budgets {','.join(map(str, budgets))}" if budgets not in (QUICK_BUDGETS, BUDGETS) else "")
        + f" --out {out}"
    )

    def result_of(complete: bool) -> dict[str, Any]:
        order = {s.key: i for i, s in enumerate(specs)}
        ordered = sorted(rows, key=lambda r: order.get(_spec_of(r).key, 1 << 30))
        return {
            "bench": "learn",
            **meta,
            "quick": quick,
            "budgets": list(budgets),
            "expand_modes": list(expand_modes),
            "seeds": seed_list,
            "world_seeds": worlds,
            "start": {str(w): starts[w] for w in worlds},
            "complete": complete,
            "rows": ordered,
            "summary": summarize(ordered) if ordered else {},
            "targets": targets(ordered) if ordered else {},
            "command": command,
            "wall_s": round(prior_wall + time.perf_counter() - t0, 1),  # all sessions of a resumed run
            "jobs": jobs,
            "cpu_count": os.cpu_count(),
        }

    out = Path(out)
    console.print(
        f"[bold]bench learn[/] regime {reg.name}: {len(todo)} runs to go ({len(specs)} in all), "
        f"{reg.steps} steps × {reg.prompts_per_step} prompts, lr {reg.lr}, {jobs} worker(s)"
    )
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    )
    with progress:
        bar = progress.add_task("runs", total=len(specs), completed=len(rows))

        def finished(spec: RunSpec, row: dict[str, Any]) -> None:
            rows.append(row)
            atomic_write_text(out, json.dumps(result_of(False), indent=1))
            progress.advance(bar)
            progress.console.print(
                f"  {spec.key:48s} EM {row['em_start']:.3f} → {row['em_end']:.3f} (greedy {row['em_greedy_end']:.3f}) · "
                f"gen tok {row['generated_tokens']} · tools/traj {row['tool_calls_per_traj_end']:.2f} · {row['wall_s']:.0f}s"
            )

        if jobs <= 1:
            for spec in todo:
                finished(spec, run_one(spec, reg, models[spec.world_seed], starts[spec.world_seed]))
        else:
            import multiprocessing as mp

            with ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as pool:
                pending: dict[Future[dict[str, Any]], RunSpec] = {
                    pool.submit(run_one, s, reg, models[s.world_seed], starts[s.world_seed]): s for s in todo
                }
                while pending:
                    ready, _ = wait(pending, return_when=FIRST_COMPLETED)
                    for fut in ready:
                        finished(pending.pop(fut), fut.result())
    result = result_of(True)
    atomic_write_text(out, json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    print_table(result, console)
    console.print(
        f"[bold]bench learn[/]: wrote {out} and {out.with_suffix('.png')} in {result['wall_s']:.0f}s"
    )
    return result
