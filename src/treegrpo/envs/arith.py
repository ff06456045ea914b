"""A single-turn verifiable task the tiny local model can learn on a CPU: multi-step arithmetic.

A problem applies one operation several times: ``"17+3x3"`` means 17 + 3 + 3 + 3 (``"50-2x2"``:
50 - 2 - 2). The prompt is ``"17+3x3=?\n"``; the policy answers in one generation with a worked
solution that counts its steps down and writes each step in full, then the final answer in tags::

    <think>3:17+3=20;2:20+3=23;1:23+3=26</think><answer>26</answer>

The reward is a function of the generated text only: 1.0 when the first ``<answer>…</answer>``
holds the right integer, else 0.0. Every digit a step computes has its inputs a fixed few tokens
before it (the step restates the running value, the operator and the operand), which is what a
0.4M-parameter model can partly learn in a few CPU-minutes of warm-up (measured: with operands at
varying places of the prompt, ``"12+7-3+9"``, or with only the running values written,
``"3:20;2:23"``, it learns to copy but not to add). It is still multi-step: one wrong digit
anywhere is carried into the answer.

All problems within the configured ranges are enumerated, shuffled from the seed and split into
``eval`` (held-out), ``train`` (RL) and ``warmup`` (demonstrations for the supervised warm-up):
disjoint sets of expressions.

:class:`ArithEnv` is also an :class:`~treegrpo.envs.base.AgentEnv` whose every step ends the
trajectory (the answer tag ``</answer>`` is the stop string), so the ``chain`` / ``tree`` samplers
and the trainer's evaluation run it unchanged; the ``eptree`` sampler
(:mod:`treegrpo.rollout.eptree`) grows token-level trees on it.

**Bootstrap** (:func:`bootstrap_arith`): the starting policy is a small Qwen2 warmed up on
deliberately imperfect worked solutions, through the search world's machinery
(:mod:`treegrpo.models.bootstrap`: ``Demo``, ``encode_demo``, ``supervised_warmup``, the atomic
folder write). Imperfections, so that the policy solves some problems but far from all and the
failures are choices RL can fix:

- ``p_guess``: answer at once, without working, a number near the true one (never the true one);
- ``p_slip``: per step, the written result is off by one (or by ten), and the error is carried on
  (one direction per demo, so slips never cancel out).

The tokenizer splits every digit into its own token (numbers are spelled digit by digit).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from treegrpo.envs.base import StepOutcome, Task

Split = Literal["warmup", "train", "eval"]
SPLITS: tuple[Split, ...] = ("warmup", "train", "eval")
ANSWER_START = "<answer>"
ANSWER_END = "</answer>"
PROMPT = "{question}=?\n"
ARITH_BOOTSTRAP_VERSION = 1
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


# --------------------------------------------------------------------------- problems


@dataclass(frozen=True)
class ArithConfig:
    """Which problems exist and how they are split.

    Attributes:
        seed: the shuffle's seed (a different seed is a different split of the problems).
        min_steps / max_steps: how many times the operation is applied.
        max_operand: the operand is drawn from 1..max_operand.
        max_start: the start is at most ``max_start`` above the least valid start.
        max_value: running values stay in 0..max_value.
        ops: the operations used.
        n_train / n_eval: problems in the RL and held-out splits; every other problem is ``warmup``.
    """

    seed: int = 0
    min_steps: int = 2
    max_steps: int = 5
    max_operand: int = 3
    max_start: int = 90
    max_value: int = 99
    ops: tuple[str, ...] = ("+", "-")
    n_train: int = 1000
    n_eval: int = 256

    def __post_init__(self) -> None:
        if not 1 <= self.min_steps <= self.max_steps <= 9:
            raise ValueError(f"need 1 <= min_steps <= max_steps <= 9, got {self.min_steps}, {self.max_steps}")
        if self.max_operand < 1 or self.max_start < 1 or not set(self.ops) <= {"+", "-"} or not self.ops:
            raise ValueError("max_operand and max_start must be >= 1 and ops a non-empty subset of ('+', '-')")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ArithConfig:
        kw = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        if "ops" in kw:
            kw["ops"] = tuple(kw["ops"])
        return cls(**kw)


def solve_steps(start: int, op: str, operand: int, steps: int) -> list[tuple[int, int]]:
    """``(value before, value after)`` of each step of ``start op operand x steps``."""
    out = []
    acc = start
    for _ in range(steps):
        res = acc + operand if op == "+" else acc - operand
        out.append((acc, res))
        acc = res
    return out


def expression(start: int, op: str, operand: int, steps: int) -> str:
    """``"17+3x3"`` (no spaces: every character is a token)."""
    return f"{start}{op}{operand}x{steps}"


def all_problems(cfg: ArithConfig) -> list[tuple[int, str, int, int]]:
    """Every ``(start, op, operand, steps)`` within ``cfg``'s ranges, in a fixed order."""
    out = []
    for steps in range(cfg.min_steps, cfg.max_steps + 1):
        for op in cfg.ops:
            for b in range(1, cfg.max_operand + 1):
                span = b * steps
                lo, hi = (1, min(cfg.max_start, cfg.max_value - span)) if op == "+" else (span, min(cfg.max_value, span + cfg.max_start))
                out.extend((a, op, b, steps) for a in range(lo, hi + 1))
    return out


