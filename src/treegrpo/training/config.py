"""Training configuration: one validated model, loadable from YAML, overridable from the CLI.

Every field's description is its ``--help`` text. Official Tree-GRPO names are accepted as
aliases where they map (``ts_m``, ``ts_n``, ``ts_l``). Bad values raise :class:`ConfigError` with
one line naming the field and the fix.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from treegrpo.errors import ConfigError

__all__ = ["ConfigError", "TrainConfig", "load_config", "make_config", "parse_set"]


class TrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, validate_assignment=True, allow_inf_nan=False)

    # -- what to train, on what ----------------------------------------------------------------
    model: str | None = Field(
        None,
        description="Local causal-LM folder; default: the bootstrapped tiny agent (built and cached on first use).",
    )
    preset: str = Field("default", description="Synthetic world preset used when no --data is given.")
    world_seed: int | None = Field(
        None, description="Override the world preset's seed (a different world of the same kind)."
    )
    data: str | None = Field(
        None,
        description="Training questions: Search-R1/verl parquet, JSONL {id, question, answers}, or a built-in set (wiki-vital-qa: with --corpus wiki-vital).",
    )
    eval_data: str | None = Field(
        None,
        description="Held-out questions (same formats); default: the world's eval split or a slice of --data.",
    )
    corpus: str | None = Field(
        None,
        description="Search-R1 corpus JSONL {id, contents} (or a built-in corpus name) for an in-process retriever.",
    )
    retriever_url: str | None = Field(
        None, description="URL of a Search-R1-compatible retrieval server (POST /retrieve)."
    )
    allow_offline_retriever: bool = Field(
        False,
        description="Start even when --retriever-url does not answer the start-up probe (searches then fail and are counted).",
    )
    topk: int = Field(3, ge=1, le=50, description="Passages returned per search.")
    prompt_template: str = Field(
        "auto",
        description="search_r1 | minimal | a format string with {question}; auto = minimal for the tiny agent, search_r1 otherwise.",
    )
    task: Literal["search", "arith", "sql"] = Field(
        "search",
        description="search (agent with a retriever: the synthetic world or --data) | arith (single-turn multi-step arithmetic, its own problems and tiny starting policy) | sql (a database agent whose SQL statements read and write: a stateful tool, its own problems and tiny starting policy).",
    )
    reward: list[str] = Field(
        default_factory=lambda: ["em"],
        description="Reward: em | sub_em | f1 (answer only) | format (search only: Search-R1's format-aware EM, 1 / 0.8 / 0.3 / 0.2 / 0.1 / 0) | package.module:function (a TRL-style reward function, docs/tools.md); several comma-separated are summed with reward_weights.",
    )
    reward_weights: list[float] | None = Field(
        None, description="Weights of the reward functions, in order (default 1 each)."
    )
    env: str | None = Field(
        None,
        description="Your own environment: package.module:Class (or an env object or factory), importable from the working directory (docs/tools.md).",
    )
    tools: list[str] = Field(
        default_factory=list,
        description="Your own tools: package.module:function, comma-separated (type hints and an Args: docstring each), or one package.module:Class whose public methods are tools and whose instance is a trajectory's state (docs/tools.md).",
    )
    protocol: Literal["tags", "tools"] = Field(
        "tags",
        description="How the model calls tools: tags (the library's <tool_call>{json}</tool_call> text protocol, any model) | tools (the model's own chat template, tool-call syntax and tool role, docs/tools.md).",
    )
    chat_template: str | None = Field(
        None,
        description="The model's chat template: a built-in name (chatml-tools: ChatML with tools for SmolLM2; qwen2.5; llama3.1) or a Jinja file; default: the model's own. Saved with the trained model.",
    )
    tool_timeout_s: float | None = Field(
        30.0, gt=0.0, description="A tool call running longer gets a time-out error as its result (null: no limit)."
    )
    tool_concurrency: int = Field(
        32,
        ge=1,
        description="Tool calls running at once over a batch (sync tools on threads, async tools on the run's event loop; each trajectory's calls in order; 1: one after another). Sized for network tools (docs/tools.md).",
    )

    # -- rollout -----------------------------------------------------------------------------------
    sampler: Literal["tree", "chain", "eptree"] = Field(
        "tree",
        description="tree (Tree-GRPO initialize-then-expand), chain (independent chains) or eptree (TreeRL token-level forking, single-turn).",
    )
    group_size: int = Field(
        4, ge=1, validation_alias=AliasChoices("group_size", "num_generations"), description="Chains per prompt for --sampler chain (TRL's num_generations)."
    )
    m: int = Field(
        2,
        ge=1,
        validation_alias=AliasChoices("m", "ts_m"),
        description="Tree: initial chains per prompt (M, ts_m).",
    )
    n: int = Field(
        2,
        ge=0,
        validation_alias=AliasChoices("n", "ts_n"),
        description="Tree: nodes expanded per tree per round (N, ts_n).",
    )
    l: int = Field(
        1, ge=0, validation_alias=AliasChoices("l", "ts_l"), description="Tree: expansion rounds (L, ts_l)."
    )
    expand_mode: Literal["random", "nonroot", "entropy"] = Field(
        "random",
        description="Which nodes a tree expands: random (official, root eligible), nonroot, entropy.",
    )
    budget_tokens: int | str | None = Field(
        None,
        description="Tree: spend this many generated tokens per prompt instead of the nominal shape: a number, or chain:G (G times the mean tokens of one chain, measured on each step's initial chains). M initial chains, then rounds of up to N picks per tree among the nodes whose measured cost still fits (L unused). Default: the nominal (M, N, L).",
    )
    t: int = Field(2, ge=1, description="EPTree: branches per fork point (T).")
    fork_score: Literal["logp", "entropy", "random"] = Field(
        "logp", description="EPTree: fork at the tokens with the highest -log p, entropy, or at random."
    )
    max_turns: int = Field(
        4,
        ge=0,
        description="Turns with search allowed; then one final turn without (0: single-turn, the first step must answer, e.g. passages given in the prompt).",
    )
    max_step_tokens: int | Literal["auto"] = Field(
        "auto",
        description="Per-step generation cap (tokens); a longer step is an invalid action. auto = the cap a bootstrapped tiny agent or a warm-up folder was taught with, else 48 for a tiny agent and 128 for a real model (a real search query plus a short thought). Resolved when the model is loaded and recorded in config.json.",
    )
    max_obs_tokens: int = Field(
        600,
        ge=1,
        description="Observation tokens kept per step; a longer one keeps whole passages and a closed </information> (600 fits topk=3 wiki-vital passages for SmolLM2's tokenizer: p99 556). A bootstrapped tiny agent uses the limit it was taught with unless this is set.",
    )
    max_context_tokens: int | Literal["auto"] = Field(
        "auto",
        description="Longest context a trajectory may reach (capped by the model's positions). auto = the limit a bootstrapped tiny agent or a warm-up folder was taught with, else 3072 for a tiny agent and 4096 for a real model (the prompt, max_turns + 1 steps and max_turns observations of 600 tokens). Resolved when the model is loaded and recorded in config.json.",
    )
    obs_format: Literal["inline", "chat"] = Field(
        "inline",
        description="How observations enter a chat model's context: inline (in the assistant turn, Search-R1's way) | chat (a new user turn through the chat template). A warm-up folder's setting is used unless this is set.",
    )
    temperature: float = Field(1.0, ge=0.0, description="Rollout sampling temperature.")
    engine: str = Field("hf", description="Rollout engine: hf (transformers, CPU/GPU) | vllm (needs vllm installed).")
    engine_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword options of the engine (make_engine): vllm e.g. kv_cache_gb (CPU), gpu_memory_utilization, max_model_len, sleep_level (GPU colocation); hf e.g. max_batch_size.",
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Rollout nucleus sampling threshold.")
    rollout_pipeline: bool = Field(
        False,
        description="Pipelined rollout loop: a trajectory whose tool results are back goes to the next engine call without waiting for the slowest call of its turn, and generation runs while other trajectories' calls are in flight (tools with latency). Implies trajectory_streams. Off: one engine call per turn for every trajectory, then one env step on the batch.",
    )
    trajectory_streams: bool = Field(
        False,
        description="Each engine request samples from its own stream, seeded by the run's sampling stream, the trajectory's place in its tree and its turn, so a forest does not depend on tool timing or on which requests share an engine call (on with rollout_pipeline). Off: one sampling stream for the batch (the default).",
    )

    # -- advantage and loss ------------------------------------------------------------------------
    advantage: str = Field(
        "auto",
        description="Estimator from the registry (grpo, tree_grpo, intra_only, inter_only, treerl, gigpo, tree_gigpo); auto = tree_grpo for trees, treerl for eptree, grpo for chains.",
    )
    adv_scale: Literal["std", "none"] = Field(
        "std", description="Divide by the group std (std) or not (none, Dr. GRPO)."
    )
    adv_sqrt_weighting: bool = Field(
        True, description="treerl: divide a segment's value by sqrt(#leaves below it) (False: the paper's ablation)."
    )
    adv_local: bool = Field(
        True, description="treerl: add the local term V(s) - V(parent) (False: global advantage only)."
    )
    # GiGPO (gigpo, tree_gigpo), under verl-agent's names (algorithm.gamma, algorithm.gigpo.*: accepted as aliases)
    gamma: float = Field(0.95, ge=0.0, le=1.0, validation_alias=AliasChoices("gamma", "algorithm.gamma"), description="gigpo, tree_gigpo: discount of the step returns (verl-agent's algorithm.gamma; 0.95 is what its GiGPO example scripts pass, its config's own default is 1.0).")
    step_advantage_w: float = Field(1.0, validation_alias=AliasChoices("step_advantage_w", "gigpo.step_advantage_w"), description="gigpo, tree_gigpo: weight of the step-level (anchor-state) term.")
    gigpo_mode: Literal["mean_norm", "mean_std_norm"] = Field("mean_norm", validation_alias=AliasChoices("gigpo_mode", "gigpo.mode"), description="gigpo, tree_gigpo: mean_norm (subtract the group mean) or mean_std_norm (and divide by the std).")
    enable_similarity: bool = Field(False, validation_alias=AliasChoices("enable_similarity", "gigpo.enable_similarity"), description="gigpo, tree_gigpo: group steps whose anchors are similar (difflib ratio) instead of equal.")
    similarity_thresh: float = Field(0.95, gt=0.0, lt=1.0, validation_alias=AliasChoices("similarity_thresh", "gigpo.similarity_thresh"), description="gigpo, tree_gigpo with enable_similarity: the difflib ratio two anchors need to share a group.")
    gigpo_anchor: Literal["observation", "context", "state"] = Field("observation", description="gigpo, tree_gigpo: what a step group shares: observation (verl-agent's: the observation the step acts on, no history), context (the whole context root→parent) or state (the env's state key, else the context).")
    clip_ratio_low: float = Field(0.2, ge=0.0, description="PPO clip range below 1.")
    clip_ratio_high: float = Field(0.2, ge=0.0, description="PPO clip range above 1.")
    dual_clip: bool = Field(False, description="Dual clip (c=3) for negative advantages.")
    kl_coef: float = Field(
        0.001,
        ge=0.0,
        validation_alias=AliasChoices("kl_coef", "beta"),
        description="KL-to-reference loss coefficient (0 disables the reference model; TRL's beta).",
    )
    kl_kind: Literal["k1", "k2", "k3", "low_var_kl"] = Field("k3", description="KL estimator.")
    entropy_coef: float = Field(0.0, ge=0.0, description="Entropy bonus coefficient.")
    agg_mode: Literal[
        "token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
        "seq-mean-token-sum-norm-legacy",
    ] = Field(
        "token-mean",
        description="Loss aggregation (verl's modes; seq-mean-token-sum-norm = Dr. GRPO's token sum / (sequences × T) as verl 0.9.1 and TRL, -legacy = token sum / T as the official Tree-GRPO code's verl fork).",
    )

    # -- optimisation ------------------------------------------------------------------------------
    steps: int = Field(200, ge=0, validation_alias=AliasChoices("steps", "max_steps"), description="RL steps (TRL's max_steps).")
    prompts_per_step: int = Field(16, ge=1, description="Prompts per RL step.")
    lr: float | Literal["auto"] = Field(
        "auto",
        validation_alias=AliasChoices("lr", "learning_rate"),
        description="AdamW learning rate (TRL's learning_rate) (peak, after warm-up); auto = 5e-4 for a bootstrapped tiny agent, 1e-6 for full fine-tuning of a real model (Search-R1's train_grpo.sh, 3B), 1e-5 with LoRA (about 10x full fine-tuning; verl's LoRA GRPO example uses 3e-6 at rank 64, alpha 32). Resolved when the model is loaded and recorded in config.json.",
    )
    lr_warmup_steps: int = Field(
        0, ge=0, description="Linear lr warm-up over the first N RL steps (step k of N uses lr·k/N)."
    )
    lr_schedule: Literal["constant", "cosine", "linear"] = Field(
        "constant",
        description="lr after warm-up: constant | cosine | linear decay to min_lr_ratio·lr at the last step (of --steps).",
    )
    min_lr_ratio: float = Field(
        0.0, ge=0.0, le=1.0, description="cosine/linear: the final lr as a fraction of lr."
    )
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0.0, description="Gradient norm clip.")
    mini_batches: int = Field(1, ge=1, description="Optimizer steps per rollout batch (PPO mini-batches).")
    micro_batch_tokens: int = Field(8192, ge=64, description="Token cap of one forward/backward micro-batch.")
    logprob_chunk_tokens: int | Literal["auto"] = Field(
        "auto",
        description="Log-probs and entropies from the last hidden states this many positions at a time (the LM head and full-vocabulary log-softmax of one chunk at a time, recomputed per chunk in backward); 0 = off (the model's full logits at once). auto = 0 for a bootstrapped tiny agent (bit-identical to earlier runs), 1024 for other models.",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="Model weights and compute for training and rollout (one model object); log-probs, entropies and losses are computed in float32 from the logits either way. bfloat16 full fine-tuning updates bf16 weights in place (tiny steps round away): prefer LoRA (float32 adapters) or float32.",
    )
    gradient_checkpointing: bool | Literal["auto"] = Field(
        "auto",
        description="Recompute each transformer layer in backward (transformers' gradient_checkpointing_enable, use_reentrant=False): less activation memory, more update time. auto = off for a bootstrapped tiny agent, on for other models (as verl's and Search-R1's configs run real models; one full-SmolLM2 per-path step peaked at 14.9 GB without it).",
    )
    lora_rank: int = Field(0, ge=0, description="LoRA rank (peft, the [lora] extra); 0 = full fine-tuning.")
    lora_alpha: float = Field(32.0, gt=0.0, description="LoRA alpha (the update is scaled by alpha / rank).")
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA branch input.")
    lora_target_modules: list[str] = Field(
        default_factory=lambda: ["all-linear"],
        description="Modules that get adapters (comma-separated names, e.g. q_proj,v_proj); all-linear = every linear layer but the LM head.",
    )
    packing: Literal["auto", "on", "off"] = Field(
        "auto", description="Train packed (auto/on: each forest one row, every shared token once; auto falls back to per path for a model that rejects custom attention masks; off: one row per path)."
    )

    # -- evaluation, logging, checkpoints ---------------------------------------------------------
    eval_every: int = Field(40, ge=0, description="Evaluate every N steps (0: only at start and end).")
    eval_every_tokens: int = Field(
        0, ge=0, description="Also evaluate after each step that takes the run's generated tokens past a multiple of this (0: off): EM-per-token curves with points at equal cost. These extra points are sampled only (when eval_sampled); greedy stays at the regular evaluations."
    )
    eval_prompts: int = Field(128, ge=1, description="Held-out prompts per evaluation.")
    eval_sampled: bool = Field(True, description="Also evaluate with sampling at T=1 (besides greedy).")
    save_every: int = Field(40, ge=0, description="Checkpoint every N steps (0: only at the end).")
    dump_rollouts_every: int = Field(
        40, ge=0, description="Write the step's forests (with advantages) every N steps (0: never)."
    )
    out_dir: str = Field("runs/tree", description="Where metrics, checkpoints and rollouts go (default: runs/<sampler>).")
    resume: bool = Field(
        False,
        description="Resume from out_dir/checkpoint (verified; falls back to checkpoint.prev); a finished run is left as it is.",
    )
    resume_override: list[str] = Field(
        default_factory=list,
        description="With --resume: config fields allowed to differ from the checkpoint's run (comma-separated, e.g. lr,seed); applied and recorded. steps may always grow.",
    )
    seed: int = Field(0, description="Seed of the run (prompt order, tree picks, sampling).")
    device: str = Field("cpu", description="torch device.")
    parallel: Literal["ddp", "fsdp2"] = Field(
        "ddp",
        description="With more than one process (torchrun, or treegrpo train --nproc K): ddp = every rank holds the whole model (DDP); fsdp2 = parameters, gradients and optimizer state sharded across ranks (FSDP2 fully_shard), for a model that does not fit one device. One process: ignored.",
    )
    threads: int = Field(
        1, ge=0, description="torch CPU threads; 1 is fastest for the tiny agent (0 = torch's default, for larger models)."
    )
    tensorboard: bool = Field(True, description="Also log to TensorBoard when it is installed.")

    @field_validator("packing", mode="before")
    @classmethod
    def _yaml_on_off(cls, v: Any) -> Any:
        # YAML 1.1 (and so ``--set packing=on`` and a config file's ``packing: off``) reads on/off as booleans
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v

    @field_validator("advantage")
    @classmethod
    def _known_estimator(cls, v: str) -> str:
        from treegrpo.algos.advantages import ADVANTAGE_ESTIMATORS

        if v != "auto" and v not in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"unknown estimator {v!r}; choose auto or one of {sorted(ADVANTAGE_ESTIMATORS)}")
        return v

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, v: str) -> str:
        from treegrpo.rollout.engine import ENGINE_NAMES

        if v not in ENGINE_NAMES:
            raise ValueError(f"unknown engine {v!r}; choose one of {', '.join(ENGINE_NAMES)}")
        return v

    @field_validator("device")
    @classmethod
    def _usable_device(cls, v: str) -> str:
        import torch

        try:
            dev = torch.device(v)
        except (RuntimeError, ValueError):
            raise ValueError(f"{v!r} is not a torch device (cpu, cuda, cuda:1, mps)") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            build = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ValueError(
                f"{v!r}: {build} (torch {torch.__version__}); use device=cpu or install a CUDA build of torch"
            )
        if dev.type == "mps" and not torch.backends.mps.is_available():
            raise ValueError(f"{v!r}: MPS is not available on this machine; use device=cpu")
        return v

    @field_validator("reward", mode="before")
    @classmethod
    def _reward_list(cls, v: Any) -> Any:
        v = [x.strip() for x in v.split(",") if x.strip()] if isinstance(v, str) else v
        if isinstance(v, list) and not v:
            raise ValueError("name at least one reward (em, sub_em, f1, format or package.module:function)")
        for r in v if isinstance(v, list) else ():
            in_memory = isinstance(r, str) and r.startswith("<") and r.endswith(">")  # a lambda / nested function passed from Python (imports.object_ref)
            if isinstance(r, str) and r not in ("em", "sub_em", "f1", "format") and ":" not in r and not in_memory:
                raise ValueError(f"unknown reward {r!r}; choose em, sub_em, f1, format or package.module:function")
        return v

    @field_validator("tools", mode="before")
    @classmethod
    def _tool_list(cls, v: Any) -> Any:
        return [x.strip() for x in v.split(",") if x.strip()] if isinstance(v, str) else v

    @field_validator("resume_override", "lora_target_modules", mode="before")
    @classmethod
    def _comma_list(cls, v: Any) -> Any:
        return [x.strip() for x in v.split(",") if x.strip()] if isinstance(v, str) else v

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.retriever_url and self.corpus:
            raise ValueError("give either --corpus or --retriever-url, not both")
        if (self.corpus or self.retriever_url) and not self.data:
            raise ValueError("--corpus/--retriever-url need --data (questions to train on)")
        if self.data and not (self.corpus or self.retriever_url or self.env or self.tools):
            raise ValueError("--data needs a retriever (--corpus PATH or --retriever-url URL), or your own --tools/--env")
        if self.task == "arith" and (self.data or self.corpus or self.retriever_url):
            raise ValueError("--task arith has its own problems: drop --data/--corpus/--retriever-url")
        if self.env and self.tools:
            raise ValueError("give either --env or --tools, not both (a tools env is made from the tools)")
        if (self.env or self.tools) and self.task != "search":
            raise ValueError(f"--task {self.task} has its own env: drop --env/--tools")
        if self.protocol == "tools" and not (self.tools or self.env or (self.task == "search" and self.data)):
            raise ValueError(
                "protocol tools is for your --tools or the search task over --data/--corpus (the synthetic world's "
                "tiny agent and the arith/sql tasks speak their tags)"
            )
        if "format" in self.reward and (len(self.reward) > 1 or self.env or self.tools or self.protocol == "tools"):
            raise ValueError("reward format is Search-R1's own score of the search protocol: use it alone, on --task search")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward):
            raise ValueError(f"reward_weights has {len(self.reward_weights)} values for {len(self.reward)} rewards")
        if self.lora_rank and not self.lora_target_modules:
            raise ValueError("lora_target_modules is empty: name the modules to adapt (e.g. all-linear)")
        if self.sampler == "eptree" and self.estimator in ("gigpo", "tree_gigpo"):
            raise ValueError(
                f"{self.estimator} groups agent steps and eptree's nodes are token segments: "
                "use sampler=tree or chain, or advantage=treerl"
            )
        if self.budget_tokens is not None:
            from treegrpo.rollout.token_budget import parse_budget_tokens

            parse_budget_tokens(self.budget_tokens)  # a bad value: one line naming the forms
            if self.sampler != "tree" or self.n < 1:
                raise ValueError("budget_tokens needs --sampler tree with N >= 1 (picks per tree per round)")
        elif self.sampler in ("tree", "eptree") and self.n * self.l == 0 and self.m < 2:
            raise ValueError(
                "a tree with N·L = 0 and M = 1 has one trajectory per prompt: no group to compare"
            )
        return self

    @field_validator("max_step_tokens", "max_context_tokens")
    @classmethod
    def _limit(cls, v: int | str, info: Any) -> int | str:
        least = 16 if info.field_name == "max_context_tokens" else 1
        if isinstance(v, int) and v < least:
            raise ValueError(f"must be >= {least} or auto")
        return v

    @field_validator("logprob_chunk_tokens")
    @classmethod
    def _chunk_size(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 0:
            raise ValueError("must be >= 1, 0 (off) or auto")
        return v

    # -- derived -----------------------------------------------------------------------------------
    @property
    def estimator(self) -> str:
        if self.advantage != "auto":
            return self.advantage
        return {"tree": "tree_grpo", "eptree": "treerl"}.get(self.sampler, "grpo")

    def trajectories_per_prompt(self) -> int:
        if self.sampler == "eptree":
            return self.m * (1 + self.n * self.l * self.t)
        return self.group_size if self.sampler == "chain" else self.m * (1 + self.n * self.l)


def field_names() -> list[str]:
    """Every name a config accepts: the fields and their aliases (``ts_m``, ``gigpo.mode`` …)."""
    names = list(TrainConfig.model_fields)
    for f in TrainConfig.model_fields.values():
        alias = f.validation_alias
        names += [a for a in getattr(alias, "choices", ()) if isinstance(a, str) and a not in names]
    return names


def _one_line(err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "config"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            close = difflib.get_close_matches(loc, field_names(), n=1, cutoff=0.6)
            msg = f"no such setting (did you mean {close[0]}?)" if close else "no such setting (treegrpo train --help lists them)"
        parts.append(f"{loc}: {msg}" if e["loc"] else msg)
    return "invalid config — " + "; ".join(parts)


def make_config(base: dict[str, Any] | None = None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """Validate ``base`` (e.g. from YAML) with ``overrides`` (from the CLI) on top."""
    data = {**(base or {}), **{k: v for k, v in (overrides or {}).items() if v is not None}}
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_one_line(e)) from None


def load_config(path: str | Path | None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """Read a YAML config (or none) and apply CLI overrides."""
    base: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {p} is not UTF-8 text (byte {e.start}); save it as UTF-8") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p} is not valid YAML: {_one_line_yaml(e)}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {p} must hold a mapping of field: value")
        base = {k.replace("-", "_"): v for k, v in loaded.items()}
    return make_config(base, overrides)


def _one_line_yaml(err: yaml.YAMLError) -> str:
    mark = getattr(err, "problem_mark", None)
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    return f"{getattr(err, 'problem', None) or err}{where}".replace("\n", " ")


#: TrainConfig fields whose value is a mapping (``--set`` keeps a YAML mapping for these).
_MAPPING_FIELDS = frozenset(k for k, f in TrainConfig.model_fields.items() if getattr(f.annotation, "__origin__", f.annotation) is dict)


def parse_set(pairs: list[str]) -> dict[str, Any]:
    """``--set key=value`` pairs. A value is read as a YAML scalar (``3``, ``true``, ``1e-4``,
    ``null``, ``[a, b]``); a mapping or text YAML rejects (``Q: {question}``, ``a: b``) is taken
    as the literal string, so a prompt template needs no quoting — except for a field that is a
    mapping (``engine_options={max_batch_size: 64}``), which keeps it."""
    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"--set {pair!r}: expected key=value")
        k, v = pair.split("=", 1)
        try:
            value = yaml.safe_load(v)
        except yaml.YAMLError:
            value = v
        if isinstance(value, dict) and k.strip().replace("-", "_") not in _MAPPING_FIELDS:
            value = v
        out[k.strip().replace("-", "_")] = value
    return out
