"""Training sequences from forests: root→leaf paths as padded tensors, and micro-batches.

Pure functions. One leaf = one training sequence (DESIGN.md §2). Tensors are aligned on tokens:
position ``t`` of ``logprobs_B_T`` is ``log p(input_ids[t] | input_ids[:t])`` (0 at t = 0), so the
policy mask and advantages index the same positions as the ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from treegrpo.training.logprobs import model_logprobs
from treegrpo.tree import Forest


@dataclass
class TrainSequence:
    """One root→leaf path: ``tokens``, ``policy_mask``, per-token ``advantages`` and the engine's
    sampling ``logprobs`` (all the same length)."""

    tokens: list[int]
    policy_mask: list[int]
    advantages: list[float]
    logprobs: list[float]
    forest_index: int = 0


@dataclass
class SequenceBatch:
    """Right-padded tensors of a micro-batch (B sequences, T = longest)."""

    input_ids_B_T: torch.Tensor
    attention_mask_B_T: torch.Tensor
    policy_mask_B_T: torch.Tensor
    advantages_B_T: torch.Tensor
    sample_logprobs_B_T: torch.Tensor

    @property
    def n_tokens(self) -> int:
        return int(self.attention_mask_B_T.sum())

    def to(self, device: str | torch.device) -> SequenceBatch:
        return SequenceBatch(*(t.to(device) for t in vars(self).values()))


def forest_sequences(
    forests: Sequence[Forest], token_advantages: Sequence[list[list[float]]]
) -> list[TrainSequence]:
    """Flatten every path of every forest, with its per-token advantages (from the estimator)."""
    out: list[TrainSequence] = []
    for fi, (forest, advs) in enumerate(zip(forests, token_advantages, strict=True)):
        for path, adv in zip(forest.paths(), advs, strict=True):
            if len(adv) != len(path.tokens_T):
                raise ValueError(
                    f"forest {forest.prompt_id}: advantages ({len(adv)}) do not match path tokens ({len(path.tokens_T)})"
                )
            out.append(TrainSequence(path.tokens_T, path.policy_mask_T, list(adv), path.logprobs_T, fi))
    return out


def collate(seqs: Sequence[TrainSequence], pad_id: int) -> SequenceBatch:
    """Right-pad ``seqs`` into a :class:`SequenceBatch`; pads carry mask 0 and advantage 0."""
    T = max(len(s.tokens) for s in seqs)
    B = len(seqs)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    attn = torch.zeros((B, T), dtype=torch.long)
    pmask = torch.zeros((B, T), dtype=torch.float32)
    adv = torch.zeros((B, T), dtype=torch.float32)
    lps = torch.zeros((B, T), dtype=torch.float32)
    for i, s in enumerate(seqs):
        n = len(s.tokens)
        ids[i, :n] = torch.tensor(s.tokens)
        attn[i, :n] = 1
        pmask[i, :n] = torch.tensor(s.policy_mask, dtype=torch.float32)
        adv[i, :n] = torch.tensor(s.advantages)
        lps[i, :n] = torch.tensor(s.logprobs)
    return SequenceBatch(ids, attn, pmask, adv, lps)


def micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Split sequence indices into micro-batches whose padded size (B × longest) stays within
    ``max_tokens``, grouping similar lengths (sorted by length) to waste little padding. A
    sequence longer than the cap goes alone."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    out: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    for i in order:
        if cur and max(longest, lengths[i]) * (len(cur) + 1) > max_tokens:
            out.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, lengths[i])
    if cur:
        out.append(cur)
    return out


def token_logprobs(
    model: torch.nn.Module,
    batch: SequenceBatch,
    with_entropy: bool = False,
    *,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``logprobs_B_T`` of each input token given the ones before it (0 at t = 0 and on pads);
    optionally the full-distribution entropy ``entropy_B_T`` at the same positions, both at the
    sampling ``temperature``. The read-out is
    :func:`~treegrpo.training.logprobs.model_logprobs` with source position ``t - 1``
    (``temperature``, ``chunk_tokens``, ``entropy_grad``: see there)."""
    inputs = {"input_ids": batch.input_ids_B_T, "attention_mask": batch.attention_mask_B_T, "use_cache": False}
    T = batch.input_ids_B_T.shape[1]
    src_B_T = (torch.arange(T, device=batch.input_ids_B_T.device) - 1).expand_as(batch.input_ids_B_T)
    lp, ent = model_logprobs(
        model,
        inputs,
        src_B_T,
        batch.input_ids_B_T,
        temperature=temperature,
        with_entropy=with_entropy,
        chunk_tokens=chunk_tokens,
        entropy_grad=entropy_grad,
    )
    lp = lp * batch.attention_mask_B_T
    if ent is not None:
        ent = ent * batch.attention_mask_B_T
    return lp, ent
