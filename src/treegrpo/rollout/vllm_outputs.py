"""What :class:`~treegrpo.rollout.vllm_engine.VLLMEngine` reads from vLLM: a request's output as a
:class:`~treegrpo.rollout.engine.Generation`, the ids vLLM ends a request on as end-of-sequence,
and whether a ready ``vllm.LLM`` records the log-probs the trainer recomputes.

* **EOS ids** (:func:`eos_ids`) — vLLM ends a request on its tokenizer's EOS *and* on every id of
  the generation config's ``eos_token_id`` (an int or a list; vLLM adds the extra ones to the
  request's ``stop_token_ids``). The engine's set is the same: the tokenizer's EOS plus the
  generation config as vLLM read it (``model_config.try_get_generation_config()``), which is the
  set :func:`treegrpo.rollout.hf_decode.eos_ids` gives the HF engine for the same folder.
* **Finish reasons** (:func:`finish_reason`) — ``"length"`` → ``"length"``; ``"stop"`` with
  ``stop_reason=None`` (the tokenizer's EOS) or with a ``stop_reason`` that is one of the EOS ids
  (a generation-config EOS, also when it is one of the request's stop ids) → ``"eos"``; ``"stop"``
  with any other stop id or a stop string → ``"stop"``. The HF engine decides the same way (an
  EOS id wins over a stop id), so both engines end a turn at the model's end-of-turn token.
* **Log-probs** (:func:`check_logprobs_mode`) — the engine needs ``logprobs_mode=
  "processed_logprobs"`` (``log_softmax(logits / T)``, the quantity the HF engine records and the
  trainer recomputes); a ``vllm.LLM`` recording anything else, or a vLLM too old to say (before
  0.10.2: temperature-1 log-probs), is refused.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from treegrpo.errors import ConfigError
from treegrpo.rollout.engine import FinishReason, Generation

__all__ = ["LOGPROBS_MODE", "check_logprobs_mode", "eos_ids", "finish_reason", "to_generation"]

#: The ``logprobs_mode`` the engine needs: ``log_softmax(logits / T)``, the trainer's quantity.
LOGPROBS_MODE = "processed_logprobs"


def _model_config(llm: Any) -> Any:
    return getattr(getattr(llm, "llm_engine", None), "model_config", None)


def eos_ids(llm: Any, tokenizer: Any | None) -> tuple[int, ...]:
    """Every id vLLM ends a request on as end-of-sequence: ``tokenizer``'s EOS first, then the
    generation config's ``eos_token_id`` (int or list) as ``llm`` read it (none when ``llm`` cannot
    say: an older vLLM or a stand-in)."""
    ids: list[int] = []
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if eos is not None:
        ids.append(int(eos))
    read = getattr(_model_config(llm), "try_get_generation_config", None)
    extra = (read() or {}).get("eos_token_id") if callable(read) else None
    for i in [extra] if isinstance(extra, int) else list(extra or []):
        if int(i) not in ids:
            ids.append(int(i))
    return tuple(ids)


def check_logprobs_mode(llm: Any) -> None:
    """Refuse a ``vllm.LLM`` that does not record processed log-probs (see the module docstring).

    Raises:
        ConfigError: its ``logprobs_mode`` is another one, or this vLLM does not record one.
    """
    mode = getattr(_model_config(llm), "logprobs_mode", None)
    mode = getattr(mode, "value", mode)  # an enum in some vLLM versions
    if mode == LOGPROBS_MODE:
        return
    said = (
        "does not say which log-probs it returns (vLLM < 0.10.2 returns temperature-1 ones)"
        if mode is None
        else f"returns logprobs_mode={mode!r}"
    )
    raise ConfigError(
        f"this vllm.LLM {said}, not the trainer's log_softmax(logits / T): build it with "
        f"vllm.LLM(..., logprobs_mode={LOGPROBS_MODE!r}) on vLLM >= 0.10.2, or pass the model folder instead"
    )


def finish_reason(completion: Any, eos: Collection[int] = ()) -> FinishReason:
    """The finish reason of one ``vllm.CompletionOutput``, ``eos`` being the EOS ids (module docstring)."""
    if completion.finish_reason == "length":
        return "length"
    if completion.finish_reason == "stop":
        stop = getattr(completion, "stop_reason", None)
        if stop is None or (isinstance(stop, int) and int(stop) in eos):
            return "eos"
        return "stop"
    raise RuntimeError(f"vLLM request ended with finish_reason={completion.finish_reason!r}")


def to_generation(output: Any, context_len: int, eos: Sequence[int] = ()) -> Generation:
    """A ``vllm.RequestOutput`` (one completion) as a :class:`Generation`: the sampled ids, their
    log-probs, the finish reason (``eos``: the EOS ids) and the prefill not served from the prefix
    cache (``extra["cached_tokens"]``: the cache hit, when vLLM reports it)."""
    if not output.outputs:
        raise RuntimeError(f"vLLM returned no completion for request {getattr(output, 'request_id', '?')}")
    comp = output.outputs[0]
    tokens = [int(t) for t in comp.token_ids]
    per_pos = comp.logprobs
    if per_pos is None or len(per_pos) != len(tokens):
        raise RuntimeError(
            "vLLM returned no per-token log-probs (the request must ask for logprobs=0): "
            f"{0 if per_pos is None else len(per_pos)} for {len(tokens)} tokens"
        )
    logprobs = []
    for pos, tok in zip(per_pos, tokens, strict=True):
        lp = pos[tok]  # the sampled token is always among the returned ones
        logprobs.append(float(getattr(lp, "logprob", lp)))
    reason = finish_reason(comp, frozenset(eos))
    cached = getattr(output, "num_cached_tokens", None)
    extra: dict[str, float] = {}
    prefill = context_len
    if cached is not None:
        prefill = context_len - int(cached)
        extra["cached_tokens"] = float(cached)
    return Generation(tokens, logprobs, reason, prefill_tokens=prefill, extra=extra)
