"""Prefill for :class:`~treegrpo.rollout.hf_engine.HFEngine`: the model call, length buckets, and
the prefixes shared within one ``generate`` call.

**The model call** (:class:`HFForward`). Position ids are always passed explicitly
(``cumsum(attention_mask) - 1``), so a padded row sees exactly the positions it would see alone;
only the last position's logits are asked for when the model takes ``logits_to_keep``.
transformers 5.x renamed the forward kwarg ``past_key_values`` to ``cache`` (the old name still
works in 5.24 with a deprecation warning, removal announced for 5.40); the call passes whichever
name the model's ``forward`` declares.

**Bucketed prefill** (:func:`bucketed_prefill`). With prefix reuse, suffix lengths in one batch
differ a lot (a row whose prefix is stored runs 1 token, its neighbour ~100), so one left-padded
prefill would mostly run padding. The prefill is therefore split into length buckets
(:func:`length_buckets`): rows sorted by suffix length, longest first, are grouped greedily, a row
joining the current bucket as long as the bucket's padded size (rows x longest suffix) stays within
:data:`BUCKET_PAD_RATIO` (1.25) x its real tokens plus :data:`BUCKET_PAD_SLACK` (16) positions (a
little slack so near-equal short suffixes share a forward rather than paying one forward each).
Each bucket is prefilled in its own forward; the buckets' caches and masks are then merged back
into the original row order (:func:`~treegrpo.rollout.hf_cache.merge_prefills`), so the decode
loop (and the sampling draws) is exactly that of one batch.

**Shared prefixes within a call** (:func:`share_prefixes`). A prefix shared by several contexts of
the same call that is not stored yet (the M copies of a prompt in the first turn, N picks of the
same node after an eviction) is prefilled **once**, stored, and copied into every row that uses it.
Its tokens are charged to the lowest-index request of the call whose context starts with it, so
the sum of a call's ``prefill_tokens`` is exactly the prefill work of that call.
"""

from __future__ import annotations

import bisect
import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from treegrpo.rollout.engine import EngineStats
from treegrpo.rollout.hf_cache import assemble_batch, growing_cache, merge_prefills, row_kv
from treegrpo.rollout.prefix_cache import PrefixCache, common_prefix_len

__all__ = [
    "BUCKET_PAD_RATIO",
    "BUCKET_PAD_SLACK",
    "HFForward",
    "bucketed_prefill",
    "length_buckets",
    "prefill_and_store",
    "share_prefixes",
]

# Prefill bucketing (module docstring): a bucket's padded positions stay within
# ``BUCKET_PAD_RATIO * real + BUCKET_PAD_SLACK``.
BUCKET_PAD_RATIO = 1.25
BUCKET_PAD_SLACK = 16

Tokens = tuple[int, ...]
Found = Sequence[tuple[int, list[torch.Tensor]]]


