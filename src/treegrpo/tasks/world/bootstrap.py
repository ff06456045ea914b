"""Bootstrap the tiny starting policy of the synthetic search world: imperfect demonstrations
(:mod:`treegrpo.tasks.world.demos`), a tokenizer and a small Qwen2 (:mod:`treegrpo.models.tiny`),
the supervised warm-up (:mod:`treegrpo.training.warmup`), measured through the real agent loop: the
one tiny-agent recipe (:mod:`treegrpo.tasks.recipe`) configured by this module.

The folder is written atomically (built in a temp folder beside it, then renamed) with
:func:`~treegrpo.models.tiny.save_tiny`; its ``treegrpo_tiny.json`` records the world, the env and
agent settings, the demo statistics, the final SFT loss and the measured warm-up success. It is
cached under ``user_cache_dir()/models/<preset>-<config hash>``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

from treegrpo.envs.base import Task
from treegrpo.envs.search import SearchEnv
from treegrpo.io import user_cache_dir
from treegrpo.models.loader import MARKER_FILE, tiny_info
from treegrpo.rollout.agent import AgentConfig, RolloutResult
from treegrpo.tasks import recipe
from treegrpo.tasks.world.demos import aux_demo_tasks, aux_worlds, make_demos, make_env
from treegrpo.tasks.world.world import World, WorldConfig, build_world, get_preset

BOOTSTRAP_VERSION = 2  # bump when the recipe changes, so cached folders are rebuilt
# The modules whose code decides the weights (world, demos, tokenizer, model, warm-up, the context
# encoding): a change to any of them is a new cache key, so a cached model is what this code builds.
WEIGHT_MODULES = (
    *recipe.RECIPE_MODULES,
    "treegrpo.envs.search",
    "treegrpo.envs.rewards",
    "treegrpo.retrieval.base",
    "treegrpo.retrieval.bm25",
    "treegrpo.tasks.world.world",
    "treegrpo.tasks.world.demos",
    "treegrpo.tasks.world.bootstrap",
)


@dataclass(frozen=True)
class BootstrapConfig(recipe.LoopRecipeConfig):
    """Everything that determines a bootstrapped starting policy: the shared knobs
    (:class:`~treegrpo.tasks.recipe.LoopRecipeConfig`: the warm-up, ``seed``, the tokenizer and
    Qwen2 shape, the agent-loop limits, ``n_eval``, ``eval_batch_size``), whose defaults are this
    recipe's but for ``layers`` (3), and

    Attributes:
        preset: world preset name (:data:`treegrpo.tasks.world.world.PRESETS`).
        world: explicit world config; overrides ``preset`` when given.
        world_seed: the preset's world with this seed instead (another world of the same kind).
        topk: passages per search in the env (the RL run must use the same).
        prompt_template: the env's prompt template (``minimal``: few prompt tokens).
        p_guess: a demo answers without searching (a random entity of the answer's type).
        p_shortcut: per intermediate hop, a multi-hop demo answers with the bridge entity it just found
            (0.5; the ``shortcut3`` and ``rare3`` presets keep 0.7, :data:`PRESET_RECIPES`). The
            warm-up learns the target world's facts from its demos: a fact no demo reaches (at 0.7,
            5 of the default world's 12 rulers were never a demo's answer) is one the starting
            policy never produces, and RL, which only reinforces what it samples, cannot learn it.
        p_bad_query: per search after the first, a demo searches another entity named in the last
            observation, then answers with a name that entity's passage gives.
        demos_per_question: demonstrations drawn per warm-up question, with independent
            imperfections: the same question is seen both continued and cut short, so the policy
            learns a *probability* of answering early instead of memorizing one choice per question.
        aux_worlds: extra worlds (same shape, other seeds: fresh names, relations and passages) whose
            every question also gets a demo. They never touch the target world's train/eval
            questions; they make the warm-up learn *copying* names rather than memorizing them.
        threads: torch intra-op threads while bootstrapping (restored afterwards; ``None`` = leave
            as is). One thread is as fast as two for a model this small on an idle 2-core CPU and
            several times faster when other processes share the cores.

    The warm-up's schedule matters here: a constant phase before the cosine decay, because copying
    names from the context emerges abruptly after a few hundred steps; ``decision_weight`` weighs
    the first token of each step after an observation (``<search>`` vs ``<answer>``), the one token
    per step that carries the decision.
    """

    preset: str = "default"
    world: WorldConfig | None = None
    world_seed: int | None = None
    topk: int = 3
    prompt_template: str = "minimal"
    layers: int = 3
    threads: int | None = 1
    p_guess: float = 0.0
    p_shortcut: float = 0.5
    p_bad_query: float = 0.05
    demos_per_question: int = 1
    aux_worlds: int = 6

    version = BOOTSTRAP_VERSION  # (class attributes, not settings)
    weight_modules = WEIGHT_MODULES

    def world_config(self) -> WorldConfig:
        """The world this bootstrap uses."""
        world = self.world if self.world is not None else get_preset(self.preset)
        return world if self.world_seed is None else replace(world, seed=self.world_seed)

    @classmethod
    def for_preset(cls, preset: str = "default", world_seed: int | None = None, **settings: Any) -> BootstrapConfig:
        """The bootstrap recipe of a world preset (the class defaults, with the preset's own
        :data:`PRESET_RECIPES` and then ``settings`` over them), on the preset's world or its
        ``world_seed`` variant."""
        if world_seed == get_preset(preset).seed:  # (a clear error for an unknown name, too)
            world_seed = None  # the preset's own world: one cached model, however it is named
        return cls(preset=preset, world_seed=world_seed, **{**PRESET_RECIPES.get(preset, {}), **settings})

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["world"] = self.world_config().to_dict()  # holds the world seed
        del d["world_seed"]
        return d


#: The bootstrap settings a world preset's recipe sets over :class:`BootstrapConfig`'s defaults:
#: the regimes of ``bench learn`` built on the shortcut habit keep the recipe they were measured with.
PRESET_RECIPES: dict[str, dict[str, Any]] = {
    "shortcut3": {"p_shortcut": 0.7},
    "rare3": {"p_shortcut": 0.7},
}

#: What a search-world measurement reports, in this order (:func:`search_metrics`).
SEARCH_METRICS = (
    "success",
    "success_by_hops",
    "tool_calls",
    "answer_after_one_search",
    "early_answer",
    "no_search_answer",
    "invalid_actions",
    "generated_tokens",
    "n",
    "wall_s",
)


def search_metrics(tasks: Sequence[Task], res: RolloutResult) -> dict[str, Any]:
    """The :data:`SEARCH_METRICS` (:func:`~treegrpo.tasks.recipe.chain_summary`), the search
    behaviour among them: ``success_by_hops``, ``answer_after_one_search`` (fraction of
    trajectories that answered after exactly one search), ``early_answer`` (fraction of multi-hop
    trajectories that answered with fewer searches than hops) and ``no_search_answer`` (answered
    without searching)."""
    by_hops: dict[int, list[float]] = {}
    one_search = early = multi = no_search = 0
    for task, forest, budget in zip(tasks, res.forests, res.budgets, strict=True):
        ((_, leaf),) = forest.leaves()
        hops = int(task.meta.get("hops", 1))
        by_hops.setdefault(hops, []).append(float(leaf.reward or 0.0))
        answered = leaf.extra.get("kind") == "answer"
        one_search += int(answered and budget.tool_calls == 1)
        no_search += int(answered and budget.tool_calls == 0)
        if hops > 1:
            multi += 1
            early += int(answered and budget.tool_calls < hops)
    n = max(1, len(tasks))
    return recipe.chain_summary(
        res,
        SEARCH_METRICS,
        success_by_hops={str(h): sum(v) / len(v) for h, v in sorted(by_hops.items())},
        answer_after_one_search=one_search / n,
        early_answer=early / max(1, multi),
        no_search_answer=no_search / n,
    )


#: Success and search behaviour of a model on ``tasks`` through the real agent loop (the ``hf``
#: engine + the ``chain`` sampler, one chain per task):
#: ``measure_policy(model, tokenizer, env, tasks, agent_cfg, seed=0, max_batch_size=None)``
#: (:func:`search_metrics`).
measure_policy = partial(recipe.measure, search_metrics)


def _prepare(cfg: BootstrapConfig, rng: random.Random) -> recipe.Prepared:
    """The world; imperfect demos on its ``warmup`` split and on the auxiliary worlds, through the real env."""
    world_cfg = cfg.world_config()
    world = build_world(world_cfg)
    env = make_env(world, cfg.topk, cfg.prompt_template)
    demos = make_demos(world, env, world.tasks("warmup"), cfg, rng)
    for w in aux_worlds(cfg):
        demos += make_demos(w, make_env(w, cfg.topk, cfg.prompt_template), aux_demo_tasks(w, world), cfg, rng)
    record = {
        "bootstrap_version": cfg.version,
        "preset": cfg.preset if cfg.world is None else None,
        "world": world_cfg.to_dict(),
        "world_stats": world.stats,
        "seed": cfg.seed,
        "env": {"topk": cfg.topk, "prompt_template": cfg.prompt_template, "metric": env.metric},
    }
    note = f"{world.stats['passages']} passages; "
    return recipe.Prepared(env, demos, world.tasks("eval"), record, corpus=world.texts(), note=note)


WORLD_RECIPE = recipe.Recipe("world", "treegrpo-bootstrap", _prepare, recipe.bpe_tokenizer, search_metrics)


def bootstrap(folder: str | Path, cfg: BootstrapConfig | None = None, progress: bool = True) -> Path:
    """Build the tiny starting policy into ``folder`` (replacing it) and return the folder.

    Steps (the one recipe, :func:`~treegrpo.tasks.recipe.build_tiny_agent`): build the world; draw
    imperfect demos on its ``warmup`` split through the real env; train a tokenizer on the world's
    texts and the demos; build a small Qwen2; warm it up on the demos' policy tokens; measure it on
    the ``eval`` split (sampled at temperature 1 and greedy) through the agent loop; save with
    :func:`~treegrpo.models.tiny.save_tiny`. The folder appears atomically: it is built in a temp
    folder beside ``folder`` and renamed into place.
    """
    cfg = cfg or BootstrapConfig.for_preset()
    return recipe.build_tiny_agent(WORLD_RECIPE, folder, cfg, progress, cfg.threads)


def default_model_dir(cfg: BootstrapConfig | None = None) -> Path:
    """Where the bootstrapped model of ``cfg`` is cached:
    ``user_cache_dir()/models/<preset>-<config hash>``."""
    cfg = cfg or BootstrapConfig.for_preset()
    name = cfg.preset if cfg.world is None else "custom"
    if cfg.world_seed is not None:
        name += f"-w{cfg.world_seed}"
    return user_cache_dir() / "models" / f"{name}-{cfg.config_hash()}"


def is_bootstrapped(folder: str | Path) -> bool:
    """``folder`` holds a complete bootstrapped model (written last, atomically)."""
    return recipe.is_complete(folder)


def ensure_bootstrapped(
    preset: str = "default",
    cfg: BootstrapConfig | None = None,
    progress: bool = True,
    force: bool = False,
    world_seed: int | None = None,
) -> Path:
    """The cached bootstrapped model folder for ``preset`` (on its ``world_seed`` variant when
    given) or for ``cfg``, building it only if it is not there yet (or ``force``)."""
    cfg = cfg or BootstrapConfig.for_preset(preset, world_seed)
    folder = default_model_dir(cfg)
    if force or not is_bootstrapped(folder):
        bootstrap(folder, cfg, progress=progress)
    return folder


@dataclass
class BootstrapSetup:
    """What an RL run needs to continue from a bootstrapped folder, rebuilt from its record."""

    folder: Path
    info: dict[str, Any]
    world: World
    env: SearchEnv
    agent: AgentConfig = field(default_factory=AgentConfig)


def load_setup(folder: str | Path) -> BootstrapSetup:
    """The world, env and agent settings a bootstrapped ``folder`` was trained and measured with."""
    folder = Path(folder)
    info = tiny_info(folder)
    if "world" not in info:
        raise ValueError(f"{folder} is not a bootstrapped model folder (no world recorded in {MARKER_FILE})")
    world = build_world(WorldConfig.from_dict(info["world"]))
    env = make_env(world, info["env"]["topk"], info["env"]["prompt_template"])
    return BootstrapSetup(folder, info, world, env, replace(AgentConfig(), **info["agent"]))



__all__ = [
    "SEARCH_METRICS",
    "WORLD_RECIPE",
    "BootstrapConfig",
    "BootstrapSetup",
    "bootstrap",
    "default_model_dir",
    "ensure_bootstrapped",
    "is_bootstrapped",
    "load_setup",
    "measure_policy",
    "search_metrics",
]
