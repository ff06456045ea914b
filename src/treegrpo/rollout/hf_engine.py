"""A ``transformers`` engine: batched, KV-cached sampling of one agent step per context, with
prefix KV reuse.

One :meth:`HFEngine.generate` call runs all contexts as one batch (chunked by
``max_batch_size``): a prefill over the contexts' uncached suffixes, then an incremental decode
loop, one forward per step for the whole batch. Rows that finish are dropped from the batch (and
from the KV cache), and the loop ends as soon as every row has finished; the decode step itself
has no per-row Python loop. The pieces live in four modules:

* this one: the engine — requests, the decode loop, the prefix store's lifetime;
* :mod:`treegrpo.rollout.hf_decode`: drawing a token (temperature, top-p), EOS / pad ids, the
  stop-string check;
* :mod:`treegrpo.rollout.hf_prefill`: the model call (explicit ``cumsum`` position ids, so a
  padded row sees exactly the positions it would see alone), prefill in length buckets, and
  prefixes shared within one call;
* :mod:`treegrpo.rollout.hf_cache`: the in-place KV cache layers, assembling a batch cache from
  stored prefixes, merging the buckets' caches, cutting a row's KV out for the store.

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
  is prefilled **once**, stored, and copied into every row that uses it
  (:func:`~treegrpo.rollout.hf_prefill.share_prefixes`).

Reuse is exact: the attention mask and position ids make a row built from stored prefixes the
computation of its full context (log-probs equal a full recompute to float rounding, ~1e-6 in
float32).

*What is counted* — :attr:`Generation.prefill_tokens` is the number of non-pad positions the
model ran for that request in prefill forwards: its own uncached suffix, plus the tokens of any
in-call shared prefix it was charged (a shared prefix computed once in a call is charged to the
lowest-index request of that call whose context starts with it). So the sum over one call's
generations is exactly the number of prefill positions computed in that call. Tokens taken from
the store were counted when they were computed (as prefill, or as generated tokens fed back
during decode). A fully stored context still prefills its last token (1).

:attr:`HFEngine.stats` (:class:`~treegrpo.rollout.engine.EngineStats`, running totals) counts what
the model computed instead, padding included: ``prefill_positions`` adds rows × padded suffix width
of every prefill forward (each length bucket, each in-call shared-prefix forward), so it is
Σ ``prefill_tokens`` plus the prefill padding; ``decode_steps`` adds one per decode forward and
``decode_positions`` its rows. A finished row leaves the batch before the next decode forward,
so ``decode_positions`` is Σ (``len(tokens)`` − 1) over the requests (the last sampled token is
never fed back) and ``decode_steps`` the longest step less one, per batch (``max_batch_size``
chunk).

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

The engine takes a loaded model and tokenizer; loading a folder is the caller's job (e.g.
:func:`treegrpo.models.tiny.load_model` / ``load_tokenizer``), so ``rollout/`` does not depend on
``models/``. :func:`treegrpo.rollout.engine.make_engine` builds it by name (``"hf"``).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache

from treegrpo.rollout.engine import EngineStats, Generation, SamplingParams, check_request
from treegrpo.rollout.hf_cache import DECODE_ROOM, row_kv, supports_prefix_reuse
from treegrpo.rollout.hf_decode import (
    EOS,
    LENGTH,
    REASONS,
    RUNNING,
    STOP,
    check_stop_strings,
    eos_ids,
    pad_id,
    sample,
)
from treegrpo.rollout.hf_prefill import HFForward, bucketed_prefill, share_prefixes
from treegrpo.rollout.prefix_cache import PrefixCache

__all__ = ["HFEngine"]

Tokens = tuple[int, ...]


def _weights_key(model: torch.nn.Module) -> tuple[tuple[int, int], ...]:
    """Identity and in-place version counter of every parameter: changes whenever a weight does."""
    return tuple((id(p), p._version) for p in model.parameters())


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
        self.stats = EngineStats()
        """The model work done so far (module docstring, *What is counted*); never reset."""
        self._cache_weights_key: tuple[tuple[int, int], ...] | None = None
        self.model: torch.nn.Module
        self.load_weights(model)

    def load_weights(self, model: torch.nn.Module) -> None:
        """Sample from ``model`` from now on (no copy: the trainer's module itself). Empties the
        prefix cache: KV computed with other weights is never reused."""
        first = next(model.parameters(), None)
        if first is not None and first.device != self.device:
            model.to(self.device)
        self.model = model
        self.eos_ids = eos_ids(model, self.tokenizer)
        self.eos_token_id: int | None = self.eos_ids[0] if self.eos_ids else None
        self.pad_token_id = pad_id(model, self.tokenizer, self.eos_ids)
        self._fwd = HFForward.of(model, self.pad_token_id, self.device, self.stats)
        self.max_positions: int | None = getattr(
            getattr(model, "config", None), "max_position_embeddings", None
        )
        self._reuse_supported = supports_prefix_reuse(model)
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
    def _cache_kwarg(self) -> str:
        """The name under which the model's ``forward`` takes the KV cache (``cache`` in 5.x)."""
        return self._fwd.cache_kwarg

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
        seeds: Sequence[int] | None = None,
    ) -> list[Generation]:
        """Sample one step for every context, in one batched call (chunked by ``max_batch_size``).

        Each step ends right after an EOS / stop id / token completing a stop string (that token
        is returned), or after ``params.max_new_tokens`` tokens. Draws come from ``generator``
        (the global RNG when ``None``), so a seeded generator gives reproducible samples; prefix
        reuse does not change which draws are made. ``seeds`` (one per context): each request
        draws from its own CPU generator seeded with its seed instead (``generator`` unused), so
        its tokens do not depend on the other requests or the chunking (up to batch numerics).

        Raises:
            ValueError: an empty context, bad sampling params, stop strings without a tokenizer,
                or a context that cannot fit ``max_new_tokens`` within ``max_position_embeddings``.
        """
        self._validate(contexts, params)
        if seeds is not None and len(seeds) != len(contexts):
            raise ValueError(f"{len(seeds)} seeds for {len(contexts)} contexts: give one seed per context")
        if not contexts:
            return []
        rows = None if seeds is None else [torch.Generator().manual_seed(int(s)) for s in seeds]
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
                    share_prefixes(self._fwd, self.prefix_cache, ctxs, charges, self.max_batch_size)
                for chunk in chunks:
                    own = None if rows is None else [rows[i] for i in chunk]
                    gens = self._generate_batch([ctxs[i] for i in chunk], params, generator, reuse, own)
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
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings need a tokenizer: pass one to HFEngine")
        check_request(contexts, params, self.max_positions, "the model's max_position_embeddings")

    # -- batch assembly, prefill, decode -----------------------------------------------------------

    def _lookup(
        self, seqs: Sequence[Tokens], limits: Sequence[int], reuse: bool
    ) -> list[tuple[int, list[torch.Tensor]]]:
        """Each row's longest stored prefix (at most ``limits[r]`` tokens): length and KV segments."""
        if not reuse:
            return [(0, [])] * len(seqs)
        return [self.prefix_cache.lookup(s, lim) for s, lim in zip(seqs, limits, strict=True)]

    def _generate_batch(
        self,
        contexts: Sequence[Tokens],
        params: SamplingParams,
        generator: torch.Generator | None,
        reuse: bool,
        row_generators: list[torch.Generator] | None = None,
    ) -> list[Generation]:
        """Prefill + decode loop for one batch of contexts (``row_generators``: one per context)."""
        device = self.device
        b = len(contexts)
        # The last context token is always run: its logits give the first sampled token.
        limits = [len(c) - 1 for c in contexts]
        found = self._lookup(contexts, limits, reuse)
        cached = [n for n, _ in found]
        prefill_tokens = [len(c) - k for c, k in zip(contexts, cached, strict=True)]
        # Room for the tokens fed back while decoding (the last sampled token is never run), at
        # most ``DECODE_ROOM`` at a time: steps are usually far shorter than the cap, and every
        # dropped row copies the buffers, room included.
        logits, cache, next_pos, mask = bucketed_prefill(
            self._fwd, contexts, found, prefill_tokens, room=min(params.max_new_tokens - 1, DECODE_ROOM)
        )
        store = reuse and self.prefix_cache.max_bytes != 0

        max_new = params.max_new_tokens
        out_tokens = torch.full((b, max_new), self.pad_token_id, dtype=torch.long, device=device)
        out_logp = torch.zeros((b, max_new), dtype=torch.float32, device=device)
        out_ent = (
            torch.zeros((b, max_new), dtype=torch.float32, device=device) if params.return_entropy else None
        )
        out_len = torch.full((b,), max_new, dtype=torch.long, device=device)
        out_reason = torch.full((b,), LENGTH, dtype=torch.long, device=device)

        eos_t = torch.tensor(self.eos_ids, dtype=torch.long, device=device)
        stop_t = torch.tensor(list(params.stop_token_ids), dtype=torch.long, device=device)
        stop_strings = tuple(params.stop_strings)
        window = 4 * max((len(s) for s in stop_strings), default=0) + 4  # tokens decoded per check

        rows = torch.arange(b, device=device)  # batch row -> original index in this chunk
        for t in range(max_new):
            tok = sample(logits, params.temperature, params.top_p, generator, row_generators)
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
                reason = torch.where(torch.isin(tok, stop_t), STOP, reason)
            if eos_t.numel():
                reason = torch.where(torch.isin(tok, eos_t), EOS, reason)
            done = reason != RUNNING
            if stop_strings:
                done, reason = check_stop_strings(
                    self.tokenizer, out_tokens, rows, t, window, stop_strings, done, reason
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
                if row_generators is not None:
                    row_generators = [row_generators[i] for i in keep.tolist()]
                cache.batch_select_indices(keep)

            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
            logits = self._fwd.decode(tok, mask, next_pos, cache)
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
                finish_reason=REASONS[reason_l[r]],
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
            self.prefix_cache.insert(seq, row_kv(cache, mask, bi))
