"""Bootstrap the tiny starting policy of the synthetic search world: imperfect demonstrations
(:mod:`treegrpo.tasks.world.demos`), a tokenizer and a small Qwen2 (:mod:`treegrpo.models.tiny`),
the supervised warm-up (:mod:`treegrpo.train.warmup`), measured through the real agent loop.

The folder is written atomically (built in a temp folder beside it, then renamed) with
:func:`~treegrpo.models.tiny.save_tiny`; its ``treegrpo_tiny.json`` records the world, the env and
agent settings, the demo statistics, the final SFT loss and the measured warm-up success. It is
cached under ``user_cache_dir()/models/<preset>-<config hash>``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from treegrpo.envs.base import Task
from treegrpo.envs.search import SearchEnv
from treegrpo.fingerprint import code_fingerprint
from treegrpo.io import atomic_write_dir, user_cache_dir
from treegrpo.models.loader import MARKER_FILE, tiny_info
from treegrpo.models.tiny import model_for, save_tiny, train_tokenizer, wrap_tokenizer
from treegrpo.progress import phase, progress_bars, torch_threads
from treegrpo.rollout.agent import AgentConfig, StepRunner
from treegrpo.tasks.recipe import is_complete, recipe_hash, warmup_config_of
from treegrpo.tasks.world.demos import aux_demo_tasks, aux_worlds, make_demos, make_env
from treegrpo.tasks.world.world import World, WorldConfig, build_world, get_preset
from treegrpo.train.warmup import WarmupConfig, demo_texts, encode_demos, supervised_warmup

BOOTSTRAP_VERSION = 2  # bump when the recipe changes, so cached folders are rebuilt
# The modules whose code decides the weights (world, demos, tokenizer, model, warm-up, the context
# encoding): a change to any of them is a new cache key, so a cached model is what this code builds.
WEIGHT_MODULES = (
    "treegrpo.envs.search",
    "treegrpo.envs.rewards",
    "treegrpo.retrieval.base",
    "treegrpo.retrieval.bm25",
    "treegrpo.rollout.agent",
    "treegrpo.models.tiny",
    "treegrpo.tasks.world.world",
    "treegrpo.tasks.world.demos",
    "treegrpo.tasks.world.bootstrap",
    "treegrpo.train.warmup",
    "treegrpo.tasks.recipe",
)


@dataclass(frozen=True)
class BootstrapConfig:
    """Everything that determines a bootstrapped starting policy.

    Attributes:
        preset: world preset name (:data:`treegrpo.tasks.world.world.PRESETS`).
        world: explicit world config; overrides ``preset`` when given.
        world_seed: the preset's world with this seed instead (another world of the same kind).
        seed: model init, demo imperfections, SFT order and evaluation sampling.
        topk: passages per search in the env (the RL run must use the same).
        prompt_template: the env's prompt template (``minimal``: few prompt tokens).
        max_turns / max_step_tokens / max_obs_tokens / max_context_tokens: the agent loop limits
            (:class:`~treegrpo.rollout.agent.AgentConfig`) demos are encoded with and evaluation uses.
        p_guess: a demo answers without searching (a random entity of the answer's type).
        p_shortcut: per intermediate hop, a multi-hop demo answers with the bridge entity it just found.
        p_bad_query: per search after the first, a demo searches another entity named in the last
            observation, then answers with a name that entity's passage gives.
        demos_per_question: demonstrations drawn per warm-up question, with independent
            imperfections: the same question is seen both continued and cut short, so the policy
            learns a *probability* of answering early instead of memorizing one choice per question.
        aux_worlds: extra worlds (same shape, other seeds: fresh names, relations and passages) whose
            every question also gets a demo. They never touch the target world's train/eval
            questions; they make the warm-up learn *copying* names rather than memorizing them.
        vocab_size: BPE vocabulary size of the tokenizer.
        hidden_size / layers / heads / kv_heads / intermediate_size / max_positions: the Qwen2 shape.
        epochs: passes over the demonstrations (may be fractional).
        batch_size: demonstrations per optimizer step (drawn at random, not length-bucketed).
        pack_len: demos of a batch are packed into rows of this many tokens (block-diagonal
            attention, positions restarting per demo); 0 = one right-padded demo per row.
        lr / weight_decay / warmup_frac / grad_clip: AdamW with a linear warm-up over ``warmup_frac``
            of the steps, then a constant rate, then a cosine decay to 0 over the last
            ``lr_decay_frac`` of the steps after warm-up (1.0 = plain cosine). A constant phase
            matters: copying names from the context emerges abruptly after a few hundred steps.
        decision_weight: loss weight of the first token of each step after an observation
            (``<search>`` vs ``<answer>``: search on or answer now). One token per step carries the
            decision; without the weight the warm-up learns its marginal rate, not when to stop.
        n_eval: eval questions used to measure the warm-up (``None`` = the whole eval split).
        eval_batch_size: contexts per engine forward batch while measuring.
        threads: torch intra-op threads while bootstrapping (restored afterwards; ``None`` = leave
            as is). One thread is as fast as two for a model this small on an idle 2-core CPU and
            several times faster when other processes share the cores.
    """

    preset: str = "default"
    world: WorldConfig | None = None
    world_seed: int | None = None
    seed: int = 0
    topk: int = 3
    prompt_template: str = "minimal"
    max_turns: int = 4
    max_step_tokens: int = 48
    max_obs_tokens: int = 160
    max_context_tokens: int = 1024
    p_guess: float = 0.0
    p_shortcut: float = 0.7
    p_bad_query: float = 0.05
    demos_per_question: int = 1
    aux_worlds: int = 6
    vocab_size: int = 3000
    hidden_size: int = 96
    layers: int = 3
    heads: int = 4
    kv_heads: int = 2
    intermediate_size: int = 256
    max_positions: int = 1024
    epochs: float = 6
    batch_size: int = 32
    pack_len: int = 256
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup_frac: float = 0.05
    lr_decay_frac: float = 0.25
    decision_weight: float = 1.0
    grad_clip: float = 1.0
    n_eval: int | None = None
    eval_batch_size: int | None = None
    threads: int | None = 1

    def world_config(self) -> WorldConfig:
        """The world this bootstrap uses."""
        world = self.world if self.world is not None else get_preset(self.preset)
        return world if self.world_seed is None else replace(world, seed=self.world_seed)

    @classmethod
    def for_preset(cls, preset: str = "default", world_seed: int | None = None) -> BootstrapConfig:
        """The bootstrap recipe of a world preset, on the preset's world or its ``world_seed``
        variant."""
        if world_seed == get_preset(preset).seed:  # (a clear error for an unknown name, too)
            world_seed = None  # the preset's own world: one cached model, however it is named
        return cls(preset=preset, world_seed=world_seed)

    def agent_config(self, temperature: float = 1.0) -> AgentConfig:
        """The agent loop settings demos are encoded with (and evaluation runs with)."""
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

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["world"] = self.world_config().to_dict()  # holds the world seed
        del d["world_seed"]
        return d

    def config_hash(self) -> str:
        """A short hash of everything that determines the weights: the settings, the recipe version,
        and the code and library versions that run the recipe (:func:`~treegrpo.tasks.recipe.recipe_hash`)."""
        return recipe_hash(BOOTSTRAP_VERSION, WEIGHT_MODULES, self.to_dict())


def measure_policy(
    model: torch.nn.Module,
    tokenizer: Any,
    env: SearchEnv,
    tasks: Sequence[Task],
    agent_cfg: AgentConfig,
    seed: int = 0,
    max_batch_size: int | None = None,
) -> dict[str, Any]:
    """Success and search behaviour of ``model`` on ``tasks`` through the real agent loop
    (the ``hf`` engine, :func:`~treegrpo.rollout.engine.make_engine`, + the ``chain`` sampler, one chain per task).

    Returns ``success`` (mean reward), ``success_by_hops``, ``tool_calls`` (mean per trajectory),
    ``answer_after_one_search`` (fraction of trajectories that answered after exactly one search),
    ``early_answer`` (fraction of multi-hop trajectories that answered with fewer searches than
    hops), ``no_search_answer`` (answered without searching), ``invalid_actions`` and
    ``generated_tokens`` (means per trajectory) and ``wall_s``.
    """
    from treegrpo.rollout.engine import make_engine
    from treegrpo.rollout.samplers import SamplerConfig, sample_chains

    engine = make_engine("hf", model, tokenizer, max_batch_size=max_batch_size)
    runner = StepRunner(engine, env, tokenizer, agent_cfg)
    gen = torch.Generator().manual_seed(seed)
    res = sample_chains(
        runner, list(tasks), SamplerConfig(name="chain", group_size=1), random.Random(seed), gen
    )
    n = len(tasks)
    rewards: list[float] = []
    by_hops: dict[int, list[float]] = {}
    one_search = early = multi = no_search = 0
    for task, forest, budget in zip(tasks, res.forests, res.budgets, strict=True):
        ((_, leaf),) = forest.leaves()
        r = float(leaf.reward or 0.0)
        rewards.append(r)
        hops = int(task.meta.get("hops", 1))
        by_hops.setdefault(hops, []).append(r)
        answered = leaf.extra.get("kind") == "answer"
        one_search += int(answered and budget.tool_calls == 1)
        no_search += int(answered and budget.tool_calls == 0)
        if hops > 1:
            multi += 1
            early += int(answered and budget.tool_calls < hops)
    total = res.total()
    return {
        "success": sum(rewards) / max(1, n),
        "success_by_hops": {str(h): sum(v) / len(v) for h, v in sorted(by_hops.items())},
        "tool_calls": total.tool_calls / max(1, n),
        "answer_after_one_search": one_search / max(1, n),
        "early_answer": early / max(1, multi),
        "no_search_answer": no_search / max(1, n),
        "invalid_actions": total.invalid_actions / max(1, n),
        "generated_tokens": total.generated_tokens / max(1, n),
        "n": n,
        "wall_s": res.wall_s,
    }


def bootstrap(folder: str | Path, cfg: BootstrapConfig | None = None, progress: bool = True) -> Path:
    """Build the tiny starting policy into ``folder`` (replacing it) and return the folder.

    Steps: build the world; draw imperfect demos on its ``warmup`` split through the real env;
    train a tokenizer on the world's texts and the demos; build a small Qwen2; warm it up on the
    demos' policy tokens; measure it on the ``eval`` split (sampled at temperature 1 and greedy)
    through the agent loop; save with :func:`~treegrpo.models.tiny.save_tiny`. The folder appears
    atomically: it is built in a temp folder beside ``folder`` and renamed into place.
    """
    cfg = cfg or BootstrapConfig()
    folder = Path(folder)
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    rng = random.Random(f"treegrpo-bootstrap-{cfg.seed}")
    with progress_bars(progress) as prog, torch_threads(cfg.threads):
        t = time.perf_counter()
        world_cfg = cfg.world_config()
        world = build_world(world_cfg)
        env = make_env(world, cfg.topk, cfg.prompt_template)
        demos = make_demos(world, env, world.tasks("warmup"), cfg, rng)
        for w in aux_worlds(cfg):
            aux_env = make_env(w, cfg.topk, cfg.prompt_template)
            demos += make_demos(w, aux_env, aux_demo_tasks(w, world), cfg, rng)
        timings["world_and_demos_s"] = time.perf_counter() - t
        phase(prog, f"world {world.stats['passages']} passages; {len(demos)} demos")

        t = time.perf_counter()
        tok = wrap_tokenizer(
            train_tokenizer([*world.texts(), *demo_texts(demos, env)], vocab_size=cfg.vocab_size)
        )
        runner = StepRunner(None, env, tok, cfg.agent_config())  # type: ignore[arg-type]  # encoding only
        encoded, _ = encode_demos(runner, demos)  # a step over the loop's cap is never taught
        timings["tokenizer_s"] = time.perf_counter() - t

        model = model_for(cfg, tok)
        n_params = sum(p.numel() for p in model.parameters())
        phase(prog, f"tokenizer vocab {len(tok)}; model {n_params / 1e6:.2f}M params")

        t = time.perf_counter()
        sft = supervised_warmup(model, encoded, cfg.warmup_config(), tok.pad_token_id, rng, prog)
        timings["sft_s"] = time.perf_counter() - t

        t = time.perf_counter()
        eval_tasks = world.tasks("eval")[: cfg.n_eval] if cfg.n_eval is not None else world.tasks("eval")
        sampled = measure_policy(
            model, tok, env, eval_tasks, cfg.agent_config(1.0), cfg.seed, cfg.eval_batch_size
        )
        greedy = measure_policy(
            model, tok, env, eval_tasks, cfg.agent_config(0.0), cfg.seed, cfg.eval_batch_size
        )
        timings["eval_s"] = time.perf_counter() - t
        timings["total_s"] = time.perf_counter() - t0

        kinds: dict[str, int] = {}
        for d in demos:
            kinds[d.kind] = kinds.get(d.kind, 0) + 1
        info = {
            "bootstrap_version": BOOTSTRAP_VERSION,
            "preset": cfg.preset if cfg.world is None else None,
            "world": world_cfg.to_dict(),
            "world_stats": world.stats,
            "seed": cfg.seed,
            "config": cfg.to_dict(),
            "config_hash": cfg.config_hash(),
            "code_fingerprint": code_fingerprint(WEIGHT_MODULES),
            "env": {"topk": cfg.topk, "prompt_template": cfg.prompt_template, "metric": env.metric},
            "agent": asdict(cfg.agent_config()),
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
        phase(prog, f"saved to {folder} in {timings['total_s']:.0f}s")
    return folder


def default_model_dir(cfg: BootstrapConfig | None = None) -> Path:
    """Where the bootstrapped model of ``cfg`` is cached:
    ``user_cache_dir()/models/<preset>-<config hash>``."""
    cfg = cfg or BootstrapConfig()
    name = cfg.preset if cfg.world is None else "custom"
    if cfg.world_seed is not None:
        name += f"-w{cfg.world_seed}"
    return user_cache_dir() / "models" / f"{name}-{cfg.config_hash()}"


def is_bootstrapped(folder: str | Path) -> bool:
    """``folder`` holds a complete bootstrapped model (written last, atomically)."""
    return is_complete(folder)


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
    "BootstrapConfig",
    "BootstrapSetup",
    "bootstrap",
    "default_model_dir",
    "ensure_bootstrapped",
    "is_bootstrapped",
    "load_setup",
    "measure_policy",
]
