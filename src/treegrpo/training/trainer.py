"""The one trainer loop: sample forests → score them → PPO-clip update → log, evaluate, checkpoint.

Read it top to bottom: :func:`train` is the whole algorithm; the helpers below it are small.
Estimators and losses are looked up in their registries (``treegrpo.algos``); samplers in theirs.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from rich.console import Console

from treegrpo.algos.advantages import AdvantageConfig, get_advantage_estimator, score_forest, token_advantages
from treegrpo.algos.gigpo import shared_anchor_stats
from treegrpo.algos.losses import LossConfig
from treegrpo.errors import ConfigError
from treegrpo.io import atomic_write_json
from treegrpo.models.loader import MARKER_FILE, LoadedModel
from treegrpo.rollout.agent import RolloutResult, StepRunner
from treegrpo.rollout.engine import engine_stats, make_engine
from treegrpo.rollout.samplers import SamplerConfig, get_sampler
from treegrpo.tasks.custom import UserObjects
from treegrpo.training.checkpoint import (
    CHECKPOINT_DIR,
    Checkpoint,
    RunState,
    open_checkpoint,
    remove_stale_temps,
    resume_config,
    resumed_run,
)
from treegrpo.training.config import TrainConfig
from treegrpo.training.defaults import AUTO_LIMITS, resolve_model_defaults, warn_single_leaf_groups
from treegrpo.training.distributed import Parallel, QuietLogger, shard
from treegrpo.training.evaluate import evaluate, headline
from treegrpo.training.memory import return_freed_memory
from treegrpo.training.metrics import MetricsLogger, peak_rss_gb
from treegrpo.training.monitors import check_step
from treegrpo.training.policy import Policy
from treegrpo.training.report import (
    eval_label,
    fmt_eval,
    rollout_metrics,
    run_shape,
    step_line,
    step_warnings,
    tool_metrics,
)
from treegrpo.training.schedule import lr_at, set_lr
from treegrpo.training.setup import RunParts, build_run, recorded_agent_fields
from treegrpo.training.update import update
from treegrpo.tree import write_forests

GIGPO_ESTIMATORS = ("gigpo", "tree_gigpo")
"""Estimators whose runs log GiGPO's anchor diagnostic (``gigpo/shared_anchor_frac``, ``gigpo/anchor_group_size``)."""


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
    eval_label: str = "success"
    """``success`` when the rewards are 0/1, else ``reward``: what the held-out figures are."""

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

    @classmethod
    def of_run(cls, out_dir: Path, steps: int, run: RunState) -> TrainSummary:
        return cls(
            out_dir=str(out_dir),
            steps=steps,
            eval_start=run.eval_start,
            eval_end=run.last_eval,
            wall_s=run.wall_s,
            em_curve=run.em_curve,
            **run.totals,
            **run.times,
        )

    @classmethod
    def read(cls, path: Path) -> TrainSummary | None:
        """A written ``summary.json``, or None when it is missing or unreadable."""
        try:
            d = json.loads(Path(path).read_text())
            return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d or f.default is dataclasses.MISSING})
        except (OSError, ValueError, KeyError, TypeError):
            return None


