"""The TRL row of ``bench peers``: ``trl.GRPOTrainer`` on the single-turn job, measured step by step.

The peer gets its best CPU settings (:func:`trl_args`): the whole step's ``prompts x G``
completions generated in one ``generate`` call and trained in one forward/backward
(``per_device_train_batch_size`` = the generation batch, no accumulation, one optimizer step per
generation), float32 (``bf16=False``), gradient checkpointing on (its default, as treegrpo's for a
real model), no Liger kernel, no vLLM (none on this CPU), no dataloader workers or pinned memory,
no logging to a service, no checkpoints, no per-step cache emptying (a CPU has no allocator cache).
The settings that make it the same job: ``num_generations=G``, ``max_completion_length`` = the
token cap, T=1 (top-p 1, top-k off), ``beta=0``, ``loss_type`` as
:data:`~treegrpo.benchmarks.peers.LOSS_PAIRS`, a constant lr, ``shuffle_dataset=False`` over the
prompts laid out in the order treegrpo draws them, the same seed.

Timing: a :class:`~transformers.TrainerCallback` clocks each step (``on_step_begin`` to
``on_step_end``, wall and process CPU seconds); a wrapper clocks ``_generate_and_score_completions``
(generation, reward, advantages: the rollout) and records what it produced (prompt and completion
tokens, padded positions); update = step - rollout. Generated tokens are TRL's completion tokens
up to and including EOS (``completion_mask``); trained tokens are the non-pad prompt + completion
tokens of the batch (every prompt G times), trained positions the padded ``B x T``.

Two probes record, on the installed versions, what the ``differences`` say: ``stop_strings`` (does
``generate`` as TRL calls it accept stop strings?) and ``tools`` (does ``GRPOTrainer`` accept
``tools=[search]`` with this model's chat template?).
"""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from treegrpo.tasks.datafile import search_env, split_tasks
from treegrpo.training.config import TrainConfig
from treegrpo.training.metrics import peak_rss_gb


def trl_args(cfg: TrainConfig, loss_type: str, out_dir: Path, generation_batch: int) -> Any:
    """The ``GRPOConfig`` of the row (see the module docstring)."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(out_dir), max_steps=cfg.steps, seed=cfg.seed, data_seed=cfg.seed,
        per_device_train_batch_size=generation_batch, gradient_accumulation_steps=1, num_iterations=1,
        num_generations=cfg.group_size, max_completion_length=cfg.max_step_tokens,
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


class _Clock:
    """Per-step wall and CPU seconds of the trainer (callback) and of its rollout (wrapper)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.rollouts: list[dict[str, Any]] = []
        self._t: tuple[float, float] = (0.0, 0.0)

    def begin(self) -> None:
        self._t = (time.perf_counter(), time.process_time())

    def end(self) -> None:
        w, c = self._t
        self.steps.append({"wall": time.perf_counter() - w, "cpu": time.process_time() - c})

    def wrap(self, fn: Callable[[Any], dict[str, Any]], group: int) -> Callable[[Any], dict[str, Any]]:
        def timed(inputs: Any) -> dict[str, Any]:
            w, c = time.perf_counter(), time.process_time()
            out = fn(inputs)
            cpu, wall = time.process_time() - c, time.perf_counter() - w
            pm, cm = out["prompt_mask"], out["completion_mask"]
            prompts = [out["prompt_ids"][i][pm[i].bool()].tolist() for i in range(0, pm.size(0), group)]
            self.rollouts.append({
                "wall": wall, "cpu": cpu, "generated": int(cm.sum()), "trained": int(pm.sum() + cm.sum()),
                "positions": int(pm.numel() + cm.numel()), "completions": int(cm.size(0)), "prompts": prompts,
                "groups_same": all(
                    out["prompt_ids"][i][pm[i].bool()].tolist() == prompts[i // group] for i in range(pm.size(0))
                ),
            })  # fmt: skip
            return out

        return timed


def probe_stop_strings(model: Any) -> dict[str, Any]:
    """Whether ``generate`` as TRL 1.16 calls it (a ``GenerationConfig``, no ``tokenizer=``)
    accepts stop strings: ``{"error": None}`` or the error it raised."""
    from transformers import GenerationConfig

    try:
        with torch.no_grad():
            ids = torch.tensor([[int(model.config.bos_token_id or 0)]])
            model.generate(
                input_ids=ids,
                generation_config=GenerationConfig(max_new_tokens=1, stop_strings=["</answer>"]),
            )
        return {"error": None}
    except (ValueError, TypeError) as e:
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}


