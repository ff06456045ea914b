"""``treegrpo bench peers``: TRL's ``GRPOTrainer`` and treegrpo on the same job, side by side
(what is the same on both sides and what differs: docs/benchmarks.md, and :mod:`treegrpo.benchmarks.peers_differences`).

The jobs: ``single_turn`` (the question with its top-``topk`` BM25 passages in the prompt,
:data:`SINGLE_TURN_PROMPT`, written once to ``work/job/`` with the job's warm-up demonstrations;
treegrpo runs it as the data-file task with ``max_turns=0``), ``long_completion`` (opt-in, not in
:data:`DEFAULT_JOBS`: the question alone with :data:`LONG_COMPLETION_PROMPT`, which asks for long
step-by-step reasoning before the answer: short prompts, completions up to the token cap, one turn;
the regime where prefix sharing and packing help least; run like ``single_turn``) and ``multi_turn`` (the search agent
in the model's own tool-call protocol: TRL's ``GRPOTrainer(tools=[search])`` and treegrpo's
``protocol: tools`` over the same ``search`` function, chat template and starting folder). Each row
of :data:`ROWS` runs in a process of its own (:mod:`treegrpo.benchmarks.peers_rows`) with the same
allocator setting, one at a time, ``repeats`` times interleaved; a row finished with the same
settings is reused from ``work/rows/<row>/repeat_<r>/result.json``. The table
(:mod:`treegrpo.benchmarks.peers_figures`) keeps the per-step lists beside its medians; the docs' text:
:mod:`treegrpo.benchmarks.peers_report`.
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from treegrpo.benchmarks.peers_differences import DIFFERENCES, TRL_TOOLS_DIFFERENCES
from treegrpo.benchmarks.peers_figures import checks, plot, shared_settings, summarize
from treegrpo.benchmarks.provenance import model_hash, provenance
from treegrpo.benchmarks.runner import Log, digest, finished_row, keep_row, run_measured, write_result
from treegrpo.envs.base import Task
from treegrpo.envs.search import information
from treegrpo.errors import ConfigError
from treegrpo.io import atomic_write_text
from treegrpo.models.loader import MARKER_FILE, load_tokenizer, resolve_model_ref
from treegrpo.retrieval.base import format_passages
from treegrpo.retrieval.factory import make_retriever
from treegrpo.rollout.templates import check_tool_template
from treegrpo.tasks.datafile import search_env, search_query, split_tasks
from treegrpo.training.config import TrainConfig
from treegrpo.training.warmup import WARMUP_RECORD

JOBS = ("single_turn", "multi_turn", "long_completion")
#: The jobs a run does unless ``jobs`` says otherwise (``long_completion`` is run on its own: its
#: token cap differs).
DEFAULT_JOBS = ("single_turn", "multi_turn")
#: Jobs of one turn whose questions the bench writes into ``work/job/<job>_{train,eval}.jsonl``
#: (``max_turns=0``, ``prompt_template="{question}"``).
ONE_TURN_JOBS = ("single_turn", "long_completion")
#: Warm-up demonstrations written for the single-turn job (:func:`single_turn_demos`).
DEMOS = 96
DEMO_WINDOW = 400
#: treegrpo ``agg_mode`` -> the TRL ``loss_type`` that computes the same loss (with one optimizer
#: step per generation batch): ``dapo`` (TRL's default) and ``bnpo`` are both the token mean over the
#: batch's completion tokens; ``grpo`` the mean over sequences of their token mean; ``dr_grpo`` the
#: token sum over (sequences x max_completion_length) (tests/algos/test_agg_parity.py).
LOSS_PAIRS = {"token-mean": "dapo", "seq-mean-token-mean": "grpo", "seq-mean-token-sum-norm": "dr_grpo"}
#: The rows: name -> system, job, sampler, the treegrpo TrainConfig fields of the sampler and, for an
#: ablation, the mechanism it turns off (prefix sharing: every context prefilled in full, no KV reuse;
#: packing: every trajectory its own row in the update, its shared prefix trained again).
ROWS: dict[str, dict[str, Any]] = {
    "single_turn/trl": {"system": "trl", "job": "single_turn", "sampler": "chain"},
    "single_turn/chain": {"system": "treegrpo", "job": "single_turn", "sampler": "chain", "fields": {"sampler": "chain"}},
    "single_turn/chain_no_sharing": {"system": "treegrpo", "job": "single_turn", "sampler": "chain", "ablation": "prefix sharing off",
                                     "fields": {"sampler": "chain", "engine_options": {"prefix_reuse": False}}},
    "single_turn/chain_no_packing": {"system": "treegrpo", "job": "single_turn", "sampler": "chain", "ablation": "packing off",
                                     "fields": {"sampler": "chain", "packing": "off"}},
    "multi_turn/trl": {"system": "trl", "job": "multi_turn", "sampler": "chain"},
    "multi_turn/chain": {"system": "treegrpo", "job": "multi_turn", "sampler": "chain", "fields": {"sampler": "chain"}},
    "multi_turn/tree_2_2_1": {"system": "treegrpo", "job": "multi_turn", "sampler": "tree",
                              "fields": {"sampler": "tree", "m": 2, "n": 2, "l": 1}},
    "multi_turn/tree_2_2_1_no_sharing": {"system": "treegrpo", "job": "multi_turn", "sampler": "tree", "ablation": "prefix sharing off",
                                         "fields": {"sampler": "tree", "m": 2, "n": 2, "l": 1, "engine_options": {"prefix_reuse": False}}},
    "multi_turn/tree_2_2_1_no_packing": {"system": "treegrpo", "job": "multi_turn", "sampler": "tree", "ablation": "packing off",
                                         "fields": {"sampler": "tree", "m": 2, "n": 2, "l": 1, "packing": "off"}},
    "long_completion/trl": {"system": "trl", "job": "long_completion", "sampler": "chain"},
    "long_completion/chain": {"system": "treegrpo", "job": "long_completion", "sampler": "chain", "fields": {"sampler": "chain"}},
}  # fmt: skip
SINGLE_TURN_PROMPT = (
    "Answer the given question using the passages below. Give the answer inside <answer> and </answer>, "
    "without detailed illustrations. For example, <answer> Beijing </answer>.\n\n{passages}\n\nQuestion: {question}\n"
)

#: The long-completion job's prompt: the question alone, and an instruction that makes SmolLM2-135M
#: write until the token cap (checked before the bench: 7 of 8 sampled completions ran to 256 tokens).
LONG_COMPLETION_PROMPT = (
    "Write a long, detailed essay of at least 400 words that reasons step by step about the question below: "
    "go through every clue, what it could point to, and why. At the very end, give your final answer inside "
    "<answer> and </answer>.\n\nQuestion: {question}\n"
)


#: TrainConfig fields the bench sets itself (from the spec's own options, or per job and row):
#: ``overrides`` may not set them.
SPEC_OWNED = (
    "model", "corpus", "topk", "eval_prompts", "eval_sampled", "seed", "threads", "tensorboard", "group_size",
    "max_step_tokens", "max_obs_tokens", "max_context_tokens", "temperature", "top_p", "kl_coef", "agg_mode", "lr",
    "steps", "prompts_per_step", "gradient_checkpointing", "mini_batches", "lr_schedule", "lr_warmup_steps", "data",
    "eval_data", "prompt_template", "max_turns", "sampler", "m", "n", "l", "out_dir", "dump_rollouts_every",
    "eval_every", "save_every", "resume", "protocol", "engine_options", "packing",
)  # fmt: skip


@dataclass(frozen=True)
class PeersSpec:
    """What ``bench peers`` runs (every field is recorded in the results).

    Attributes:
        model: the single-turn job's starting folder (or model reference) both sides load: a warm-up
            on the job's own demonstrations (``work/job/single_turn_demos.jsonl``, docs/benchmarks.md),
            which teaches the answer and the end-of-turn token after it.
        tools_model: the multi-turn job's starting folder: a ``--protocol tools`` warm-up, carrying a
            chat template that renders tool calls (``chatml-tools``); default: ``model``.
        data / eval_data / corpus: questions, held-out questions (default: the set's own split) and the
            retriever's corpus (BM25, in process).
        steps: RL steps K of every row. eval_prompts: held-out questions (greedy) before and after.
        repeats: runs of every row, interleaved (every row of repeat 1, then of repeat 2, ...);
            repeat ``r`` runs every row with seed ``seed + r``.
        malloc_mmap_threshold: glibc's ``MALLOC_MMAP_THRESHOLD_`` (bytes) in every row's
            environment, so both sides run on the same allocator setting (0: leave it unset).
        prompts_per_step / group_size: prompts per step and completions per prompt (chain rows, TRL).
        max_new_tokens: the cap on tokens per completion (a treegrpo step; TRL's max_completion_length).
        lr / loss / seed / threads: AdamW lr, treegrpo agg_mode (:data:`LOSS_PAIRS`), seed (prompt
            order, sampling) and torch CPU threads (0: torch's default) of every row.
        topk: passages per search and in the single-turn prompt.
        jobs / rows: which jobs and rows (:data:`ROWS` names) to run.
        max_turns / max_obs_tokens / max_context_tokens: multi-turn agent limits (treegrpo rows).
        overrides: further TrainConfig fields of the treegrpo rows and of every evaluation.
    """

    model: str
    tools_model: str | None = None
    data: str = "wiki-vital-qa"
    eval_data: str | None = None
    corpus: str = "wiki-vital"
    steps: int = 8
    repeats: int = 2
    malloc_mmap_threshold: int = 1 << 20
    eval_prompts: int = 64
    prompts_per_step: int = 2
    group_size: int = 4
    max_new_tokens: int = 48
    lr: float = 1e-5
    loss: str = "token-mean"
    seed: int = 0
    threads: int = 0
    topk: int = 3
    jobs: tuple[str, ...] = DEFAULT_JOBS
    rows: tuple[str, ...] = tuple(ROWS)
    max_turns: int = 4
    max_obs_tokens: int = 600
    max_context_tokens: int = 3072
    overrides: dict[str, Any] = field(default_factory=dict)

    def check(self) -> None:
        """Raise :class:`ConfigError` (one line) on a setting the bench cannot run."""
        if self.loss not in LOSS_PAIRS:
            raise ConfigError(f"--loss {self.loss!r}: choose one TRL also has: {', '.join(LOSS_PAIRS)}")
        if bad := [j for j in self.jobs if j not in JOBS]:
            raise ConfigError(f"--jobs: unknown {bad}; choose from {', '.join(JOBS)}")
        if bad := [r for r in self.rows if r not in ROWS]:
            raise ConfigError(f"--rows: unknown {bad}; choose from {', '.join(ROWS)}")
        if min(self.steps, self.repeats, self.eval_prompts, self.prompts_per_step, self.group_size, self.max_new_tokens) < 1:
            raise ConfigError("--steps, --repeats, --eval-prompts, --prompts-per-step, --group-size and --max-new-tokens must be >= 1")
        if self.malloc_mmap_threshold < 0:
            raise ConfigError("--malloc-mmap-threshold must be >= 0 bytes (0: leave glibc's default)")
        if self.group_size < 2:
            raise ConfigError("--group-size must be >= 2: a group of one has no baseline")
        if not self.lr > 0 or self.threads < 0 or self.max_turns < 1 or self.topk < 1:
            raise ConfigError("--lr must be > 0, --threads >= 0, --max-turns and --topk >= 1")
        if owned := sorted(set(self.overrides) & set(SPEC_OWNED)):
            raise ConfigError(f"--set {', '.join(owned)}: set by the bench itself (use its own options, see --help)")


def _agent_obs_format(folder: Path) -> str | None:
    """The observation format a warm-up folder was taught with (its record), if any."""
    try:
        return json.loads((folder / WARMUP_RECORD).read_text())["agent"]["obs_format"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def job_model(spec: PeersSpec, job: str) -> Path:
    """The starting folder of ``job``: ``tools_model`` (else ``model``) for the multi-turn job."""
    return resolve_model_ref(spec.tools_model or spec.model if job == "multi_turn" else spec.model)


def job_config(spec: PeersSpec, job: str, work: Path, **fields: Any) -> TrainConfig:
    """The treegrpo run config of ``job`` (every agent limit explicit, so a folder's recorded limits
    never differ between rows); ``fields`` on top (sampler, seed, output folder). The multi-turn
    job runs the search tool in the model's own tool-call protocol (``protocol: tools``), the one
    TRL's ``tools=`` speaks."""
    folder = job_model(spec, job)
    common: dict[str, Any] = {
        "model": str(folder), "corpus": spec.corpus, "topk": spec.topk, "eval_prompts": spec.eval_prompts,
        "eval_sampled": False, "seed": spec.seed, "threads": spec.threads, "tensorboard": False,
        "group_size": spec.group_size, "max_step_tokens": spec.max_new_tokens, "max_obs_tokens": spec.max_obs_tokens,
        "max_context_tokens": spec.max_context_tokens, "temperature": 1.0, "top_p": 1.0, "kl_coef": 0.0,
        "agg_mode": spec.loss, "lr": spec.lr, "steps": spec.steps, "prompts_per_step": spec.prompts_per_step,
        "gradient_checkpointing": True, "mini_batches": 1, "lr_schedule": "constant", "lr_warmup_steps": 0,
    }  # fmt: skip
    if job in ONE_TURN_JOBS:
        if (obs := _agent_obs_format(folder)) is not None:
            common["obs_format"] = obs
        common.update(
            data=str(work / "job" / f"{job}_train.jsonl"), eval_data=str(work / "job" / f"{job}_eval.jsonl"),
            prompt_template="{question}", max_turns=0, protocol="tags",  # as recorded before protocol auto
        )  # fmt: skip
    else:
        common.update(data=spec.data, eval_data=spec.eval_data, max_turns=spec.max_turns, protocol="tools")
    return TrainConfig(**{**common, **spec.overrides, **fields})


def prompt_order(train: Sequence[Task], seed: int, steps: int, per_step: int) -> list[list[str]]:
    """The question ids of every step, as the trainer draws them (``RunState.fresh(seed).rng``, one
    ``sample`` per step: ``treegrpo.training.trainer``); the bench's tests check the runs drew these."""
    rng = random.Random(seed)
    return [[t.id for t in rng.sample(list(train), min(per_step, len(train)))] for _ in range(steps)]


def single_turn_tasks(tasks: Sequence[Task], retriever: Any, topk: int) -> list[Task]:
    """``tasks`` with their top-``topk`` passages (the question's search query, one batched call)
    and the answer instruction in the question: :data:`SINGLE_TURN_PROMPT`."""
    hits = retriever.retrieve([search_query(t.question) for t in tasks], topk) if tasks else []
    return [
        Task(t.id, SINGLE_TURN_PROMPT.format(passages=information(format_passages(h)).strip(), question=t.question),
             list(t.answers), t.data_source)
        for t, h in zip(tasks, hits, strict=True)
    ]  # fmt: skip


def long_completion_tasks(tasks: Sequence[Task]) -> list[Task]:
    """``tasks`` with the long-reasoning instruction around the question: :data:`LONG_COMPLETION_PROMPT`."""
    return [Task(t.id, LONG_COMPLETION_PROMPT.format(question=t.question), list(t.answers), t.data_source) for t in tasks]


def _write_jsonl(path: Path, tasks: Sequence[Task]) -> None:
    rows = [json.dumps({"id": t.id, "question": t.question, "answers": t.answers, "data_source": t.data_source}) for t in tasks]
    atomic_write_text(path, "\n".join(rows) + "\n")


def single_turn_demos(tasks: Sequence[Task], n: int, window: int = DEMO_WINDOW) -> list[dict[str, Any]]:
    """Warm-up demonstrations of the single-turn job (``treegrpo warmup --demos``): of the last
    ``window`` questions of ``tasks`` (the training split's end, which a short bench rarely draws),
    the first ``n`` whose passages hold their first answer, answered in one step; the warm-up follows
    each with the end-of-turn token, so the model learns to stop after ``</answer>`` by itself."""
    good = [t for t in tasks[-window:] if t.answers and t.answers[0].lower() in t.question.lower()]
    return [{"id": t.id, "question": t.question, "answers": t.answers, "steps": [f"<answer> {t.answers[0]} </answer>"]}
            for t in good[:n]]  # fmt: skip


def prepare_jobs(spec: PeersSpec, work: Path, log: Log) -> dict[str, Any]:
    """The questions of both jobs, written once into ``work/job`` (the single-turn files with their
    passages, and its warm-up demonstrations), and per job: the prompt order of every repeat and the
    exact chat messages (and tools) of every prompt used."""
    base = job_config(spec, "multi_turn", work)
    train, held_out = split_tasks(base)
    held_out = held_out[: spec.eval_prompts]
    orders = [prompt_order(train, spec.seed + r, spec.steps, spec.prompts_per_step) for r in range(spec.repeats)]
    out: dict[str, Any] = {}
    if "single_turn" in spec.jobs:
        log(f"single-turn job: top-{spec.topk} passages for {len(train)} + {len(held_out)} questions")
        retriever = make_retriever(corpus=spec.corpus)
        single = single_turn_tasks(train, retriever, spec.topk)
        _write_jsonl(work / "job" / "single_turn_train.jsonl", single)
        _write_jsonl(work / "job" / "single_turn_eval.jsonl", single_turn_tasks(held_out, retriever, spec.topk))
        demos = "\n".join(json.dumps(d) for d in single_turn_demos(single, DEMOS))
        atomic_write_text(work / "job" / "single_turn_demos.jsonl", demos + "\n")
    if "long_completion" in spec.jobs:
        log(f"long-completion job: {len(train)} + {len(held_out)} questions, no passages")
        _write_jsonl(work / "job" / "long_completion_train.jsonl", long_completion_tasks(train))
        _write_jsonl(work / "job" / "long_completion_eval.jsonl", long_completion_tasks(held_out))
    for job in spec.jobs:
        cfg = job_config(spec, job, work)
        tok = load_tokenizer(job_model(spec, job))
        if job == "multi_turn":
            try:
                check_tool_template(tok, [])
            except ConfigError as e:
                raise ConfigError(
                    f"{'--tools-model' if spec.tools_model else '--model'} {job_model(spec, job)}: the multi-turn job (TRL's "
                    f"tools=, treegrpo's protocol tools) needs a tool-calling chat template: {e} (warm a folder up with "
                    "`treegrpo warmup --protocol tools --chat-template chatml-tools` and pass it as --tools-model)"
                ) from None
        env = search_env(cfg, tiny=(job_model(spec, job) / MARKER_FILE).is_file(), tokenizer=tok)
        job_train, job_eval = split_tasks(cfg)
        tasks = {t.id: t for t in job_train}
        tools = {"tools": env.chat_tools} if getattr(env, "chat_tools", None) else {}
        out[job] = {
            "orders": orders,
            "prompts": [
                {"repeat": r, "step": s + 1, "id": i, "messages": [{"role": "user", "content": env.prompt(tasks[i])}],
                 **tools, "answers": tasks[i].answers}
                for r, order in enumerate(orders) for s, ids in enumerate(order) for i in ids
            ],
            "eval_questions": len(job_eval[: spec.eval_prompts]),
        }  # fmt: skip
    return out


def prepare_single_turn(spec: PeersSpec, work: Path, log: Log) -> Path:
    """Write the single-turn job's files into ``work/job`` (:func:`prepare_jobs`, the same the bench
    writes with these settings) and log the warm-up command of its starting folder; returns the
    demonstrations file."""
    spec.check()
    prepare_jobs(replace(spec, jobs=("single_turn",)), work, log)
    job = work / "job"
    log(
        f"wrote {job}; warm the single-turn job's starting folder up with:\n  treegrpo warmup --model {spec.model} "
        f"--demos {job / 'single_turn_demos.jsonl'} --data {job / 'single_turn_train.jsonl'} "
        f"--eval-data {job / 'single_turn_eval.jsonl'} --corpus {spec.corpus} --set max_turns=0 "
        f"--set prompt_template='{{question}}' --set max_step_tokens={spec.max_new_tokens} --eval-prompts 32 --out runs/peers-single-warm"
    )
    return job / "single_turn_demos.jsonl"


def run_row(task: dict[str, Any], folder: Path, key: str, log: Log, env: dict[str, str]) -> dict[str, Any]:
    """Run one row (``treegrpo.benchmarks.peers_rows``) in a process of its own with ``env`` set, or
    reuse the one finished in ``folder`` with the same ``key``; returns its record plus peak RSS and wall."""
    done = folder / "result.json"
    if (prev := finished_row(done, key)) is not None:
        log(f"  {task['name']}: reusing {done}")
        return prev
    cmd = [sys.executable, "-c", "from treegrpo.benchmarks.peers_rows import main; main()", json.dumps(task)]
    got = run_measured(cmd, log=folder / "log.txt", env=env)
    if got["rc"] != 0 or not (folder / "row.json").is_file():
        tail = (folder / "log.txt").read_text()[-3000:] if (folder / "log.txt").is_file() else ""
        raise RuntimeError(f"bench peers: row {task['name']} failed (rc {got['rc']}); its log ends:\n{tail}")
    row = {
        **json.loads((folder / "row.json").read_text()),
        "process_peak_rss_gb": got["peak_rss_gb"],  # the whole process, its evaluation included
        "process_wall_s": got["wall_s"],
    }
    keep_row(done, key, row)
    return row


def row_environment(spec: PeersSpec) -> dict[str, str]:
    """The environment every row runs with: the same glibc allocator setting on both sides."""
    return {"MALLOC_MMAP_THRESHOLD_": str(spec.malloc_mmap_threshold)} if spec.malloc_mmap_threshold else {}


def run_bench(spec: PeersSpec, work: Path, out: Path, log: Log) -> dict[str, Any]:
    """Every asked row of every asked job, ``repeats`` times interleaved; writes ``out`` (JSON) and
    its PNG; returns the results."""
    spec.check()
    t0 = time.perf_counter()
    work.mkdir(parents=True, exist_ok=True)
    jobs = prepare_jobs(spec, work, log)
    env = row_environment(spec)
    rows: list[dict[str, Any]] = []
    keys = {  # a job's settings; a row's key adds its name, repeat and prompt order (more repeats reuse these)
        job: digest(asdict(spec) | {"rows": None, "jobs": None, "repeats": None}, model_hash(job_model(spec, job)),
                    *sorted((work / "job").glob(f"{job}_*.jsonl")))
        for job in spec.jobs
    }  # fmt: skip
    counts = ", ".join(f"{j}: {jobs[j]['eval_questions']}" for j in spec.jobs)
    log(f"held-out EM of the starting models ({counts} questions, greedy), own process")
    configs = {job: job_config(spec, job, work).model_dump() for job in spec.jobs}
    start = {"name": "eval_start", "kind": "eval", "configs": configs, "threads": spec.threads, "out": str(work / "rows" / "eval_start")}
    evals = run_row(start, work / "rows" / "eval_start", digest(keys), log, env)["eval"]
    for rep in range(spec.repeats):
        for name in spec.rows:
            meta, job = ROWS[name], ROWS[name]["job"]
            if job not in spec.jobs:
                continue
            folder = work / "rows" / name / f"repeat_{rep}"
            cfg = job_config(spec, job, work, out_dir=str(folder / "run"), dump_rollouts_every=1, eval_every=spec.steps,
                             save_every=spec.steps, seed=spec.seed + rep, **meta.get("fields", {}))  # fmt: skip
            task = {
                "name": name, "kind": meta["system"], "job": job, "config": cfg.model_dump(), "threads": spec.threads,
                "out": str(folder), "eval_start": evals[job], "order": jobs[job]["orders"][rep], "trl_loss": LOSS_PAIRS[spec.loss],
            }  # fmt: skip
            log(f"{name} (repeat {rep + 1}/{spec.repeats}, seed {spec.seed + rep}): {spec.steps} steps x {spec.prompts_per_step} prompts, own process")
            row = run_row(task, folder, digest(keys[job], name, rep, task["order"]), log, env)
            rows.append({**{k: v for k, v in meta.items() if k != "fields"}, "name": name, "repeat": rep, **row})
    table = summarize(rows)
    results = {
        "provenance": provenance(model_dir=resolve_model_ref(spec.model), threads=spec.threads or None),
        "spec": asdict(spec),
        "environment": {
            **env, "threads": spec.threads, "seeds": [spec.seed + r for r in range(spec.repeats)],
            "order": "interleaved: every row of repeat 1, then of repeat 2, ...",
        },
        "rows": rows,
        "table": table,
        "settings": {
            "shared": shared_settings(rows),
            "differences": DIFFERENCES,
            "differences_multi_turn": TRL_TOOLS_DIFFERENCES,
            "loss_pairs": LOSS_PAIRS,
        },
        "prompts": {job: jobs[job]["prompts"] for job in spec.jobs},
        "eval_before": evals,
        "checks": checks(rows),
        "wall_s": time.perf_counter() - t0,
    }
    write_result(out, results, plot, log=log)
    return results
