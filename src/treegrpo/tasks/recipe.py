"""The one bootstrap recipe of a tiny agent (the search world's, arithmetic's, SQL's): demos →
tokenizer → model → warm-up → measure → record → cache, run by :func:`build_tiny_agent`.

A task family *configures* the recipe, it does not restate it:

- its settings are a frozen dataclass that extends :class:`RecipeConfig` (the warm-up's knobs,
  inherited from :class:`~treegrpo.training.warmup.WarmupConfig`, the seed, the tokenizer and Qwen2
  shape, the measurement), or :class:`LoopRecipeConfig` for a multi-turn agent (its loop limits);
  the class names its ``version`` and its ``weight_modules`` (what decides the weights, hashed
  into the cache key, :func:`recipe_hash`);
- its steps are a :class:`Recipe`: ``prepare`` (the problems or world, the env, the demos, the
  eval tasks, the family's own record fields), ``tokenizer`` and ``metrics`` (what a measurement
  reports, from the sampled chains).

The folder is written atomically (built beside it, then renamed) with
:func:`~treegrpo.models.tiny.save_tiny`; its record (``treegrpo_tiny.json``) is written last and
holds the measured warm-up success, so :func:`is_complete` tells a finished folder from one cut
short.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from tokenizers import pre_tokenizers

from treegrpo.envs.base import AgentEnv, Task
from treegrpo.fingerprint import code_fingerprint
from treegrpo.io import atomic_write_dir, user_cache_dir
from treegrpo.models.loader import MARKER_FILE, tiny_info
from treegrpo.models.tiny import model_for, save_tiny, train_tokenizer, wrap_tokenizer
from treegrpo.progress import phase, progress_bars, torch_threads
from treegrpo.rollout.agent import AgentConfig, RolloutResult, StepRunner
from treegrpo.rollout.engine import make_engine
from treegrpo.rollout.samplers import SamplerConfig, sample_chains
from treegrpo.tasks.common import Settings
from treegrpo.training.warmup import Demo, WarmupConfig, demo_texts, encode_demos, supervised_warmup

#: The modules whose code decides every tiny agent's weights (the context encoding, the model, the
#: warm-up, the splits and settings records, this recipe); a family's ``weight_modules`` add its
#: own (problems or world, demos, env).
RECIPE_MODULES = (
    "treegrpo.rollout.agent",
    "treegrpo.models.tiny",
    "treegrpo.training.warmup",
    "treegrpo.tasks.common",
    "treegrpo.tasks.recipe",
)


def recipe_hash(version: int, weight_modules: Sequence[str], settings: dict[str, Any]) -> str:
    """A short hash of everything that decides a bootstrapped model's weights: the recipe
    ``version``, the code of ``weight_modules`` (:func:`~treegrpo.fingerprint.code_fingerprint`)
    and the ``settings``."""
    blob = json.dumps({"v": version, "code": code_fingerprint(weight_modules), **settings}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def warmup_config_of(cfg: Any) -> WarmupConfig:
    """The :class:`~treegrpo.training.warmup.WarmupConfig` of a bootstrap config: every warm-up field
    the config has, the warm-up's defaults for the others."""
    names = {f.name for f in dataclasses.fields(WarmupConfig)}
    return WarmupConfig(**{n: getattr(cfg, n) for n in names if hasattr(cfg, n)})


