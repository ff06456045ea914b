"""The TRL rows of ``bench peers``: ``trl.GRPOTrainer`` on the single-turn and the multi-turn job,
measured step by step (:func:`trl_row`, which dispatches on ``task["job"]``; one code path, the job
switch is :func:`job_setup`).

The peer gets its best CPU settings (:func:`trl_args`): the whole step's ``prompts x G``
completions generated in one ``generate`` call and trained in one forward/backward
(``per_device_train_batch_size`` = the generation batch, no accumulation, one optimizer step per
generation), float32 (``bf16=False``), gradient checkpointing on (its default, as treegrpo's for a
real model), no Liger kernel, no vLLM (none on this CPU), no dataloader workers or pinned memory,
no logging to a service, no checkpoints, no per-step cache emptying (a CPU has no allocator cache).
The settings that make it the same job: ``num_generations=G``, T=1 (top-p 1, top-k off),
``beta=0``, ``loss_type`` as :data:`~treegrpo.benchmarks.peers.LOSS_PAIRS`, a constant lr,
``shuffle_dataset=False`` over the prompts laid out in the order treegrpo draws them, the same seed;
the agent limits are treegrpo's as its run resolves them (``treegrpo.training.setup.agent_config``).

``single_turn`` and ``long_completion`` (one turn each): ``max_completion_length`` = the token cap
(``max_step_tokens``); the reward is the search env's own scoring of the completion's first action
(``env.step``).

``multi_turn`` (``protocol="tools"``, the model's own tool calling; the model folder's chat template,
``chatml-tools`` for SmolLM2, as a ``--protocol tools`` warm-up saves it):
``GRPOTrainer(tools=[search])`` where ``search`` is the treegrpo env's own tool function
(:func:`~treegrpo.tasks.datafile.search_tool` of the env's retriever, taken from the env: same name,
docstring, schema and result text); the reward is the env's own reward functions
(``env.rewards.score``) on TRL's completion messages, the task found by the dataset's ``task_id``;
``max_tool_calling_iterations`` = ``max_turns`` (at most ``max_turns`` tool rounds and
``max_turns + 1`` assistant turns on both sides); ``max_completion_length`` = ``max_context_tokens``
minus the shortest prompt of the job (as TRL tokenizes it): a treegrpo trajectory never holds more
than ``max_context_tokens`` tokens, prompt included, so its completion (generated tokens + tool
results) never passes that, and TRL's budget never binds before treegrpo's limits would. What still
differs: :data:`~treegrpo.benchmarks.peers_differences.TRL_TOOLS_DIFFERENCES`.

Timing: a :class:`~transformers.TrainerCallback` clocks each step (``on_step_begin`` to
``on_step_end``, wall and process CPU seconds); a wrapper clocks ``_generate_and_score_completions``
(generation and tool calls, reward, advantages: the rollout) and records what it produced; update =
step - rollout. Per step: ``generated_tokens`` are the model's own tokens up to and including EOS
(``completion_mask``, and ``tool_mask`` in the multi-turn row: tool results excluded),
``completion_tokens`` all completion tokens (tool results included), ``trained_tokens`` the non-pad
prompt + completion tokens of the batch (every prompt G times), ``computed_tokens`` =
``update_positions`` the padded ``B x T`` of the training forward, ``completion_len_mean`` /
``completion_len_max`` the model's own tokens per trajectory, ``tool_calls`` the calls TRL made
(its ``tools/call_frequency`` x B: every call it attempted, failed ones included).

Generation phases (a wrapper around the model's ``generate``, every call of the step summed): TRL's
tool loop calls ``generate`` again after each tool round with the whole context of every trajectory
that called a tool (prompt + completion so far + results, left-padded; no KV kept between calls), so
``prefill_positions`` = rows x padded input length, ``decode_steps`` = the new tokens of each call's
output (its longest row: the first comes from the prefill's logits, each further one from one
batched decode forward), ``decode_positions`` = rows x new tokens (finished rows are carried to the
end of the call); ``generate_calls`` the calls.

Two probes record, on the installed versions, what the ``differences`` say: ``stop_strings`` (does
``generate`` as TRL calls it accept stop strings?) and ``tools`` (does ``GRPOTrainer`` accept
``tools=[search]`` with this model's chat template? the multi-turn row: it did, it ran).
"""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from treegrpo.benchmarks.peers_differences import TRL_TOOLS_DIFFERENCES
from treegrpo.benchmarks.peers_trl_probes import probe_lm_head, probe_stop_strings, probe_tools
from treegrpo.envs.base import Task
from treegrpo.errors import ConfigError
from treegrpo.models.loader import MARKER_FILE
from treegrpo.rollout.agent import AgentConfig
from treegrpo.tasks.datafile import search_env, split_tasks
from treegrpo.training.config import TrainConfig
from treegrpo.training.metrics import peak_rss_gb
from treegrpo.training.setup import _warmup_agent, agent_config

