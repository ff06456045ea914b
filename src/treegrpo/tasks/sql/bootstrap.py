"""The SQL task's starting policy: a small Qwen2 warmed up on deliberately imperfect demonstrations
(:mod:`treegrpo.tasks.sql.demos`) through the one tiny-agent recipe (:mod:`treegrpo.tasks.recipe`),
measured through the real agent loop, cached under ``user_cache_dir()/models/sql-<hash>``.

The tokenizer splits every digit into its own token (balances are copied digit by digit from
``<result>`` observations into answers) and keeps the tags ``<sql>``, ``</sql>``, ``<result>``,
``</result>`` whole (a stop tag is one stop id).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from treegrpo.envs.base import Task
from treegrpo.models.loader import tiny_info
from treegrpo.rollout.agent import RolloutResult
from treegrpo.tasks import recipe
from treegrpo.tasks.sql.demos import make_demos
from treegrpo.tasks.sql.env import SqlEnv
from treegrpo.tasks.sql.problems import SqlConfig, build_problems

SQL_BOOTSTRAP_VERSION = 1
SQL_TAGS = ("<sql>", "</sql>", "<result>", "</result>")
# The modules whose code decides the weights: a change to any of them is a new cache key.
WEIGHT_MODULES = (
    *recipe.RECIPE_MODULES,
    "treegrpo.tasks.sql.tool",
    "treegrpo.tasks.sql.env",
    "treegrpo.tasks.sql.problems",
    "treegrpo.tasks.sql.demos",
    "treegrpo.tasks.sql.bootstrap",
)


@dataclass(frozen=True)
class SqlBootstrapConfig(recipe.LoopRecipeConfig):
    """Everything that determines the SQL starting policy: the shared knobs
    (:class:`~treegrpo.tasks.recipe.LoopRecipeConfig`: warm-up, seed, tokenizer and Qwen2 shape,
    agent-loop limits, ``n_eval``) at this task's defaults, and

    Attributes:
        problems: the problem set (its ``warmup`` split gives the demonstrations).
        p_stale / p_guess / p_one_leg: the demo imperfections (:mod:`treegrpo.tasks.sql.demos`).
        n_demos: demonstrations, cycling through the ``warmup`` problems.
    """

    problems: SqlConfig = field(default_factory=SqlConfig)
    p_stale: float = 0.2
    p_guess: float = 0.2
    p_one_leg: float = 0.4
    n_demos: int = 4000
    max_step_tokens: int = 40
    max_obs_tokens: int = 32
    max_context_tokens: int = 384
    vocab_size: int = 700
    max_positions: int = 384
    epochs: float = 4
    pack_len: int = 384
    n_eval: int | None = 200

    version = SQL_BOOTSTRAP_VERSION  # (class attributes, not settings)
    weight_modules = WEIGHT_MODULES


def sql_tokenizer(texts: Sequence[str], vocab_size: int) -> Any:
    """Byte-level BPE with digits split and the SQL tags whole, as a ``PreTrainedTokenizerFast``."""
    return recipe.digit_tokenizer(texts, vocab_size, extra_tokens=SQL_TAGS)


#: What a SQL measurement reports, in this order (:func:`sql_metrics`).
SQL_METRICS = ("success", "state_ok", "answered", "tool_calls", "generated_tokens", "n", "wall_s")


def sql_metrics(tasks: Sequence[Task], res: RolloutResult) -> dict[str, Any]:
    """The :data:`SQL_METRICS` (:func:`~treegrpo.tasks.recipe.chain_summary`), ``state_ok`` being the
    fraction that answered with the right final database."""
    leaves = recipe.final_leaves(res)
    state_ok = sum(bool(x.extra.get("state_ok")) for x in leaves) / max(1, len(leaves))
    return recipe.chain_summary(res, SQL_METRICS, state_ok=state_ok)


#: Success of a model on SQL tasks, one chain per task through the real agent loop:
#: ``measure_sql(model, tokenizer, env, tasks, agent_cfg, seed=0)`` (:func:`sql_metrics`).
measure_sql = partial(recipe.measure, sql_metrics)


def _prepare(cfg: SqlBootstrapConfig, rng: random.Random) -> recipe.Prepared:
    problems = build_problems(cfg.problems)
    env = SqlEnv()
    demos = make_demos(env, problems.tasks("warmup"), cfg, rng)
    return recipe.Prepared(env, demos, problems.tasks("eval"), {"task": "sql", "sql_bootstrap_version": cfg.version})


SQL_RECIPE = recipe.Recipe("sql", "treegrpo-sql-bootstrap", _prepare, sql_tokenizer, sql_metrics)


def bootstrap_sql(folder: str | Path, cfg: SqlBootstrapConfig | None = None, progress: bool = True, threads: int | None = 1) -> Path:
    """Build the SQL starting policy into ``folder`` (replacing it, atomically) through the one
    recipe (:func:`~treegrpo.tasks.recipe.build_tiny_agent`): draw the problems, make the demos
    through the env, train the tokenizer, build and warm up the model, measure it on the ``eval``
    split (sampled at T=1 and greedy), save it with its record."""
    return recipe.build_tiny_agent(SQL_RECIPE, folder, cfg or SqlBootstrapConfig(), progress, threads)


def sql_model_dir(cfg: SqlBootstrapConfig | None = None) -> Path:
    """Where the SQL starting policy of ``cfg`` is cached: ``user_cache_dir()/models/sql-<hash>``."""
    return recipe.cache_folder("sql", cfg or SqlBootstrapConfig())


def is_sql_bootstrapped(folder: str | Path) -> bool:
    """``folder`` holds a complete SQL starting policy (its record is written last)."""
    return recipe.is_complete(folder)


def ensure_sql_bootstrapped(cfg: SqlBootstrapConfig | None = None, progress: bool = True, force: bool = False) -> Path:
    """The cached SQL starting policy, built only if it is not there yet (or ``force``)."""
    folder = sql_model_dir(cfg)
    if force or not is_sql_bootstrapped(folder):
        bootstrap_sql(folder, cfg, progress=progress)
    return folder


def recorded_config(model_dir: str | Path) -> SqlBootstrapConfig:
    """The bootstrap config recorded in ``model_dir`` (the defaults for any other folder)."""
    info = tiny_info(model_dir)
    return SqlBootstrapConfig.from_dict(info["config"]) if info.get("task") == "sql" else SqlBootstrapConfig()


__all__ = [
    "SQL_METRICS",
    "SQL_RECIPE",
    "SQL_TAGS",
    "SqlBootstrapConfig",
    "bootstrap_sql",
    "ensure_sql_bootstrapped",
    "is_sql_bootstrapped",
    "measure_sql",
    "recorded_config",
    "sql_metrics",
    "sql_model_dir",
    "sql_tokenizer",
]
