"""``treegrpo bench eptree``: uncertainty-guided token forking (TreeRL's EPTree) vs random forking
vs independent chains on the single-turn arithmetic task, then short RL runs with ``treerl`` vs
``grpo`` advantages.

**Sampling** (the same starting policy — the cached arithmetic bootstrap — the same prompts, a
sample of the ``train`` split, and per seed the same generator for every method, so the EPTree
variants share their M initial chains and differ only in where they fork):

- ``eptree_logp``: EPTree (M, N, L, T) = (6, 2, 1, 2), forking at the highest ``-log p`` tokens;
- ``eptree_random``: the same shape, fork points drawn uniformly among the same candidates;
- ``eptree_entropy``: the same shape, forking at the highest full-distribution entropy;
- ``chains_16``: 16 independent chains per prompt;
- ``chains_matched``: as many chains as the ``eptree_logp`` rollout's generated tokens pay for
  (its tokens ÷ the mean tokens of one chain, measured on ``chains_16``, rounded).

Per method and seed: ``pass_rate`` (fraction of prompts with at least one correct leaf),
``distinct_correct`` (distinct correct responses — token sequences — per prompt), ``correct_frac``
(fraction of leaves correct), ``correct_leaves`` (per prompt), ``correct_per_1k_tokens`` (correct
leaves per 1000 generated tokens), ``mixed_frac`` (prompts whose leaves disagree, i.e. that give a
non-zero advantage), ``trajectories``, ``generated_tokens`` and ``prefill_tokens`` (sums over
prompts, the samplers' own budget counters) and ``wall_s``.

**RL** (the one trainer loop, :func:`treegrpo.training.trainer.train`, from the same starting policy):
``eptree+treerl`` (process rewards per segment), ``eptree+grpo`` (the same forests, one
trajectory-level advantage per leaf) and ``chains+grpo`` (chains at the matched token count);
held-out success on the ``eval`` split (greedy and sampled, one chain per problem) before and after,
per RL seed and averaged (``rl.summary``).

Results: JSON (``--out``) and a PNG plot beside it.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from treegrpo.benchmarks.runner import pyplot, save_figure, write_result
from treegrpo.tree import Forest

DEFAULT_SHAPE: tuple[int, int, int, int] = (6, 2, 1, 2)
METHODS: tuple[str, ...] = ("eptree_logp", "eptree_random", "eptree_entropy", "chains_16", "chains_matched")


def forest_stats(forests: Sequence[Forest]) -> dict[str, float]:
    """Per batch of forests: ``pass_rate`` (prompts with a correct leaf), ``distinct_correct``
    (distinct correct responses per prompt), ``correct_frac`` (correct leaves), ``correct_leaves``
    (per prompt) and ``mixed_frac`` (prompts whose leaves disagree: a non-zero learning signal).

    For EPTree forests (leaves carry ``extra["round"]``) also ``branch_correct_frac`` (forked
    branches that are correct) and ``rescued_frac`` (trees whose initial chain failed in which some
    branch succeeded, over trees whose initial chain failed and that forked) and
    ``hard_rescued_frac`` (prompts whose M initial chains all failed that a branch solved, over
    such prompts); ``None`` otherwise.
    """
    passed = 0
    distinct = 0
    correct = 0
    leaves = 0
    mixed = 0
    branches = branch_ok = failed = rescued = hard = hard_ok = 0
    for forest in forests:
        firsts = [leaf for _, leaf in forest.leaves() if leaf.extra.get("round") == 0]
        if firsts and all((leaf.reward or 0.0) <= 0 for leaf in firsts):
            hard += 1
            hard_ok += int(any((leaf.reward or 0.0) > 0 for _, leaf in forest.leaves()))
        for tree in forest.trees:
            tl = tree.leaves()
            first = [leaf for leaf in tl if leaf.extra.get("round") == 0]
            forked = [leaf for leaf in tl if (leaf.extra.get("round") or 0) >= 1]
            branches += len(forked)
            branch_ok += sum((leaf.reward or 0.0) > 0 for leaf in forked)
            if first and forked and (first[0].reward or 0.0) <= 0:
                failed += 1
                rescued += int(any((leaf.reward or 0.0) > 0 for leaf in forked))
        seqs = set()
        mine = forest.leaves()
        for ti, leaf in mine:
            leaves += 1
            if (leaf.reward or 0.0) > 0:
                correct += 1
                path = forest.trees[ti].path(leaf.id)[1:]
                seqs.add(tuple(tok for nd in path for tok, m in zip(nd.tokens, nd.policy_mask, strict=True) if m))
        passed += int(bool(seqs))
        distinct += len(seqs)
        mixed += int(len({leaf.reward for _, leaf in mine}) > 1)
    n = max(1, len(forests))
    return {
        "pass_rate": passed / n, "distinct_correct": distinct / n, "correct_frac": correct / max(1, leaves),
        "correct_leaves": correct / n, "mixed_frac": mixed / n,
        "branch_correct_frac": branch_ok / branches if branches else None,
        "rescued_frac": rescued / failed if failed else None, "hard_prompts": hard if _has_rounds(forests) else None,
        "hard_rescued_frac": hard_ok / hard if hard else None,
    }  # fmt: skip


def _has_rounds(forests: Sequence[Forest]) -> bool:
    """Whether the forests' leaves record their EPTree round (``extra["round"]``)."""
    return any("round" in leaf.extra for f in forests for _, leaf in f.leaves())


