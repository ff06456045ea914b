"""Bootstrap the tiny starting policy: imperfect demonstrations, a tokenizer, a small Qwen2, and a
supervised warm-up, measured through the real agent loop.

The warm-up teaches the *protocol* (``<search> name </search>``, copy the entity a passage names
into the next query or the answer) from demonstrations that are deliberately imperfect, so the
starting policy solves some questions but far from all, and the failure is a *choice* RL can fix:

- ``p_shortcut``: on a multi-hop question, answer with the bridge entity just found instead of
  searching it (per intermediate hop) — "answering too early";
- ``p_bad_query``: search another entity named in the last observation, and answer with what
  that passage names (a copy slip);
- ``p_guess`` (off by default): answer at once, without searching, with a random entity.

Demonstrations come from the world's ``warmup`` split and from ``aux_worlds`` extra worlds with
the same entity names but other relations (the warm-up must learn to *copy* names, not memorize
facts; no target train/eval question is used). They are encoded exactly as the agent loop builds
a context (:meth:`~treegrpo.rollout.agent.StepRunner.prompt_ids`, then per step the step's ids —
loss on — and the observation's ids from the real :class:`~treegrpo.envs.search.SearchEnv`,
truncated to ``max_obs_tokens`` — loss off), so the policy is trained on the very token sequences
it will see. Batches are random (not length-bucketed: a demo's length gives away its
search-or-answer decisions) and packed into rows with block-diagonal attention.

The folder is written atomically (built in a temp folder beside it, then renamed) with
:func:`~treegrpo.models.tiny.save_tiny`; its ``treegrpo_tiny.json`` records the world, the env and
agent settings, the demo statistics, the final SFT loss and the measured warm-up success.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from treegrpo.envs.base import Task
from treegrpo.envs.search import SearchEnv
from treegrpo.envs.world import RELATIONS, SPLITS, World, WorldConfig, build_world, get_preset
from treegrpo.io import user_cache_dir
from treegrpo.models.tiny import (
    MARKER_FILE,
    build_model,
    load_model,
    load_tokenizer,
    save_tiny,
    tiny_info,
    train_tokenizer,
    wrap_tokenizer,
)
from treegrpo.rollout.agent import AgentConfig, StepRunner

BOOTSTRAP_VERSION = 2  # bump when the recipe changes, so cached folders are rebuilt


@dataclass(frozen=True)
class BootstrapConfig:
    """Everything that determines a bootstrapped starting policy.

    Attributes:
        preset: world preset name (:data:`treegrpo.envs.world.PRESETS`).
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

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["world"] = self.world_config().to_dict()  # holds the world seed
        del d["world_seed"]
        return d

    def config_hash(self) -> str:
        """A short hash of everything that determines the result (and the recipe version)."""
        blob = json.dumps({"v": BOOTSTRAP_VERSION, **self.to_dict()}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


# --------------------------------------------------------------------------- demonstrations


@dataclass
class Demo:
    """One demonstration: a task and its steps (policy text, then observation text or ``None``)."""

    task: Task
    steps: list[tuple[str, str | None]]
    kind: str  # "correct" | "guess" | "shortcut" | "bad_query"
    reward: float = 0.0


@dataclass
class EncodedDemo:
    """A demo as the agent loop would hold it: ids and the policy mask (1 = trained on)."""

    ids: list[int]
    policy_mask: list[int]


def make_env(world: World, topk: int = 3, prompt_template: str = "minimal") -> SearchEnv:
    """The world's search environment (BM25 over the world's passages)."""
    return SearchEnv(world.retriever, topk=topk, prompt_template=prompt_template)


def search_text(query: str) -> str:
    """A search step, Search-R1 style."""
    return f"<search> {query} </search>"


def answer_text(answer: str) -> str:
    """An answer step, Search-R1 style."""
    return f"<answer> {answer} </answer>"


def make_demos(
    world: World, env: SearchEnv, tasks: Sequence[Task], cfg: BootstrapConfig, rng: random.Random
) -> list[Demo]:
    """Imperfect demonstrations for ``tasks``, observations from the real ``env``.

    Each demo walks the task's relation chain: search the current entity, read the relation's
    object off that entity's passage, then search it — or, with the configured probabilities,
    guess without searching (``p_guess``), answer early with the bridge entity just found
    (``p_shortcut``), or search another entity named in the last observation (``p_bad_query``)
    and answer with a name that entity's passage gives. Every name a demo writes is copied from
    the question or an observation, except a guess. Searches are batched hop by hop.
    """
    by_type: dict[str, list[str]] = {}
    for name, e in world.entities.items():
        by_type.setdefault(e.type, []).append(name)

    @dataclass
    class _Walk:
        demo: Demo
        current: str
        last_obs: str = ""
        done: bool = False

    walks: list[_Walk] = []
    for task in tasks:
        for _ in range(cfg.demos_per_question):
            if rng.random() < cfg.p_guess:
                guess = rng.choice(by_type[RELATIONS[task.meta["relations"][-1]][1]])
                walks.append(_Walk(Demo(task, [(answer_text(guess), None)], "guess"), guess, done=True))
            else:
                walks.append(_Walk(Demo(task, [], "correct"), task.meta["start"]))
    for k in range(max((len(t.meta["relations"]) for t in tasks), default=0)):
        active = [w for w in walks if not w.done and k < len(w.demo.task.meta["relations"])]
        queries: list[str] = []
        for w in active:
            query = w.current
            if k > 0 and rng.random() < cfg.p_bad_query:
                queried = w.demo.task.meta["queries"]
                others = [n for n in world.names_in(w.last_obs) if n != w.current and n not in queried]
                if others:
                    query, w.demo.kind = rng.choice(others), "bad_query"
            queries.append(query)
        steps = [search_text(q) for q in queries]
        outs = env.step([w.demo.task for w in active], steps, [True] * len(active))
        for w, query, step, out in zip(active, queries, steps, outs, strict=True):
            w.last_obs = out.observation or ""
            w.demo.steps.append((step, out.observation))
            rels = w.demo.task.meta["relations"]
            if query != w.current:  # on a wrong track: answer with what that passage names
                named = [n for n in world.names_in(world.doc(query).text) if n != query]
                w.current, w.done = (named[0] if named else query), True
                continue
            w.current = world.entities[query].relations[rels[k]]
            if k == len(rels) - 1:
                w.done = True
            elif rng.random() < cfg.p_shortcut:
                w.demo.kind, w.done = "shortcut", True
    for w in walks:
        if w.demo.kind != "guess":
            w.demo.steps.append((answer_text(w.current), None))
    demos = [w.demo for w in walks]
    finals = env.step([d.task for d in demos], [d.steps[-1][0] for d in demos], [False] * len(demos))
    for d, out in zip(demos, finals, strict=True):
        d.reward = float(out.reward or 0.0)
    return demos


def encode_demo(runner: StepRunner, demo: Demo) -> EncodedDemo:
    """Token ids and policy mask of ``demo``, built exactly as the agent loop builds a context."""
    tok = runner.tokenizer
    ids = list(runner.prompt_ids(demo.task))
    mask = [0] * len(ids)
    for step, obs in demo.steps:
        s = list(tok.encode(step, add_special_tokens=False))
        ids += s
        mask += [1] * len(s)
        if obs is not None:
            o = list(tok.encode(obs, add_special_tokens=False))[: runner.cfg.max_obs_tokens]
            ids += o
            mask += [0] * len(o)
    return EncodedDemo(ids, mask)


def demo_texts(demos: Sequence[Demo], env: SearchEnv) -> list[str]:
    """Full demo transcripts (prompt, steps, observations), for tokenizer training."""
    return [env.prompt(d.task) + "".join(s + (o or "") for s, o in d.steps) for d in demos]


def aux_worlds(cfg: BootstrapConfig) -> list[World]:
    """The auxiliary demo worlds of ``cfg``: the target world's shape and entity *names* with other
    seeds, hence other relations, passages and questions. Every name token is seen in many roles,
    so the warm-up must learn to copy names from passages rather than memorize facts."""
    base = cfg.world_config()
    names = base.seed if base.name_seed is None else base.name_seed
    return [
        build_world(replace(base, seed=base.seed + 1_000_003 * (i + 1), name_seed=names))
        for i in range(cfg.aux_worlds)
    ]


def aux_demo_tasks(world: World, target: World) -> list[Task]:
    """``world``'s questions (every split) except any whose text is a ``target`` train/eval question."""
    held = {t.question for s in ("train", "eval") for t in target.tasks(s)}  # type: ignore[arg-type]
    return [t for s in SPLITS for t in world.tasks(s) if t.question not in held]



def model_for(cfg: Any, tok: Any) -> torch.nn.Module:
    """The small Qwen2 a bootstrap config describes (its ``hidden_size``, ``layers``, ``heads``,
    ``kv_heads``, ``intermediate_size``, ``max_positions`` and ``seed``), sized to ``tok``."""
    return build_model(
        vocab_size=len(tok),
        hidden_size=cfg.hidden_size,
        layers=cfg.layers,
        heads=cfg.heads,
        kv_heads=cfg.kv_heads,
        intermediate_size=cfg.intermediate_size,
        max_positions=cfg.max_positions,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        seed=cfg.seed,
    )

# --------------------------------------------------------------------------- supervised warm-up


def _batches(n: int, batch_size: int, rng: random.Random) -> list[list[int]]:
    """One shuffled epoch of random batches.

    Not length-bucketed on purpose: a demo's length says whether it searched on or answered, so
    length-sorted batches carry correlated decision labels and whipsaw the search-or-answer logit
    (the warm-up then learns a context-free answering rate instead of *when* to stop). Packing
    keeps the padding low instead.
    """
    order = list(range(n))
    rng.shuffle(order)
    return [order[i : i + batch_size] for i in range(0, n, batch_size)]


def _pack(lengths: Sequence[int], idx: Sequence[int], row_len: int) -> list[list[int]]:
    """First-fit-decreasing packing of demos ``idx`` into rows of ``row_len`` tokens (a longer
    demo gets a row of its own)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(idx, key=lambda i: -lengths[i]):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(row_len - lengths[i])
    return rows


def _collate_packed(
    encoded: Sequence[EncodedDemo], rows: Sequence[Sequence[int]], pad_id: int, decision_weight: float = 1.0
) -> dict[str, torch.Tensor]:
    """Like :func:`_collate`, several demos per row: positions restart at 0 for each demo and a 4D
    additive attention mask keeps every demo causal and blind to the others in its row."""
    singles = [[encoded[i] for i in row] for row in rows]
    flat = _collate([e for row in singles for e in row], pad_id, decision_weight)
    width = max(sum(len(e.ids) for e in row) for row in singles)
    n = len(rows)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    lab = torch.full((n, width), -100, dtype=torch.long)
    wts = torch.zeros((n, width), dtype=torch.float32)
    pos = torch.zeros((n, width), dtype=torch.long)
    allowed = torch.zeros((n, width, width), dtype=torch.bool)
    k = 0
    for r, row in enumerate(singles):
        start = 0
        for e in row:
            m = len(e.ids)
            ids[r, start : start + m] = flat["input_ids"][k, :m]
            lab[r, start : start + m] = flat["labels"][k, :m]
            wts[r, start : start + m] = flat["weights"][k, :m]
            pos[r, start : start + m] = torch.arange(m)
            allowed[r, start : start + m, start : start + m] = torch.ones((m, m), dtype=torch.bool).tril()
            start += m
            k += 1
        allowed[r, range(start, width), range(start, width)] = True  # padding sees itself (no empty rows)
    mask = torch.zeros((n, 1, width, width), dtype=torch.float32)
    mask.masked_fill_(~allowed[:, None], torch.finfo(torch.float32).min)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": pos, "labels": lab, "weights": wts}


def _collate(
    encoded: Sequence[EncodedDemo], pad_id: int, decision_weight: float = 1.0
) -> dict[str, torch.Tensor]:
    """Right-padded batch: ids, attention mask, positions, labels (-100 off the policy) and
    per-token loss weights (``decision_weight`` on the first token of every step that follows an
    observation — where the policy chooses to search on or to answer — 1 on other policy tokens)."""
    width = max(len(e.ids) for e in encoded)
    n = len(encoded)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    att = torch.zeros((n, width), dtype=torch.long)
    lab = torch.full((n, width), -100, dtype=torch.long)
    wts = torch.zeros((n, width), dtype=torch.float32)
    for r, e in enumerate(encoded):
        t = torch.tensor(e.ids, dtype=torch.long)
        ids[r, : len(e.ids)] = t
        att[r, : len(e.ids)] = 1
        m = torch.tensor(e.policy_mask, dtype=torch.bool)
        lab[r, : len(e.ids)] = torch.where(m, t, torch.full_like(t, -100))
        w = m.float()
        if decision_weight != 1.0 and len(e.ids) > 1:
            starts = m[1:] & ~m[:-1]  # a policy token right after a non-policy one ...
            starts &= torch.cumsum(m.long(), 0)[:-1] > 0  # ... that is not the first step's
            w[1:] = torch.where(starts, torch.full_like(w[1:], decision_weight), w[1:])
        wts[r, : len(e.ids)] = w
    pos = torch.arange(width).unsqueeze(0).expand(n, width)
    return {"input_ids": ids, "attention_mask": att, "position_ids": pos, "labels": lab, "weights": wts}


def policy_token_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Next-token cross-entropy over policy tokens only (labels are -100 elsewhere), weighted by
    ``batch["weights"]`` when present (a weighted mean), else a plain mean.

    Logits are computed at the policy positions only (most positions are prompt and observation
    tokens, so this skips most of the output layer's work)."""
    labels = batch["labels"][:, 1:]
    sel = labels != -100
    base = getattr(model, "model", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    kwargs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
    if isinstance(base, torch.nn.Module) and head is not None:
        logits = head(base(**kwargs).last_hidden_state[:, :-1][sel])
    else:  # any other causal LM: full logits
        logits = model(**kwargs).logits[:, :-1][sel]
    ce = torch.nn.functional.cross_entropy(logits.float(), labels[sel], reduction="none")
    if "weights" not in batch:
        return ce.mean()
    w = batch["weights"][:, 1:][sel]
    return (ce * w).sum() / w.sum().clamp(min=1e-8)


def supervised_warmup(
    model: torch.nn.Module,
    encoded: Sequence[EncodedDemo],
    cfg: BootstrapConfig,
    pad_id: int,
    rng: random.Random,
    progress: Any = None,
) -> dict[str, float]:
    """AdamW on the demos' policy tokens; returns loss statistics."""
    lengths = [len(e.ids) for e in encoded]
    per_epoch = math.ceil(len(encoded) / cfg.batch_size)
    total = max(1, math.ceil(cfg.epochs * per_epoch))
    plan: list[list[int]] = []
    while len(plan) < total:  # whole shuffled epochs; a fractional last one is cut short
        plan += _batches(len(encoded), cfg.batch_size, rng)
    plan = plan[:total]

    def batch_of(idx: list[int]) -> dict[str, torch.Tensor]:
        if cfg.pack_len <= 0:
            return _collate([encoded[i] for i in idx], pad_id, cfg.decision_weight)
        row_len = max(cfg.pack_len, *(lengths[i] for i in idx))
        return _collate_packed(encoded, _pack(lengths, idx, row_len), pad_id, cfg.decision_weight)

    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    warm = max(1, int(cfg.warmup_frac * total))

    decay = max(1, round(cfg.lr_decay_frac * (total - warm)))  # cosine over the last `decay` steps

    def lr_at(step: int) -> float:
        if step < warm:
            return cfg.lr * (step + 1) / warm
        into = step - (total - decay)
        if into < 0:
            return cfg.lr
        return cfg.lr * 0.5 * (1 + math.cos(math.pi * into / decay))

    model.train()
    ema: float | None = None
    last_epoch: list[float] = []
    task_id = progress.add_task("warm-up (SFT)", total=total) if progress is not None else None
    for step, idx in enumerate(plan):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        loss = policy_token_loss(model, batch_of(idx))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        val = float(loss.detach())
        ema = val if ema is None else 0.95 * ema + 0.05 * val
        if step >= total - per_epoch:
            last_epoch.append(val)
        if progress is not None:
            progress.update(task_id, advance=1, description=f"warm-up (SFT) loss {ema:.3f}")
    model.eval()
    return {
        "final_loss": sum(last_epoch) / max(1, len(last_epoch)),
        "final_loss_ema": float(ema or 0.0),
        "steps": total,
    }


# --------------------------------------------------------------------------- measurement


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
    (:class:`~treegrpo.rollout.hf_engine.HFEngine` + the ``chain`` sampler, one chain per task).

    Returns ``success`` (mean reward), ``success_by_hops``, ``tool_calls`` (mean per trajectory),
    ``answer_after_one_search`` (fraction of trajectories that answered after exactly one search),
    ``early_answer`` (fraction of multi-hop trajectories that answered with fewer searches than
    hops), ``no_search_answer`` (answered without searching), ``invalid_actions`` and
    ``generated_tokens`` (means per trajectory) and ``wall_s``.
    """
    from treegrpo.rollout.hf_engine import HFEngine
    from treegrpo.rollout.samplers import SamplerConfig, sample_chains

    engine = HFEngine(model, tokenizer, max_batch_size=max_batch_size)
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


# --------------------------------------------------------------------------- the whole bootstrap


@contextmanager
def _progress(enabled: bool) -> Iterator[Any]:
    if not enabled:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        transient=False,
    ) as p:
        yield p


@contextmanager
def _torch_threads(n: int | None) -> Iterator[None]:
    """Run with ``n`` torch intra-op threads, restoring the previous setting afterwards."""
    old = torch.get_num_threads()
    if n is not None and n != old:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != old:
            torch.set_num_threads(old)


def _phase(progress: Any, text: str) -> None:
    if progress is not None:
        progress.console.print(f"[bold]bootstrap[/bold] {text}")


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
    with _progress(progress) as prog, _torch_threads(cfg.threads):
        t = time.perf_counter()
        world_cfg = cfg.world_config()
        world = build_world(world_cfg)
        env = make_env(world, cfg.topk, cfg.prompt_template)
        demos = make_demos(world, env, world.tasks("warmup"), cfg, rng)
        for w in aux_worlds(cfg):
            aux_env = make_env(w, cfg.topk, cfg.prompt_template)
            demos += make_demos(w, aux_env, aux_demo_tasks(w, world), cfg, rng)
        timings["world_and_demos_s"] = time.perf_counter() - t
        _phase(prog, f"world {world.stats['passages']} passages; {len(demos)} demos")

        t = time.perf_counter()
        tok = wrap_tokenizer(
            train_tokenizer([*world.texts(), *demo_texts(demos, env)], vocab_size=cfg.vocab_size)
        )
        runner = StepRunner(None, env, tok, cfg.agent_config())  # type: ignore[arg-type]  # encoding only
        encoded = [encode_demo(runner, d) for d in demos]
        timings["tokenizer_s"] = time.perf_counter() - t

        model = model_for(cfg, tok)
        n_params = sum(p.numel() for p in model.parameters())
        _phase(prog, f"tokenizer vocab {len(tok)}; model {n_params / 1e6:.2f}M params")

        t = time.perf_counter()
        sft = supervised_warmup(model, encoded, cfg, tok.pad_token_id, rng, prog)
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
        _write_atomically(folder, lambda tmp: save_tiny(model, tok, tmp, info))
        _phase(prog, f"saved to {folder} in {timings['total_s']:.0f}s")
    return folder


def _write_atomically(folder: Path, write: Any) -> None:
    """Build into a temp folder beside ``folder``, then rename it into place."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}-{time.monotonic_ns()}"
    try:
        write(tmp)
        old = None
        if folder.exists():
            old = folder.parent / f".{folder.name}.old-{os.getpid()}-{time.monotonic_ns()}"
            os.replace(folder, old)
        os.replace(tmp, folder)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------- cache


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
    folder = Path(folder)
    return (folder / MARKER_FILE).is_file() and "warmup_eval" in tiny_info(folder)


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
    "Demo",
    "EncodedDemo",
    "aux_demo_tasks",
    "aux_worlds",
    "bootstrap",
    "default_model_dir",
    "demo_texts",
    "encode_demo",
    "ensure_bootstrapped",
    "is_bootstrapped",
    "load_model",
    "load_setup",
    "load_tokenizer",
    "make_demos",
    "make_env",
    "measure_policy",
    "policy_token_loss",
    "supervised_warmup",
]