def probe_lm_head(device: str) -> dict[str, Any]:
    """How TRL's fused LM head scores the update's positions on ``device``: only the completion
    positions (``compact``: where Triton runs, CUDA/XPU) or every prompt and completion position,
    in chunks of ``chunk_positions`` (trl/trainer/utils.py ``add_fused_lm_head``)."""
    from trl.kernels.chunked_logprob import _use_triton
    from trl.trainer import utils

    return {
        "compact": bool(_use_triton(torch.device(device))),
        "chunk_positions": utils._CHUNKED_LOGPROB_CHUNK_SIZE,
    }


def probe_tools(model: Any, tok: Any, args: Any, dataset: Any, retriever: Any, topk: int) -> dict[str, Any]:
    """Whether ``GRPOTrainer`` accepts ``tools=[search]`` (our retriever as the tool) with this
    model's chat template: ``{"error": None | str, "supports_tool_calling": bool}``."""
    from trl import GRPOTrainer
    from trl.chat_template_utils import supports_tool_calling

    from treegrpo.retrieval.base import format_passages

    def search(query: str) -> str:
        """Search Wikipedia for passages about a query.

        Args:
            query: what to search for.

        Returns:
            The top passages, one per line.
        """
        return format_passages(retriever.retrieve([query], topk)[0])

    try:
        GRPOTrainer(model=model, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)], args=args,
                    train_dataset=dataset, processing_class=tok, tools=[search])  # fmt: skip
        error = None
    except (ValueError, TypeError, ImportError) as e:
        error = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return {"error": error, "supports_tool_calling": bool(supports_tool_calling(tok))}


def trl_row(
    task: dict[str, Any],
    evaluate_model: Callable[[TrainConfig], dict[str, float]],
    common_settings: Callable[[TrainConfig], dict[str, Any]],
) -> dict[str, Any]:
    """Train with ``GRPOTrainer`` on the job of ``task["config"]`` in ``task["order"]``, save the
    model, evaluate it with ``evaluate_model`` (treegrpo's evaluation); the row's record."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    cfg = TrainConfig(**task["config"])
    out = Path(task["out"])
    tasks = {t.id: t for t in split_tasks(cfg)[0]}
    env = search_env(cfg, tiny=False)
    order: list[list[str]] = task["order"]
    rows = [
        {"prompt": [{"role": "user", "content": env.prompt(tasks[i])}], "task_id": i}
        for step in order
        for i in step
    ]
    dataset = Dataset.from_list(rows)
    rewards: list[float] = []

    def em_reward(completions: list[Any], task_id: list[str], **_: Any) -> list[float]:
        """The env's own scoring of a single-turn step (its first action; a search is refused: 0)."""
        texts = [c[-1]["content"] if isinstance(c, list) else str(c) for c in completions]
        outs = env.step([tasks[i] for i in task_id], texts, [False] * len(texts))
        got = [float(o.reward or 0.0) for o in outs]
        rewards.append(sum(got) / max(1, len(got)))
        return got

    model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32, attn_implementation="sdpa")
    tok = AutoTokenizer.from_pretrained(cfg.model)
    batch = len(order[0]) * cfg.group_size
    args = trl_args(cfg, task["trl_loss"], out / "trl", batch)
    clock = _Clock()

    class StepClock(TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            clock.begin()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            clock.end()

    stop_probe = probe_stop_strings(model)
    trainer = GRPOTrainer(model=model, reward_funcs=[em_reward], args=args, train_dataset=dataset,
                          processing_class=tok, callbacks=[StepClock()])  # fmt: skip
    timed = clock.wrap(trainer._generate_and_score_completions, cfg.group_size)
    trainer._generate_and_score_completions = timed  # type: ignore[method-assign]
    trainer.train()
    peak_train = peak_rss_gb()  # the high-water mark of training, before the probes and the evaluation
    trainer.save_model(str(out / "model"))
    dumped = json.loads(json.dumps(trainer.args.to_dict(), default=str))
    del trainer
    gc.collect()
    tools_probe = probe_tools(model, tok, args, dataset, env.retriever, cfg.topk)
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
        "tool_calls": [0 for _ in rolls],
        "reward_mean": rewards,
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
            "probes": {
                "stop_strings": stop_probe,
                "tools": tools_probe,
                "lm_head": probe_lm_head(cfg.device),
            },
        },
    }
