"""A ``transformers`` engine: batched, KV-cached sampling of one agent step per context.

One :meth:`HFEngine.generate` call runs all contexts as one left-padded batch (chunked by
``max_batch_size``): a prefill over the padded contexts, then an incremental decode loop with a
:class:`~transformers.DynamicCache`. Position ids are always passed explicitly
(``cumsum(attention_mask) - 1``), so a left-padded row sees exactly the positions it would see
alone. Rows that finish are dropped from the batch (and from the KV cache), and the loop ends as
soon as every row has finished.

Log-probs and entropies are those of the model's own distribution — ``log_softmax`` of the raw
logits at temperature 1, without top-p — whatever temperature / top-p was used to draw the token,
so they are the "old log-probs" a PPO-style trainer needs (:class:`~treegrpo.rollout.engine.Generation`).

transformers 5.x renamed the forward kwarg ``past_key_values`` to ``cache`` (the old name still
works in 5.24 with a deprecation warning, removal announced for 5.40); the engine passes
whichever name the model's ``forward`` declares.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from treegrpo.rollout.engine import FinishReason, Generation, SamplingParams

__all__ = ["HFEngine"]

# Finish-reason codes used on tensors inside the decode loop.
_RUNNING, _STOP, _EOS, _LENGTH = 0, 1, 2, 3
_REASONS: dict[int, FinishReason] = {_STOP: "stop", _EOS: "eos", _LENGTH: "length"}


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


class HFEngine:
    """Samples agent steps from a ``transformers`` causal LM (CPU or GPU).

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
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any | None = None,
        device: str | torch.device = "cpu",
        max_batch_size: int | None = None,
    ) -> None:
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1 or None, got {max_batch_size}")
        self.device = torch.device(device)
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
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
    ) -> HFEngine:
        """Load a local causal LM folder (a tiny model or any real one) with its tokenizer."""
        from treegrpo.models.tiny import load_model, load_tokenizer

        model = load_model(folder, dtype=dtype, attn_implementation=attn_implementation)
        tokenizer = load_tokenizer(folder)
        return cls(model, tokenizer, device=device, max_batch_size=max_batch_size)

    def load_weights(self, model: torch.nn.Module) -> None:
        """Sample from ``model`` from now on (no copy: the trainer's module itself)."""
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
        (the global RNG when ``None``), so a seeded generator gives reproducible samples.

        Raises:
            ValueError: an empty context, bad sampling params, stop strings without a tokenizer,
                or a context that cannot fit ``max_new_tokens`` within ``max_position_embeddings``.
        """
        self._validate(contexts, params)
        if not contexts:
            return []
        n = len(contexts)
        bs = self.max_batch_size or n
        if bs >= n:
            chunks = [list(range(n))]
        else:
            # Group similar lengths to keep padding small; results are put back in input order.
            order = sorted(range(n), key=lambda i: len(contexts[i]))
            chunks = [order[i : i + bs] for i in range(0, n, bs)]

        results: list[Generation | None] = [None] * n
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                for chunk in chunks:
                    gens = self._generate_batch([contexts[i] for i in chunk], params, generator)
                    for i, g in zip(chunk, gens, strict=True):
                        results[i] = g
        finally:
            self.model.train(was_training)
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
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache: DynamicCache | None = None
    ) -> tuple[torch.Tensor, DynamicCache, torch.Tensor]:
        """Run the (left-padded) contexts through the model.

        ``cache`` is the hook for prefix-KV reuse: when given, it already holds the first
        ``attention_mask.shape[1] - input_ids.shape[1]`` positions and only ``input_ids`` (the
        uncached suffix) is computed.

        Returns:
            the last-position logits ``(B, V)``, the filled cache, and each row's next position id ``(B,)``.
        """
        if cache is None:
            cache = DynamicCache(config=getattr(self.model, "config", None))
        position_ids = (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)
        position_ids = position_ids[:, -input_ids.shape[1] :]
        logits = self._forward(input_ids, attention_mask, position_ids, cache, last_only=True)
        next_pos = attention_mask.long().sum(dim=-1)
        return logits, cache, next_pos

    def _generate_batch(
        self, contexts: Sequence[Sequence[int]], params: SamplingParams, generator: torch.Generator | None
    ) -> list[Generation]:
        """Prefill + decode loop for one batch of contexts."""
        device = self.device
        b = len(contexts)
        lengths = [len(c) for c in contexts]
        width = max(lengths)
        ids = torch.full((b, width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((b, width), dtype=torch.long)
        for r, ctx in enumerate(contexts):
            ids[r, width - len(ctx) :] = torch.as_tensor(list(ctx), dtype=torch.long)
            mask[r, width - len(ctx) :] = 1
        ids, mask = ids.to(device), mask.to(device)

        logits, cache, next_pos = self._prefill(ids, mask)
        prefill_tokens = lengths  # no prefix reuse yet: every context token was computed

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
            logp_all = torch.log_softmax(logits, dim=-1)
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
                break
            if bool(done.any()):
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
            )
            for r in range(b)
        ]

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