#: The jobs a TRL row runs (``task["job"]``).
TRL_JOBS: tuple[str, ...] = ("single_turn", "multi_turn", "long_completion")


def trl_args(
    cfg: TrainConfig,
    loss_type: str,
    out_dir: Path,
    generation_batch: int,
    max_completion_length: int | None = None,
    max_tool_calling_iterations: int | None = None,
) -> Any:
    """The ``GRPOConfig`` of the row (see the module docstring). ``max_completion_length``:
    ``cfg.max_step_tokens`` unless given (the multi-turn row's completion budget)."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(out_dir), max_steps=cfg.steps, seed=cfg.seed, data_seed=cfg.seed,
        per_device_train_batch_size=generation_batch, gradient_accumulation_steps=1, num_iterations=1,
        num_generations=cfg.group_size,
        max_completion_length=cfg.max_step_tokens if max_completion_length is None else max_completion_length,
        max_tool_calling_iterations=max_tool_calling_iterations,
        temperature=cfg.temperature, top_p=cfg.top_p, top_k=0,
        learning_rate=float(cfg.lr), lr_scheduler_type="constant", warmup_steps=0, weight_decay=cfg.weight_decay,
        max_grad_norm=cfg.grad_clip, beta=cfg.kl_coef, loss_type=loss_type,
        scale_rewards="group" if cfg.adv_scale == "std" else "none",
        epsilon=cfg.clip_ratio_low, epsilon_high=cfg.clip_ratio_high, mask_truncated_completions=False,
        shuffle_dataset=False, use_cpu=cfg.device == "cpu", bf16=False, fp16=False,
        gradient_checkpointing=cfg.gradient_checkpointing is True, gradient_checkpointing_kwargs={"use_reentrant": False},
        use_liger_kernel=False, torch_empty_cache_steps=None, dataloader_num_workers=0, dataloader_pin_memory=False,
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, log_completions=False,
        remove_unused_columns=False,
    )  # fmt: skip


@dataclass
class _Phases:
    """What the current rollout's ``generate`` calls computed, and the tool calls TRL made."""

    generate_calls: int = 0
    prefill_positions: int = 0
    decode_steps: int = 0
    decode_positions: int = 0
    tool_calls: int = 0
    over_obs_cap: int = 0


