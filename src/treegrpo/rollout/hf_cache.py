"""KV cache layers and batch caches for :class:`~treegrpo.rollout.hf_engine.HFEngine`.

**KV buffers with room.** A batch cache is a ``DynamicCache`` of :class:`GrowingLayer` s: its
keys/values are views of buffers allocated with room for the suffix and the tokens fed back while
decoding (up to :data:`DECODE_ROOM` at a time), so the prefill and nearly every decode step write
their new positions in place. (``DynamicLayer`` concatenates, i.e. copies the whole batch cache,
on every forward; with expansions that continue from long stored contexts this copying cost more
than the model's own arithmetic on the tiny CPU model.) A batch assembled from stored prefixes is
used as is.

**Assembly** (:func:`assemble_batch`). A row's cached prefix (its segments from the
:class:`~treegrpo.rollout.prefix_cache.PrefixCache`) is copied into a padded batch cache: cached
part right-aligned in a cache region of width ``P``, uncached suffix right-aligned in a query block
of width ``S``, holes masked. The attention mask and ``cumsum`` position ids make this exactly the
computation of the full context (log-probs equal a full recompute to float rounding, ~1e-6 in
float32).

**Merging** (:func:`merge_prefills`). Per-bucket prefills (:mod:`treegrpo.rollout.hf_prefill`)
have caches and masks of different widths; they are left-padded (masked) to a common width and put
back in the original row order, so the decode loop runs one batch.

**Storing** (:func:`row_kv`): the KV of one batch row's real positions, cut out for
:meth:`PrefixCache.insert`. Only models whose cache layers are plain full-attention
``DynamicLayer`` s support this (:func:`supports_prefix_reuse`); sliding-window / hybrid caches run
without reuse.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

__all__ = [
    "DECODE_ROOM",
    "GrowingLayer",
    "assemble_batch",
    "growing_cache",
    "merge_prefills",
    "row_kv",
    "supports_prefix_reuse",
]

#: Spare KV positions allocated past the filled ones (:class:`GrowingLayer`), per (re)allocation.
DECODE_ROOM = 16

Tokens = tuple[int, ...]


class GrowingLayer(DynamicLayer):
    """A full-attention cache layer whose keys/values are views of buffers with spare room.

    ``update`` writes the new positions in place (growing the buffers only when the room runs out),
    where ``DynamicLayer`` allocates and copies the whole cache on every call. A decode step then
    moves one position per row instead of the row's whole context, and a batch cache assembled
    from stored prefixes is used as is, not copied again.

    Args:
        room: spare positions allocated past the filled ones whenever the buffers are (re)made.
        keys, values: ``(B, kv_heads, capacity, head_dim)`` buffers whose first ``filled``
            positions hold the cache (``None``: allocated on the first ``update``).
    """

    def __init__(
        self,
        room: int,
        keys: torch.Tensor | None = None,
        values: torch.Tensor | None = None,
        filled: int = 0,
    ) -> None:
        super().__init__()
        self.room = room
        self._filled = 0
        if keys is not None and values is not None:
            self._point(keys, values, filled)

    def _point(self, key_buf: torch.Tensor, value_buf: torch.Tensor, filled: int) -> None:
        self._key_buf, self._value_buf, self._filled = key_buf, value_buf, filled
        self.keys, self.values = key_buf[:, :, :filled], value_buf[:, :, :filled]
        self.device, self.dtype, self.is_initialized = key_buf.device, key_buf.dtype, True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, q = self._filled, key_states.shape[-2]
        if not self.is_initialized or n + q > self._key_buf.shape[2]:
            b, heads, _, dim = key_states.shape
            key_buf = key_states.new_empty((b, heads, n + q + self.room, dim))
            value_buf = value_states.new_empty((b, heads, n + q + self.room, dim))
            if n:
                key_buf[:, :, :n] = self.keys
                value_buf[:, :, :n] = self.values
            self._point(key_buf, value_buf, n)
        self._key_buf[:, :, n : n + q] = key_states
        self._value_buf[:, :, n : n + q] = value_states
        self._point(self._key_buf, self._value_buf, n + q)
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._point(self._key_buf[indices], self._value_buf[indices], self._filled)


def growing_cache(
    config: Any, room: int, kv: Sequence[tuple[torch.Tensor, torch.Tensor]] = (), filled: int = 0
) -> DynamicCache:
    """A ``DynamicCache`` of :class:`GrowingLayer` s: empty, or over the given per-layer
    ``(keys, values)`` buffers whose first ``filled`` positions are the cache.

    Every layer keeps all positions, sliding-window ones included: ``transformers`` builds their
    window into the attention mask, from each layer's KV length, so the result is unchanged (and
    the buckets' caches can be merged, which window-trimmed layers of different widths cannot).
    Those models run without prefix reuse, so a row's positions are contiguous in the cache, as
    the window mask assumes."""
    cache = DynamicCache(config=config)
    if kv:
        cache.layers = [GrowingLayer(room, k, v, filled) for k, v in kv]
    else:
        cache.layers = [GrowingLayer(room) for _ in cache.layers]
    return cache


def assemble_batch(
    seqs: Sequence[Tokens],
    found: Sequence[tuple[int, list[torch.Tensor]]],
    pad_id: int,
    device: torch.device,
    config: Any,
    room: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, DynamicCache | None, list[int]]:
    """Build one padded batch: each row's stored prefix (``found[r]``: its length and KV
    segments, as :meth:`PrefixCache.lookup` returns them) goes into a batch cache, right-aligned in
    a cache region of width ``P``; its uncached suffix is right-aligned in a query block of width
    ``S``. The attention mask (width ``P + S``) marks real positions; the holes between the two
    parts are masked. The cache has room for the ``S`` suffix positions plus ``room`` more
    (:class:`GrowingLayer`).

    Returns:
        suffix ids ``(B, S)``, attention mask ``(B, P + S)``, the batch cache (``None`` when
        nothing was reused) and each row's number of reused tokens.
    """
    cached = [n for n, _ in found]
    b = len(seqs)
    p = max(cached)
    width = max(len(s) - c for s, c in zip(seqs, cached, strict=True))
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    mask = torch.zeros((b, p + width), dtype=torch.long)
    for r, (s, c) in enumerate(zip(seqs, cached, strict=True)):
        suffix = s[c:]
        ids[r, width - len(suffix) :] = torch.tensor(suffix, dtype=torch.long)
        mask[r, p - c : p] = 1
        mask[r, p + width - len(suffix) :] = 1
    cache = None
    if p > 0:
        ref = next(seg for _, segs in found for seg in segs)
        n_layers, _, heads, _, head_dim = ref.shape
        kv = torch.empty(
            (n_layers, 2, b, heads, p + width + room, head_dim), dtype=ref.dtype, device=ref.device
        )
        for r, (c, segs) in enumerate(found):
            at = p - c
            if at:  # masked, but must be finite: attention weights them by exactly 0
                kv[:, :, r, :, :at] = 0.0
            for seg in segs:
                ln = seg.shape[3]
                kv[:, :, r, :, at : at + ln] = seg
                at += ln
        cache = growing_cache(config, room, [(kv[i, 0], kv[i, 1]) for i in range(n_layers)], p)
    return ids.to(device), mask.to(device), cache, cached


def merge_prefills(
    parts: Sequence[tuple[list[int], torch.Tensor, DynamicCache, torch.Tensor, torch.Tensor]],
    b: int,
    config: Any,
    room: int = 0,
) -> tuple[torch.Tensor, DynamicCache, torch.Tensor, torch.Tensor]:
    """Merge per-bucket prefills ``(row indices, logits, cache, next_pos, mask)`` into one batch of
    ``b`` rows in original row order: caches and masks are left-padded (masked) to a common width.
    The merged cache has ``room`` spare positions for decoding (:class:`GrowingLayer`).

    Returns the merged logits ``(b, V)``, cache, next positions ``(b,)`` and attention mask."""
    width = max(mask.shape[1] for _, _, _, _, mask in parts)
    ref_logits, ref_cache, ref_mask = parts[0][1], parts[0][2], parts[0][4]
    logits = ref_logits.new_empty((b, ref_logits.shape[1]))
    next_pos = parts[0][3].new_empty((b,))
    mask = ref_mask.new_zeros((b, width))
    kv = []
    for layer in ref_cache.layers:
        shape = (b, layer.keys.shape[1], width + room, layer.keys.shape[3])
        kv.append((layer.keys.new_empty(shape), layer.values.new_empty(shape)))
    for idx, lg, cache, pos, msk in parts:
        sel = torch.tensor(idx, dtype=torch.long, device=lg.device)
        w = msk.shape[1]
        logits[sel] = lg
        next_pos[sel] = pos
        mask[sel, width - w :] = msk
        for (keys, values), layer in zip(kv, cache.layers, strict=True):
            keys[sel, :, width - w : width] = layer.keys
            values[sel, :, width - w : width] = layer.values
            if w < width:  # masked, but must be finite: attention weights them by exactly 0
                keys[sel, :, : width - w] = 0.0
                values[sel, :, : width - w] = 0.0
    return logits, growing_cache(config, room, kv, width), next_pos, mask


def supports_prefix_reuse(model: torch.nn.Module) -> bool:
    """Whether the model's ``DynamicCache`` is made of plain full-attention ``DynamicLayer``s (whose
    keys/values cover every position, so they can be cut per row and reassembled)."""
    try:
        cache = DynamicCache(config=getattr(model, "config", None))
    except Exception:  # pragma: no cover - exotic configs
        return False
    return all(type(layer) is DynamicLayer for layer in cache.layers)


def row_kv(cache: DynamicCache, mask: torch.Tensor, b: int) -> Callable[[int], torch.Tensor]:
    """``kv_from(start)`` for :meth:`PrefixCache.insert`: the KV of batch row ``b``'s real (unmasked)
    positions from ``start`` on, as one ``(layers, 2, kv_heads, n, head_dim)`` tensor (a copy)."""

    def kv_from(start: int) -> torch.Tensor:
        cols = mask[b].nonzero().squeeze(-1)[start:]
        return torch.stack(
            [
                torch.stack((layer.keys[b].index_select(-2, cols), layer.values[b].index_select(-2, cols)))
                for layer in cache.layers
            ]
        )

    return kv_from
