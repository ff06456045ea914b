"""The arithmetic task's starting policy (:func:`bootstrap_arith`): the starting policy is a small Qwen2 warmed up on
deliberately imperfect worked solutions, through the generic warm-up
(:mod:`treegrpo.train.warmup`: ``Demo``, ``encode_demos``, ``supervised_warmup``) and the atomic
folder write. Imperfections, so that the policy solves some problems but far from all and the
failures are choices RL can fix:

- ``p_guess``: answer at once, without working, a number near the true one (never the true one);
- ``p_slip``: per step, the written result is off by one (or by ten), and the error is carried on
  (one direction per demo, so slips never cancel out).

The tokenizer splits every digit into its own token (numbers are spelled digit by digit).
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from tokenizers import pre_tokenizers

from treegrpo.envs.base import Task
from treegrpo.fingerprint import code_fingerprint
from treegrpo.io import atomic_write_dir, user_cache_dir
from treegrpo.models.loader import tiny_info
from treegrpo.models.tiny import model_for, save_tiny, train_tokenizer, wrap_tokenizer
from treegrpo.progress import phase, progress_bars
from treegrpo.rollout.agent import AgentConfig, StepRunner
from treegrpo.rollout.engine import make_engine
from treegrpo.rollout.samplers import SamplerConfig, sample_chains
from treegrpo.tasks.arith.problems import (
    ANSWER_START,
    ArithConfig,
    ArithEnv,
    ArithProblems,
    build_problems,
    worked_solution,
)
from treegrpo.tasks.recipe import is_complete, recipe_hash, warmup_config_of
from treegrpo.train.warmup import Demo, demo_texts, encode_demos, supervised_warmup

ARITH_BOOTSTRAP_VERSION = 1
# The modules whose code decides the weights (problems, demos, tokenizer, model, warm-up): a change
# to any of them is a new cache key.
WEIGHT_MODULES = (
    "treegrpo.rollout.agent",
    "treegrpo.models.tiny",
    "treegrpo.tasks.arith.problems",
    "treegrpo.tasks.arith.bootstrap",
    "treegrpo.train.warmup",
    "treegrpo.tasks.recipe",
)


@dataclass(frozen=True)
class ArithBootstrapConfig:
    """Everything that determines the arithmetic starting policy.

    Attributes:
        problems: the problem set (its ``warmup`` split gives the demonstrations).
        seed: model init, demo imperfections, SFT order and evaluation sampling.
        p_guess: a demo answers at once with a wrong number near the true one.
        p_slip: per step, a demo's written result is off by ±1 (or ±10, one time in four).
        n_demos: demonstrations, cycling through the ``warmup`` problems (independent imperfections).
        max_new_tokens: the response length cap (one generation).
        vocab_size / hidden_size / layers / heads / kv_heads / intermediate_size / max_positions:
            tokenizer and Qwen2 shape.
        epochs / batch_size / lr / weight_decay / warmup_frac / grad_clip: the supervised warm-up
            (:func:`treegrpo.train.warmup.supervised_warmup`).
        n_eval: eval problems used to measure the warm-up.
    """

    problems: ArithConfig = field(default_factory=ArithConfig)
    seed: int = 0
    p_guess: float = 0.2
    p_slip: float = 0.1
    n_demos: int = 8000
    max_new_tokens: int = 64
    vocab_size: int = 320
    hidden_size: int = 96
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate_size: int = 256
    max_positions: int = 256
    epochs: int = 3
    batch_size: int = 32
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup_frac: float = 0.05
    grad_clip: float = 1.0
    n_eval: int = 256

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ArithBootstrapConfig:
        kw = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        if isinstance(kw.get("problems"), dict):
            kw["problems"] = ArithConfig.from_dict(kw["problems"])
        return cls(**kw)

    def config_hash(self) -> str:
        """A short hash of the settings, the recipe version and the code that runs the recipe."""
        return recipe_hash(ARITH_BOOTSTRAP_VERSION, WEIGHT_MODULES, self.to_dict())

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
    tok = train_tokenizer(texts, vocab_size=vocab_size)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    return wrap_tokenizer(tok)


def measure_arith(
    model: torch.nn.Module,
    tokenizer: Any,
    env: ArithEnv,
    tasks: Sequence[Task],
    agent_cfg: Any,
    seed: int = 0,
) -> dict[str, Any]:
    """Success of ``model`` on ``tasks``, one chain per task through the real agent loop.

    Returns ``success`` (mean reward), ``answered`` (fraction with a well-formed answer),
    ``guess`` (fraction that answered without working), ``generated_tokens`` (mean per task),
    ``n`` and ``wall_s``.
    """
    runner = StepRunner(make_engine("hf", model, tokenizer), env, tokenizer, agent_cfg)
    gen = torch.Generator().manual_seed(seed)
    res = sample_chains(runner, list(tasks), SamplerConfig(name="chain", group_size=1), random.Random(seed), gen)
    leaves = [leaf for f in res.forests for _, leaf in f.leaves()]
    n = max(1, len(leaves))
    return {
        "success": sum(float(x.reward or 0.0) for x in leaves) / n,
        "answered": sum(x.extra.get("kind") == "answer" for x in leaves) / n,
        "guess": sum(x.text.startswith(ANSWER_START) for x in leaves) / n,
        "generated_tokens": res.total().generated_tokens / n,
        "n": len(leaves),
        "wall_s": res.wall_s,
    }


def bootstrap_arith(
    folder: str | Path, cfg: ArithBootstrapConfig | None = None, progress: bool = True, threads: int | None = 1
) -> Path:
    """Build the arithmetic starting policy into ``folder`` (replacing it, atomically).

    ``threads``: torch intra-op threads while building (restored afterwards; ``None`` leaves them).
    One is the fastest for a model this small, and by far on a shared, busy CPU.

    Steps: draw the problems; ``n_demos`` imperfect demos over the ``warmup`` problems; train the digit-split
    tokenizer on the demos; build a small Qwen2; warm it up on the demos' policy tokens; measure it
    on the ``eval`` split (sampled at T=1 and greedy); save with
    :func:`~treegrpo.models.tiny.save_tiny`, recording everything in ``treegrpo_tiny.json``.
    """
    cfg = cfg or ArithBootstrapConfig()
    folder = Path(folder)
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _bootstrap_arith(folder, cfg, progress)
    finally:
        torch.set_num_threads(before)


def _bootstrap_arith(folder: Path, cfg: ArithBootstrapConfig, progress: bool) -> Path:
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    rng = random.Random(f"treegrpo-arith-bootstrap-{cfg.seed}")
    with progress_bars(progress) as prog:
        problems = build_problems(cfg.problems)
        env = ArithEnv()
        demos = make_arith_demos(problems.tasks("warmup"), env, cfg, rng)
        tok = arith_tokenizer(demo_texts(demos, env), cfg.vocab_size)
        runner = StepRunner(None, env, tok, cfg.agent_config())  # type: ignore[arg-type]  # encoding only
        encoded, _ = encode_demos(runner, demos)  # a step over the loop's cap is never taught
        timings["demos_and_tokenizer_s"] = time.perf_counter() - t0
        model = model_for(cfg, tok)
        n_params = sum(p.numel() for p in model.parameters())
        phase(prog, f"arith: {len(demos)} demos; vocab {len(tok)}; model {n_params / 1e6:.2f}M params")

        t = time.perf_counter()
        sft_cfg = warmup_config_of(cfg)
        sft = supervised_warmup(model, encoded, sft_cfg, tok.pad_token_id, rng, prog)
        timings["sft_s"] = time.perf_counter() - t

        t = time.perf_counter()
        eval_tasks = problems.tasks("eval")[: cfg.n_eval]
        sampled = measure_arith(model, tok, env, eval_tasks, cfg.agent_config(1.0), cfg.seed)
        greedy = measure_arith(model, tok, env, eval_tasks, cfg.agent_config(0.0), cfg.seed)
        timings["eval_s"] = time.perf_counter() - t
        timings["total_s"] = time.perf_counter() - t0
        kinds: dict[str, int] = {}
        for d in demos:
            kinds[d.kind] = kinds.get(d.kind, 0) + 1
        info = {
            "task": "arith",
            "arith_bootstrap_version": ARITH_BOOTSTRAP_VERSION,
            "config": cfg.to_dict(),
            "config_hash": cfg.config_hash(),
            "code_fingerprint": code_fingerprint(WEIGHT_MODULES),
            "problems": cfg.problems.to_dict(),
            "agent": asdict(cfg.agent_config()),
            "params": n_params,
            "demos": {
                "n": len(demos),
                "kinds": kinds,
                "success": sum(d.reward for d in demos) / max(1, len(demos)),
                "mean_tokens": sum(len(e.ids) for e in encoded) / max(1, len(encoded)),
            },
            "sft": sft,
            "warmup_eval": {"sampled": sampled, "greedy": greedy},
            "timings": timings,
        }
        atomic_write_dir(folder, lambda tmp: save_tiny(model, tok, tmp, info))
        phase(
            prog,
            f"arith: warm-up success sampled {sampled['success']:.3f} / greedy {greedy['success']:.3f}; "
            f"saved to {folder} in {timings['total_s']:.0f}s",
        )
    return folder


def arith_model_dir(cfg: ArithBootstrapConfig | None = None) -> Path:
    """Where the arithmetic starting policy of ``cfg`` is cached: ``user_cache_dir()/models/arith-<hash>``."""
    return user_cache_dir() / "models" / f"arith-{(cfg or ArithBootstrapConfig()).config_hash()}"


def is_arith_bootstrapped(folder: str | Path) -> bool:
    """``folder`` holds a complete arithmetic starting policy (its record is written last)."""
    return is_complete(folder)


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
    (:class:`~treegrpo.train.config.TrainConfig`) gives temperature and top-p, and overrides the
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
    "ArithBootstrapConfig",
    "ArithSetup",
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