def train(
    cfg: TrainConfig,
    console: Console | None = None,
    parts: RunParts | None = None,
    eval_start: dict[str, float] | None = None,
    user: UserObjects | None = None,
    loaded: LoadedModel | None = None,
) -> TrainSummary:
    """Run ``cfg``. ``parts`` (model, env, questions) are built from ``cfg`` unless given —
    with a Python caller's env, tools and rewards (``user``) and model (``loaded``), see
    :func:`~treegrpo.training.setup.build_run`; ``eval_start`` is the starting policy's held-out
    evaluation when the caller already has it (evaluation is deterministic, so runs from one model
    can share it)."""
    par = Parallel.from_env(cfg.parallel, cfg.device)  # one process, or this rank of torchrun's job
    warn_single_leaf_groups(cfg)  # their advantage has no baseline
    console = (console or Console(soft_wrap=True)) if par.main else Console(quiet=True)
    t_start = time.perf_counter()
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if par.main:
        remove_stale_temps(out)
    resume_from = open_checkpoint(out, console.print) if cfg.resume else None
    changed: dict[str, tuple[Any, Any]] = {}  # config fields a resume overrides
    if resume_from is not None:  # the recorded config, with what this call sets explicitly on top
        cfg, changed = resume_config(resume_from, cfg)
        if resume_from.step >= cfg.steps:
            return _finished(out, cfg, resume_from, console)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    return_freed_memory()  # glibc: freed activations go back to the OS (peak RSS), see training/memory.py

    # -- the pieces ------------------------------------------------------------------------------
    parts = parts or par.main_first(lambda: build_run(cfg, user=user, loaded=loaded))  # rank 0 bootstraps
    limits = {k: getattr(parts.agent_cfg, k) for k in AUTO_LIMITS}  # the ones the run uses
    cfg = resolve_model_defaults(cfg, tiny=(parts.model_dir / MARKER_FILE).is_file(), limits=limits)  # auto fields
    cfg = recorded_agent_fields(cfg, parts.agent_cfg)  # config.json says what runs
    policy, tok = Policy.build(parts.model, cfg, par), parts.tokenizer  # LoRA, reference, DDP/FSDP2
    engine = make_engine(cfg.engine, policy.rollout_module(), tok, device=cfg.device, **cfg.engine_options)
    runner = StepRunner(engine, parts.env, tok, parts.agent_cfg)
    label = eval_label(parts.env)  # held-out "success" (0/1 rewards) or "reward"
    for note in (runner.context_note, runner.template_note):  # a capped context, a re-rendering template
        if note:
            console.print(note)
    sampler = get_sampler(cfg.sampler)
    sampler_cfg = SamplerConfig(
        cfg.sampler, cfg.group_size, cfg.m, cfg.n, cfg.l, cfg.expand_mode, t=cfg.t, fork_score=cfg.fork_score,
        budget_tokens=cfg.budget_tokens,
    )
    estimator = cfg.estimator
    get_advantage_estimator(estimator)  # fail fast on an unknown name
    adv_cfg, loss_cfg = advantage_config(cfg), loss_config(cfg)
    trainable = policy.trainable_parameters()  # all, or the LoRA adapter's
    optimizer = torch.optim.AdamW(trainable, lr=float(cfg.lr), weight_decay=cfg.weight_decay)
    if resume_from is None:
        run = RunState.fresh(cfg.seed, eval_start)  # prompt order, tree picks and sampling streams
    else:
        policy.restore(resume_from, optimizer)  # weights (LoRA: the adapter) and optimizer state
        run = resumed_run(resume_from, optimizer, cfg, changed)  # applies overridden lr/seed
        for k, (old, new) in changed.items():
            console.print(f"resume: {k} changed from {old!r} to {new!r} (--resume-override)")
        console.print(f"[bold]resumed[/] from {resume_from.folder} at step {run.step}")
    par.own_streams(run, cfg.seed)  # rank r > 0: its own tree picks and sampling
    wall_before = run.wall_s  # earlier sessions of this run
    logger = (
        QuietLogger()
        if not par.main
        else MetricsLogger(
            out, cfg.tensorboard, resume_step=run.step if resume_from else None, say=console.print
        )
    )
    if par.main:
        atomic_write_json(out / "config.json", cfg.model_dump())
    console.print(
        f"[bold]treegrpo[/] {cfg.sampler} {run_shape(cfg)} · advantage {estimator} · model {parts.model_dir} · "
        f"{len(parts.train_tasks)} train / {len(parts.eval_tasks)} eval questions · {cfg.steps} steps"
    )
    if resume_from is None:
        run.eval_start = run.eval_start or par.on_main(
            lambda: evaluate(runner, parts.eval_tasks, cfg.eval_sampled)
        )
        run.last_eval = run.eval_start
        run.em_curve.append([0, headline(run.eval_start), 0])
        logger.log(0, run.eval_start)
        console.print(f"step {0:4d} · held-out {label} {fmt_eval(run.eval_start)}")

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
        bar = progress.add_task("train", total=cfg.steps, completed=run.step)
        for step in range(run.step + 1, cfg.steps + 1):
            # 1. rollout: one batch of prompts (the same on every rank; each grows its share)
            tasks = run.draw_prompts(parts.train_tasks, cfg.prompts_per_step)
            t0, c0 = time.perf_counter(), time.process_time()
            engine.load_weights(policy.rollout_module())
            mine = shard(tasks, par.rank, par.world)
            before = engine_stats(engine)  # the engine's model work so far (None: it counts none)
            tool_stats = _tool_counters(parts.env)  # evaluation's calls dropped: this rollout's only
            result: RolloutResult = sampler(runner, mine, sampler_cfg, run.pick_rng, run.gen)
            result.count_engine(before, engine_stats(engine))  # this rollout's: engine/* metrics
            loop_stats, tools = runner.loop_stats.take(), (tool_stats.take() if tool_stats is not None else None)
            t1, c1 = time.perf_counter(), time.process_time()
            # 2. advantages, through the registry; one training sequence per leaf
            advs = _advantages(result, estimator, adv_cfg, parts.env)
            everything = par.gather_rollouts(result)  # all ranks' forests, in task order
            n_traj = sum(f.n_trajectories() for f in everything.forests)
            # 3. policy update: packed (each shared token once) or per path, see training/update.py
            lr = lr_at(step, float(cfg.lr), cfg.steps, cfg.lr_warmup_steps, cfg.lr_schedule, cfg.min_lr_ratio)
            set_lr(optimizer, lr)  # warm-up and schedule: one value per RL step
            metrics = update(
                policy, optimizer, result.forests, advs, cfg, loss_cfg, tok.pad_token_id, console.print
            )
            t2, c2 = time.perf_counter(), time.process_time()
            dt_roll, dt_upd, cpu_roll, cpu_upd = par.slowest(t1 - t0, t2 - t1, c1 - c0, c2 - c1)
            # 4. bookkeeping: metrics, evaluation, rollouts, checkpoint
            budget = everything.total()
            tokens_before = run.totals["generated_tokens"]
            run.step = step
            run.account(
                n_traj, budget.generated_tokens, budget.prefill_tokens, budget.tool_calls, dt_roll, dt_upd
            )
            metrics.update(rollout_metrics(everything, n_traj))
            if tools is not None or runner.cfg.rollout_pipeline:  # tools with latency: where the time went
                metrics.update(tool_metrics(loop_stats, tools, everything.forests))
            metrics["rollout/prompt_ids"] = [t.id for t in tasks]  # what this step trained on (every rank's)
            if estimator in GIGPO_ESTIMATORS:  # GiGPO's own diagnostic: steps that have anchor-state peers
                anchors = shared_anchor_stats(everything.forests, adv_cfg)
                metrics.update({"gigpo/shared_anchor_frac": anchors["shared_frac"], "gigpo/anchor_group_size": anchors["group_size"]})
            metrics.update({f"budget/total_{k}": v for k, v in run.totals.items()})
            metrics.update({"time/rollout_s": dt_roll, "time/update_s": dt_upd})
            metrics.update({"time/rollout_cpu_s": cpu_roll, "time/update_cpu_s": cpu_upd})  # slowest rank
            if (rss := peak_rss_gb()) is not None:
                metrics["mem/peak_rss_gb"] = rss  # this process's high-water mark, before the step's evaluation
            if cfg.lr_warmup_steps or cfg.lr_schedule != "constant":
                metrics["actor/lr"] = lr
            if due := eval_due(cfg, step, tokens_before, run.totals["generated_tokens"]):
                policy.rollout_module()  # FSDP2: the engine's full copy refreshed from the shards
                greedy = due == "full"  # a token checkpoint alone: the sampled half only (when measured)
                run.last_eval = par.on_main(lambda g=greedy: evaluate(runner, parts.eval_tasks, cfg.eval_sampled, g))
                metrics.update(run.last_eval)
                run.em_curve.append([run.totals["generated_tokens"], headline(run.last_eval), run.totals["tool_calls"]])
            monitored, alerts = check_step(logger.rows, metrics, step=step)  # collapse monitors
            metrics.update(monitored)
            logger.log(step, metrics)
            if (
                par.main
                and cfg.dump_rollouts_every
                and (step % cfg.dump_rollouts_every == 0 or step == cfg.steps)
            ):
                for f, b in zip(everything.forests, everything.budgets, strict=True):
                    score_forest(f, estimator, adv_cfg)
                    f.extra["budget"] = b.to_dict()  # what this prompt's rollout cost (the viewer shows it)
                write_forests(everything.forests, out / "rollouts" / f"step_{step:05d}.jsonl")
            console.print(step_line(step, metrics, label))
            for warning in step_warnings(metrics) + alerts:
                console.print(warning, markup=False, style="yellow")
            if (cfg.save_every and step % cfg.save_every == 0) or step == cfg.steps:
                run.wall_s = wall_before + time.perf_counter() - t_start
                par.collect_streams(run)  # every rank's streams; FSDP2 gathers weights and optimizer:
                policy.save(out / CHECKPOINT_DIR, run, tok, optimizer, cfg, parts.extra_files)
            progress.advance(bar)
    logger.close()
    run.wall_s = wall_before + time.perf_counter() - t_start
    summary = dataclasses.replace(TrainSummary.of_run(out, cfg.steps, run), eval_label=label)
    if par.main:
        atomic_write_json(out / "summary.json", summary.to_dict())
    par.close()
    return summary


