"""The SQL task's starting policy: a small Qwen2 warmed up on deliberately imperfect demonstrations
(:mod:`treegrpo.tasks.sql.demos`) through the generic warm-up (:mod:`treegrpo.train.warmup`),
measured through the real agent loop, cached under ``user_cache_dir()/models/sql-<hash>``.

The tokenizer splits every digit into its own token (balances are copied digit by digit from
``<result>`` observations into answers) and keeps the tags ``<sql>``, ``</sql>``, ``<result>``,
``</result>`` whole (a stop tag is one stop id).
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tokenizers import pre_tokenizers

from treegrpo.envs.base import Task
from treegrpo.fingerprint import code_fingerprint
from treegrpo.io import atomic_write_dir, user_cache_dir
from treegrpo.models.loader import tiny_info
from treegrpo.models.tiny import model_for, save_tiny, train_tokenizer, wrap_tokenizer
from treegrpo.progress import phase, progress_bars, torch_threads
from treegrpo.rollout.agent import AgentConfig, StepRunner
from treegrpo.rollout.samplers import SamplerConfig, sample_chains
from treegrpo.tasks.recipe import is_complete, recipe_hash, warmup_config_of
from treegrpo.tasks.sql.demos import make_demos
from treegrpo.tasks.sql.env import SqlEnv
from treegrpo.tasks.sql.problems import SqlConfig, build_problems
from treegrpo.train.warmup import WarmupConfig, demo_texts, encode_demos, supervised_warmup

SQL_BOOTSTRAP_VERSION = 1
SQL_TAGS = ("<sql>", "</sql>", "<result>", "</result>")
# The modules whose code decides the weights: a change to any of them is a new cache key.
WEIGHT_MODULES = (
    "treegrpo.rollout.agent",
    "treegrpo.models.tiny",
    "treegrpo.tasks.sql.tool",
    "treegrpo.tasks.sql.env",
    "treegrpo.tasks.sql.problems",
    "treegrpo.tasks.sql.demos",
    "treegrpo.tasks.sql.bootstrap",
    "treegrpo.train.warmup",
    "treegrpo.tasks.recipe",
)


@dataclass(frozen=True)
class SqlBootstrapConfig:
    """Everything that determines the SQL starting policy.

    Attributes:
        problems: the problem set (its ``warmup`` split gives the demonstrations).
        seed: model init, demo imperfections, SFT order and evaluation sampling.
        p_stale / p_guess / p_one_leg: the demo imperfections (:mod:`treegrpo.tasks.sql.demos`).
        n_demos: demonstrations, cycling through the ``warmup`` problems.
        max_turns / max_step_tokens / max_obs_tokens / max_context_tokens: agent-loop limits.
        vocab_size / hidden_size / layers / heads / kv_heads / intermediate_size / max_positions:
            tokenizer and Qwen2 shape.
        epochs / batch_size / pack_len / lr / weight_decay / warmup_frac / grad_clip: the warm-up.
        n_eval: eval problems used to measure the warm-up.
    """

    problems: SqlConfig = field(default_factory=SqlConfig)
    seed: int = 0
    p_stale: float = 0.2
    p_guess: float = 0.2
    p_one_leg: float = 0.4
    n_demos: int = 4000
    max_turns: int = 4
    max_step_tokens: int = 40
    max_obs_tokens: int = 32
    max_context_tokens: int = 384
    vocab_size: int = 700
    hidden_size: int = 96
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate_size: int = 256
    max_positions: int = 384
    epochs: float = 4
    batch_size: int = 32
    pack_len: int = 384
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup_frac: float = 0.05
    grad_clip: float = 1.0
    n_eval: int = 200

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SqlBootstrapConfig:
        kw = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        if isinstance(kw.get("problems"), dict):
            kw["problems"] = SqlConfig.from_dict(kw["problems"])
        return cls(**kw)

    def config_hash(self) -> str:
        """A short hash of the settings, the recipe version and the code that runs the recipe."""
        return recipe_hash(SQL_BOOTSTRAP_VERSION, WEIGHT_MODULES, self.to_dict())

    def agent_config(self, temperature: float = 1.0) -> AgentConfig:
        return AgentConfig(
            max_turns=self.max_turns,
            max_step_tokens=self.max_step_tokens,
            max_obs_tokens=self.max_obs_tokens,
            max_context_tokens=self.max_context_tokens,
            temperature=temperature,
            use_chat_template=False,
        )

    def warmup_config(self) -> WarmupConfig:
        """The supervised warm-up recipe of this bootstrap."""
        return warmup_config_of(self)


def sql_tokenizer(texts: Sequence[str], vocab_size: int) -> Any:
    """Byte-level BPE with digits split and the SQL tags whole, as a ``PreTrainedTokenizerFast``."""
    tok = train_tokenizer(texts, vocab_size=vocab_size, extra_tokens=SQL_TAGS)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    return wrap_tokenizer(tok)


def measure_sql(model: torch.nn.Module, tokenizer: Any, env: SqlEnv, tasks: Sequence[Task], agent_cfg: AgentConfig, seed: int = 0) -> dict[str, Any]:
    """Success of ``model`` on ``tasks``, one chain per task through the real agent loop:
    ``success`` (mean reward), ``state_ok`` (answered with the right final database),
    ``answered``, ``tool_calls`` and ``generated_tokens`` (means per trajectory), ``n``, ``wall_s``."""
    from treegrpo.rollout.engine import make_engine

    runner = StepRunner(make_engine("hf", model, tokenizer), env, tokenizer, agent_cfg)
    gen = torch.Generator().manual_seed(seed)
    res = sample_chains(runner, list(tasks), SamplerConfig(name="chain", group_size=1), random.Random(seed), gen)
    leaves = [leaf for f in res.forests for _, leaf in f.leaves()]
    n = max(1, len(leaves))
    total = res.total()
    return {
        "success": sum(float(x.reward or 0.0) for x in leaves) / n,
        "state_ok": sum(bool(x.extra.get("state_ok")) for x in leaves) / n,
        "answered": sum(x.extra.get("kind") == "answer" for x in leaves) / n,
        "tool_calls": total.tool_calls / n,
        "generated_tokens": total.generated_tokens / n,
        "n": len(leaves),
        "wall_s": res.wall_s,
    }


def bootstrap_sql(folder: str | Path, cfg: SqlBootstrapConfig | None = None, progress: bool = True, threads: int | None = 1) -> Path:
    """Build the SQL starting policy into ``folder`` (replacing it, atomically): draw the problems,
    make the demos through the env, train the tokenizer, build and warm up the model, measure it
    on the ``eval`` split (sampled at T=1 and greedy), save it with its record."""
    cfg = cfg or SqlBootstrapConfig()
    folder = Path(folder)
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    rng = random.Random(f"treegrpo-sql-bootstrap-{cfg.seed}")
    with progress_bars(progress) as prog, torch_threads(threads):
        problems = build_problems(cfg.problems)
        env = SqlEnv()
        demos = make_demos(env, problems.tasks("warmup"), cfg, rng)
        tok = sql_tokenizer(demo_texts(demos, env), cfg.vocab_size)
        runner = StepRunner(None, env, tok, cfg.agent_config())  # type: ignore[arg-type]  # encoding only
        encoded, _ = encode_demos(runner, demos)  # a step over the loop's cap is never taught
        timings["demos_and_tokenizer_s"] = time.perf_counter() - t0
        model = model_for(cfg, tok)
        n_params = sum(p.numel() for p in model.parameters())
        phase(prog, f"sql: {len(demos)} demos; vocab {len(tok)}; model {n_params / 1e6:.2f}M params")
        t = time.perf_counter()
        sft = supervised_warmup(model, encoded, cfg.warmup_config(), tok.pad_token_id, rng, prog)
        timings["sft_s"] = time.perf_counter() - t
        t = time.perf_counter()
        eval_tasks = problems.tasks("eval")[: cfg.n_eval]
        sampled = measure_sql(model, tok, env, eval_tasks, cfg.agent_config(1.0), cfg.seed)
        greedy = measure_sql(model, tok, env, eval_tasks, cfg.agent_config(0.0), cfg.seed)
        timings["eval_s"] = time.perf_counter() - t
        timings["total_s"] = time.perf_counter() - t0
        kinds: dict[str, int] = {}
        for d in demos:
            kinds[d.kind] = kinds.get(d.kind, 0) + 1
        info = {
            "task": "sql",
            "sql_bootstrap_version": SQL_BOOTSTRAP_VERSION,
            "config": cfg.to_dict(),
            "config_hash": cfg.config_hash(),
            "code_fingerprint": code_fingerprint(WEIGHT_MODULES),
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
            f"sql: warm-up success sampled {sampled['success']:.3f} / greedy {greedy['success']:.3f}; "
            f"saved to {folder} in {timings['total_s']:.0f}s",
        )
    return folder


def sql_model_dir(cfg: SqlBootstrapConfig | None = None) -> Path:
    """Where the SQL starting policy of ``cfg`` is cached: ``user_cache_dir()/models/sql-<hash>``."""
    return user_cache_dir() / "models" / f"sql-{(cfg or SqlBootstrapConfig()).config_hash()}"


def is_sql_bootstrapped(folder: str | Path) -> bool:
    """``folder`` holds a complete SQL starting policy (its record is written last)."""
    return is_complete(folder)


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
    "SQL_TAGS",
    "SqlBootstrapConfig",
    "bootstrap_sql",
    "ensure_sql_bootstrapped",
    "is_sql_bootstrapped",
    "measure_sql",
    "recorded_config",
    "sql_model_dir",
    "sql_tokenizer",
]
