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

The starting policy and its demonstrations: :mod:`treegrpo.tasks.arith.bootstrap`.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from treegrpo.envs.base import StepOutcome, Task
from treegrpo.tasks.common import SPLITS, ProblemSet, Settings

ANSWER_START = "<answer>"
ANSWER_END = "</answer>"
PROMPT = "{question}=?\n"
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


# --------------------------------------------------------------------------- problems


@dataclass(frozen=True)
class ArithConfig(Settings):
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


class ArithProblems(ProblemSet[ArithConfig]):
    """The problem set of an :class:`ArithConfig`: disjoint splits of tasks."""


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
    actions: ClassVar[dict[str, str | None]] = {"answer": ANSWER_END}
    binary_reward: ClassVar[bool] = True
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


__all__ = [
    "ANSWER_END",
    "ANSWER_START",
    "SPLITS",
    "ArithConfig",
    "ArithEnv",
    "ArithProblems",
    "all_problems",
    "build_problems",
    "expression",
    "make_task",
    "parse_answer",
    "solve_steps",
    "worked_solution",
]