def _tool_counters(env: Any) -> Any:
    """The env's ``tool_stats`` (``take()`` -> calls, busy_s, peak_in_flight, abandoned), reset
    now, or ``None`` for an env that keeps none."""
    stats = getattr(env, "tool_stats", None)
    if stats is not None:
        stats.take()
    return stats


def eval_due(cfg: TrainConfig, step: int, tokens_before: int, tokens_after: int) -> str | None:
    """Whether ``step`` ends with a held-out evaluation: ``"full"`` every ``eval_every`` steps and
    at the last step; ``"tokens"`` (``eval_every_tokens``) at any other step that took the run's
    generated tokens from ``tokens_before`` past a multiple of ``eval_every_tokens`` (a point on the
    EM-per-token curve: sampled only, when ``eval_sampled``); ``None`` otherwise."""
    if (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps:
        return "full"
    k = cfg.eval_every_tokens
    return "tokens" if k and tokens_after // k > tokens_before // k else None


def advantage_config(cfg: TrainConfig) -> AdvantageConfig:
    """The estimators' options of a run (``adv_*`` fields; GiGPO's under verl-agent's names)."""
    renamed = {"scale": "adv_scale", "sqrt_weighting": "adv_sqrt_weighting", "local": "adv_local"}
    return options_of(AdvantageConfig, cfg, **renamed, mode="gigpo_mode", anchor="gigpo_anchor")


def loss_config(cfg: TrainConfig) -> LossConfig:
    """The PPO-clip loss settings of a run."""
    return options_of(LossConfig, cfg)


_O = TypeVar("_O")


def options_of(cls: type[_O], cfg: TrainConfig, **renamed: str) -> _O:
    """The options dataclass ``cls`` from ``cfg``: each of its fields that ``cfg`` has under the
    same name, and those ``renamed`` (``field="config_field"``); the others keep their defaults."""
    names = {f.name: f.name for f in dataclasses.fields(cls) if f.name in TrainConfig.model_fields}  # type: ignore[arg-type]
    return cls(**{k: getattr(cfg, v) for k, v in {**names, **renamed}.items()})


def _finished(out: Path, cfg: TrainConfig, ck: Checkpoint, console: Console) -> TrainSummary:
    """Resuming a finished run changes nothing: its summary as written (rewritten from the
    checkpoint only if the run was killed before writing it)."""
    console.print(
        f"{out} is finished (step {ck.step} of {cfg.steps}); nothing to do — give a larger --steps to extend it"
    )
    summary = TrainSummary.read(out / "summary.json")
    if summary is None:
        summary = TrainSummary.of_run(out, cfg.steps, ck.run)
        atomic_write_json(out / "summary.json", summary.to_dict())
    return summary


def _advantages(result: RolloutResult, estimator: str, adv_cfg: AdvantageConfig, env: Any) -> list[Any]:
    """Per-token advantages of every forest, through the estimator registry. A reward the
    estimator rejects (missing, NaN, inf) stops the run with one line naming the prompt, the leaf
    and the reward function that produced it."""
    try:
        return [token_advantages(f, estimator, adv_cfg) for f in result.forests]
    except ValueError as e:
        reward_fn = getattr(env, "metric", None) or type(env).__name__
        raise ConfigError(f"{e} (reward function: {reward_fn})") from None
