"""A ``transformers`` engine: batched, KV-cached sampling of one agent step per context, with
prefix KV reuse.

One :meth:`HFEngine.generate` call runs all contexts as one batch (chunked by
``max_batch_size``): a prefill over the contexts' uncached suffixes, then an incremental decode
loop with a :class:`~transformers.DynamicCache`, one forward per step for the whole batch. Position ids are always passed explicitly
(``cumsum(attention_mask) - 1``), so a padded row sees exactly the positions it would see alone.
Rows that finish are dropped from the batch (and from the KV cache), and the loop ends as soon as
every row has finished; the decode step itself has no per-row Python loop.

**Prefix KV reuse** (``prefix_reuse=True``, the default; DESIGN.md §3.3). The engine keeps the
keys/values it computed in a :class:`~treegrpo.rollout.prefix_cache.PrefixCache` — a radix tree
keyed by token ids, so a prefix shared by many sequences is stored once:

* *across turns*: when a row finishes, the KV of its context plus the tokens it fed back
  (``context + step[:-1]``) is stored; the next turn's context (``context + step + observation``)
  then only prefills ``1 + len(observation)`` tokens;
* *across rounds*: an expansion continues from a node's full context, which is a prefix of the
  trajectory that went through the node, so its KV is already stored (only the last context
  token is recomputed, to get the next-token logits);
* *within a call*: a prefix shared by several contexts of the same call that is not stored yet
  (the M copies of a prompt in the first turn, N picks of the same node after an eviction) is
  prefilled **once**, stored, and copied into every row that uses it.

A row's cached prefix is copied from the tree into a padded batch cache (cached part right-aligned
in the cache region, uncached suffix right-aligned in the query block, holes masked); the
attention mask and ``cumsum`` position ids make this exactly the computation of the full
context (log-probs equal a full recompute to float rounding, ~1e-6 in float32).

**Bucketed prefill.** With reuse, suffix lengths in one batch differ a lot (a row whose prefix is
stored runs 1 token, its neighbour ~100), so one left-padded prefill would mostly run padding.
The prefill is therefore split into length buckets (:func:`_length_buckets`): rows sorted by
suffix length, longest first, are grouped greedily, a row joining the current bucket as long as
the bucket's padded size (rows x longest suffix) stays within ``_BUCKET_PAD_RATIO`` (1.25) x its
real tokens plus ``_BUCKET_PAD_SLACK`` (16) positions (a little slack so near-equal short suffixes
share a forward rather than paying one forward each). Each bucket is prefilled in its own
forward; the buckets' caches and masks are then left-padded to a common width and merged back
into the original row order, so the decode loop (and the sampling draws) is exactly that of one
batch.

**KV buffers with room.** The batch cache is a ``DynamicCache`` of :class:`_GrowingLayer` s: its
keys/values are views of buffers allocated with room for the suffix and the tokens fed back while
decoding (up to ``_DECODE_ROOM`` at a time), so the prefill and nearly every decode step write their
new positions in place. (``DynamicLayer`` concatenates, i.e. copies the whole batch cache, on every forward; with
expansions that continue from long stored contexts this copying cost more than the model's own
arithmetic on this tiny CPU model.) A batch assembled from stored prefixes is used as is.

*What is counted* — :attr:`Generation.prefill_tokens` is the number of non-pad positions the
model ran for that request in prefill forwards: its own uncached suffix, plus the tokens of any
in-call shared prefix it was charged (a shared prefix computed once in a call is charged to the
lowest-index request of that call whose context starts with it). So the sum over one call's
generations is exactly the number of prefill positions computed in that call. Tokens taken from
the store were counted when they were computed (as prefill, or as generated tokens fed back
during decode). A fully stored context still prefills its last token (1).

*Memory* — the store is bounded by ``prefix_cache_mb``: at the end of every ``generate`` call the
least-recently-used leaves are evicted until it fits (``0`` keeps nothing between calls, but
in-call sharing still works). It is emptied by :meth:`HFEngine.release_cache` (the samplers call
it when a rollout ends, see :func:`~treegrpo.rollout.engine.release_engine_cache`), by
:meth:`HFEngine.load_weights`, and automatically when any parameter changed in place since the
cache was filled (an optimizer step, ``load_state_dict``: detected through the tensors' version
counters), so a stale KV is never reused. Models whose cache layers are not plain
``DynamicLayer`` (sliding-window / hybrid caches) run without reuse.

Log-probs and entropies are those of the distribution the token was drawn from — ``log_softmax``
of the logits at the sampling temperature (logits / T; T = 0, greedy, counts as 1), without top-p —
so they are the "old log-probs" a PPO-style trainer computing its ratio at T needs
(:class:`~treegrpo.rollout.engine.Generation`).

transformers 5.x renamed the forward kwarg ``past_key_values`` to ``cache`` (the old name still
works in 5.24 with a deprecation warning, removal announced for 5.40); the engine passes
whichever name the model's ``forward`` declares.
"""

