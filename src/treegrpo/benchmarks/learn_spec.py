"""The learn benchmark's vocabulary, shared by the runner (:mod:`~treegrpo.benchmarks.learn`) and
the analysis (:mod:`~treegrpo.benchmarks.learn_report`): the runs of the table and the keys of a
result row."""

from __future__ import annotations

from dataclasses import dataclass
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

BUDGETS: tuple[int, ...] = tuple(sorted(PAPER_PAIRS))  # 2, 4, 8, 16: the paper's matched pairs
QUICK_BUDGETS: tuple[int, ...] = (2, 4)
EXPAND_MODES: tuple[str, ...] = ("random", "nonroot", "entropy")
ABLATION_BUDGET = 4
ABLATION: tuple[str, ...] = ("intra_only", "inter_only")


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
        """The configuration, without seeds: ``chain 4``, ``chain 4 gigpo``, ``tree (2,2,1) random``,
        ``… intra_only``."""
        if self.mode == "chain":
            return f"chain {self.budget}" if self.advantage == "grpo" else f"chain {self.budget} {self.advantage}"
        s = f"tree ({self.m},{self.n},{self.l}) {self.expand_mode}"
        return s if self.advantage == "tree_grpo" else f"{s} {self.advantage}"

    @property
    def key(self) -> str:
        return f"{self.label} | seed {self.seed} | world {self.world_seed}"

    def overrides(self) -> dict[str, Any]:
        """The :class:`~treegrpo.train.config.TrainConfig` fields of this run."""
        if self.mode == "chain":
            return {"sampler": "chain", "group_size": self.budget, "advantage": self.advantage, "seed": self.seed}
        return {
            "sampler": "tree",
            "m": self.m,
            "n": self.n,
            "l": self.l,
            "expand_mode": self.expand_mode,
            "advantage": self.advantage,
            "seed": self.seed,
        }


def spec_of(row: dict[str, Any]) -> RunSpec:
    """The run a result row describes."""
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


__all__ = ["ABLATION", "ABLATION_BUDGET", "BUDGETS", "EXPAND_MODES", "QUICK_BUDGETS", "ROW_KEYS", "RunSpec", "spec_of"]
