"""Budget planner: which Tree-GRPO shape ``(M, N, L)`` to run for a given chain budget.

What this module computes is stated in ``docs/design.md`` §6 "Matching budgets" (the formula, the
cost check at ``f`` and the order of the choices); the two are one. A chain budget ``B`` is the
cost of ``B`` independent chains per prompt. The cost model counts a tree rollout in chain units::

    cost(M, N, L) = M · (1 + L · N · f)          (× B_chain tokens for one chain)

for ``M · (1 + N · L)`` trajectories, where ``f`` is the average cost of one expansion relative to
a whole chain: an expansion continues from a picked node, so it only generates the rest of a
trajectory. With picks landing half-way on average ``f = 0.5`` (the paper's formula,
:data:`FORMULA_F`); a prototype measured ``f ≈ 0.7`` on the tiny agent (:data:`MEASURED_F`: the
root is eligible, and final answer steps are short, so the remainder is more than half); the
``treegrpo bench budget`` run measures it per shape (``phases[*].f_measured``).

Choice of shape (:func:`choose_shape`), the first that applies:

1. *Paper pairs* (:data:`PAPER_PAIRS`): chain budget 2 ↔ (1,2,1), 4 ↔ (2,2,1), 8 ↔ (2,6,1),
   16 ↔ (4,5,1) — when the budget is one of these and the pair's predicted cost at ``f`` is at
   most ``B``.
2. *Rule*: for ``M = ⌊√B⌋, ⌊√B⌋ − 1, …, 1`` (enough independent trees for the inter-tree
   baseline, growing slowly so most of a large budget goes to cheap expansions) the first ``M``
   with ``N = ⌊(B/M − 1) / (L·f)⌋ ≥ 1``: the most expansions that fit (cost ``≤ B``).
3. *Plain chains*: when not even one expansion fits for any ``M ≥ 1``, ``⌊B⌋`` of them (at least
   one; ``N = L = 0``).

With ``f = 0.5`` the rule reproduces the paper pairs for 2, 4 and 8 and gives (4,6,1) for 16
(cost exactly 16; the paper's (4,5,1) leaves 2 chains of budget unused).

Budgets may be given in trajectories (chains per prompt) or in generated tokens per prompt; tokens
are turned into chain units with the mean generated tokens of one chain (``chain_tokens``: given,
read from the bootstrapped agent's record, or measured with ``treegrpo plan --measure``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

Unit = Literal["trajectories", "tokens"]
Source = Literal["paper", "rule", "chain"]

#: The paper's matched budgets: chain budget -> (M, N, L).
PAPER_PAIRS: dict[int, tuple[int, int, int]] = {2: (1, 2, 1), 4: (2, 2, 1), 8: (2, 6, 1), 16: (4, 5, 1)}
#: Expansion cost fraction of the paper's formula (picks land half-way on average).
FORMULA_F = 0.5
#: Expansion cost fraction a prototype measured on the default tiny agent (random picks).
MEASURED_F = 0.7

_EPS = 1e-9


def predicted_cost(m: int, n: int, l: int, f: float = FORMULA_F) -> float:
    """Predicted cost of a tree rollout ``(M, N, L)`` in chain units: ``M · (1 + L·N·f)``.

    A chain rollout of ``G`` chains is ``(G, 0, 0)`` and costs ``G``.
    """
    if m < 1 or n < 0 or l < 0:
        raise ValueError(f"need M >= 1, N >= 0, L >= 0; got ({m}, {n}, {l})")
    return m * (1 + l * n * f)


def trajectories(m: int, n: int, l: int) -> int:
    """Trajectories (leaves) per prompt of ``(M, N, L)``: ``M · (1 + N·L)``."""
    return m * (1 + n * l)


def choose_shape(
    budget_chains: float, f: float = FORMULA_F, l: int = 1, use_paper: bool = True
) -> tuple[int, int, int, Source]:
    """The shape ``(M, N, L, source)`` for a budget of ``budget_chains`` chains (module docstring).

    Args:
        budget_chains: chain budget ``B`` (may be fractional when it came from a token budget).
        f: expansion cost fraction of the cost model.
        l: expansion rounds ``L`` of the rule (the paper pairs all use ``L = 1``).
        use_paper: take the paper's pair when ``B`` is one of its budgets and the pair fits.
    """
    if not budget_chains > 0:
        raise ValueError(f"budget must be > 0, got {budget_chains}")
    if not f > 0:
        raise ValueError(f"f must be > 0, got {f}")
    if l < 1:
        raise ValueError(f"L must be >= 1, got {l}")
    b = float(budget_chains)
    if use_paper and abs(b - round(b)) < _EPS and round(b) in PAPER_PAIRS:
        m, n, pl = PAPER_PAIRS[round(b)]
        if predicted_cost(m, n, pl, f) <= b + _EPS:
            return m, n, pl, "paper"
    for m in range(max(1, math.isqrt(int(b + _EPS))), 0, -1):
        n = math.floor((b / m - 1) / (l * f) + _EPS)
        if n >= 1:
            return m, n, l, "rule"
    return max(1, math.floor(b + _EPS)), 0, 0, "chain"


@dataclass(frozen=True)
class Plan:
    """A chosen shape with its predicted cost.

    Attributes:
        budget: the budget as given, in ``unit``.
        unit: ``trajectories`` (chains per prompt) or ``tokens`` (generated tokens per prompt).
        budget_chains: the budget in chain units ``B``.
        chain_tokens: mean generated tokens of one chain (``None`` when not known / not needed).
        m / n / l: the shape; ``n = l = 0`` means plain chains (``m`` of them).
        source: ``paper`` (a paper pair), ``rule`` or ``chain`` (no expansion fits).
        f: the expansion cost fraction used.
        trajectories: ``M · (1 + N·L)`` per prompt.
        chain_trajectories: what plain chains give for the same budget, ``⌊B⌋``.
        predicted_cost_chains: ``M · (1 + L·N·f)``.
        predicted_tokens: ``predicted_cost_chains · chain_tokens`` (when ``chain_tokens`` is known).
    """

    budget: float
    unit: Unit
    budget_chains: float
    chain_tokens: float | None
    m: int
    n: int
    l: int
    source: Source
    f: float
    trajectories: int
    chain_trajectories: int
    predicted_cost_chains: float
    predicted_tokens: float | None

    @property
    def mode(self) -> str:
        """``tree`` or ``chain`` (the sampler to run)."""
        return "chain" if self.n == 0 else "tree"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "mode": self.mode}


def make_plan(
    budget: float,
    unit: Unit = "trajectories",
    f: float = FORMULA_F,
    chain_tokens: float | None = None,
    l: int = 1,
    use_paper: bool = True,
) -> Plan:
    """Plan a tree rollout for ``budget`` (module docstring).

    Args:
        budget: chains per prompt (``unit="trajectories"``) or generated tokens per prompt
            (``unit="tokens"``, then ``chain_tokens`` is required).
        unit: the budget's unit.
        f: expansion cost fraction of the cost model.
        chain_tokens: mean generated tokens of one chain; turns tokens into chain units and chain
            units into predicted tokens.
        l: expansion rounds for the rule.
        use_paper: prefer the paper's pairs (:func:`choose_shape`).
    """
    if unit == "tokens":
        if chain_tokens is None or not chain_tokens > 0:
            raise ValueError("a token budget needs chain_tokens > 0 (mean generated tokens of one chain)")
        b = budget / chain_tokens
    elif unit == "trajectories":
        b = float(budget)
    else:
        raise ValueError(f"unit must be 'trajectories' or 'tokens', got {unit!r}")
    m, n, pl, source = choose_shape(b, f=f, l=l, use_paper=use_paper)
    cost = predicted_cost(m, n, pl, f)
    return Plan(
        budget=float(budget),
        unit=unit,
        budget_chains=b,
        chain_tokens=chain_tokens,
        m=m,
        n=n,
        l=pl,
        source=source,
        f=f,
        trajectories=trajectories(m, n, pl),
        chain_trajectories=max(1, math.floor(b + _EPS)),
        predicted_cost_chains=cost,
        predicted_tokens=cost * chain_tokens if chain_tokens is not None else None,
    )


def recorded_chain_tokens(model_dir: str | Path) -> float | None:
    """Mean generated tokens per trajectory the bootstrapped agent in ``model_dir`` measured on its
    eval split (sampled at temperature 1), or ``None`` when the folder does not record it."""
    from treegrpo.models.loader import tiny_info

    try:
        value = tiny_info(Path(model_dir))["warmup_eval"]["sampled"]["generated_tokens"]
    except (KeyError, TypeError, OSError, ValueError):
        return None
    return float(value) if value else None


__all__ = [
    "FORMULA_F",
    "MEASURED_F",
    "PAPER_PAIRS",
    "Plan",
    "choose_shape",
    "make_plan",
    "predicted_cost",
    "recorded_chain_tokens",
    "trajectories",
]
