"""A vLLM engine (optional extra ``vllm``, GPU): token-in/token-out steps with automatic prefix caching.

Install with ``pip install 'treegrpo[vllm]'``. This module imports without vLLM; using the engine
without it raises an :class:`ImportError` that says so.

What it does, per :class:`~treegrpo.rollout.engine.Engine` contract:

* **Token in, token out** — every context goes in as ``TokensPrompt(prompt_token_ids=...)``; the
  step is ``CompletionOutput.token_ids`` as sampled (never decoded and re-encoded, DESIGN.md §3.1).
* **Stop at the action** — ``stop_token_ids`` and ``stop`` strings come from
  :class:`~treegrpo.rollout.engine.SamplingParams`, with ``include_stop_str_in_output=True``. vLLM
  keeps the stop id (and EOS) in ``token_ids``; a stop string ends generation on the token that
  completes it (vLLM only truncates the *text*, the ids end with that token), which is this
  library's rule too. ``finish_reason``: vLLM ``"length"`` → ``"length"``; ``"stop"`` with
  ``stop_reason=None`` → ``"eos"``; ``"stop"`` with a stop id/string → ``"stop"``.
* **Log-probs** — ``logprobs=0`` asks for the sampled token's log-prob only (vLLM always adds the
  sampled token to the top-``k`` it returns, here ``k = 0``). vLLM V1's sampler returns them
  *raw* by default (``logprobs_mode="raw_logprobs"``: ``log_softmax`` of the model's logits
  before temperature, penalties, top-k/top-p), the same quantity as the HF engine (the
  policy at temperature 1). :meth:`VLLMEngine.from_pretrained` sets ``logprobs_mode`` explicitly
  when the installed vLLM has the option. Full-distribution entropies are not available
  (``return_entropy=True`` is refused).
* **Prefill accounting** — ``enable_prefix_caching=True``; ``prefill_tokens = len(context) -
  RequestOutput.num_cached_tokens`` (prefix-cache hits are not computed; vLLM caches whole blocks
  and always recomputes at least the last prompt token). Where an older vLLM does not report
  ``num_cached_tokens``, the full context length is reported (an upper bound) and
  ``extra["cached_tokens"]`` is absent.
* **Weight sync** — :meth:`VLLMEngine.load_weights` pushes the trainer module's ``state_dict``
  into the vLLM model through ``LLM.collective_rpc`` (each worker calls
  ``model_runner.model.load_weights(weights)``, which takes Hugging Face parameter names and
  handles fused QKV / gate-up layouts and tied embeddings), then calls ``LLM.reset_prefix_cache()``
  so no KV computed with the old weights is reused. With vLLM's engine core in-process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, what :meth:`VLLMEngine.from_pretrained` sets by default
  for a trainer and vLLM sharing one GPU) the tensors are passed by reference; otherwise they are
  moved to CPU and pickled to the workers (``cpu_weight_sync=True``), in chunks of
  ``sync_chunk_mb``. Pre-``collective_rpc`` vLLM (V0) is reached through
  ``llm.llm_engine.model_executor.driver_worker.model_runner.model``.

Targeted API: vLLM V1 as of 0.10–0.11 (``LLM.generate(prompts, sampling_params=..., use_tqdm=...)``,
``vllm.TokensPrompt``, ``vllm.SamplingParams``, ``RequestOutput.num_cached_tokens``,
``LLM.collective_rpc``, ``LLM.reset_prefix_cache``, ``EngineArgs.logprobs_mode``); it only uses
long-standing fields, so later releases with the same public surface work too. Reproducibility:
with a ``torch.Generator`` each request gets its own ``seed`` drawn from it.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from treegrpo.rollout.engine import FinishReason, Generation, SamplingParams

__all__ = ["INSTALL_HINT", "VLLMEngine", "make_vllm_engine", "vllm_available"]

INSTALL_HINT = "pip install 'treegrpo[vllm]'"


def vllm_available() -> bool:
    """Whether vLLM can be imported here."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def _import_vllm() -> ModuleType:
    """Import vLLM or fail with the install command."""
    try:
        import vllm
    except ImportError as e:
        raise ImportError(
            f"VLLMEngine needs vLLM (a GPU inference engine), which is not installed: {INSTALL_HINT}"
        ) from e
    return vllm


