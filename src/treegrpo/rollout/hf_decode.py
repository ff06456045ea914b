"""The token-level pieces of :class:`~treegrpo.rollout.hf_engine.HFEngine`'s decode loop: drawing
a token, the special ids, and the stop-string check.

* :func:`sample` draws one token per row: greedy at temperature 0, else temperature-scaled,
  nucleus-filtered multinomial sampling from a ``torch.Generator`` (drawn on the generator's
  device, so its stream is the one advanced) — or, with one generator per row (per-request
  seeds), by inverting each row's CDF at a uniform drawn from that row's own generator, so a
  row's token does not depend on the other rows of the batch. Log-probs are *not* taken from these scaled
  probabilities: the engine reports the model's own distribution (temperature 1, no top-p).
* :func:`eos_ids` / :func:`pad_id`: every EOS id (the tokenizer's plus the generation config's)
  and the pad id used for padding a batch.
* :func:`check_stop_strings`: a step ends on the token that *completes* a stop string in the
  decoded generated text, so that token is the last one returned and nothing is cut (DESIGN.md
  §3.2). Only a tail window of the generated tokens is decoded per step, and only for rows that
  are still running (a stop id or EOS already ended the others).

Finish reasons travel through the loop as the integer codes :data:`RUNNING` … :data:`LENGTH`
(:data:`REASONS` names them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from treegrpo.rollout.engine import FinishReason

__all__ = ["EOS", "LENGTH", "REASONS", "RUNNING", "STOP", "check_stop_strings", "eos_ids", "pad_id", "sample", "sample_rows"]

# Finish-reason codes used on tensors inside the decode loop.
RUNNING, STOP, EOS, LENGTH = 0, 1, 2, 3
REASONS: dict[int, FinishReason] = {STOP: "stop", EOS: "eos", LENGTH: "length"}


def eos_ids(model: torch.nn.Module, tokenizer: Any | None) -> list[int]:
    """All end-of-sequence ids: the tokenizer's EOS plus the generation config's (int or list)."""
    ids: list[int] = []
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(int(tokenizer.eos_token_id))
    gen_cfg = getattr(model, "generation_config", None)
    extra = getattr(gen_cfg, "eos_token_id", None) if gen_cfg is not None else None
    if extra is None:
        extra = getattr(getattr(model, "config", None), "eos_token_id", None)
    if isinstance(extra, int):
        extra = [extra]
    for i in extra or []:
        if int(i) not in ids:
            ids.append(int(i))
    return ids


def pad_id(model: torch.nn.Module, tokenizer: Any | None, eos_ids: Sequence[int]) -> int:
    """The pad id: the tokenizer's, else the model config's, else the first EOS, else 0."""
    if tokenizer is not None and getattr(tokenizer, "pad_token_id", None) is not None:
        return int(tokenizer.pad_token_id)
    cfg_pad = getattr(getattr(model, "config", None), "pad_token_id", None)
    if cfg_pad is not None:
        return int(cfg_pad)
    return int(eos_ids[0]) if eos_ids else 0


def sample(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
    row_generators: Sequence[torch.Generator] | None = None,
) -> torch.Tensor:
    """Draw one token per row of float32 ``logits`` ``(B, V)``: greedy at temperature 0, else
    temperature-scaled, nucleus-filtered multinomial sampling with ``generator`` — or, given
    ``row_generators`` (one per row), :func:`sample_rows`."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, sorted_idx = probs.sort(dim=-1, descending=True)
        cum = sorted_probs.cumsum(dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p (the top one is kept).
        sorted_probs = sorted_probs.masked_fill(cum - sorted_probs >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, sorted_idx, sorted_probs)
    if row_generators is not None:
        return sample_rows(probs, row_generators)
    if generator is not None and generator.device != probs.device:
        # A generator lives on one device: draw there so its stream is the one advanced.
        return (
            torch.multinomial(probs.to(generator.device), 1, generator=generator).squeeze(-1).to(probs.device)
        )
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def sample_rows(probs: torch.Tensor, row_generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One token per row of ``probs`` ``(B, V)`` (rows need not sum to 1), row ``r`` from its own
    generator: ``u`` uniform in [0, 1) from ``row_generators[r]`` (one float64 draw on the
    generator's device), and the token is the first whose cumulative probability exceeds
    ``u`` times the row's total (float64), so a zero-probability token is never drawn."""
    if len(row_generators) != probs.shape[0]:
        raise ValueError(f"{len(row_generators)} generators for {probs.shape[0]} rows: give one per row")
    u = torch.stack([torch.rand((), generator=g, dtype=torch.float64, device=g.device) for g in row_generators])
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(u.to(cdf.device)[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(-1)


def check_stop_strings(
    tokenizer: Any,
    out_tokens: torch.Tensor,
    rows: torch.Tensor,
    t: int,
    window: int,
    stop_strings: tuple[str, ...],
    done: torch.Tensor,
    reason: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mark the batch rows (``rows``: their indices into ``out_tokens``) whose decoded generated tail
    now contains a stop string: ``done`` and ``reason = STOP``, still-running rows only.

    A stop string is caught on the step whose token completes it, so that token is the last one
    returned; tokens are never cut. Only a tail window of ``window`` tokens is decoded.
    """
    running = (~done).nonzero().squeeze(-1)
    if running.numel() == 0:
        return done, reason
    start = max(0, t + 1 - window)
    tails = out_tokens[rows[running], start : t + 1].tolist()
    texts = tokenizer.batch_decode(tails, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    hit = [i for i, text in enumerate(texts) if any(s in text for s in stop_strings)]
    if not hit:
        return done, reason
    idx = running[torch.tensor(hit, dtype=torch.long, device=running.device)]
    done = done.clone()
    reason = reason.clone()
    done[idx] = True
    reason[idx] = STOP
    return done, reason