def make_task(start: int, op: str, operand: int, steps: int, task_id: str) -> Task:
    """The task of one problem; ``meta`` keeps its parts."""
    value = solve_steps(start, op, operand, steps)[-1][1]
    return Task(
        id=task_id,
        question=expression(start, op, operand, steps),
        answers=[str(value)],
        data_source="arith",
        meta={"start": start, "op": op, "operand": operand, "steps": steps},
    )


@dataclass
class ArithProblems:
    """The problem set of an :class:`ArithConfig`: disjoint splits of tasks."""

    cfg: ArithConfig
    splits: dict[str, list[Task]]

    def tasks(self, split: Split) -> list[Task]:
        if split not in self.splits:
            raise ValueError(f"unknown split {split!r}; choose one of {list(SPLITS)}")
        return self.splits[split]


def build_problems(cfg: ArithConfig | None = None) -> ArithProblems:
    """Enumerate every problem of ``cfg``, shuffle them from ``cfg.seed`` and split them.

    Raises:
        ValueError: fewer problems than ``n_train + n_eval`` + some left for the warm-up.
    """
    cfg = cfg or ArithConfig()
    items = all_problems(cfg)
    if len(items) < cfg.n_train + cfg.n_eval + 100:
        raise ValueError(f"only {len(items)} problems in range; ask for fewer than n_train + n_eval + 100")
    random.Random(f"treegrpo-arith-{cfg.seed}").shuffle(items)
    bounds = {"eval": (0, cfg.n_eval), "train": (cfg.n_eval, cfg.n_eval + cfg.n_train)}
    bounds["warmup"] = (cfg.n_eval + cfg.n_train, len(items))
    splits = {
        s: [make_task(*item, f"arith-{cfg.seed}-{s}-{i}") for i, item in enumerate(items[a:b])]
        for s, (a, b) in bounds.items()
    }
    return ArithProblems(cfg, {s: splits[s] for s in SPLITS})


# --------------------------------------------------------------------------- the environment


def worked_solution(task: Task, slips: Sequence[int] = ()) -> str:
    """The worked solution of ``task``; ``slips[k]`` (when non-zero) is added to step k's written
    result, and the wrong value is carried into the next step and the answer."""
    m = task.meta
    parts = []
    acc = m["start"]
    for k in range(m["steps"]):
        res = (acc + m["operand"] if m["op"] == "+" else acc - m["operand"]) + (slips[k] if k < len(slips) else 0)
        parts.append(f"{m['steps'] - k}:{acc}{m['op']}{m['operand']}={res}")
        acc = res
    return f"<think>{';'.join(parts)}</think><answer>{acc}</answer>"


def parse_answer(text: str) -> str | None:
    """The stripped content of the first ``<answer>…</answer>``, or ``None``."""
    m = _ANSWER_RE.search(text)
    return None if m is None else m.group(1).strip()


@dataclass
class ArithEnv:
    """Single-turn arithmetic: a prompt per task and a reward of the generated text.

    As an :class:`~treegrpo.envs.base.AgentEnv`, every step ends the trajectory with its reward
    (``kind="answer"`` when a well-formed answer tag was given, else ``"invalid"``).
    """

    prompt_template: str = PROMPT
    stop_strings: tuple[str, ...] = (ANSWER_END,)
    answer_start: str = ANSWER_START
    metric: str = "exact_int"

    def prompt(self, task: Task) -> str:
        """The prompt text (no chat template: the tiny tokenizer has none)."""
        return self.prompt_template.format(question=task.question)

    def reward(self, task: Task, text: str) -> float:
        """1.0 if the first answer tag holds the gold integer, else 0.0."""
        ans = parse_answer(text)
        if ans is None:
            return 0.0
        try:
            return float(int(ans) == int(task.answers[0]))
        except ValueError:
            return 0.0

    def step(
        self, tasks: Sequence[Task], steps: Sequence[str], search_allowed: Sequence[bool]
    ) -> list[StepOutcome]:
        """Every step ends its trajectory and is scored (``search_allowed`` is ignored)."""
        out = []
        for task, text in zip(tasks, steps, strict=True):
            ans = parse_answer(text)
            kind = "answer" if ans is not None else "invalid"
            out.append(
                StepOutcome(kind=kind, done=True, reward=self.reward(task, text), info={"answer": ans})  # type: ignore[arg-type]
            )
        return out

    def score(self, task: Task, step: str) -> float:
        """The reward of a trajectory cut at ``step`` (same as :meth:`reward`)."""
        return self.reward(task, step)