def _sampler_cfg(method: str, shape: tuple[int, int, int, int], chains: int) -> Any:
    from treegrpo.rollout.samplers import SamplerConfig

    m, n, l, t = shape
    if method.startswith("eptree_"):
        return SamplerConfig("eptree", m=m, n=n, l=l, t=t, fork_score=method.removeprefix("eptree_"))  # type: ignore[arg-type]
    return SamplerConfig("chain", group_size=chains)


def sampling_rows(
    model_dir: Path,
    n_prompts: int,
    seeds: Sequence[int],
    shape: tuple[int, int, int, int] = DEFAULT_SHAPE,
    log: Callable[[str], object] = print,
) -> list[dict[str, Any]]:
    """One row per (method, seed): the sampling comparison (module docstring)."""
    from treegrpo.models.loader import load_model, load_tokenizer
    from treegrpo.rollout.agent import StepRunner
    from treegrpo.rollout.engine import make_engine
    from treegrpo.rollout.samplers import get_sampler
    from treegrpo.tasks.arith.bootstrap import load_arith_setup

    setup = load_arith_setup(model_dir)
    model, tok = load_model(model_dir), load_tokenizer(model_dir)
    model.eval()
    runner = StepRunner(make_engine("hf", model, tok), setup.env, tok, setup.agent)
    rows: list[dict[str, Any]] = []
    for seed in seeds:
        tasks = random.Random(f"bench-eptree-{seed}").sample(setup.problems.tasks("train"), n_prompts)
        per_chain = 0.0
        for method in METHODS:
            chains = 16
            if method == "chains_matched":
                ep = next(r for r in rows if r["seed"] == seed and r["method"] == "eptree_logp")
                chains = max(1, round(ep["generated_tokens"] / max(1e-9, per_chain * n_prompts)))
            cfg = _sampler_cfg(method, shape, chains)
            res = get_sampler(cfg.name)(runner, tasks, cfg, random.Random(seed), torch.Generator().manual_seed(seed))
            total = res.total()
            row = {
                "method": method, "seed": seed, "prompts": n_prompts, "chains": chains if cfg.name == "chain" else None,
                "trajectories": sum(f.n_trajectories() for f in res.forests), "generated_tokens": total.generated_tokens,
                "prefill_tokens": total.prefill_tokens, "engine_calls": res.engine_calls, "wall_s": round(res.wall_s, 3),
                **forest_stats(res.forests),
            }  # fmt: skip
            row["correct_per_1k_tokens"] = 1000.0 * row["correct_leaves"] * n_prompts / max(1, row["generated_tokens"])
            if method == "chains_16":
                per_chain = total.generated_tokens / max(1, row["trajectories"])
            rows.append(row)
            log(
                f"  seed {seed} {method:15s} pass {row['pass_rate']:.3f} · distinct correct "
                f"{row['distinct_correct']:.2f} · leaves {row['trajectories']} · gen tokens {row['generated_tokens']}"
            )
    return rows


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per method: mean over seeds of every measure (and the per-seed pass rates)."""
    out: dict[str, dict[str, float]] = {}
    for method in METHODS:
        mine = [r for r in rows if r["method"] == method]
        if not mine:
            continue
        keys = ("pass_rate", "distinct_correct", "correct_frac", "correct_leaves", "correct_per_1k_tokens", "mixed_frac",
                "trajectories", "generated_tokens", "prefill_tokens", "wall_s")  # fmt: skip
        out[method] = {k: statistics.fmean(float(r[k]) for r in mine) for k in keys}
        out[method]["pass_rate_per_seed"] = [r["pass_rate"] for r in mine]  # type: ignore[assignment]
        if mine[0]["chains"] is not None:
            out[method]["chains"] = statistics.fmean(r["chains"] for r in mine)
        for k in ("branch_correct_frac", "rescued_frac", "hard_prompts", "hard_rescued_frac"):
            vals = [r[k] for r in mine if r.get(k) is not None]
            if vals:
                out[method][k] = statistics.fmean(vals)
    return out


def rl_runs(
    model_dir: Path,
    seed: int,
    steps: int,
    prompts_per_step: int,
    lr: float,
    chains: int,
    eval_prompts: int,
    shape: tuple[int, int, int, int] = DEFAULT_SHAPE,
    threads: int | None = None,
    log: Callable[[str], object] = print,
) -> list[dict[str, Any]]:
    """Short RL runs from the starting policy: eptree+treerl, eptree+grpo, chains+grpo."""
    from rich.console import Console

    from treegrpo.training.config import make_config
    from treegrpo.training.trainer import train

    m, n, l, t = shape
    runs = [
        ("eptree+treerl", {"sampler": "eptree", "advantage": "treerl"}),
        ("eptree+grpo", {"sampler": "eptree", "advantage": "grpo"}),
        ("chains+grpo", {"sampler": "chain", "advantage": "grpo", "group_size": chains}),
    ]
    out = []
    with tempfile.TemporaryDirectory(prefix="treegrpo-bench-eptree-") as tmp:
        for name, kw in runs:
            cfg = make_config({
                "task": "arith", "model": str(model_dir), "m": m, "n": n, "l": l, "t": t, "fork_score": "logp",
                "steps": steps, "prompts_per_step": prompts_per_step, "lr": lr, "eval_every": 0,
                "eval_prompts": eval_prompts, "save_every": 0, "dump_rollouts_every": 0, "tensorboard": False,
                "seed": seed, "threads": threads or 0, "out_dir": str(Path(tmp) / name.replace("+", "_")), **kw,
            })  # fmt: skip
            s = train(cfg, console=Console(quiet=True))
            out.append({
                "name": name, "seed": seed, "sampler": cfg.sampler, "advantage": cfg.estimator, "steps": steps,
                "prompts_per_step": prompts_per_step, "lr": lr, "eval_start": s.eval_start, "eval_end": s.eval_end,
                "trajectories": s.trajectories, "generated_tokens": s.generated_tokens, "wall_s": round(s.wall_s, 1),
            })  # fmt: skip
            log(
                f"  RL seed {seed} {name:14s} held-out sampled {s.eval_start.get('eval/success_sampled', float('nan')):.3f} → "
                f"{s.eval_end.get('eval/success_sampled', float('nan')):.3f} · greedy "
                f"{s.eval_start['eval/success_greedy']:.3f} → {s.eval_end['eval/success_greedy']:.3f} · "
                f"gen tokens {s.generated_tokens} · {s.wall_s:.0f}s"
            )
    return out


def rl_summary(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per RL configuration: held-out success at the start and the end, mean over seeds."""
    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(r["name"] for r in runs):
        mine = [r for r in runs if r["name"] == name]
        row: dict[str, Any] = {"seeds": [r["seed"] for r in mine]}
        for key in ("eval/success_sampled", "eval/success_greedy"):
            if key in mine[0]["eval_start"]:
                short = key.split("/")[-1]
                row[f"{short}_start"] = statistics.fmean(r["eval_start"][key] for r in mine)
                row[f"{short}_end"] = statistics.fmean(r["eval_end"][key] for r in mine)
                row[f"{short}_end_per_seed"] = [r["eval_end"][key] for r in mine]
        row["generated_tokens"] = statistics.fmean(r["generated_tokens"] for r in mine)
        out[name] = row
    return out