@dataclass(frozen=True)
class RecipeConfig(WarmupConfig, Settings):
    """What every tiny-agent bootstrap config has (a family's config extends it with its own knobs
    and its own defaults).

    Attributes:
        epochs / batch_size / pack_len / lr / weight_decay / warmup_frac / lr_decay_frac /
            decision_weight / grad_clip / micro_batch_size: the supervised warm-up
            (:class:`~treegrpo.training.warmup.WarmupConfig`).
        seed: model init, demo imperfections, SFT order and evaluation sampling.
        vocab_size: BPE vocabulary size of the tokenizer.
        hidden_size / layers / heads / kv_heads / intermediate_size / max_positions: the Qwen2 shape.
        n_eval: eval tasks used to measure the warm-up (``None`` = the whole eval split).
        eval_batch_size: contexts per engine forward batch while measuring (``None`` = all).

    Class attributes (not settings): ``version``, bumped when the recipe changes so cached
    folders are rebuilt; ``weight_modules``, the modules whose code decides the weights.
    """

    version: ClassVar[int] = 1
    weight_modules: ClassVar[tuple[str, ...]] = ()

    seed: int = 0
    vocab_size: int = 3000
    hidden_size: int = 96
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate_size: int = 256
    max_positions: int = 1024
    n_eval: int | None = None
    eval_batch_size: int | None = None

    def config_hash(self) -> str:
        """A short hash of the settings, the recipe version and the code that runs the recipe."""
        return recipe_hash(self.version, self.weight_modules, self.to_dict())

    def warmup_config(self) -> WarmupConfig:
        """The supervised warm-up recipe of this bootstrap."""
        return warmup_config_of(self)

    def agent_config(self, temperature: float = 1.0) -> AgentConfig:
        """The agent loop settings demos are encoded with (and evaluation runs with)."""
        raise NotImplementedError(f"{type(self).__name__} must say its agent loop settings")


@dataclass(frozen=True)
class LoopRecipeConfig(RecipeConfig):
    """A multi-turn agent's bootstrap config: :class:`RecipeConfig` and the loop limits.

    Attributes:
        max_turns / max_step_tokens / max_obs_tokens / max_context_tokens: the agent loop limits
            (:class:`~treegrpo.rollout.agent.AgentConfig`) demos are encoded with and evaluation uses.
    """

    max_turns: int = 4
    max_step_tokens: int = 48
    max_obs_tokens: int = 160
    max_context_tokens: int = 1024

    def agent_config(self, temperature: float = 1.0) -> AgentConfig:
        return AgentConfig(
            max_turns=self.max_turns,
            max_step_tokens=self.max_step_tokens,
            max_obs_tokens=self.max_obs_tokens,
            max_context_tokens=self.max_context_tokens,
            temperature=temperature,
            use_chat_template=False,
        )


@dataclass
class Prepared:
    """What a family's ``prepare`` hands the driver.

    Attributes:
        env: the env the demos ran through (and the measurement runs through).
        demos: the demonstrations, in training order of drawing.
        eval_tasks: the eval split (the driver takes its first ``n_eval``).
        record: the family's own record fields, first in ``treegrpo_tiny.json``.
        corpus: texts the tokenizer learns from besides the demos' transcripts (before them).
        note: said before the demo count in the progress line (``"1234 passages; "``).
    """

    env: AgentEnv
    demos: list[Demo]
    eval_tasks: Sequence[Task]
    record: dict[str, Any]
    corpus: Sequence[str] = ()
    note: str = ""


#: ``metrics(tasks, rollouts)``: what a measurement reports from one chain per task.
Metrics = Callable[[Sequence[Task], RolloutResult], dict[str, Any]]


@dataclass(frozen=True)
class Recipe:
    """A task family's part of the bootstrap recipe.

    Attributes:
        name: the family, in progress lines (``world``, ``arith``, ``sql``).
        seed_name: the demo/SFT random stream is ``random.Random(f"{seed_name}-{cfg.seed}")``.
        prepare: ``(cfg, rng) -> Prepared``: the problems or world, the env, the demos (drawn
            from ``rng``), the eval tasks and the record fields.
        tokenizer: ``(texts, vocab_size) -> tokenizer`` (a ``PreTrainedTokenizerFast``).
        metrics: the measurement's report (:data:`Metrics`).
    """

    name: str
    seed_name: str
    prepare: Callable[[Any, random.Random], Prepared]
    tokenizer: Callable[[Sequence[str], int], Any]
    metrics: Metrics


