"""The vocabulary of ``bench learn`` and ``bench learn --gigpo``, shared by the runner
(:mod:`~treegrpo.benchmarks.learn`) and the analysis (:mod:`~treegrpo.benchmarks.learn_report`):
the runs of each table, the keys of a result row and the regimes (RL settings) they train with."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from treegrpo.benchmarks.runner import Shape
from treegrpo.rollout.planner import PAPER_PAIRS

#: The keys of a ``bench learn`` result row, exactly.
ROW_KEYS: tuple[str, ...] = (
    "mode", "budget", "M", "N", "L", "expand_mode", "advantage", "seed", "world_seed", "em_start", "em_end",
    "em_greedy_end", "em_curve", "generated_tokens", "tool_calls", "trajectories", "tool_calls_per_traj_start",
    "tool_calls_per_traj_end", "wall_s",
)  # fmt: skip
#: The keys of a ``bench learn --matched tokens`` result row: :data:`ROW_KEYS`, the token budget of a
#: token-matched tree (``None`` for a chain), the token spacing of its evaluations and its EM curve
#: over tool calls (``[tool calls, EM]`` at the same evaluations as ``em_curve``).
TOKEN_ROW_KEYS: tuple[str, ...] = (*ROW_KEYS, "budget_tokens", "eval_every_tokens", "tool_curve", "em_greedy_start")
#: The keys of a ``bench learn --gigpo`` result row: :data:`ROW_KEYS` and GiGPO's anchor diagnostic.
GIGPO_ROW_KEYS: tuple[str, ...] = (
    *ROW_KEYS, "task", "em_greedy_start", "anchor_steps", "anchor_shared_frac", "anchor_deep_shared_frac",
    "anchor_group_size",
)  # fmt: skip

BUDGETS: tuple[int, ...] = tuple(sorted(PAPER_PAIRS))  # 2, 4, 8, 16: the paper's matched pairs
QUICK_BUDGETS: tuple[int, ...] = (2, 4)
GIGPO_BUDGETS: tuple[int, ...] = (2, 4)
EXPAND_MODES: tuple[str, ...] = ("random", "nonroot", "entropy")
ABLATION_BUDGET = 4
ABLATION: tuple[str, ...] = ("intra_only", "inter_only")
#: ``--matched tokens``: the pick rules compared, and the evaluation spacing — every this many
#: generated tokens per unit of budget (chain 2: every 2,000 tokens, chain 16: every 16,000), so
#: every run of the table has five or six points on its EM-per-token curve at about the same
#: tokens as its pair's (a held-out evaluation of 400 questions costs more than a chain-2 run's
#: whole training: denser points would multiply the table's time).
TOKEN_EXPAND_MODES: tuple[str, ...] = ("random", "nonroot")
TOKEN_EVAL_PER_BUDGET = 1000
TASKS: tuple[str, ...] = ("search", "sql")


@dataclass(frozen=True)
class RunSpec(Shape):
    """One training run of the table: a :class:`~treegrpo.benchmarks.runner.Shape` trained with
    ``advantage`` from ``seed`` in world ``world_seed``; ``budget_tokens`` (``chain:B``) makes the
    tree token-matched (its ``l`` unused), ``eval_every_tokens`` evaluates at token checkpoints
    (instead of the regime's ``eval_every`` steps)."""

    advantage: str
    seed: int
    world_seed: int
    budget_tokens: str | None = None
    eval_every_tokens: int = 0

    @property
    def label(self) -> str:
        """The configuration, without seeds: ``chain 4``, ``chain 4 gigpo``, ``tree (2,2,1) random``,
        ``… intra_only``."""
        if self.mode == "chain":
            return f"chain {self.budget}" if self.advantage == "grpo" else f"chain {self.budget} {self.advantage}"
        if self.budget_tokens is not None:
            s = f"tree ({self.m},{self.n}) {self.expand_mode} tokens=chain {self.budget}"
            return s if self.advantage == "tree_grpo" else f"{s} {self.advantage}"
        s = f"tree ({self.m},{self.n},{self.l}) {self.expand_mode}"
        return s if self.advantage == "tree_grpo" else f"{s} {self.advantage}"

    @property
    def key(self) -> str:
        return f"{self.label} | seed {self.seed} | world {self.world_seed}"

    def overrides(self) -> dict[str, Any]:
        """The :class:`~treegrpo.training.config.TrainConfig` fields of this run."""
        dense = {"eval_every_tokens": self.eval_every_tokens, "eval_every": 0} if self.eval_every_tokens else {}
        if self.mode == "chain":
            return {"sampler": "chain", "group_size": self.budget, "advantage": self.advantage, "seed": self.seed, **dense}
        matched = {} if self.budget_tokens is None else {"budget_tokens": self.budget_tokens}
        return {"sampler": "tree", "m": self.m, "n": self.n, "l": self.l, "expand_mode": self.expand_mode,
                "advantage": self.advantage, "seed": self.seed, **matched, **dense}  # fmt: skip


def spec_of(row: dict[str, Any]) -> RunSpec:
    """The run a result row describes."""
    keys = ("mode", "budget", "M", "N", "L", "expand_mode", "advantage", "seed", "world_seed")
    return RunSpec(*(row[k] for k in keys), row.get("budget_tokens"), row.get("eval_every_tokens", 0))


def tree_label(budget: int, mode: str, advantage: str = "tree_grpo", tokens: bool = False) -> str:
    """The label of Tree-GRPO at ``budget``'s paper shape with pick ``mode`` and ``advantage``
    (``tokens``: the token-matched tree at chain ``budget``'s tokens)."""
    return RunSpec("tree", budget, *PAPER_PAIRS[budget], mode, advantage, 0, 0, f"chain:{budget}" if tokens else None).label


def _shape(budget: int) -> tuple[int, int, int]:
    if budget not in PAPER_PAIRS:
        raise ValueError(f"budget {budget} has no paper shape; choose from {sorted(PAPER_PAIRS)}")
    return PAPER_PAIRS[budget]


def plan_runs(
    budgets: Sequence[int],
    seeds: Sequence[int],
    world_seeds: Sequence[int],
    expand_modes: Sequence[str] = EXPAND_MODES,
    ablation: bool = True,
) -> list[RunSpec]:
    """Every run of the ``bench learn`` table, seeds innermost so paired runs finish close together."""
    configs: list[tuple[Any, ...]] = []
    for b in budgets:
        m, n, l = _shape(b)
        configs.append(("chain", b, b, 0, 0, None, "grpo"))
        configs += [("tree", b, m, n, l, mode, "tree_grpo") for mode in expand_modes]
        if ablation and b == ABLATION_BUDGET:
            configs += [("tree", b, m, n, l, "random", adv) for adv in ABLATION]
    return [RunSpec(*c, seed=s, world_seed=w) for w in world_seeds for c in configs for s in seeds]  # type: ignore[arg-type]


def plan_token_runs(
    budgets: Sequence[int],
    seeds: Sequence[int],
    world_seeds: Sequence[int],
    expand_modes: Sequence[str] = TOKEN_EXPAND_MODES,
    ablation: bool = True,
) -> list[RunSpec]:
    """Every run of the ``bench learn --matched tokens`` table: per budget ``B``, chain ``B`` and the
    token-matched tree at chain ``B``'s tokens (``budget_tokens: chain:B``, M and N of ``B``'s paper
    shape) for each pick rule, at :data:`ABLATION_BUDGET` also the token-matched random tree with
    each :data:`ABLATION` estimator; every run evaluated every ``TOKEN_EVAL_PER_BUDGET · B`` tokens.
    Seeds innermost."""
    configs: list[tuple[Any, ...]] = []
    for b in budgets:
        m, n, l = _shape(b)
        dense = TOKEN_EVAL_PER_BUDGET * b
        configs.append(("chain", b, b, 0, 0, None, "grpo", None, dense))
        configs += [("tree", b, m, n, l, mode, "tree_grpo", f"chain:{b}", dense) for mode in expand_modes]
        if ablation and b == ABLATION_BUDGET:
            configs += [("tree", b, m, n, l, "random", adv, f"chain:{b}", dense) for adv in ABLATION]
    return [RunSpec(*c[:7], s, w, *c[7:]) for w in world_seeds for c in configs for s in seeds]  # type: ignore[arg-type]


def plan_gigpo(budgets: Sequence[int], seeds: Sequence[int], world_seed: int) -> list[RunSpec]:
    """The four configurations per budget of ``bench learn --gigpo`` (chain GRPO, chain GiGPO,
    Tree-GRPO, Tree-GRPO + GiGPO's step term), seeds innermost."""
    configs: list[tuple[Any, ...]] = []
    for b in budgets:
        m, n, l = _shape(b)
        configs += [("chain", b, b, 0, 0, None, "grpo"), ("chain", b, b, 0, 0, None, "gigpo"),
                    ("tree", b, m, n, l, "random", "tree_grpo"), ("tree", b, m, n, l, "random", "tree_gigpo")]  # fmt: skip
    return [RunSpec(*c, seed=s, world_seed=world_seed) for c in configs for s in seeds]  # type: ignore[arg-type]


@dataclass(frozen=True)
class Regime:
    """A world preset (world + starting policy) and the RL settings every run of the table uses.

    Attributes:
        name: the regime's name (``--regime``).
        preset: world preset (:data:`treegrpo.tasks.world.world.PRESETS`); its bootstrap recipe is
            :meth:`treegrpo.tasks.world.bootstrap.BootstrapConfig.for_preset`.
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


_REGIMES = (
    Regime("default", "default", 40, 8, 1e-4, 10, 200,
           about="the embedded default world and starting policy (answers after one search about 70% of the time), "
           "a slow learning rate so the switch to multi-hop is not finished within the run"),
    Regime("shortcut3", "shortcut3", 40, 8, 1e-4, 10, 400,
           about="2- and 3-hop questions only; the starting policy answers after one search (sampled success "
           "about 9%, greedy 0): success hinges on a late choice, to search again"),
    Regime("rare3", "rare3", 40, 8, 3e-4, 10, 400,
           about="3-hop questions only; the starting policy almost never succeeds (sampled success about 3%, "
           "greedy 0): most small groups carry no signal at all"),
)  # fmt: skip
REGIMES: dict[str, Regime] = {r.name: r for r in _REGIMES}
#: The SQL task's RL settings (``bench stateful``'s learning part: 10 steps × 8 prompts, lr 5e-4, 100
#: held-out questions; here evaluated every 5 steps). Its starting policy learns fast: longer runs saturate.
SQL_REGIME = Regime("sql", "", 10, 8, 5e-4, 5, 100,
                    about="the SQL agent (a stateful tool: UPDATE/INSERT then a read); its tiny starting policy "
                    "succeeds about 40% of the time")  # fmt: skip


__all__ = [
    "ABLATION", "ABLATION_BUDGET", "BUDGETS", "EXPAND_MODES", "GIGPO_BUDGETS", "GIGPO_ROW_KEYS", "QUICK_BUDGETS",
    "REGIMES", "ROW_KEYS", "SQL_REGIME", "TASKS", "TOKEN_EVAL_PER_BUDGET", "TOKEN_EXPAND_MODES", "TOKEN_ROW_KEYS",
    "Regime", "RunSpec", "plan_gigpo", "plan_runs", "plan_token_runs", "spec_of", "tree_label",
]  # fmt: skip