def _load_into_worker(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> int:
    """Runs inside each vLLM worker (``LLM.collective_rpc``): load HF-named tensors into its model."""
    runner = getattr(worker, "model_runner", None)
    if runner is None:  # a wrapper around the real worker
        runner = worker.worker.model_runner
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    model.load_weights(weights=weights)
    return len(weights)


def _chunks(
    items: Iterable[tuple[str, torch.Tensor]], max_bytes: int
) -> Iterable[list[tuple[str, torch.Tensor]]]:
    """Group ``(name, tensor)`` pairs into lists of at most ``max_bytes`` (a bigger tensor alone)."""
    chunk: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in items:
        nb = t.numel() * t.element_size()
        if chunk and size + nb > max_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append((name, t))
        size += nb
    if chunk:
        yield chunk


class VLLMEngine:
    """Samples agent steps with vLLM (see the module docstring for the exact semantics).

    Args:
        llm: a ``vllm.LLM`` built with ``enable_prefix_caching=True`` (or anything with the same
            ``generate`` / ``collective_rpc`` / ``reset_prefix_cache`` surface).
        tokenizer: gives the EOS id; defaults to ``llm.get_tokenizer()``.
        max_model_len: context + step limit; defaults to the engine's ``model_config.max_model_len``.
        cpu_weight_sync: move weights to CPU before pushing them (needed when the workers run in
            other processes); ``False`` passes the trainer's tensors by reference (in-process engine).
        sync_chunk_mb: weights are pushed in chunks of about this many MiB.
        vllm_module: the ``vllm`` module to build requests with (tests pass a stand-in).
    """

    def __init__(
        self,
        llm: Any,
        tokenizer: Any | None = None,
        *,
        max_model_len: int | None = None,
        cpu_weight_sync: bool = False,
        sync_chunk_mb: float = 1024.0,
        vllm_module: ModuleType | None = None,
    ) -> None:
        self._vllm = vllm_module if vllm_module is not None else _import_vllm()
        self.llm = llm
        if tokenizer is None and hasattr(llm, "get_tokenizer"):
            tokenizer = llm.get_tokenizer()
        self.tokenizer = tokenizer
        eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        self.eos_token_id: int | None = int(eos) if eos is not None else None
        if max_model_len is None:
            cfg = getattr(getattr(llm, "llm_engine", None), "model_config", None)
            max_model_len = getattr(cfg, "max_model_len", None)
        self.max_model_len: int | None = max_model_len
        self.cpu_weight_sync = cpu_weight_sync
        self.sync_chunk_bytes = max(1, int(sync_chunk_mb * 2**20))

    @classmethod
    def from_pretrained(
        cls,
        folder: str | Path,
        *,
        tokenizer: Any | None = None,
        dtype: str = "auto",
        gpu_memory_utilization: float = 0.4,
        max_model_len: int | None = None,
        seed: int = 0,
        in_process: bool = True,
        enforce_eager: bool = False,
        **llm_kwargs: Any,
    ) -> VLLMEngine:
        """Build a ``vllm.LLM`` on a local model folder with prefix caching on.

        ``tokenizer`` gives the EOS id and the ids of the stop strings' tokens; pass the one the
        trainer uses (e.g. :func:`treegrpo.models.tiny.load_tokenizer` of the folder, exact for
        locally trained tokenizers). Without it, vLLM's own tokenizer of the folder is used.
        ``in_process=True`` runs vLLM's engine core in this process
        (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set only if not already set) so weight sync passes
        tensors by reference; ``gpu_memory_utilization`` leaves room for a trainer on the same
        GPU. Extra keyword arguments go to ``vllm.LLM``.
        """
        vllm = _import_vllm()
        if in_process:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        kwargs: dict[str, Any] = {
            "model": str(folder),
            "enable_prefix_caching": True,
            "dtype": dtype,
            "gpu_memory_utilization": gpu_memory_utilization,
            "seed": seed,
            "enforce_eager": enforce_eager,
        }
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        engine_args = getattr(vllm, "EngineArgs", None)
        fields = (
            {f.name for f in dataclasses.fields(engine_args)}
            if engine_args is not None and dataclasses.is_dataclass(engine_args)
            else set()
        )
        if "logprobs_mode" in fields:  # vLLM >= 0.10: say explicitly that log-probs are raw
            kwargs["logprobs_mode"] = "raw_logprobs"
        kwargs.update(llm_kwargs)
        llm = vllm.LLM(**kwargs)
        return cls(
            llm, tokenizer, max_model_len=max_model_len, cpu_weight_sync=not in_process, vllm_module=vllm
        )

    # ------------------------------------------------------------------ requests

    def _validate(self, contexts: Sequence[Sequence[int]], params: SamplingParams) -> None:
        if params.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {params.max_new_tokens}")
        if params.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {params.temperature}")
        if not 0.0 < params.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
        if any(not s for s in params.stop_strings):
            raise ValueError("stop_strings must be non-empty strings")
        if params.return_entropy:
            raise ValueError(
                "VLLMEngine cannot return full-distribution entropies (vLLM returns top-k log-probs only); "
                "use -log p of the sampled token (EPTree's default) or HFEngine"
            )
        for i, ctx in enumerate(contexts):
            if len(ctx) == 0:
                raise ValueError(f"context {i} is empty: a step needs at least one context token")
            if self.max_model_len is not None and len(ctx) + params.max_new_tokens > self.max_model_len:
                raise ValueError(
                    f"context {i} has {len(ctx)} tokens; with max_new_tokens={params.max_new_tokens} it exceeds "
                    f"vLLM's max_model_len={self.max_model_len}"
                )

    def sampling_params(self, params: SamplingParams, seed: int | None = None) -> Any:
        """The ``vllm.SamplingParams`` of one request."""
        return self._vllm.SamplingParams(
            n=1,
            max_tokens=params.max_new_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            stop_token_ids=list(params.stop_token_ids),
            stop=list(params.stop_strings),
            include_stop_str_in_output=True,
            logprobs=0,
            seed=seed,
            skip_special_tokens=False,
            spaces_between_special_tokens=False,
        )

    def build_requests(
        self,
        contexts: Sequence[Sequence[int]],
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> tuple[list[Any], list[Any]]:
        """Token prompts and per-request sampling params. With ``generator`` every request gets a
        seed drawn from it (reproducible rollouts); without, vLLM's own RNG is used."""
        prompts = [self._vllm.TokensPrompt(prompt_token_ids=[int(t) for t in c]) for c in contexts]
        if generator is None:
            seeds: list[int | None] = [None] * len(contexts)
        else:
            seeds = torch.randint(0, 2**31 - 1, (len(contexts),), generator=generator).tolist()
        return prompts, [self.sampling_params(params, s) for s in seeds]

    # ------------------------------------------------------------------ outputs

    @staticmethod
    def to_generation(output: Any, context_len: int) -> Generation:
        """A ``vllm.RequestOutput`` (one completion) as a :class:`Generation`."""
        if not output.outputs:
            raise RuntimeError(
                f"vLLM returned no completion for request {getattr(output, 'request_id', '?')}"
            )
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
        reason: FinishReason
        if comp.finish_reason == "length":
            reason = "length"
        elif comp.finish_reason == "stop":
            reason = "eos" if getattr(comp, "stop_reason", None) is None else "stop"
        else:
            raise RuntimeError(f"vLLM request ended with finish_reason={comp.finish_reason!r}")
        cached = getattr(output, "num_cached_tokens", None)
        extra: dict[str, float] = {}
        prefill = context_len
        if cached is not None:
            prefill = context_len - int(cached)
            extra["cached_tokens"] = float(cached)
        return Generation(tokens, logprobs, reason, prefill_tokens=prefill, extra=extra)

    # ------------------------------------------------------------------ Engine API

    def generate(
        self,
        contexts: Sequence[Sequence[int]],
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> list[Generation]:
        """Sample one step for every context in one ``LLM.generate`` call (vLLM batches them)."""
        self._validate(contexts, params)
        if not contexts:
            return []
        prompts, sps = self.build_requests(contexts, params, generator)
        outputs = self.llm.generate(prompts, sampling_params=sps, use_tqdm=False)
        if len(outputs) != len(contexts):
            raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(contexts)} requests")
        return [self.to_generation(o, len(c)) for o, c in zip(outputs, contexts, strict=True)]

    def load_weights(self, model: torch.nn.Module) -> None:
        """Push ``model``'s current weights into vLLM, then drop vLLM's prefix cache (its KV was
        computed with the old weights)."""
        state = model.state_dict()
        items = [(name, t.detach()) for name, t in state.items()]
        if self.cpu_weight_sync:
            items = [(name, t.to("cpu")) for name, t in items]
        for chunk in _chunks(items, self.sync_chunk_bytes):
            self._push(chunk)
        reset = getattr(self.llm, "reset_prefix_cache", None)
        if callable(reset) and reset() is False:
            warnings.warn("vLLM refused to reset its prefix cache (requests still running?)", stacklevel=2)

    def _push(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        rpc = getattr(self.llm, "collective_rpc", None)
        if callable(rpc):
            rpc(_load_into_worker, args=(weights,))
            return
        # vLLM V0 (no collective_rpc): the driver worker's model, in this process.
        model = self.llm.llm_engine.model_executor.driver_worker.model_runner.model
        model.load_weights(weights=weights)


def make_vllm_engine(
    model: Any, tokenizer: Any | None = None, *, device: str | torch.device = "cuda", **options: Any
) -> VLLMEngine:
    """The ``"vllm"`` entry of :func:`~treegrpo.rollout.engine.make_engine`.

    ``model`` is one of:

    * a model folder (``str`` / ``Path``): :meth:`VLLMEngine.from_pretrained` on it;
    * a loaded ``transformers`` model (the trainer's): vLLM is built from the folder it was loaded
      from (``model.name_or_path``), then given the module's current weights
      (:meth:`VLLMEngine.load_weights`), so it samples from exactly what the trainer holds;
    * anything else is taken as a ready ``vllm.LLM`` (:class:`VLLMEngine` wraps it).

    ``options`` go to :meth:`VLLMEngine.from_pretrained` (or the constructor for a ready LLM).
    vLLM places the model on its GPU itself (choose it with ``CUDA_VISIBLE_DEVICES``); ``device``
    must be a CUDA device.

    Raises:
        ImportError: vLLM is not installed (the message gives the install command).
        ValueError: ``device`` is not a CUDA device, or a module with no folder to build vLLM from.
    """
    if options.get("vllm_module") is None:
        _import_vllm()
    if torch.device(device).type != "cuda":
        raise ValueError(f"the vllm engine runs on a CUDA GPU, not device={device!s}: use the hf engine there")
    if isinstance(model, str | Path):
        return VLLMEngine.from_pretrained(model, tokenizer=tokenizer, **options)
    if isinstance(model, torch.nn.Module):
        folder = getattr(model, "name_or_path", None) or getattr(
            getattr(model, "config", None), "_name_or_path", None
        )
        if not folder:
            raise ValueError(
                "the vllm engine builds vLLM from a model folder, and this model has no name_or_path: "
                "pass the folder, or load the model with from_pretrained"
            )
        engine = VLLMEngine.from_pretrained(folder, tokenizer=tokenizer, **options)
        engine.load_weights(model)
        return engine
    return VLLMEngine(model, tokenizer, **options)