def bpe_tokenizer(texts: Sequence[str], vocab_size: int) -> Any:
    """A byte-level BPE (:func:`~treegrpo.models.tiny.train_tokenizer`) as a ``PreTrainedTokenizerFast``."""
    return wrap_tokenizer(train_tokenizer(texts, vocab_size=vocab_size))


def digit_tokenizer(texts: Sequence[str], vocab_size: int, extra_tokens: Sequence[str] = ()) -> Any:
    """A byte-level BPE whose pre-tokenizer splits every digit into its own token (numbers are
    spelled digit by digit) and keeps ``extra_tokens`` whole, as a ``PreTrainedTokenizerFast``."""
    tok = train_tokenizer(texts, vocab_size=vocab_size, extra_tokens=extra_tokens)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    return wrap_tokenizer(tok)


def measure(
    metrics: Metrics,
    model: torch.nn.Module,
    tokenizer: Any,
    env: AgentEnv,
    tasks: Sequence[Task],
    agent_cfg: AgentConfig,
    seed: int = 0,
    max_batch_size: int | None = None,
) -> dict[str, Any]:
    """``metrics`` of ``model`` on ``tasks``: one chain per task through the real agent loop (the
    ``hf`` engine, :func:`~treegrpo.rollout.engine.make_engine`, and the ``chain`` sampler), sampled
    from ``random.Random(seed)`` and a torch generator seeded with ``seed``."""
    engine = make_engine("hf", model, tokenizer, max_batch_size=max_batch_size)
    runner = StepRunner(engine, env, tokenizer, agent_cfg)
    gen = torch.Generator().manual_seed(seed)
    res = sample_chains(runner, list(tasks), SamplerConfig(name="chain", group_size=1), random.Random(seed), gen)
    return metrics(tasks, res)


def final_leaves(res: RolloutResult) -> list[Any]:
    """The last node of every sampled trajectory, in task order."""
    return [leaf for f in res.forests for _, leaf in f.leaves()]


def chain_summary(res: RolloutResult, keys: Sequence[str], **extra: Any) -> dict[str, Any]:
    """A measurement's report: the figures named by ``keys``, in that order, from the common ones
    — ``success`` (mean reward), ``answered`` (fraction that ended with a well-formed answer),
    ``tool_calls``, ``invalid_actions`` and ``generated_tokens`` (means per trajectory), ``n``
    (trajectories), ``wall_s`` — and a family's own ``extra`` ones."""
    leaves = final_leaves(res)
    n = max(1, len(leaves))
    total = res.total()
    figures = {
        "success": sum(float(x.reward or 0.0) for x in leaves) / n,
        "answered": sum(x.extra.get("kind") == "answer" for x in leaves) / n,
        "tool_calls": total.tool_calls / n,
        "invalid_actions": total.invalid_actions / n,
        "generated_tokens": total.generated_tokens / n,
        "n": len(leaves),
        "wall_s": res.wall_s,
        **extra,
    }
    return {k: figures[k] for k in keys}


