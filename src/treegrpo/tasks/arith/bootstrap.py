"""The arithmetic task's starting policy (:func:`bootstrap_arith`): a small Qwen2 warmed up on
deliberately imperfect worked solutions through the one tiny-agent recipe
(:mod:`treegrpo.tasks.recipe`; this module gives its settings, demos, tokenizer and metrics).
Imperfections, so that the policy solves some problems but far from all and the
failures are choices RL can fix:

- ``p_guess``: answer at once, without working, a number near the true one (never the true one);
- ``p_slip``: per step, the written result is off by one (or by ten), and the error is carried on
  (one direction per demo, so slips never cancel out).

The tokenizer splits every digit into its own token (numbers are spelled digit by digit).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

from treegrpo.envs.base import Task
from treegrpo.models.loader import tiny_info
from treegrpo.rollout.agent import AgentConfig, RolloutResult
from treegrpo.tasks import recipe
from treegrpo.tasks.arith.problems import (
    ANSWER_START,
    ArithConfig,
    ArithEnv,
    ArithProblems,
    build_problems,
    worked_solution,
)
from treegrpo.training.warmup import Demo

ARITH_BOOTSTRAP_VERSION = 1
# The modules whose code decides the weights (problems, demos, tokenizer, model, warm-up): a change
# to any of them is a new cache key.
WEIGHT_MODULES = (*recipe.RECIPE_MODULES, "treegrpo.tasks.arith.problems", "treegrpo.tasks.arith.bootstrap")


@dataclass(frozen=True)
class ArithBootstrapConfig(recipe.RecipeConfig):
    """Everything that determines the arithmetic starting policy: the shared knobs
    (:class:`~treegrpo.tasks.recipe.RecipeConfig`: warm-up, seed, tokenizer and Qwen2 shape,
    ``n_eval``) at this task's defaults, and

    Attributes:
        problems: the problem set (its ``warmup`` split gives the demonstrations).
        p_guess: a demo answers at once with a wrong number near the true one.
        p_slip: per step, a demo's written result is off by ±1 (or ±10, one time in four).
        n_demos: demonstrations, cycling through the ``warmup`` problems (independent imperfections).
        max_new_tokens: the response length cap (one generation).
    """

    problems: ArithConfig = field(default_factory=ArithConfig)
    p_guess: float = 0.2
    p_slip: float = 0.1
    n_demos: int = 8000
    max_new_tokens: int = 64
    n_eval: int | None = 256
    vocab_size: int = 320
    max_positions: int = 256
    epochs: int = 3

    version = ARITH_BOOTSTRAP_VERSION  # (class attributes, not settings)
    weight_modules = WEIGHT_MODULES

    def agent_config(self, temperature: float = 1.0) -> AgentConfig:
        """Agent-loop settings for this task: one turn, ``max_new_tokens`` per generation."""
        return AgentConfig(
            max_turns=1,
            max_step_tokens=self.max_new_tokens,
            max_obs_tokens=1,
            max_context_tokens=self.max_positions,
            temperature=temperature,
            use_chat_template=False,
        )


def make_arith_demos(tasks: Sequence[Task], env: ArithEnv, cfg: ArithBootstrapConfig, rng: random.Random) -> list[Demo]:
    """``cfg.n_demos`` imperfect demonstrations, cycling through ``tasks`` (one step each)."""
    demos = []
    for task in (tasks[i % len(tasks)] for i in range(cfg.n_demos)):
        gold = int(task.answers[0])
        if rng.random() < cfg.p_guess:
            off = rng.choice([d for d in range(-5, 6) if d != 0 and gold + d >= 0])
            text, kind = f"<answer>{gold + off}</answer>", "guess"
        else:
            sign = rng.choice((-1, 1))  # one sign per demo: slips add up, the answer is wrong
            slips = []
            for _ in range(task.meta["steps"]):
                s = 0
                if rng.random() < cfg.p_slip:
                    s = sign * (10 if rng.random() < 0.25 else 1)
                slips.append(s)
            text = worked_solution(task, slips)
            kind = "slip" if any(slips) else "correct"
        demos.append(Demo(task, [(text, None)], kind, env.reward(task, text)))
    return demos


def arith_tokenizer(texts: Sequence[str], vocab_size: int) -> Any:
    """A byte-level BPE (:func:`treegrpo.models.tiny.train_tokenizer`) whose pre-tokenizer splits
    every digit into its own token, wrapped as a ``PreTrainedTokenizerFast``."""
    return recipe.digit_tokenizer(texts, vocab_size)


#: What an arithmetic measurement reports, in this order (:func:`arith_metrics`).
ARITH_METRICS = ("success", "answered", "guess", "generated_tokens", "n", "wall_s")


def arith_metrics(tasks: Sequence[Task], res: RolloutResult) -> dict[str, Any]:
    """The :data:`ARITH_METRICS` (:func:`~treegrpo.tasks.recipe.chain_summary`), ``guess`` being the
    fraction that answered without working."""
    leaves = recipe.final_leaves(res)
    guess = sum(x.text.startswith(ANSWER_START) for x in leaves) / max(1, len(leaves))
    return recipe.chain_summary(res, ARITH_METRICS, guess=guess)


#: Success of a model on arithmetic tasks, one chain per task through the real agent loop:
#: ``measure_arith(model, tokenizer, env, tasks, agent_cfg, seed=0)`` (:func:`arith_metrics`).
measure_arith = partial(recipe.measure, arith_metrics)


def _prepare(cfg: ArithBootstrapConfig, rng: random.Random) -> recipe.Prepared:
    problems = build_problems(cfg.problems)
    env = ArithEnv()
    demos = make_arith_demos(problems.tasks("warmup"), env, cfg, rng)
    record = {"task": "arith", "arith_bootstrap_version": cfg.version, "problems": cfg.problems.to_dict()}
    return recipe.Prepared(env, demos, problems.tasks("eval"), record)


ARITH_RECIPE = recipe.Recipe("arith", "treegrpo-arith-bootstrap", _prepare, arith_tokenizer, arith_metrics)


def bootstrap_arith(
    folder: str | Path, cfg: ArithBootstrapConfig | None = None, progress: bool = True, threads: int | None = 1
) -> Path:
    """Build the arithmetic starting policy into ``folder`` (replacing it, atomically) through the
    one recipe (:func:`~treegrpo.tasks.recipe.build_tiny_agent`): draw the problems; ``n_demos``
    imperfect demos over the ``warmup`` problems; the digit-split tokenizer; a small Qwen2 warmed up
    on the demos' policy tokens; measured on the ``eval`` split (sampled at T=1 and greedy).

    ``threads``: torch intra-op threads while building (restored afterwards; ``None`` or 0 leaves them).
    """
    return recipe.build_tiny_agent(ARITH_RECIPE, folder, cfg or ArithBootstrapConfig(), progress, threads or None)


def arith_model_dir(cfg: ArithBootstrapConfig | None = None) -> Path:
    """Where the arithmetic starting policy of ``cfg`` is cached: ``user_cache_dir()/models/arith-<hash>``."""
    return recipe.cache_folder("arith", cfg or ArithBootstrapConfig())


def is_arith_bootstrapped(folder: str | Path) -> bool:
    """``folder`` holds a complete arithmetic starting policy (its record is written last)."""
    return recipe.is_complete(folder)


def ensure_arith_bootstrapped(
    cfg: ArithBootstrapConfig | None = None, progress: bool = True, force: bool = False, threads: int | None = 1
) -> Path:
    """The cached arithmetic starting policy, built only if it is not there yet (or ``force``);
    ``threads`` as in :func:`bootstrap_arith`."""
    folder = arith_model_dir(cfg)
    if force or not is_arith_bootstrapped(folder):
        bootstrap_arith(folder, cfg, progress=progress, threads=threads)
    return folder


@dataclass
class ArithSetup:
    """What an RL run needs to continue from an arithmetic starting policy."""

    folder: Path
    info: dict[str, Any]
    cfg: ArithBootstrapConfig
    problems: ArithProblems
    env: ArithEnv
    agent: Any


def load_arith_setup(folder: str | Path) -> ArithSetup:
    """The problems, env and agent settings an arithmetic bootstrap ``folder`` was made with."""
    folder = Path(folder)
    info = tiny_info(folder)
    if info.get("task") != "arith":
        raise ValueError(f"{folder} is not an arithmetic bootstrap folder (no task 'arith' recorded)")
    cfg = ArithBootstrapConfig.from_dict(info["config"])
    return ArithSetup(folder, info, cfg, build_problems(cfg.problems), ArithEnv(), cfg.agent_config())


def arith_run_parts(cfg: Any, model_dir: str | Path) -> tuple[ArithEnv, list[Task], list[Task], Any]:
    """Env, train tasks, eval tasks and agent settings of a ``task: arith`` training run.

    The problem set and the response cap come from the bootstrap recorded in ``model_dir``
    (:class:`ArithBootstrapConfig` defaults for any other folder); the run config ``cfg``
    (:class:`~treegrpo.training.config.TrainConfig`) gives temperature and top-p, and overrides the
    cap and the context limit when it sets ``max_step_tokens`` / ``max_context_tokens`` explicitly.
    """
    info = tiny_info(model_dir)
    boot = ArithBootstrapConfig.from_dict(info["config"]) if info.get("task") == "arith" else ArithBootstrapConfig()
    problems = build_problems(boot.problems)
    agent = boot.agent_config(cfg.temperature)
    explicit = {k for k in getattr(cfg, "model_fields_set", set()) if getattr(cfg, k) != "auto"}
    agent = replace(
        agent,
        top_p=cfg.top_p,
        max_step_tokens=cfg.max_step_tokens if "max_step_tokens" in explicit else agent.max_step_tokens,
        max_context_tokens=cfg.max_context_tokens if "max_context_tokens" in explicit else agent.max_context_tokens,
    )
    return ArithEnv(), problems.tasks("train"), problems.tasks("eval"), agent


__all__ = [
    "ARITH_METRICS",
    "ARITH_RECIPE",
    "ArithBootstrapConfig",
    "ArithSetup",
    "arith_metrics",
    "arith_model_dir",
    "arith_run_parts",
    "arith_tokenizer",
    "bootstrap_arith",
    "ensure_arith_bootstrapped",
    "is_arith_bootstrapped",
    "load_arith_setup",
    "make_arith_demos",
    "measure_arith",
]