from __future__ import annotations

import bisect
import inspect
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from treegrpo.rollout.engine import FinishReason, Generation, SamplingParams
from treegrpo.rollout.prefix_cache import PrefixCache, common_prefix_len

__all__ = ["HFEngine"]

# Finish-reason codes used on tensors inside the decode loop.
_RUNNING, _STOP, _EOS, _LENGTH = 0, 1, 2, 3
_REASONS: dict[int, FinishReason] = {_STOP: "stop", _EOS: "eos", _LENGTH: "length"}

# Prefill bucketing (module docstring): a bucket's padded positions stay within
# ``_BUCKET_PAD_RATIO * real + _BUCKET_PAD_SLACK``.
_BUCKET_PAD_RATIO = 1.25
_BUCKET_PAD_SLACK = 16

# Spare KV positions allocated past the filled ones (:class:`_GrowingLayer`), per (re)allocation.
_DECODE_ROOM = 16

Tokens = tuple[int, ...]


def _cache_kwarg_name(model: torch.nn.Module) -> str:
    """``"cache"`` for transformers 5.x models whose ``forward`` declares it, else ``"past_key_values"``."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - exotic wrappers
        return "cache"
    if "cache" in params:
        return "cache"
    return "past_key_values"


def _accepts(model: torch.nn.Module, name: str) -> bool:
    """Whether ``model.forward`` declares the keyword ``name``."""
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return False


def _eos_ids(model: torch.nn.Module, tokenizer: Any | None) -> list[int]:
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


def _pad_id(model: torch.nn.Module, tokenizer: Any | None, eos_ids: Sequence[int]) -> int:
    """The pad id: the tokenizer's, else the model config's, else the first EOS, else 0."""
    if tokenizer is not None and getattr(tokenizer, "pad_token_id", None) is not None:
        return int(tokenizer.pad_token_id)
    cfg_pad = getattr(getattr(model, "config", None), "pad_token_id", None)
    if cfg_pad is not None:
        return int(cfg_pad)
    return int(eos_ids[0]) if eos_ids else 0


def _sample(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> torch.Tensor:
    """Draw one token per row of float32 ``logits`` ``(B, V)``: greedy at temperature 0, else
    temperature-scaled, nucleus-filtered multinomial sampling with ``generator``."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, sorted_idx = probs.sort(dim=-1, descending=True)
        cum = sorted_probs.cumsum(dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p (the top one is kept).
        sorted_probs = sorted_probs.masked_fill(cum - sorted_probs >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, sorted_idx, sorted_probs)
    if generator is not None and generator.device != probs.device:
        # A generator lives on one device: draw there so its stream is the one advanced.
        return (
            torch.multinomial(probs.to(generator.device), 1, generator=generator).squeeze(-1).to(probs.device)
        )
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _length_buckets(
    lengths: Sequence[int], ratio: float = _BUCKET_PAD_RATIO, slack: int = _BUCKET_PAD_SLACK
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


class _GrowingLayer(DynamicLayer):
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


def _growing_cache(
    config: Any, room: int, kv: Sequence[tuple[torch.Tensor, torch.Tensor]] = (), filled: int = 0
) -> DynamicCache:
    """A ``DynamicCache`` of :class:`_GrowingLayer` s: empty, or over the given per-layer
    ``(keys, values)`` buffers whose first ``filled`` positions are the cache.

    Every layer keeps all positions, sliding-window ones included: ``transformers`` builds their
    window into the attention mask, from each layer's KV length, so the result is unchanged (and
    the buckets' caches can be merged, which window-trimmed layers of different widths cannot).
    Those models run without prefix reuse, so a row's positions are contiguous in the cache, as
    the window mask assumes."""
    cache = DynamicCache(config=config)
    if kv:
        cache.layers = [_GrowingLayer(room, k, v, filled) for k, v in kv]
    else:
        cache.layers = [_GrowingLayer(room) for _ in cache.layers]
    return cache


def _merge_prefills(
    parts: Sequence[tuple[list[int], torch.Tensor, DynamicCache, torch.Tensor, torch.Tensor]],
    b: int,
    config: Any,
    room: int = 0,
) -> tuple[torch.Tensor, DynamicCache, torch.Tensor, torch.Tensor]:
    """Merge per-bucket prefills ``(row indices, logits, cache, next_pos, mask)`` into one batch of
    ``b`` rows in original row order: caches and masks are left-padded (masked) to a common width.
    The merged cache has ``room`` spare positions for decoding (:class:`_GrowingLayer`).

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
    return logits, _growing_cache(config, room, kv, width), next_pos, mask


def _supports_prefix_reuse(model: torch.nn.Module) -> bool:
    """Whether the model's ``DynamicCache`` is made of plain full-attention ``DynamicLayer``s (whose
    keys/values cover every position, so they can be cut per row and reassembled)."""
    try:
        cache = DynamicCache(config=getattr(model, "config", None))
    except Exception:  # pragma: no cover - exotic configs
        return False
    return all(type(layer) is DynamicLayer for layer in cache.layers)


def _weights_key(model: torch.nn.Module) -> tuple[tuple[int, int], ...]:
    """Identity and in-place version counter of every parameter: changes whenever a weight does."""
    return tuple((id(p), p._version) for p in model.parameters())


def _row_kv(cache: DynamicCache, mask: torch.Tensor, b: int) -> Callable[[int], torch.Tensor]:
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


class HFEngine:
    """Samples agent steps from a ``transformers`` causal LM (CPU or GPU), reusing prefix KV.

    The model object is shared with the trainer: :meth:`load_weights` only points the engine at a
    module, no copy is made. During :meth:`generate` the model is in eval mode; its previous
    training mode is restored afterwards.

    Args:
        model: a causal LM (``AutoModelForCausalLM``-like: ``forward(input_ids, attention_mask,
            position_ids, cache=...)`` returning ``.logits``). Its dtype is kept; it is moved to
            ``device`` if its parameters live elsewhere (``Module.to`` is in place).
        tokenizer: the model's tokenizer; gives the pad / EOS ids and decodes tails for
            ``stop_strings``. Optional when no stop strings are used and the config has the ids.
        device: where the model runs.
        max_batch_size: contexts per forward batch; ``None`` = all contexts in one batch.
        prefix_reuse: reuse computed KV across turns, rounds and within a call (module docstring).
            ``False`` prefills every context in full (the baseline for efficiency benchmarks).
        prefix_cache_mb: the most KV (MiB) kept between ``generate`` calls; least-recently-used
            entries are evicted beyond it. ``0`` keeps nothing between calls (in-call sharing of a
            common prefix still happens).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any | None = None,
        device: str | torch.device = "cpu",
        max_batch_size: int | None = None,
        prefix_reuse: bool = True,
        prefix_cache_mb: float = 1024.0,
    ) -> None:
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1 or None, got {max_batch_size}")
        if prefix_cache_mb < 0:
            raise ValueError(f"prefix_cache_mb must be >= 0, got {prefix_cache_mb}")
        self.device = torch.device(device)
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.prefix_reuse = prefix_reuse
        self.prefix_cache_mb = prefix_cache_mb
        self.prefix_cache = PrefixCache(max_bytes=int(prefix_cache_mb * 2**20))
        self._cache_weights_key: tuple[tuple[int, int], ...] | None = None
        self.model: torch.nn.Module
        self.load_weights(model)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_pretrained(
        cls,
        folder: str | Path,
        device: str | torch.device = "cpu",
        max_batch_size: int | None = None,
        dtype: torch.dtype = torch.float32,
        attn_implementation: str = "sdpa",
        prefix_reuse: bool = True,
        prefix_cache_mb: float = 1024.0,
    ) -> HFEngine:
        """Load a local causal LM folder (a tiny model or any real one) with its tokenizer."""
        from treegrpo.models.tiny import load_model, load_tokenizer

        model = load_model(folder, dtype=dtype, attn_implementation=attn_implementation)
        tokenizer = load_tokenizer(folder)
        return cls(
            model,
            tokenizer,
            device=device,
            max_batch_size=max_batch_size,
            prefix_reuse=prefix_reuse,
            prefix_cache_mb=prefix_cache_mb,
        )

    def load_weights(self, model: torch.nn.Module) -> None:
        """Sample from ``model`` from now on (no copy: the trainer's module itself). Empties the
        prefix cache: KV computed with other weights is never reused."""
        first = next(model.parameters(), None)
        if first is not None and first.device != self.device:
            model.to(self.device)
        self.model = model
        self._cache_kwarg = _cache_kwarg_name(model)
        self._has_logits_to_keep = _accepts(model, "logits_to_keep")
        self.eos_ids = _eos_ids(model, self.tokenizer)
        self.eos_token_id: int | None = self.eos_ids[0] if self.eos_ids else None
        self.pad_token_id = _pad_id(model, self.tokenizer, self.eos_ids)
        self.max_positions: int | None = getattr(
            getattr(model, "config", None), "max_position_embeddings", None
        )
        self._reuse_supported = _supports_prefix_reuse(model)
        if self.prefix_reuse and not self._reuse_supported:
            warnings.warn(
                "HFEngine: this model's KV cache is not made of plain DynamicLayers (sliding window or "
                "hybrid attention); prefix reuse is off for it",
                stacklevel=2,
            )
        self.release_cache()

    def release_cache(self) -> None:
        """Free every stored prefix KV (the optional engine hook the samplers call after a rollout)."""
        self.prefix_cache.clear()
        self._cache_weights_key = None

    @property
    def reuses_prefixes(self) -> bool:
        """Whether prefix KV reuse is on (asked for, and supported by the model's cache)."""
        return self.prefix_reuse and self._reuse_supported

    # ------------------------------------------------------------------ public API

    def generate(
        self,
        contexts: Sequence[Sequence[int]],
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> list[Generation]:
        """Sample one step for every context, in one batched call (chunked by ``max_batch_size``).

        Each step ends right after an EOS / stop id / token completing a stop string (that token
        is returned), or after ``params.max_new_tokens`` tokens. Draws come from ``generator``
        (the global RNG when ``None``), so a seeded generator gives reproducible samples; prefix
        reuse does not change which draws are made.

        Raises:
            ValueError: an empty context, bad sampling params, stop strings without a tokenizer,
                or a context that cannot fit ``max_new_tokens`` within ``max_position_embeddings``.
        """
        self._validate(contexts, params)
        if not contexts:
            return []
        ctxs: list[Tokens] = [tuple(int(t) for t in c) for c in contexts]
        n = len(ctxs)
        bs = self.max_batch_size or n
        if bs >= n:
            chunks = [list(range(n))]
        else:
            # Group similar lengths to keep padding small; results are put back in input order.
            order = sorted(range(n), key=lambda i: len(ctxs[i]))
            chunks = [order[i : i + bs] for i in range(0, n, bs)]

        reuse = self.reuses_prefixes
        charges = [0] * n  # in-call shared-prefix tokens charged to each request
        results: list[Generation | None] = [None] * n
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                if reuse:
                    key = _weights_key(self.model)
                    if key != self._cache_weights_key:  # weights changed since the KV was computed
                        self.prefix_cache.clear()
                        self._cache_weights_key = key
                    self._share_prefixes(ctxs, charges)
                for chunk in chunks:
                    gens = self._generate_batch([ctxs[i] for i in chunk], params, generator, reuse)
                    for i, g in zip(chunk, gens, strict=True):
                        g.prefill_tokens += charges[i]
                        results[i] = g
        finally:
            self.model.train(was_training)
            if reuse:
                self.prefix_cache.evict_to()
        return [g for g in results if g is not None]

    # ------------------------------------------------------------------ internals

    def _validate(self, contexts: Sequence[Sequence[int]], params: SamplingParams) -> None:
        """Reject requests the engine cannot serve, with a clear message."""
        if params.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {params.max_new_tokens}")
        if params.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {params.temperature}")
        if not 0.0 < params.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings need a tokenizer: pass one to HFEngine")
        if any(not s for s in params.stop_strings):
            raise ValueError("stop_strings must be non-empty strings")
        for i, ctx in enumerate(contexts):
            if len(ctx) == 0:
                raise ValueError(f"context {i} is empty: a step needs at least one context token")
            if self.max_positions is not None and len(ctx) + params.max_new_tokens > self.max_positions:
                raise ValueError(
                    f"context {i} has {len(ctx)} tokens; with max_new_tokens={params.max_new_tokens} it exceeds "
                    f"the model's max_position_embeddings={self.max_positions}"
                )

    # -- prefix sharing within a call ------------------------------------------------------------

    def _share_prefixes(self, ctxs: list[Tokens], charges: list[int]) -> None:
        """Prefill, once each, the prefixes that several contexts of this call share and the store
        lacks, so the per-row prefill only computes each row's own suffix. A context's shared
        prefix stops one token short of its end (the last token is always run for its logits)."""
        order = sorted(range(len(ctxs)), key=ctxs.__getitem__)
        srt = [ctxs[i] for i in order]
        targets: set[Tokens] = set()
        for j, c in enumerate(srt):
            shared = max(
                common_prefix_len(c, srt[j - 1]) if j > 0 else 0,
                common_prefix_len(c, srt[j + 1]) if j + 1 < len(srt) else 0,
            )
            shared = min(shared, len(c) - 1)
            if shared > 0 and self.prefix_cache.match(c, shared) < shared:
                targets.add(c[:shared])
        if targets:
            self._ensure_cached(sorted(targets), srt, order, charges)

    def _ensure_cached(
        self, seqs: list[Tokens], srt: list[Tokens], order: list[int], charges: list[int]
    ) -> None:
        """Compute and store every sequence of ``seqs`` (sorted), their own shared prefixes first."""
        need = [s for s in seqs if self.prefix_cache.match(s) < len(s)]
        if not need:
            return
        sub: set[Tokens] = set()
        for j, s in enumerate(need):
            shared = max(
                common_prefix_len(s, need[j - 1]) if j > 0 else 0,
                common_prefix_len(s, need[j + 1]) if j + 1 < len(need) else 0,
            )
            if 0 < shared < len(s) and self.prefix_cache.match(s, shared) < shared:
                sub.add(s[:shared])
        if sub:  # strictly shorter than the sequences they come from: the recursion ends
            self._ensure_cached(sorted(sub), srt, order, charges)
        need = [s for s in need if self.prefix_cache.match(s) < len(s)]
        bs = self.max_batch_size or max(1, len(need))
        for k in range(0, len(need), bs):
            chunk = [s for s in need[k : k + bs] if self.prefix_cache.match(s) < len(s)]
            if chunk:
                for s, computed in zip(chunk, self._prefill_and_store(chunk), strict=True):
                    charges[self._owner(s, srt, order)] += computed

    @staticmethod
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

    def _prefill_and_store(self, seqs: list[Tokens]) -> list[int]:
        """Run ``seqs`` through the model (reusing what is stored) and store their full KV.
        Returns the tokens computed per sequence."""
        ids, mask, cache, cached = self._assemble(seqs, [len(s) for s in seqs], reuse=True, room=0)
        _, cache, _ = self._prefill(ids, mask, cache, room=0)
        for b, s in enumerate(seqs):
            self.prefix_cache.insert(s, _row_kv(cache, mask, b))
        return [len(s) - c for s, c in zip(seqs, cached, strict=True)]

    # -- batch assembly, prefill, decode -----------------------------------------------------------

    def _lookup(
        self, seqs: Sequence[Tokens], limits: Sequence[int], reuse: bool
    ) -> list[tuple[int, list[torch.Tensor]]]:
        """Each row's longest stored prefix (at most ``limits[r]`` tokens): length and KV segments."""
        if not reuse:
            return [(0, [])] * len(seqs)
        return [self.prefix_cache.lookup(s, lim) for s, lim in zip(seqs, limits, strict=True)]

    def _assemble(
        self,
        seqs: Sequence[Tokens],
        limits: Sequence[int],
        reuse: bool,
        found: Sequence[tuple[int, list[torch.Tensor]]] | None = None,
        room: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor, DynamicCache | None, list[int]]:
        """Build one padded batch: each row's longest stored prefix (at most ``limits[r]`` tokens)
        goes into a batch cache, right-aligned in a cache region of width ``P``; its uncached suffix
        is right-aligned in a query block of width ``S``. The attention mask (width ``P + S``) marks
        real positions; the holes between the two parts are masked.

        ``found`` (:meth:`_lookup`'s result for these rows) skips the lookup. The cache has room
        for the ``S`` suffix positions plus ``room`` more (:class:`_GrowingLayer`).

        Returns:
            suffix ids ``(B, S)``, attention mask ``(B, P + S)``, the batch cache (``None`` when
            nothing was reused) and each row's number of reused tokens.
        """
        if found is None:
            found = self._lookup(seqs, limits, reuse)
        cached = [n for n, _ in found]
        b = len(seqs)
        p = max(cached)
        width = max(len(s) - c for s, c in zip(seqs, cached, strict=True))
        ids = torch.full((b, width), self.pad_token_id, dtype=torch.long)
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
            cache = _growing_cache(
                getattr(self.model, "config", None), room, [(kv[i, 0], kv[i, 1]) for i in range(n_layers)], p
            )
        return ids.to(self.device), mask.to(self.device), cache, cached

    def _forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: DynamicCache,
        last_only: bool,
    ) -> torch.Tensor:
        """One model call extending ``cache``; returns float32 logits of the last position ``(B, V)``."""
        kwargs: dict[str, Any] = {self._cache_kwarg: cache}
        if last_only and self._has_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            **kwargs,
        )
        return out.logits[:, -1, :].float()

    def _prefill(
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
            cache = _growing_cache(getattr(self.model, "config", None), room)
        position_ids = (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)
        position_ids = position_ids[:, -input_ids.shape[1] :]
        logits = self._forward(input_ids, attention_mask, position_ids, cache, last_only=True)
        next_pos = attention_mask.long().sum(dim=-1)
        return logits, cache, next_pos

    def _bucketed_prefill(
        self,
        contexts: Sequence[Tokens],
        limits: Sequence[int],
        reuse: bool,
        found: Sequence[tuple[int, list[torch.Tensor]]],
        suffix_lens: Sequence[int],
        room: int,
    ) -> tuple[torch.Tensor, DynamicCache, torch.Tensor, torch.Tensor]:
        """Prefill the batch one length bucket at a time (:func:`_length_buckets`) and merge the
        results, in row order, into one decode batch whose cache has ``room`` spare positions.
        Returns logits, cache, next positions, mask."""
        buckets = _length_buckets(suffix_lens)
        if len(buckets) == 1:
            ids, mask, cache, _ = self._assemble(contexts, limits, reuse, found, room)
            logits, cache, next_pos = self._prefill(ids, mask, cache, room)
            return logits, cache, next_pos, mask
        parts = []
        for idx in buckets:
            ids, mask, cache, _ = self._assemble(
                [contexts[i] for i in idx], [limits[i] for i in idx], reuse, [found[i] for i in idx]
            )
            logits, cache, next_pos = self._prefill(ids, mask, cache)
            parts.append((idx, logits, cache, next_pos, mask))
        return _merge_prefills(parts, len(contexts), getattr(self.model, "config", None), room)

    def _generate_batch(
        self,
        contexts: Sequence[Tokens],
        params: SamplingParams,
        generator: torch.Generator | None,
        reuse: bool,
    ) -> list[Generation]:
        """Prefill + decode loop for one batch of contexts."""
        device = self.device
        b = len(contexts)
        # The last context token is always run: its logits give the first sampled token.
        limits = [len(c) - 1 for c in contexts]
        found = self._lookup(contexts, limits, reuse)
        cached = [n for n, _ in found]
        prefill_tokens = [len(c) - k for c, k in zip(contexts, cached, strict=True)]
        # Room for the tokens fed back while decoding (the last sampled token is never run), at
        # most ``_DECODE_ROOM`` at a time: steps are usually far shorter than the cap, and every
        # dropped row copies the buffers, room included.
        logits, cache, next_pos, mask = self._bucketed_prefill(
            contexts, limits, reuse, found, prefill_tokens, room=min(params.max_new_tokens - 1, _DECODE_ROOM)
        )
        store = reuse and self.prefix_cache.max_bytes != 0

        max_new = params.max_new_tokens
        out_tokens = torch.full((b, max_new), self.pad_token_id, dtype=torch.long, device=device)
        out_logp = torch.zeros((b, max_new), dtype=torch.float32, device=device)
        out_ent = (
            torch.zeros((b, max_new), dtype=torch.float32, device=device) if params.return_entropy else None
        )
        out_len = torch.full((b,), max_new, dtype=torch.long, device=device)
        out_reason = torch.full((b,), _LENGTH, dtype=torch.long, device=device)

        eos_t = torch.tensor(self.eos_ids, dtype=torch.long, device=device)
        stop_t = torch.tensor(list(params.stop_token_ids), dtype=torch.long, device=device)
        stop_strings = tuple(params.stop_strings)
        window = 4 * max((len(s) for s in stop_strings), default=0) + 4  # tokens decoded per check

        rows = torch.arange(b, device=device)  # batch row -> original index in this chunk
        for t in range(max_new):
            tok = _sample(logits, params.temperature, params.top_p, generator)
            scaled = logits if params.temperature in (0.0, 1.0) else logits / params.temperature
            logp_all = torch.log_softmax(scaled, dim=-1)  # the distribution drawn from (before top-p)
            out_tokens[rows, t] = tok
            out_logp[rows, t] = logp_all.gather(-1, tok[:, None]).squeeze(-1)
            if out_ent is not None:
                p = logp_all.exp()
                out_ent[rows, t] = -torch.where(p > 0, p * logp_all, 0.0).sum(dim=-1)

            # Vectorised stop checks: EOS first, then the explicit stop ids.
            reason = torch.zeros_like(tok)
            if stop_t.numel():
                reason = torch.where(torch.isin(tok, stop_t), _STOP, reason)
            if eos_t.numel():
                reason = torch.where(torch.isin(tok, eos_t), _EOS, reason)
            done = reason != _RUNNING
            if stop_strings:
                done, reason = self._check_stop_strings(
                    out_tokens, rows, t, window, stop_strings, done, reason
                )

            if t == max_new - 1:
                out_reason[rows] = torch.where(done, reason, out_reason[rows])
                if store:
                    self._store_rows(contexts, out_tokens, rows, torch.ones_like(done), t, cache, mask)
                break
            if bool(done.any()):
                if store:
                    self._store_rows(contexts, out_tokens, rows, done, t, cache, mask)
                out_len[rows[done]] = t + 1
                out_reason[rows[done]] = reason[done]
                keep = (~done).nonzero().squeeze(-1)
                if keep.numel() == 0:
                    break
                rows, tok, next_pos, mask = rows[keep], tok[keep], next_pos[keep], mask[keep]
                cache.batch_select_indices(keep)

            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
            logits = self._forward(tok[:, None], mask, next_pos[:, None], cache, last_only=True)
            next_pos = next_pos + 1

        tokens_l = out_tokens.tolist()
        logp_l = out_logp.tolist()
        ent_l = out_ent.tolist() if out_ent is not None else None
        len_l = out_len.tolist()
        reason_l = out_reason.tolist()
        return [
            Generation(
                tokens=tokens_l[r][: len_l[r]],
                logprobs=logp_l[r][: len_l[r]],
                finish_reason=_REASONS[reason_l[r]],
                prefill_tokens=prefill_tokens[r],
                entropies=ent_l[r][: len_l[r]] if ent_l is not None else None,
                extra={"cached_tokens": float(cached[r])},
            )
            for r in range(b)
        ]

    def _store_rows(
        self,
        contexts: Sequence[Tokens],
        out_tokens: torch.Tensor,
        rows: torch.Tensor,
        which: torch.Tensor,
        t: int,
        cache: DynamicCache,
        mask: torch.Tensor,
    ) -> None:
        """Store the KV of the finishing batch rows ``which``: their context plus the ``t`` sampled
        tokens already fed back (the last sampled token has no KV yet; the next turn prefills it)."""
        for bi in which.nonzero().squeeze(-1).tolist():
            r = int(rows[bi])
            seq = contexts[r] + tuple(out_tokens[r, :t].tolist())
            self.prefix_cache.insert(seq, _row_kv(cache, mask, bi))

    def _check_stop_strings(
        self,
        out_tokens: torch.Tensor,
        rows: torch.Tensor,
        t: int,
        window: int,
        stop_strings: tuple[str, ...],
        done: torch.Tensor,
        reason: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Mark rows whose decoded generated tail now contains a stop string (still-running rows only).

        A stop string is caught on the step whose token completes it, so that token is the last one
        returned; tokens are never cut. Only a tail window of ``window`` tokens is decoded.
        """
        running = (~done).nonzero().squeeze(-1)
        if running.numel() == 0:
            return done, reason
        start = max(0, t + 1 - window)
        tails = out_tokens[rows[running], start : t + 1].tolist()
        texts = self.tokenizer.batch_decode(
            tails, skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        hit = [i for i, text in enumerate(texts) if any(s in text for s in stop_strings)]
        if not hit:
            return done, reason
        idx = running[torch.tensor(hit, dtype=torch.long, device=running.device)]
        done = done.clone()
        reason = reason.clone()
        done[idx] = True
        reason[idx] = _STOP
        return done, reason