def cache_kwarg_name(model: torch.nn.Module) -> str:
    """``"cache"`` for transformers 5.x models whose ``forward`` declares it, else ``"past_key_values"``."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - exotic wrappers
        return "cache"
    if "cache" in params:
        return "cache"
    return "past_key_values"


def accepts(model: torch.nn.Module, name: str) -> bool:
    """Whether ``model.forward`` declares the keyword ``name``."""
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return False


@dataclass(frozen=True, eq=False)
class HFForward:
    """How to run one causal LM: its cache kwarg name, whether it takes ``logits_to_keep``, the
    pad id and device of its input batches, and the engine's :class:`EngineStats`, which every
    forward adds to (:meth:`prefill`: rows × padded width; :meth:`decode`: one step of its rows).

    Build with :meth:`of`; the engine makes a new one whenever it is pointed at a module (the
    stats object stays the engine's)."""

    model: torch.nn.Module
    pad_id: int
    device: torch.device
    cache_kwarg: str
    has_logits_to_keep: bool
    stats: EngineStats = field(default_factory=EngineStats)

    @classmethod
    def of(
        cls, model: torch.nn.Module, pad_id: int, device: torch.device, stats: EngineStats | None = None
    ) -> HFForward:
        return cls(
            model, pad_id, device, cache_kwarg_name(model), accepts(model, "logits_to_keep"), stats or EngineStats()
        )

    @property
    def config(self) -> Any:
        """The model config (``None`` for a bare module): it shapes the ``DynamicCache``."""
        return getattr(self.model, "config", None)

    def __call__(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: DynamicCache,
        last_only: bool,
    ) -> torch.Tensor:
        """One model call extending ``cache``; returns float32 logits of the last position ``(B, V)``."""
        kwargs: dict[str, Any] = {self.cache_kwarg: cache}
        if last_only and self.has_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            **kwargs,
        )
        return out.logits[:, -1, :].float()

    def assemble(
        self, seqs: Sequence[Tokens], found: Found, room: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, DynamicCache | None, list[int]]:
        """:func:`~treegrpo.rollout.hf_cache.assemble_batch` with this model's pad id, device, config."""
        return assemble_batch(seqs, found, self.pad_id, self.device, self.config, room)

    def prefill(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        cache: DynamicCache | None = None,
        room: int = 0,
    ) -> tuple[torch.Tensor, DynamicCache, torch.Tensor]:
        """Run the (padded) uncached suffixes through the model.

        When ``cache`` is given it already holds the first ``attention_mask.shape[1] -
        input_ids.shape[1]`` positions (a reused prefix per row) and only ``input_ids`` is computed.
        Otherwise a new cache is made, with ``room`` spare positions past the prefill.

        Returns:
            the last-position logits ``(B, V)``, the filled cache, and each row's next position id ``(B,)``.
        """
        if cache is None:
            cache = growing_cache(self.config, room)
        position_ids = (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)
        position_ids = position_ids[:, -input_ids.shape[1] :]
        logits = self(input_ids, attention_mask, position_ids, cache, last_only=True)
        self.stats.prefill_positions += input_ids.numel()  # every row of the padded width: computed
        next_pos = attention_mask.long().sum(dim=-1)
        return logits, cache, next_pos

    def decode(
        self, tokens: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor, cache: DynamicCache
    ) -> torch.Tensor:
        """One decode step: feed each row's last sampled token ``tokens`` ``(B,)`` at ``positions``
        ``(B,)`` (``attention_mask`` already covers it); returns the next logits ``(B, V)``."""
        logits = self(tokens[:, None], attention_mask, positions[:, None], cache, last_only=True)
        self.stats.decode_steps = (self.stats.decode_steps or 0) + 1
        self.stats.decode_positions += tokens.shape[0]
        return logits