class _Clock:
    """Per-step wall and CPU seconds of the trainer (callback) and of its rollout (wrapper), and
    what each rollout computed (generation phases, tokens, tool calls)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.rollouts: list[dict[str, Any]] = []
        self._t: tuple[float, float] = (0.0, 0.0)
        self.now = _Phases()

    def begin(self) -> None:
        self._t = (time.perf_counter(), time.process_time())

    def end(self) -> None:
        w, c = self._t
        self.steps.append({"wall": time.perf_counter() - w, "cpu": time.process_time() - c})

    def count_generate(self, generate: Callable[..., Any]) -> Callable[..., Any]:
        """``generate`` (the model's), counting each call's prefill and decode work into :attr:`now`."""

        def counted(*args: Any, **kwargs: Any) -> Any:
            out = generate(*args, **kwargs)
            ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
            seqs = out if isinstance(out, torch.Tensor) else out.sequences
            rows, width = int(ids.size(0)), int(ids.size(1))
            new = int(seqs.size(1)) - width
            self.now.generate_calls += 1
            self.now.prefill_positions += rows * width
            self.now.decode_steps += new
            self.now.decode_positions += rows * new
            return out

        return counted

    def count_turns(
        self, fn: Callable[[Any], Any], tools_of: Callable[[Any], tuple[int, int]]
    ) -> Callable[[Any], Any]:
        """TRL's ``_generate`` (generation and the tool loop), recording ``tools_of(its output)``:
        the tool calls made and the results longer than treegrpo's ``max_obs_tokens``."""

        def counted(prompts: Any) -> Any:
            out = fn(prompts)
            self.now.tool_calls, self.now.over_obs_cap = tools_of(out)
            return out

        return counted

    def wrap(self, fn: Callable[[Any], dict[str, Any]], group: int) -> Callable[[Any], dict[str, Any]]:
        def timed(inputs: Any) -> dict[str, Any]:
            self.now = _Phases()
            w, c = time.perf_counter(), time.process_time()
            out = fn(inputs)
            cpu, wall = time.process_time() - c, time.perf_counter() - w
            pm, cm = out["prompt_mask"], out["completion_mask"]
            tm = out.get("tool_mask")
            own = cm if tm is None else cm * tm  # the model's own tokens: tool results excluded
            per = own.sum(dim=1)
            prompts = [out["prompt_ids"][i][pm[i].bool()].tolist() for i in range(0, pm.size(0), group)]
            self.rollouts.append({
                "wall": wall, "cpu": cpu, "generated": int(per.sum()), "completion_tokens": int(cm.sum()),
                "trained": int(pm.sum() + cm.sum()), "positions": int(pm.numel() + cm.numel()),
                "completions": int(cm.size(0)), "prompts": prompts,
                "len_mean": float(per.float().mean()), "len_max": int(per.max()), **asdict(self.now),
                "groups_same": all(
                    out["prompt_ids"][i][pm[i].bool()].tolist() == prompts[i // group] for i in range(pm.size(0))
                ),
            })  # fmt: skip
            return out

        return timed


@dataclass
class JobSetup:
    """What the TRL row of one job runs (:func:`job_setup`); the rest of the row is one code path.

    Attributes:
        env: the treegrpo env of the job (its prompts, tool and rewards).
        tools: ``GRPOTrainer(tools=...)``: none (single-turn) or the env's own tool functions.
        reward: the reward function TRL calls (the env's own scoring); appends each call's mean to
            ``reward_means``.
        max_completion_length / max_tool_calling_iterations: TRL's budget and tool rounds.
        agent: treegrpo's agent limits of the job, as its run resolves them.
        settings: what the row records about the job's settings (``settings.trl_tools``).
    """

    env: Any
    tools: list[Callable[..., Any]]
    reward: Callable[..., list[float]]
    max_completion_length: int
    max_tool_calling_iterations: int | None
    agent: AgentConfig
    settings: dict[str, Any] = field(default_factory=dict)
    reward_means: list[float] = field(default_factory=list)


def agent_limits(cfg: TrainConfig, max_positions: int | None) -> AgentConfig:
    """treegrpo's agent limits for ``cfg`` as its run resolves them (set fields, else the model
    folder's warm-up record, else the defaults; the context capped by the model's positions)."""
    folder = Path(cfg.model or "")
    return agent_config(cfg, _warmup_agent(folder), max_positions, tiny=(folder / MARKER_FILE).is_file())


def prompt_messages(env: Any, task: Task) -> list[dict[str, Any]]:
    """The chat messages of a question's prompt (both sides: the env's prompt as the user turn)."""
    return [{"role": "user", "content": env.prompt(task)}]


def job_setup(
    job: str,
    cfg: TrainConfig,
    tok: Any,
    tasks: dict[str, Task],
    order: Sequence[Sequence[str]],
    agent: AgentConfig,
) -> JobSetup:
    """The job switch of :func:`trl_row` (module docstring): the env, tools, reward, budget and
    tool rounds of ``single_turn`` / ``long_completion`` (one turn) or ``multi_turn``."""
    if job in ("single_turn", "long_completion"):
        env = search_env(cfg, tiny=False)
        setup = JobSetup(env, [], _single_turn_reward(env, tasks), agent.max_step_tokens, None, agent)
    elif job == "multi_turn":
        if cfg.protocol != "tools":
            raise ConfigError(
                "the multi-turn TRL row runs the model's own tool calling: its config needs protocol=tools"
            )
        env = search_env(cfg, tiny=False, tokenizer=tok)  # a ToolEnv over search_tool(retriever, cfg.topk)
        tools = list(env.tools)  # the env's own function: TRL's schema, call and result text are treegrpo's
        lengths = [
            len(tok.apply_chat_template(prompt_messages(env, tasks[i]), tools=tools, add_generation_prompt=True,
                                        tokenize=True, return_dict=False))
            for step in order for i in step
        ]  # fmt: skip
        budget = max(agent.max_step_tokens, agent.max_context_tokens - min(lengths))
        setup = JobSetup(env, tools, _env_reward(env, tasks), budget, agent.max_turns, agent)
        setup.settings = {
            "agent_limits": {k: getattr(agent, k) for k in ("max_turns", "max_step_tokens", "max_obs_tokens", "max_context_tokens")},
            "max_completion_length": budget,
            "max_completion_length_rule": "max_context_tokens - shortest prompt (tokens), at least max_step_tokens",
            "shortest_prompt_tokens": min(lengths),
            "longest_prompt_tokens": max(lengths),
            "max_tool_calling_iterations": agent.max_turns,
        }  # fmt: skip
    else:
        raise ConfigError(f"bench peers: a TRL row runs {' or '.join(TRL_JOBS)}, not {job!r}")
    means = setup.reward_means
    inner = setup.reward

    def recorded(**kwargs: Any) -> list[float]:
        got = inner(**kwargs)
        means.append(sum(got) / max(1, len(got)))
        return got

    recorded.__name__ = inner.__name__  # TRL logs a reward by its function's name
    setup.reward = recorded
    return setup


def _single_turn_reward(env: Any, tasks: dict[str, Task]) -> Callable[..., list[float]]:
    def em_reward(completions: list[Any], task_id: list[str], **_: Any) -> list[float]:
        """The env's own scoring of a single-turn step (its first action; a search is refused: 0)."""
        texts = [c[-1]["content"] if isinstance(c, list) else str(c) for c in completions]
        outs = env.step([tasks[i] for i in task_id], texts, [False] * len(texts))
        return [float(o.reward or 0.0) for o in outs]

    return em_reward


def _env_reward(env: Any, tasks: dict[str, Task]) -> Callable[..., list[float]]:
    def env_reward(completions: list[Any], task_id: list[str], **_: Any) -> list[float]:
        """The env's own reward functions on TRL's completion messages (as ``ToolEnv`` scores a
        trajectory: the prompt as the user message, the task's answers and columns)."""
        chosen = [tasks[i] for i in task_id]
        prompts = [prompt_messages(env, t) for t in chosen]
        return [total for total, _ in env.rewards.score(chosen, prompts, completions)]

    return env_reward


def _tokenizer(cfg: TrainConfig) -> Any:
    """The model folder's tokenizer with the run's chat template (``cfg.chat_template``, as
    treegrpo's run sets it; default: the folder's own)."""
    from transformers import AutoTokenizer

    from treegrpo.rollout.templates import set_chat_template

    tok = AutoTokenizer.from_pretrained(cfg.model)
    if cfg.chat_template:
        set_chat_template(tok, cfg.chat_template)
    return tok


def _tools_counter(trainer: Any, tok: Any, obs_cap: int) -> Callable[[Any], tuple[int, int]]:
    """From ``_generate``'s output: the tool calls TRL made (``tools/call_frequency`` x B, the
    metric it appends in that call) and the tool results longer than ``obs_cap`` tokens."""

    def tools_of(out: Any) -> tuple[int, int]:
        if not trainer.tools:
            return 0, 0
        batch, completions = len(out[0]), out[3]
        calls = round(trainer._metrics["train"]["tools/call_frequency"][-1] * batch)
        results = [
            m["content"] for c in completions for m in c if isinstance(m, dict) and m.get("role") == "tool"
        ]
        over = sum(len(tok.encode(str(r), add_special_tokens=False)) > obs_cap for r in results)
        return calls, over

    return tools_of


def trl_row(
    task: dict[str, Any],
    evaluate_model: Callable[[TrainConfig], dict[str, float]],
    common_settings: Callable[[TrainConfig], dict[str, Any]],
) -> dict[str, Any]:
    """Train with ``GRPOTrainer`` on the job ``task["job"]`` (one of :data:`TRL_JOBS`;
    default single-turn) of ``task["config"]`` in ``task["order"]`` with ``task["trl_loss"]``, save
    the model into ``task["out"]/model``, evaluate it with ``evaluate_model`` (treegrpo's
    evaluation); the row's record (per-step lists, the evaluation before and after, the settings)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from transformers.utils import get_json_schema
    from trl import GRPOTrainer
    from trl.chat_template_utils import supports_tool_calling

    from treegrpo.rollout.templates import builtin_name
    from treegrpo.rollout.toolcall import end_of_turn_ids

    job = task.get("job", "single_turn")
    cfg = TrainConfig(**task["config"])
    out = Path(task["out"])
    tasks = {t.id: t for t in split_tasks(cfg)[0]}
    order: list[list[str]] = task["order"]
    model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32, attn_implementation="sdpa")
    tok = _tokenizer(cfg)
    agent = agent_limits(cfg, getattr(model.config, "max_position_embeddings", None))
    setup = job_setup(job, cfg, tok, tasks, order, agent)
    dataset = Dataset.from_list(
        [{"prompt": prompt_messages(setup.env, tasks[i]), "task_id": i} for step in order for i in step]
    )
    batch = len(order[0]) * cfg.group_size
    args = trl_args(
        cfg,
        task["trl_loss"],
        out / "trl",
        batch,
        setup.max_completion_length,
        setup.max_tool_calling_iterations,
    )
    clock = _Clock()

    class StepClock(TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            clock.begin()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            clock.end()

    stop_probe = probe_stop_strings(model)
    trainer = GRPOTrainer(model=model, reward_funcs=[setup.reward], args=args, train_dataset=dataset,
                          processing_class=tok, callbacks=[StepClock()], tools=setup.tools or None)  # fmt: skip
    counted, tools_of = (
        clock.count_generate(model.generate),
        _tools_counter(trainer, tok, agent.max_obs_tokens),
    )
    model.generate = counted  # type: ignore[method-assign]
    trainer._generate = clock.count_turns(trainer._generate, tools_of)  # type: ignore[method-assign]
    timed = clock.wrap(trainer._generate_and_score_completions, cfg.group_size)
    trainer._generate_and_score_completions = timed  # type: ignore[method-assign]
    if setup.tools:
        setup.settings |= {
            "stop_ids": {"trl": list(trainer.eos_token_ids), "treegrpo": sorted(end_of_turn_ids(tok))},
            "chat_template": builtin_name(tok.chat_template) or "the model folder's own",
            "template_replaced_by_trl": trainer.chat_template is not None,
            "tool_schemas_same": [get_json_schema(f) for f in setup.tools] == setup.env.tool_schemas,
        }
    trainer.train()
    peak_train = peak_rss_gb()  # the high-water mark of training, before the probes and the evaluation
    trainer.save_model(str(out / "model"))
    dumped = json.loads(json.dumps(trainer.args.to_dict(), default=str))
    del trainer
    gc.collect()
    if setup.tools:  # the row itself is the probe: GRPOTrainer took tools=[search] and ran them
        tools_probe = {"error": None, "supports_tool_calling": bool(supports_tool_calling(tok))}
    else:
        tools_probe = probe_tools(model, tok, args, dataset, setup.env.retriever, cfg.topk)
    del model
    gc.collect()
    eval_after = evaluate_model(TrainConfig(**{**task["config"], "model": str(out / "model")}))
    steps, rolls = clock.steps, clock.rollouts
    return {
        "steps": len(steps),
        "step_wall_s": [s["wall"] for s in steps],
        "rollout_wall_s": [r["wall"] for r in rolls],
        "update_wall_s": [s["wall"] - r["wall"] for s, r in zip(steps, rolls, strict=True)],
        "rollout_cpu_s": [r["cpu"] for r in rolls],
        "update_cpu_s": [s["cpu"] - r["cpu"] for s, r in zip(steps, rolls, strict=True)],
        "generated_tokens": [r["generated"] for r in rolls],
        "trained_tokens": [r["trained"] for r in rolls],
        "computed_tokens": [r["positions"] for r in rolls],
        "trajectories": [r["completions"] for r in rolls],
        "tool_calls": [r["tool_calls"] for r in rolls],
        "completion_tokens": [r["completion_tokens"] for r in rolls],
        "completion_len_mean": [r["len_mean"] for r in rolls],
        "completion_len_max": [r["len_max"] for r in rolls],
        "generate_calls": [r["generate_calls"] for r in rolls],
        "prefill_positions": [r["prefill_positions"] for r in rolls],
        "decode_steps": [r["decode_steps"] for r in rolls],
        "decode_positions": [r["decode_positions"] for r in rolls],
        "update_positions": [r["positions"] for r in rolls],
        "tool_results_over_obs_cap": [r["over_obs_cap"] for r in rolls],
        "reward_mean": setup.reward_means,
        "peak_rss_gb": peak_train,
        "eval_before": task["eval_start"],
        "eval_after": eval_after,
        "em_before": task["eval_start"]["eval/success_greedy"],
        "em_after": eval_after["eval/success_greedy"],
        "prompts_seen": [
            [{"id": i, "ids": ids} for i, ids in zip(step, r["prompts"], strict=True)]
            for step, r in zip(order, rolls, strict=True)
        ],
        "groups_same_prompt": all(r["groups_same"] for r in rolls),
        "settings": {
            **common_settings(cfg),
            "model_dir": cfg.model,
            "group_size": dumped["num_generations"],
            "max_new_tokens": dumped["max_completion_length"],
            "lr": dumped["learning_rate"],
            "loss": dumped["loss_type"],
            "seed": dumped["seed"],
            "prompt_ids": [list(step) for step in order],
            "trl_config": dumped,
            **({"trl_tools": setup.settings} if setup.tools else {}),
            "probes": {
                "stop_strings": stop_probe,
                "tools": tools_probe,
                "lm_head": probe_lm_head(cfg.device),
            },
        },
    }


__all__ = [
    "TRL_JOBS",
    "TRL_TOOLS_DIFFERENCES",
    "JobSetup",
    "agent_limits",
    "job_setup",
    "trl_args",
    "trl_row",
]
