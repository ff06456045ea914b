"""The SQL task's problems: small bank databases and instructions that need writes *and* a read.

Every task has its own database — one table ``accounts(name, balance)`` with 3-5 accounts and
random balances — and one instruction of four kinds:

- ``transfer``: "move 7 from ann to bob, then report bob's balance" (two UPDATEs, a SELECT);
- ``deposit`` / ``withdraw``: "deposit 7 to ann, then report ann's balance" (an UPDATE, a SELECT);
- ``open``: "open an account for cy with 12, then report the number of accounts" (an INSERT,
  a ``count(*)``).

``meta`` holds the rows (``rows``), the kind and the reference solution (``solution``: the SQL
statements, in order); the gold answer is what the reference's final read returns. The reward
(:class:`~treegrpo.tasks.sql.env.SqlEnv`) checks the final database state against the state the
reference leaves *and* the answer, so a policy must both write correctly and read after writing.
Splits ``warmup`` (demonstrations), ``train`` (RL) and ``eval`` (held-out) are drawn from separate
seeded streams.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from treegrpo.envs.base import Task
from treegrpo.tasks.splits import ProblemSet, RecordedConfig

KINDS: tuple[str, ...] = ("transfer", "deposit", "withdraw", "open")
SCHEMA = "CREATE TABLE accounts(name TEXT PRIMARY KEY, balance INTEGER NOT NULL CHECK (balance >= 0));"
NAMES: tuple[str, ...] = (
    "ann", "bob", "cy", "dan", "eve", "fay", "gus", "hal", "ida", "jo", "kim", "lee", "max", "ned",
    "oli", "pam", "quin", "ray", "sue", "tom", "uma", "vic", "wes", "xia", "yan", "zoe",
)  # fmt: skip


@dataclass(frozen=True)
class SqlConfig(RecordedConfig):
    """Which problems exist.

    Attributes:
        seed: the draws' seed.
        min_accounts / max_accounts: accounts per database.
        min_balance / max_balance: starting balances.
        max_amount: amounts moved, deposited, withdrawn or opened with (1..max_amount).
        kinds: the instruction kinds used.
        n_warmup / n_train / n_eval: problems per split.
    """

    seed: int = 0
    min_accounts: int = 3
    max_accounts: int = 5
    min_balance: int = 20
    max_balance: int = 99
    max_amount: int = 19
    kinds: tuple[str, ...] = KINDS
    n_warmup: int = 3000
    n_train: int = 1000
    n_eval: int = 200

    def __post_init__(self) -> None:
        if not 2 <= self.min_accounts <= self.max_accounts < len(NAMES):
            raise ValueError(f"need 2 <= min_accounts <= max_accounts < {len(NAMES)}")
        if not set(self.kinds) <= set(KINDS) or not self.kinds:
            raise ValueError(f"kinds must be a non-empty subset of {KINDS}")
        if self.max_amount >= self.min_balance:
            raise ValueError("max_amount must be below min_balance (a withdrawal never overdraws)")


def db_script(rows: list[list[Any]]) -> str:
    """The SQL that creates a task's database."""
    values = ", ".join(f"('{n}', {int(b)})" for n, b in rows)
    return f"{SCHEMA} INSERT INTO accounts VALUES {values};"


def update(name: str, delta: int) -> str:
    sign = "+" if delta >= 0 else "-"
    return f"UPDATE accounts SET balance = balance {sign} {abs(delta)} WHERE name = '{name}'"


def read_balance(name: str) -> str:
    return f"SELECT balance FROM accounts WHERE name = '{name}'"


COUNT = "SELECT count(*) FROM accounts"


def make_task(rng: random.Random, cfg: SqlConfig, task_id: str) -> Task:
    """One random problem (module docstring)."""
    names = rng.sample(NAMES, rng.randint(cfg.min_accounts, cfg.max_accounts))
    rows = [[n, rng.randint(cfg.min_balance, cfg.max_balance)] for n in names]
    balance = {n: b for n, b in rows}
    kind = rng.choice(cfg.kinds)
    x = rng.randint(1, cfg.max_amount)
    if kind == "transfer":
        a, b = rng.sample(names, 2)
        who = rng.choice((a, b))
        question = f"move {x} from {a} to {b}, then report {who}'s balance"
        solution = [update(a, -x), update(b, x), read_balance(who)]
        answer = balance[who] + (x if who == b else -x)
    elif kind in ("deposit", "withdraw"):
        a = rng.choice(names)
        d = x if kind == "deposit" else -x
        question = f"deposit {x} to {a}, then report {a}'s balance" if d > 0 else f"withdraw {x} from {a}, then report {a}'s balance"
        solution = [update(a, d), read_balance(a)]
        answer = balance[a] + d
    else:
        c = rng.choice([n for n in NAMES if n not in balance])
        question = f"open an account for {c} with {x}, then report the number of accounts"
        solution = [f"INSERT INTO accounts VALUES ('{c}', {x})", COUNT]
        answer = len(rows) + 1
    meta = {"rows": rows, "kind": kind, "solution": solution}
    return Task(task_id, question, [str(answer)], "sql", meta)


class SqlProblems(ProblemSet[SqlConfig]):
    """The problem set of a :class:`SqlConfig`: its splits."""


def build_problems(cfg: SqlConfig | None = None) -> SqlProblems:
    """Draw every split of ``cfg`` (each split from its own stream)."""
    cfg = cfg or SqlConfig()
    sizes = {"warmup": cfg.n_warmup, "train": cfg.n_train, "eval": cfg.n_eval}
    splits = {}
    for split, n in sizes.items():
        rng = random.Random(f"treegrpo-sql-{cfg.seed}-{split}")
        splits[split] = [make_task(rng, cfg, f"sql-{split}-{i}") for i in range(n)]
    return SqlProblems(cfg, splits)


__all__ = ["COUNT", "KINDS", "NAMES", "SCHEMA", "SqlConfig", "SqlProblems", "build_problems", "db_script", "make_task", "read_balance", "update"]