def build_tiny_agent(
    recipe: Recipe, folder: str | Path, cfg: RecipeConfig, progress: bool = True, threads: int | None = 1
) -> Path:
    """Build ``recipe``'s tiny agent of ``cfg`` into ``folder`` (replacing it, atomically) and return it.

    Steps: ``recipe.prepare`` (the env and the demos); a tokenizer trained on the corpus and the
    demos' transcripts; the demos encoded as the agent loop holds them (a step over the loop's cap
    is never taught, :func:`~treegrpo.training.warmup.encode_demos`); a small Qwen2
    (:func:`~treegrpo.models.tiny.model_for`); the supervised warm-up on the demos' policy tokens;
    the measurement on the first ``n_eval`` eval tasks, sampled at T=1 and greedy; the record;
    :func:`~treegrpo.models.tiny.save_tiny`. ``threads``: torch intra-op threads while building
    (restored afterwards; ``None`` leaves them): one is the fastest for a model this small, and by
    far on a shared, busy CPU.
    """
    folder = Path(folder)
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    rng = random.Random(f"{recipe.seed_name}-{cfg.seed}")
    with progress_bars(progress) as prog, torch_threads(threads):
        parts = recipe.prepare(cfg, rng)
        demos, env = parts.demos, parts.env
        timings["demos_s"] = time.perf_counter() - t0

        t = time.perf_counter()
        tok = recipe.tokenizer([*parts.corpus, *demo_texts(demos, env)], cfg.vocab_size)
        runner = StepRunner(None, env, tok, cfg.agent_config())  # type: ignore[arg-type]  # encoding only
        encoded, _ = encode_demos(runner, demos)
        timings["tokenizer_s"] = time.perf_counter() - t
        model = model_for(cfg, tok)
        n_params = sum(p.numel() for p in model.parameters())
        note = f"{recipe.name}: {parts.note}{len(demos)} demos; vocab {len(tok)}; model {n_params / 1e6:.2f}M params"
        phase(prog, note)

        t = time.perf_counter()
        sft = supervised_warmup(model, encoded, cfg.warmup_config(), tok.pad_token_id, rng, prog)
        timings["sft_s"] = time.perf_counter() - t

        t = time.perf_counter()
        eval_tasks = list(parts.eval_tasks)[: cfg.n_eval]
        sampled, greedy = [
            measure(recipe.metrics, model, tok, env, eval_tasks, cfg.agent_config(temp), cfg.seed, cfg.eval_batch_size)
            for temp in (1.0, 0.0)  # sampled, then greedy
        ]
        timings["eval_s"] = time.perf_counter() - t
        timings["total_s"] = time.perf_counter() - t0

        kinds: dict[str, int] = {}
        for d in demos:
            kinds[d.kind] = kinds.get(d.kind, 0) + 1
        info = {
            **parts.record,
            "config": cfg.to_dict(),
            "config_hash": cfg.config_hash(),
            "code_fingerprint": code_fingerprint(cfg.weight_modules),
            "agent": dataclasses.asdict(cfg.agent_config()),
            "params": n_params,
            "demos": {
                "n": len(demos),
                "kinds": kinds,
                "success": sum(d.reward for d in demos) / max(1, len(demos)),
                "mean_tokens": sum(len(e.ids) for e in encoded) / max(1, len(encoded)),
                "mean_policy_tokens": sum(sum(e.policy_mask) for e in encoded) / max(1, len(encoded)),
            },
            "sft": sft,
            "warmup_eval": {"sampled": sampled, "greedy": greedy},
            "timings": timings,
        }
        atomic_write_dir(folder, lambda tmp: save_tiny(model, tok, tmp, info))
        phase(
            prog,
            f"{recipe.name}: warm-up success sampled {sampled['success']:.3f} / greedy {greedy['success']:.3f}; "
            f"saved to {folder} in {timings['total_s']:.0f}s",
        )
    return folder


def cache_folder(name: str, cfg: RecipeConfig) -> Path:
    """Where the tiny agent ``name`` of ``cfg`` is cached: ``user_cache_dir()/models/<name>-<config hash>``."""
    return user_cache_dir() / "models" / f"{name}-{cfg.config_hash()}"


def is_complete(folder: str | Path) -> bool:
    """``folder`` holds a complete bootstrapped model: its record, written last, has the measured
    warm-up success (a folder cut short by an interruption never has it)."""
    folder = Path(folder)
    return (folder / MARKER_FILE).is_file() and "warmup_eval" in tiny_info(folder)


__all__ = [
    "RECIPE_MODULES",
    "LoopRecipeConfig",
    "Metrics",
    "Prepared",
    "Recipe",
    "RecipeConfig",
    "bpe_tokenizer",
    "build_tiny_agent",
    "cache_folder",
    "chain_summary",
    "digit_tokenizer",
    "final_leaves",
    "is_complete",
    "measure",
    "recipe_hash",
    "warmup_config_of",
]