def verdict(summary: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Does -log p forking beat random forking and chains at the same (or fewer) generated tokens?"""
    lp, rnd = summary["eptree_logp"], summary["eptree_random"]
    out: dict[str, Any] = {
        "logp_vs_random_pass_rate": lp["pass_rate"] - rnd["pass_rate"],
        "logp_vs_random_distinct_correct": lp["distinct_correct"] - rnd["distinct_correct"],
        "logp_vs_random_tokens_ratio": lp["generated_tokens"] / max(1.0, rnd["generated_tokens"]),
        "logp_vs_random_correct_per_1k_tokens": lp["correct_per_1k_tokens"] - rnd["correct_per_1k_tokens"],
        "logp_vs_random_branch_correct_frac": lp.get("branch_correct_frac", 0.0) - rnd.get("branch_correct_frac", 0.0),
        "logp_vs_random_rescued_frac": lp.get("rescued_frac", 0.0) - rnd.get("rescued_frac", 0.0),
    }
    for chains in ("chains_16", "chains_matched"):
        c = summary.get(chains)
        if c is not None:
            out[f"logp_vs_{chains}_pass_rate"] = lp["pass_rate"] - c["pass_rate"]
            out[f"logp_vs_{chains}_distinct_correct"] = lp["distinct_correct"] - c["distinct_correct"]
            out[f"logp_vs_{chains}_tokens_ratio"] = lp["generated_tokens"] / max(1.0, c["generated_tokens"])
            out[f"logp_vs_{chains}_correct_per_1k_tokens"] = lp["correct_per_1k_tokens"] - c["correct_per_1k_tokens"]
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    """Two panels: pass rate / distinct correct per method (tokens annotated); RL held-out success."""
    plt = pyplot()
    summary = result["sampling"]["summary"]
    methods = [m for m in METHODS if m in summary]
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.4))
    x = range(len(methods))
    panels = (
        ("pass_rate", "tab:blue", "PassRate (≥1 correct leaf)", "pass rate (generated tokens on top)"),
        ("distinct_correct", "tab:green", "distinct correct responses / prompt", "diversity of correct responses"),
        ("correct_per_1k_tokens", "tab:purple", "correct leaves / 1k generated tokens", "correct trajectories per token"),
    )
    for ax, (key, color, ylabel, title) in zip(axes, panels, strict=False):
        ax.bar(x, [summary[m][key] for m in methods], color=color)
        ax.set_xticks(list(x), methods, rotation=20, fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
    for i, m in enumerate(methods):
        axes[0].text(i, summary[m]["pass_rate"], f"{summary[m]['generated_tokens'] / 1000:.1f}k tok", ha="center", va="bottom", fontsize=8)
    axes[0].set_ylim(0, 1.1)
    ax = axes[3]
    rl = result.get("rl", {})
    rsum = rl.get("summary", {})
    if rsum:
        names = list(rsum)
        key = "success_sampled" if "success_sampled_start" in rsum[names[0]] else "success_greedy"
        xs = range(len(names))
        ax.bar([i - 0.2 for i in xs], [rsum[k][f"{key}_start"] for k in names], width=0.4, label="start", color="tab:gray")
        ax.bar([i + 0.2 for i in xs], [rsum[k][f"{key}_end"] for k in names], width=0.4, label="end (mean)", color="tab:orange")
        for i, k in enumerate(names):
            ax.scatter([i + 0.2] * len(rsum[k][f"{key}_end_per_seed"]), rsum[k][f"{key}_end_per_seed"], color="k", s=10, zorder=3)
        ax.set_xticks(list(xs), names, rotation=15, fontsize=8)
        ax.set_ylabel(f"held-out {key}")
        ax.legend(fontsize=8)
        ax.set_title(f"RL, {rl['runs'][0]['steps']} steps, seeds {rl['seeds']}")
    fig.suptitle(
        f"EPTree {tuple(result['shape'].values())} vs random forking vs chains — arithmetic, seeds {result['seeds']}",
        fontsize=10,
    )
    save_figure(fig, path)


def run_bench(
    out: Path,
    prompts: int = 96,
    seeds: Sequence[int] = (0, 1, 2),
    rl_steps: int = 30,
    rl_prompts_per_step: int = 8,
    rl_lr: float = 3e-4,
    rl_seeds: Sequence[int] = (0, 1),
    eval_prompts: int = 256,
    threads: int | None = 1,
    model_dir: Path | None = None,
    shape: tuple[int, int, int, int] = DEFAULT_SHAPE,
    log: Callable[[str], object] = print,
) -> dict[str, Any]:
    """The whole benchmark (module docstring); writes ``out`` (JSON) and ``out`` with ``.png``."""
    from treegrpo.benchmarks.provenance import provenance
    from treegrpo.models.loader import tiny_info
    from treegrpo.tasks.arith.bootstrap import ensure_arith_bootstrapped

    t0 = time.perf_counter()
    if threads:
        torch.set_num_threads(threads)
    if model_dir is None:
        log("bench eptree: the arithmetic starting policy (bootstrapped and cached on first use)")
        model_dir = ensure_arith_bootstrapped(progress=False)
    info = tiny_info(model_dir)
    prov = provenance(model_dir=model_dir)
    log(f"bench eptree: sampling, {prompts} prompts × seeds {list(seeds)}, EPTree {shape}")
    rows = sampling_rows(model_dir, prompts, seeds, shape, log)
    summary = summarize(rows)
    matched = max(1, round(summary["chains_matched"]["chains"])) if "chains_matched" in summary else 16
    t_sampling = time.perf_counter() - t0
    runs: list[dict[str, Any]] = []
    if rl_steps > 0:
        log(
            f"bench eptree: RL, seeds {list(rl_seeds)}, {rl_steps} steps × {rl_prompts_per_step} prompts, "
            f"lr {rl_lr}, chains+grpo with G={matched}"
        )
        for rl_seed in rl_seeds:
            runs += rl_runs(
                model_dir, rl_seed, rl_steps, rl_prompts_per_step, rl_lr, matched, eval_prompts, shape, threads, log
            )
    result = {
        "bench": "eptree", "task": "arith",
        "model": {"folder": str(model_dir), **{k: info.get(k) for k in ("params", "warmup_eval", "config_hash")}},
        "shape": dict(zip("mnlt", shape, strict=True)), "seeds": list(seeds), "prompts": prompts, "split": "train",
        "sampling": {"rows": rows, "summary": summary, "wall_s": round(t_sampling, 1)}, "verdict": verdict(summary),
        "rl": {"runs": runs, "summary": rl_summary(runs), "seeds": list(rl_seeds), "eval_split": "eval",
               "eval_prompts": eval_prompts, "chains_group_size": matched},
        "command": (
            f"treegrpo bench eptree --out {out} --prompts {prompts} --seeds {','.join(map(str, seeds))} "
            f"--rl-steps {rl_steps} --rl-seeds {','.join(map(str, rl_seeds))} "
            f"--rl-prompts-per-step {rl_prompts_per_step} --rl-lr {rl_lr} "
            f"--eval-prompts {eval_prompts} --threads {threads}"
        ),
        "wall_s": round(time.perf_counter() - t0, 1), "provenance": prov,
    }  # fmt: skip
    out = Path(out)
    write_result(out, result, plot)
    log(f"bench eptree: wrote {out} and {out.with_suffix('.png')} in {result['wall_s']:.0f}s")
    return result
