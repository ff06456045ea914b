"""Supervised warm-up on demonstrations: the step every bootstrap takes before RL (and any model
can take: real instruct models learn the tags the same way).

A :class:`Demo` is a task and its steps (policy text, then the observation text or ``None``).
:func:`encode_demo` turns it into exactly the token sequence the agent loop would hold
(:meth:`~treegrpo.rollout.agent.StepRunner.prompt_ids`, then per step the step's ids — loss on —
and the observation's ids, truncated to ``max_obs_tokens`` — loss off), so the policy is trained
on the very sequences it will see. :func:`supervised_warmup` runs AdamW on the policy tokens:
random batches (not length-bucketed: a demo's length gives away its search-or-answer decisions)
packed into rows with block-diagonal attention, a linear warm-up, a constant phase and a cosine
decay (:class:`WarmupConfig`).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from treegrpo.envs.base import AgentEnv, Task
from treegrpo.errors import ConfigError
from treegrpo.rollout.agent import StepRunner

#: The record ``treegrpo warmup`` writes into its output folder (what was done, the agent settings).
WARMUP_RECORD = "treegrpo_warmup.json"


@dataclass(frozen=True)
class WarmupConfig:
    """The supervised warm-up's optimisation recipe.

    Attributes:
        epochs: passes over the demonstrations (may be fractional).
        batch_size: demonstrations per optimizer step (drawn at random, not length-bucketed).
        pack_len: demos of a batch are packed into rows of this many tokens (block-diagonal
            attention, positions restarting per demo); 0 = one right-padded demo per row.
        lr / weight_decay / warmup_frac / grad_clip: AdamW (betas 0.9/0.98) with a linear warm-up
            over ``warmup_frac`` of the steps, then a constant rate, then a cosine decay to 0 over
            the last ``lr_decay_frac`` of the steps after warm-up (1.0 = plain cosine).
        decision_weight: loss weight of the first token of each step after an observation (the
            search-on-or-answer decision); 1.0 = every policy token alike.
        micro_batch_size: demonstrations per forward/backward, gradients accumulated over the
            batch (the same weighted mean, so the same step up to float rounding); 0 = the whole
            batch in one pass (the tiny agents' recipes). Real models need it: a batch of 8
            SmolLM2-135M demos of ~450 tokens in one pass peaked above 14 GB.
        share_prefix: packed rows hold the prefix their demos share (the system prompt with the
            tool schemas, :func:`shared_prefix_len`) once, each demo attending to it, as the RL
            update does for a tree's shared tokens: the same loss and gradients up to float
            rounding, less compute. A batch's demos are packed into rows of ``pack_len`` tokens
            counting that prefix once, and each row is one forward/backward (``micro_batch_size``
            then only says whether rows are accumulated one at a time, > 0, or run as one batch).
            Off by default: the bootstraps and the committed warm-ups were made without it (float
            rounding would move their weights in the last bits).
    """

    epochs: float = 6
    batch_size: int = 32
    pack_len: int = 256
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup_frac: float = 0.05
    lr_decay_frac: float = 0.25
    decision_weight: float = 1.0
    grad_clip: float = 1.0
    micro_batch_size: int = 0
    share_prefix: bool = False


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


class DemoTooLong(ConfigError):
    """A demonstration step longer than the agent loop's per-step cap: the loop would cut such a
    step off as an invalid action, so the warm-up must never teach it."""


def end_of_turn_id(tokenizer: Any) -> int | None:
    """The id that ends a model's turn: the tokenizer's EOS (``<|im_end|>`` for ChatML instruct
    models such as SmolLM2 and Qwen2.5, ``<|eot_id|>`` for Llama 3.1 Instruct, the tiny agents'
    ``</s>``); ``None`` for a tokenizer without one."""
    eos = getattr(tokenizer, "eos_token_id", None)
    return None if eos is None else int(eos)


def encode_demo(runner: StepRunner, demo: Demo) -> EncodedDemo:
    """Token ids and policy mask of ``demo``, built exactly as the agent loop builds a context.

    A demo that ends in a final step (no observation after it) gets the end-of-turn token
    (:func:`end_of_turn_id`) after that step, trained on: the model learns to end its turn by
    itself after its answer, so it stops there when served without our stop strings (TRL's
    ``generate``, a chat server). The agent loop still stops a step at its action's end tag.

    Raises :class:`DemoTooLong` when a step has more tokens than ``max_step_tokens``."""
    tok = runner.tokenizer
    ids = list(runner.prompt_ids(demo.task))
    mask = [0] * len(ids)
    cap = runner.cfg.max_step_tokens
    for step, obs in demo.steps:
        s = list(tok.encode(step, add_special_tokens=False))
        if len(s) > cap:
            raise DemoTooLong(
                f"a demonstration step of {len(s)} tokens exceeds max_step_tokens={cap} "
                f"(the loop would cut it off): {step[:60]!r}...; raise max_step_tokens or shorten the demo"
            )
        ids += s
        mask += [1] * len(s)
        if obs is not None:
            o = runner.observation_ids(obs)[1]  # as the loop keeps it (truncation, chat format)
            ids += o
            mask += [0] * len(o)
    eot = end_of_turn_id(tok)
    if demo.steps and demo.steps[-1][1] is None and eot is not None and (not ids or ids[-1] != eot):
        ids.append(eot)
        mask.append(1)
    return EncodedDemo(ids, mask)


def encode_demos(runner: StepRunner, demos: Sequence[Demo]) -> tuple[list[EncodedDemo], int]:
    """The demos encoded as the loop holds them (:func:`encode_demo`), leaving out those with a
    step the loop's ``max_step_tokens`` would cut off; returns them and how many were left out.
    Every warm-up (the tiny bootstraps and ``treegrpo warmup``) encodes through this, so none
    teaches a step the loop would not let the policy finish."""
    encoded: list[EncodedDemo] = []
    for d in demos:
        try:
            encoded.append(encode_demo(runner, d))
        except DemoTooLong:
            continue
    return encoded, len(demos) - len(encoded)


def demos_over_context(runner: StepRunner, demos: Sequence[Demo]) -> tuple[list[EncodedDemo], int, list[tuple[int, int]]]:
    """:func:`encode_demos`, and ``(index into demos, tokens)`` of each encoded demo longer than
    the loop's ``max_context_tokens``: the loop would end such a trajectory before its last steps,
    so the warm-up would teach a context the policy never holds."""
    encoded: list[EncodedDemo] = []
    over: list[tuple[int, int]] = []
    for i, d in enumerate(demos):
        try:
            e = encode_demo(runner, d)
        except DemoTooLong:
            continue
        encoded.append(e)
        if len(e.ids) > runner.cfg.max_context_tokens:
            over.append((i, len(e.ids)))
    return encoded, len(demos) - len(encoded), over


def demo_texts(demos: Sequence[Demo], env: AgentEnv) -> list[str]:
    """Full demo transcripts (prompt, steps, observations), for tokenizer training."""
    return [env.prompt(d.task) + "".join(s + (o or "") for s, o in d.steps) for d in demos]


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


def shared_prefix_len(demos: Sequence[EncodedDemo]) -> int:
    """How many leading tokens every one of ``demos`` shares and none trains on: their common
    prefix, ending at least one token before any demo's first policy token (so that token is
    still predicted from its own demo's previous token); 0 for fewer than two demos."""
    if len(demos) < 2:
        return 0
    limit = min((e.policy_mask.index(1) if 1 in e.policy_mask else len(e.ids)) - 1 for e in demos)
    first = demos[0].ids
    n = 0
    while n < limit and all(e.ids[n] == first[n] for e in demos[1:]):
        n += 1
    return max(0, n)


def _pack_shared(encoded: Sequence[EncodedDemo], idx: Sequence[int], row_len: int) -> list[list[int]]:
    """:func:`_pack` of demos ``idx`` counting the prefix they all share once per row: each demo
    takes its tokens after that prefix, a row ``row_len`` less the prefix (a row's own shared
    prefix, :func:`shared_prefix_len`, is at least as long, so no row ends up longer)."""
    p = shared_prefix_len([encoded[i] for i in idx])
    rest = {i: len(encoded[i].ids) - p for i in idx}
    return _pack(rest, idx, row_len - p)  # type: ignore[arg-type]


def _collate_packed(
    encoded: Sequence[EncodedDemo],
    rows: Sequence[Sequence[int]],
    pad_id: int,
    decision_weight: float = 1.0,
    share_prefix: bool = False,
) -> dict[str, torch.Tensor]:
    """Like :func:`_collate`, several demos per row: positions restart at 0 for each demo and a 4D
    additive attention mask keeps every demo causal and blind to the others in its row. With
    ``share_prefix`` a row holds its demos' :func:`shared_prefix_len` tokens once, at its start:
    each demo's remaining tokens follow at positions after it and attend to it."""
    singles = [[encoded[i] for i in row] for row in rows]
    flat = _collate([e for row in singles for e in row], pad_id, decision_weight)
    shared = [shared_prefix_len(row) if share_prefix else 0 for row in singles]
    width = max(p + sum(len(e.ids) - p for e in row) for p, row in zip(shared, singles, strict=True))
    n = len(rows)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    lab = torch.full((n, width), -100, dtype=torch.long)
    wts = torch.zeros((n, width), dtype=torch.float32)
    pos = torch.zeros((n, width), dtype=torch.long)
    allowed = torch.zeros((n, width, width), dtype=torch.bool)
    k = 0
    for r, (row, p) in enumerate(zip(singles, shared, strict=True)):
        if p:  # the shared prefix, once (no policy token in it: labels -100, weight 0)
            ids[r, :p] = flat["input_ids"][k, :p]
            pos[r, :p] = torch.arange(p)
            allowed[r, :p, :p] = torch.ones((p, p), dtype=torch.bool).tril()
        start = p
        for e in row:
            m = len(e.ids) - p
            ids[r, start : start + m] = flat["input_ids"][k, p : p + m]
            lab[r, start : start + m] = flat["labels"][k, p : p + m]
            wts[r, start : start + m] = flat["weights"][k, p : p + m]
            pos[r, start : start + m] = torch.arange(p, p + m)
            allowed[r, start : start + m, start : start + m] = torch.ones((m, m), dtype=torch.bool).tril()
            allowed[r, start : start + m, :p] = True
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
    ce, w = _policy_ce(model, batch)
    if w is None:
        return ce.mean()
    return (ce * w).sum() / w.sum().clamp(min=1e-8)


def _policy_weight(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The total loss weight of a batch's policy tokens (their count without ``weights``)."""
    sel = batch["labels"][:, 1:] != -100
    return batch["weights"][:, 1:][sel].sum() if "weights" in batch else sel.sum().to(torch.float32)


def _policy_ce(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-policy-token cross-entropy and weights (``None`` without ``weights``)."""
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
    return ce, (batch["weights"][:, 1:][sel] if "weights" in batch else None)


def _accumulated_step(model: torch.nn.Module, batches: Sequence[dict[str, torch.Tensor]]) -> float:
    """Backward of the batch's weighted-mean loss, one micro-batch at a time; returns the loss."""
    total = torch.stack([_policy_weight(b) for b in batches]).sum().clamp(min=1e-8)
    value = 0.0
    for b in batches:
        ce, w = _policy_ce(model, b)
        part = (ce if w is None else ce * w).sum() / total
        part.backward()
        value += float(part.detach())
    return value


def sft_steps(n_demos: int, cfg: WarmupConfig) -> int:
    """The optimizer steps :func:`supervised_warmup` takes on ``n_demos`` demonstrations."""
    return max(1, math.ceil(cfg.epochs * math.ceil(n_demos / cfg.batch_size)))


def _duration(seconds: float) -> str:
    """``75`` → ``1m15s``, ``3725`` → ``1h02m``, ``9`` → ``9s``."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def progress_line(step: int, total: int, loss: float, loss_ema: float, demos: int, elapsed_s: float) -> str:
    """One warm-up progress line after optimizer step ``step`` (1-based) of ``total``: the step's
    loss and its running mean, demonstrations per second so far (``demos`` trained in
    ``elapsed_s``) and the time left at that pace."""
    rate = demos / elapsed_s if elapsed_s > 0 else float("inf")
    eta = elapsed_s / step * (total - step) if step > 0 else float("nan")
    return (
        f"warm-up step {step}/{total} · loss {loss:.4f} (ema {loss_ema:.4f}) · "
        f"{rate:.2f} demos/s · ETA {_duration(eta) if math.isfinite(eta) else '?'}"
    )


def supervised_warmup(
    model: torch.nn.Module,
    encoded: Sequence[EncodedDemo],
    cfg: WarmupConfig,
    pad_id: int,
    rng: random.Random,
    progress: Any = None,
    say: Callable[[str], Any] | None = None,
    say_every: int = 1,
) -> dict[str, float]:
    """AdamW on the demos' policy tokens; returns loss statistics.

    ``progress``: a rich display that gets a bar; ``say``: a printer that gets a
    :func:`progress_line` every ``say_every`` optimizer steps and after the last (for a log, where
    a bar shows nothing until it ends). Neither draws random numbers: the run is the same."""
    if say_every < 1:
        raise ValueError(f"say_every must be >= 1, got {say_every}")
    lengths = [len(e.ids) for e in encoded]
    per_epoch = math.ceil(len(encoded) / cfg.batch_size)
    total = sft_steps(len(encoded), cfg)
    plan: list[list[int]] = []
    while len(plan) < total:  # whole shuffled epochs; a fractional last one is cut short
        plan += _batches(len(encoded), cfg.batch_size, rng)
    plan = plan[:total]

    def batch_of(idx: list[int]) -> dict[str, torch.Tensor]:
        if cfg.pack_len <= 0:
            return _collate([encoded[i] for i in idx], pad_id, cfg.decision_weight)
        row_len = max(cfg.pack_len, *(lengths[i] for i in idx))
        return _collate_packed(encoded, _pack(lengths, idx, row_len), pad_id, cfg.decision_weight)

    def shared_rows(idx: list[int]) -> list[dict[str, torch.Tensor]]:  # share_prefix: one forward per row
        rows = _pack_shared(encoded, idx, max(cfg.pack_len, *(lengths[i] for i in idx)))
        one = [rows] if cfg.micro_batch_size <= 0 else [[row] for row in rows]
        return [_collate_packed(encoded, r, pad_id, cfg.decision_weight, share_prefix=True) for r in one]

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
    t0, seen = time.perf_counter(), 0
    for step, idx in enumerate(plan):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        opt.zero_grad(set_to_none=True)
        if cfg.share_prefix and cfg.pack_len > 0:  # packed rows holding their shared prefix once
            val = _accumulated_step(model, shared_rows(idx))
        elif cfg.micro_batch_size > 0:  # gradients accumulated over micro-batches of demos
            m = cfg.micro_batch_size
            val = _accumulated_step(model, [batch_of(idx[i : i + m]) for i in range(0, len(idx), m)])
        else:
            loss = policy_token_loss(model, batch_of(idx))
            loss.backward()
            val = float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        ema = val if ema is None else 0.95 * ema + 0.05 * val
        if step >= total - per_epoch:
            last_epoch.append(val)
        if progress is not None:
            progress.update(task_id, advance=1, description=f"warm-up (SFT) loss {ema:.3f}")
        seen += len(idx)
        if say is not None and ((step + 1) % say_every == 0 or step + 1 == total):
            say(progress_line(step + 1, total, val, ema, seen, time.perf_counter() - t0))
    model.eval()
    return {
        "final_loss": sum(last_epoch) / max(1, len(last_epoch)),
        "final_loss_ema": float(ema or 0.0),
        "steps": total,
    }



__all__ = [
    "Demo",
    "EncodedDemo",
    "WarmupConfig",
    "demo_texts",
    "demos_over_context",
    "encode_demo",
    "end_of_turn_id",
    "policy_token_loss",
    "progress_line",
    "sft_steps",
    "shared_prefix_len",
    "supervised_warmup",
]