def length_buckets(
    lengths: Sequence[int], ratio: float = BUCKET_PAD_RATIO, slack: int = BUCKET_PAD_SLACK
) -> list[list[int]]:
    """Group row indices for bucketed prefill. Rows are taken longest first; a row joins the
    current bucket (whose width is its first, longest row) while ``rows * width <= ratio * real +
    slack`` holds, ``real`` being the bucket's total length; otherwise it opens a new bucket. So
    every bucket's padding is at most ``(ratio - 1) * real + slack`` positions. Buckets come out
    longest first, indices within a bucket in decreasing length (ties by index)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    buckets: list[list[int]] = []
    width = real = 0
    for i in order:
        n = lengths[i]
        if buckets and (len(buckets[-1]) + 1) * width <= ratio * (real + n) + slack:
            buckets[-1].append(i)
            real += n
        else:
            buckets.append([i])
            width = real = n
    return buckets


def bucketed_prefill(
    fwd: HFForward, contexts: Sequence[Tokens], found: Found, suffix_lens: Sequence[int], room: int
) -> tuple[torch.Tensor, DynamicCache, torch.Tensor, torch.Tensor]:
    """Prefill the batch one length bucket at a time (:func:`length_buckets` of ``suffix_lens``),
    each row reusing its stored prefix ``found[r]``, and merge the results, in row order, into one
    decode batch whose cache has ``room`` spare positions. Returns logits, cache, next positions,
    mask."""
    buckets = length_buckets(suffix_lens)
    if len(buckets) == 1:
        ids, mask, cache, _ = fwd.assemble(contexts, found, room)
        logits, cache, next_pos = fwd.prefill(ids, mask, cache, room)
        return logits, cache, next_pos, mask
    parts = []
    for idx in buckets:
        ids, mask, cache, _ = fwd.assemble([contexts[i] for i in idx], [found[i] for i in idx])
        logits, cache, next_pos = fwd.prefill(ids, mask, cache)
        parts.append((idx, logits, cache, next_pos, mask))
    return merge_prefills(parts, len(contexts), fwd.config, room)


def prefill_and_store(fwd: HFForward, store: PrefixCache, seqs: list[Tokens]) -> list[int]:
    """Run ``seqs`` through the model (reusing what ``store`` holds) and store their full KV.
    Returns the tokens computed per sequence."""
    found = [store.lookup(s, len(s)) for s in seqs]
    ids, mask, cache, cached = fwd.assemble(seqs, found, room=0)
    _, cache, _ = fwd.prefill(ids, mask, cache, room=0)
    for b, s in enumerate(seqs):
        store.insert(s, row_kv(cache, mask, b))
    return [len(s) - c for s, c in zip(seqs, cached, strict=True)]


def share_prefixes(
    fwd: HFForward,
    store: PrefixCache,
    ctxs: list[Tokens],
    charges: list[int],
    max_batch_size: int | None,
) -> None:
    """Prefill, once each, the prefixes that several contexts of this call share and ``store``
    lacks, so the per-row prefill only computes each row's own suffix. A context's shared prefix
    stops one token short of its end (the last token is always run for its logits). The tokens
    computed are added to ``charges[i]`` of the owning request (:func:`_owner`)."""
    order = sorted(range(len(ctxs)), key=ctxs.__getitem__)
    srt = [ctxs[i] for i in order]
    targets: set[Tokens] = set()
    for j, c in enumerate(srt):
        shared = max(
            common_prefix_len(c, srt[j - 1]) if j > 0 else 0,
            common_prefix_len(c, srt[j + 1]) if j + 1 < len(srt) else 0,
        )
        shared = min(shared, len(c) - 1)
        if shared > 0 and store.match(c, shared) < shared:
            targets.add(c[:shared])
    if targets:
        _ensure_cached(fwd, store, sorted(targets), srt, order, charges, max_batch_size)


def _ensure_cached(
    fwd: HFForward,
    store: PrefixCache,
    seqs: list[Tokens],
    srt: list[Tokens],
    order: list[int],
    charges: list[int],
    max_batch_size: int | None,
) -> None:
    """Compute and store every sequence of ``seqs`` (sorted), their own shared prefixes first."""
    need = [s for s in seqs if store.match(s) < len(s)]
    if not need:
        return
    sub: set[Tokens] = set()
    for j, s in enumerate(need):
        shared = max(
            common_prefix_len(s, need[j - 1]) if j > 0 else 0,
            common_prefix_len(s, need[j + 1]) if j + 1 < len(need) else 0,
        )
        if 0 < shared < len(s) and store.match(s, shared) < shared:
            sub.add(s[:shared])
    if sub:  # strictly shorter than the sequences they come from: the recursion ends
        _ensure_cached(fwd, store, sorted(sub), srt, order, charges, max_batch_size)
    need = [s for s in need if store.match(s) < len(s)]
    bs = max_batch_size or max(1, len(need))
    for k in range(0, len(need), bs):
        chunk = [s for s in need[k : k + bs] if store.match(s) < len(s)]
        if chunk:
            for s, computed in zip(chunk, prefill_and_store(fwd, store, chunk), strict=True):
                charges[_owner(s, srt, order)] += computed


def _owner(prefix: Tokens, srt: list[Tokens], order: list[int]) -> int:
    """The lowest request index whose context starts with ``prefix`` (``srt``: contexts sorted,
    ``order``: their request indices). Contexts sharing a prefix are contiguous once sorted."""
    k = bisect.bisect_left(srt, prefix)
    owner = None
    while k < len(srt) and srt[k][: len(prefix)] == prefix:
        owner = order[k] if owner is None else min(owner, order[k])
        k += 1
    assert owner is not None, "a shared prefix always comes from some context"
    return owner
