"""The one trainer loop: sample forests → score them → PPO-clip update → log, evaluate, checkpoint.

Read it top to bottom: :func:`train` is the whole algorithm; the helpers below it are small.
Estimators and losses are looked up in their registries (``treegrpo.algos``); samplers in theirs.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from treegrpo.algos.advantages import AdvantageConfig, get_advantage_estimator, score_forest, token_advantages
from treegrpo.algos.losses import LossConfig
from treegrpo.envs.base import Task
from treegrpo.rollout.agent import RolloutResult, StepRunner
from treegrpo.rollout.hf_engine import HFEngine
from treegrpo.rollout.samplers import SamplerConfig, get_sampler
from treegrpo.train.checkpoint import find_checkpoint, load_state, save_checkpoint
from treegrpo.train.config import TrainConfig, warn_single_leaf_groups
from treegrpo.train.metrics import MetricsLogger
from treegrpo.train.setup import RunParts, build_run
from treegrpo.train.update import update
from treegrpo.tree import write_forests

EVAL_SEED = 12345  # evaluation draws from its own stream, never from the training RNG


@dataclass
class TrainSummary:
    """What a run did, for the closing report and for benchmarks."""

    out_dir: str
    steps: int
    eval_start: dict[str, float]
    eval_end: dict[str, float]
    trajectories: int
    generated_tokens: int
    prefill_tokens: int
    tool_calls: int
    wall_s: float
    rollout_s: float
    update_s: float
    em_curve: list[list[float]]

    @property
    def trajectories_per_1k_tokens(self) -> float:
        return 1000.0 * self.trajectories / max(1, self.generated_tokens)

    @property
    def tool_calls_per_trajectory(self) -> float:
        return self.tool_calls / max(1, self.trajectories)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["trajectories_per_1k_tokens"] = self.trajectories_per_1k_tokens
        d["tool_calls_per_trajectory"] = self.tool_calls_per_trajectory
        return d


def train(
    cfg: TrainConfig,
    console: Console | None = None,
    parts: RunParts | None = None,
    eval_start: dict[str, float] | None = None,
) -> TrainSummary:
    """Run ``cfg``. ``parts`` (model, env, questions) are built from ``cfg`` unless given;
    ``eval_start`` is the starting policy's held-out evaluation when the caller already has it
    (evaluation is deterministic, so runs from one model can share it)."""
    warn_single_leaf_groups(cfg)  # their advantage has no baseline
    console = console or Console(soft_wrap=True)
    t_start = time.perf_counter()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_dir = out / "checkpoint"
    resume_from = find_checkpoint(ckpt_dir) if cfg.resume else None

    # -- the pieces ------------------------------------------------------------------------------
    parts = parts or build_run(cfg)
    model, tok = parts.model, parts.tokenizer
    ref_model = _frozen_copy(model) if cfg.kl_coef > 0 else None  # reference = the starting policy
    engine = HFEngine(model, tok, device=cfg.device)
    runner = StepRunner(engine, parts.env, tok, parts.agent_cfg)
    sampler = get_sampler(cfg.sampler)
    sampler_cfg = SamplerConfig(
        cfg.sampler, cfg.group_size, cfg.m, cfg.n, cfg.l, cfg.expand_mode, t=cfg.t, fork_score=cfg.fork_score
    )
    estimator = cfg.estimator
    get_advantage_estimator(estimator)  # fail fast on an unknown name
    adv_cfg = AdvantageConfig(scale=cfg.adv_scale, sqrt_weighting=cfg.adv_sqrt_weighting, local=cfg.adv_local)
    loss_cfg = LossConfig(
        clip_ratio_low=cfg.clip_ratio_low,
        clip_ratio_high=cfg.clip_ratio_high,
        dual_clip=cfg.dual_clip,
        kl_coef=cfg.kl_coef,
        kl_kind=cfg.kl_kind,
        entropy_coef=cfg.entropy_coef,
        agg_mode=cfg.agg_mode,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    rng = random.Random(cfg.seed)  # prompt order: the same for every sampler at one seed (paired runs)
    pick_rng = random.Random(f"picks-{cfg.seed}")  # tree picks, apart so they cannot shift the prompts
    gen = torch.Generator().manual_seed(cfg.seed)  # rollout sampling
    totals = {"trajectories": 0, "generated_tokens": 0, "prefill_tokens": 0, "tool_calls": 0}
    times = {"rollout_s": 0.0, "update_s": 0.0}
    start_step, em_curve = 0, []
    eval_start = dict(eval_start or {})
    if resume_from is not None:
        state = load_state(resume_from)
        model.load_state_dict(_load_weights(resume_from, model))
        optimizer.load_state_dict(state["optimizer"])
        rng.setstate(state["rng"])
        if "pick_rng" in state:
            pick_rng.setstate(state["pick_rng"])
        gen.set_state(state["gen"])
        start_step, totals, times = state["step"], state["totals"], state["times"]
        eval_start, em_curve = state["eval_start"], state["em_curve"]
        console.print(f"[bold]resumed[/] from {resume_from} at step {start_step}")
    logger = MetricsLogger(out, cfg.tensorboard, resume_step=start_step if resume_from else None)
    (out / "config.json").write_text(json.dumps(cfg.model_dump(), indent=1))
    console.print(
        f"[bold]treegrpo[/] {cfg.sampler} {_shape(cfg)} · advantage {estimator} · model {parts.model_dir} · "
        f"{len(parts.train_tasks)} train / {len(parts.eval_tasks)} eval questions · {cfg.steps} steps"
    )
    if resume_from is None:
        eval_start = eval_start or evaluate(runner, parts.eval_tasks, cfg.eval_sampled)
        em_curve.append([0, _headline(eval_start)])
        logger.log(start_step, eval_start)
        console.print(f"step {start_step:4d} · held-out success {_fmt_eval(eval_start)}")
    last_eval = eval_start

    # -- the loop --------------------------------------------------------------------------------
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    progress = Progress(
        TextColumn("train"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    )
    with progress:
        bar = progress.add_task("train", total=cfg.steps, completed=start_step)
        for step in range(start_step + 1, cfg.steps + 1):
            # 1. rollout: one batch of prompts, grown into forests by the sampler
            tasks = rng.sample(parts.train_tasks, min(cfg.prompts_per_step, len(parts.train_tasks)))
            t0 = time.perf_counter()
            engine.load_weights(model)
            result: RolloutResult = sampler(runner, tasks, sampler_cfg, pick_rng, gen)
            t1 = time.perf_counter()
            # 2. advantages, through the registry; one training sequence per leaf
            advs = [token_advantages(f, estimator, adv_cfg) for f in result.forests]
            n_traj = sum(f.n_trajectories() for f in result.forests)
            # 3. policy update: packed (each shared token once) or per path, see train/update.py
            metrics = update(
                model,
                ref_model,
                optimizer,
                result.forests,
                advs,
                cfg,
                loss_cfg,
                tok.pad_token_id,
                console.print,
            )
            t2 = time.perf_counter()
            times["rollout_s"] += t1 - t0
            times["update_s"] += t2 - t1
            # 4. bookkeeping: metrics, evaluation, rollouts, checkpoint
            budget = result.total()
            totals["trajectories"] += n_traj
            totals["generated_tokens"] += budget.generated_tokens
            totals["prefill_tokens"] += budget.prefill_tokens
            totals["tool_calls"] += budget.tool_calls
            metrics.update(rollout_metrics(result, n_traj))
            metrics.update({f"budget/total_{k}": v for k, v in totals.items()})
            metrics.update({"time/rollout_s": t1 - t0, "time/update_s": t2 - t1})
            if cfg.eval_every and step % cfg.eval_every == 0 and step != cfg.steps:
                last_eval = evaluate(runner, parts.eval_tasks, cfg.eval_sampled)
                metrics.update(last_eval)
                em_curve.append([totals["generated_tokens"], _headline(last_eval)])
            if step == cfg.steps:
                last_eval = evaluate(runner, parts.eval_tasks, cfg.eval_sampled)
                metrics.update(last_eval)
                em_curve.append([totals["generated_tokens"], _headline(last_eval)])
            logger.log(step, metrics)
            if cfg.dump_rollouts_every and (step % cfg.dump_rollouts_every == 0 or step == cfg.steps):
                for f in result.forests:
                    score_forest(f, estimator, adv_cfg)
                write_forests(result.forests, out / "rollouts" / f"step_{step:05d}.jsonl")
            console.print(_step_line(step, metrics))
            if (cfg.save_every and step % cfg.save_every == 0) or step == cfg.steps:
                state = {
                    "step": step,
                    "optimizer": optimizer.state_dict(),
                    "rng": rng.getstate(),
                    "pick_rng": pick_rng.getstate(),
                    "gen": gen.get_state(),
                    "totals": totals,
                    "times": times,
                    "eval_start": eval_start,
                    "em_curve": em_curve,
                    "config": cfg.model_dump(),
                }
                save_checkpoint(ckpt_dir, model, tok, state, parts.extra_files)
            progress.advance(bar)
    logger.close()
    summary = TrainSummary(
        out_dir=str(out),
        steps=cfg.steps,
        eval_start=eval_start,
        eval_end=last_eval,
        wall_s=time.perf_counter() - t_start,
        em_curve=em_curve,
        **totals,
        **times,
    )
    (out / "summary.json").write_text(json.dumps(summary.to_dict(), indent=1))
    return summary


def _frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    ref = copy.deepcopy(model)
    ref.eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def _load_weights(folder: Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from treegrpo.models.tiny import load_model

    return load_model(folder).state_dict()


# -- rollout and evaluation statistics ----------------------------------------------------------


def rollout_metrics(result: RolloutResult, n_traj: int) -> dict[str, float]:
    """Reward, trajectory shape and budget figures of one rollout batch."""
    leaves = [leaf for f in result.forests for _, leaf in f.leaves()]
    rewards = [float(leaf.reward or 0.0) for leaf in leaves]
    b = result.total()
    turns = [int(leaf.extra.get("turn", 0)) for leaf in leaves]
    answered = [leaf.extra.get("kind") == "answer" for leaf in leaves]
    solved_prompts = sum(any((leaf.reward or 0) > 0 for _, leaf in f.leaves()) for f in result.forests)
    # groups with a non-zero advantage signal: forests whose leaves disagree
    informative = sum(len({leaf.reward for _, leaf in f.leaves()}) > 1 for f in result.forests)
    return {
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
        "budget/tool_calls_per_traj": b.tool_calls / max(1, n_traj),
        "budget/traj_per_1k_tokens": 1000.0 * n_traj / max(1, b.generated_tokens),
    }


def evaluate(runner: StepRunner, tasks: Sequence[Task], sampled: bool = True) -> dict[str, float]:
    """Held-out success: greedy, and (optionally) sampled at T=1 — one chain per question, drawn
    from a fixed evaluation stream so evaluating never moves the training RNG."""
    out: dict[str, float] = {}
    modes = [("greedy", 0.0)] + ([("sampled", 1.0)] if sampled else [])
    chains = get_sampler("chain")
    for name, temp in modes:
        r = StepRunner(
            runner.engine,
            runner.env,
            runner.tokenizer,
            dataclasses.replace(runner.cfg, temperature=temp, top_p=1.0),
        )
        result = chains(
            r,
            tasks,
            SamplerConfig("chain", group_size=1),
            random.Random(EVAL_SEED),
            torch.Generator().manual_seed(EVAL_SEED),
        )
        leaves = [leaf for f in result.forests for _, leaf in f.leaves()]
        out[f"eval/success_{name}"] = sum(float(leaf.reward or 0.0) for leaf in leaves) / max(1, len(leaves))
        out[f"eval/tool_calls_{name}"] = result.total().tool_calls / max(1, len(leaves))
    return out


def _headline(ev: dict[str, float]) -> float:
    return ev.get("eval/success_sampled", ev["eval/success_greedy"])


def _shape(cfg: TrainConfig) -> str:
    if cfg.sampler == "eptree":
        return f"(M,N,L,T)=({cfg.m},{cfg.n},{cfg.l},{cfg.t}) fork at {cfg.fork_score}"
    return (
        f"G={cfg.group_size}"
        if cfg.sampler == "chain"
        else f"(M,N,L)=({cfg.m},{cfg.n},{cfg.l}) {cfg.expand_mode}"
    )


def _fmt_eval(ev: dict[str, float]) -> str:
    parts = [f"greedy {ev['eval/success_greedy']:.3f}"]
    if "eval/success_sampled" in ev:
        parts.insert(0, f"sampled {ev['eval/success_sampled']:.3f}")
    return " · ".join(parts)


def _step_line(step: int, m: dict[str, float]) -> str:
    line = (
        f"step {step:4d} · reward {m['reward/mean']:.3f} · traj {int(m['rollout/trajectories'])} · "
        f"gen tok {int(m['budget/generated_tokens'])} · tools/traj {m['budget/tool_calls_per_traj']:.2f} · "
        f"turns {m['rollout/turns_mean']:.2f} · {m['time/rollout_s']:.1f}s+{m['time/update_s']:.1f}s"
    )
    if "eval/success_greedy" in m:
        line += f" · [bold]held-out {_fmt_eval(m)}[/]"
    return line