# --------------------------------------------------------------------------- bootstrap


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
            (:func:`treegrpo.models.bootstrap.supervised_warmup`).
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
        blob = json.dumps({"v": ARITH_BOOTSTRAP_VERSION, **self.to_dict()}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    def agent_config(self, temperature: float = 1.0) -> Any:
        """Agent-loop settings for this task: one turn, ``max_new_tokens`` per generation."""
        from treegrpo.rollout.agent import AgentConfig

        return AgentConfig(
            max_turns=1,
            max_step_tokens=self.max_new_tokens,
            max_obs_tokens=1,
            max_context_tokens=self.max_positions,
            temperature=temperature,
            use_chat_template=False,
        )


def make_arith_demos(tasks: Sequence[Task], env: ArithEnv, cfg: ArithBootstrapConfig, rng: random.Random) -> list[Any]:
    """``cfg.n_demos`` imperfect demonstrations, cycling through ``tasks`` (:class:`treegrpo.models.bootstrap.Demo`, one step)."""
    from treegrpo.models.bootstrap import Demo

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
    from tokenizers import pre_tokenizers

    from treegrpo.models.tiny import train_tokenizer, wrap_tokenizer

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
    from treegrpo.rollout.agent import StepRunner
    from treegrpo.rollout.hf_engine import HFEngine
    from treegrpo.rollout.samplers import SamplerConfig, sample_chains

    runner = StepRunner(HFEngine(model, tokenizer), env, tokenizer, agent_cfg)
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
    from treegrpo.models.bootstrap import (
        BootstrapConfig,
        _phase,
        _progress,
        _write_atomically,
        demo_texts,
        encode_demo,
        model_for,
        supervised_warmup,
    )
    from treegrpo.models.tiny import save_tiny
    from treegrpo.rollout.agent import StepRunner

    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    rng = random.Random(f"treegrpo-arith-bootstrap-{cfg.seed}")
    with _progress(progress) as prog:
        problems = build_problems(cfg.problems)
        env = ArithEnv()
        demos = make_arith_demos(problems.tasks("warmup"), env, cfg, rng)
        tok = arith_tokenizer(demo_texts(demos, env), cfg.vocab_size)
        runner = StepRunner(None, env, tok, cfg.agent_config())  # type: ignore[arg-type]  # encoding only
        encoded = [encode_demo(runner, d) for d in demos]
        timings["demos_and_tokenizer_s"] = time.perf_counter() - t0
        model = model_for(cfg, tok)
        n_params = sum(p.numel() for p in model.parameters())
        _phase(prog, f"arith: {len(demos)} demos; vocab {len(tok)}; model {n_params / 1e6:.2f}M params")

        t = time.perf_counter()
        sft_cfg = BootstrapConfig(
            seed=cfg.seed,
            epochs=cfg.epochs,
            batch_size=cfg.batch_size,
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
            warmup_frac=cfg.warmup_frac,
            grad_clip=cfg.grad_clip,
        )
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
        _write_atomically(folder, lambda tmp: save_tiny(model, tok, tmp, info))
        _phase(
            prog,
            f"arith: warm-up success sampled {sampled['success']:.3f} / greedy {greedy['success']:.3f}; "
            f"saved to {folder} in {timings['total_s']:.0f}s",
        )
    return folder


def arith_model_dir(cfg: ArithBootstrapConfig | None = None) -> Path:
    """Where the arithmetic starting policy of ``cfg`` is cached: ``user_cache_dir()/models/arith-<hash>``."""
    from treegrpo.io import user_cache_dir

    return user_cache_dir() / "models" / f"arith-{(cfg or ArithBootstrapConfig()).config_hash()}"


def ensure_arith_bootstrapped(
    cfg: ArithBootstrapConfig | None = None, progress: bool = True, force: bool = False, threads: int | None = 1
) -> Path:
    """The cached arithmetic starting policy, built only if it is not there yet (or ``force``);
    ``threads`` as in :func:`bootstrap_arith`."""
    from treegrpo.models.bootstrap import is_bootstrapped

    folder = arith_model_dir(cfg)
    if force or not is_bootstrapped(folder):
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
    from treegrpo.models.tiny import tiny_info

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
    from dataclasses import replace

    from treegrpo.models.tiny import tiny_info

    info = tiny_info(model_dir)
    boot = ArithBootstrapConfig.from_dict(info["config"]) if info.get("task") == "arith" else ArithBootstrapConfig()
    problems = build_problems(boot.problems)
    agent = boot.agent_config(cfg.temperature)
    explicit = getattr(cfg, "model_fields_set", set())
    agent = replace(
        agent,
        top_p=cfg.top_p,
        max_step_tokens=cfg.max_step_tokens if "max_step_tokens" in explicit else agent.max_step_tokens,
        max_context_tokens=cfg.max_context_tokens if "max_context_tokens" in explicit else agent.max_context_tokens,
    )
    return ArithEnv(), problems.tasks("train"), problems.tasks("eval"), agent


__all__ = [
    "ANSWER_START",
    "SPLITS",
    "ArithBootstrapConfig",
    "ArithConfig",
    "ArithEnv",
    "ArithProblems",
    "ArithSetup",
    "all_problems",
    "arith_model_dir",
    "arith_run_parts",
    "arith_tokenizer",
    "bootstrap_arith",
    "build_problems",
    "ensure_arith_bootstrapped",
    "expression",
    "load_arith_setup",
    "make_arith_demos",
    "make_task",
    "measure_arith",
    "parse_answer",
    "solve_steps",
    "worked_solution",
]
