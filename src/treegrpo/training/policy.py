"""The policy a run trains, set up in one place: weights, LoRA adapter, KL reference, data-parallel
wrapping, the rollout view, and saving/restoring its weights and optimizer state.

:meth:`Policy.build` does the whole set-up from a loaded model and the run's config, in order:

1. gradient checkpointing when asked (:func:`prepare_model`), a LoRA adapter when
   ``lora_rank > 0`` (peft, :func:`~treegrpo.models.lora.apply_lora`);
2. the KL reference (:func:`reference_of`): none without a KL term, the same model with its adapter
   disabled for LoRA (no copy), else a frozen copy;
3. data parallelism (:meth:`Policy.distribute`, several processes only): DDP
   (``broadcast_buffers=False``, gradients summed by a comm hook) or FSDP2 (``fully_shard`` of each
   decoder layer and the root, gradients summed; a full-weight copy kept for the rollout engine).

Afterwards the trainer, its update, evaluation and checkpointing reach the model only through the
policy's views:

=====================================  ==========================================================
:meth:`Policy.trainable_parameters`    what the optimizer steps (all, or the LoRA adapter's)
:meth:`Policy.grad_module`             gradient-taking forwards (the DDP wrapper, else the model)
:meth:`Policy.sync`                    around one micro-batch: gradients reduced on the last only
:meth:`Policy.local_module`            full weights, no collective in forward (packing probe)
:meth:`Policy.rollout_module`          what the engine samples from (FSDP2: the refreshed copy)
:meth:`Policy.save`                    a checkpoint generation (weights, optimizer, run state)
:meth:`Policy.restore`                 a checkpoint's weights (LoRA: adapter) and optimizer state
=====================================  ==========================================================

With one process every view is the model itself (or, under LoRA, the transformers model inside
the peft wrapper for the engine) and nothing touches ``torch.distributed``. ``Policy(model)``
(no reference, one process) is the plain policy the update's tests use.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch

from treegrpo.errors import ConfigError
from treegrpo.models.loader import load_model
from treegrpo.models.lora import AdapterDisabled, apply_lora, is_lora, load_adapter, sampling_module
from treegrpo.training import logprobs
from treegrpo.training.checkpoint import Checkpoint, RunState, save_run
from treegrpo.training.config import TrainConfig
from treegrpo.training.distributed import SINGLE, Parallel

Reference = torch.nn.Module | AdapterDisabled
"""The KL reference policy: a frozen model, or (LoRA) the policy with its adapter disabled."""

_T = TypeVar("_T")


def with_reference(ref: Reference, fn: Callable[[torch.nn.Module], _T]) -> _T:
    """``fn(module)`` for the reference policy: a LoRA reference runs inside
    ``model.disable_adapter()``, a frozen model as it is."""
    if isinstance(ref, AdapterDisabled):
        with ref.active() as module:
            return fn(module)
    return fn(ref)


def prepare_model(model: torch.nn.Module, cfg: TrainConfig) -> torch.nn.Module:
    """The module trained: ``model`` (loaded in ``cfg.dtype``) with gradient checkpointing
    (transformers' ``gradient_checkpointing_enable``, non-reentrant; ``activation_checkpointing_enable``
    as transformers >= 5.x names it) when asked, wrapped with a LoRA adapter (peft) when
    ``cfg.lora_rank > 0``. (``auto`` fields unresolved by
    :func:`~treegrpo.training.defaults.resolve_model_defaults` count as off.)"""
    if cfg.gradient_checkpointing is True:
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        elif hasattr(model, "gradient_checkpointing_enable"):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            raise ConfigError(
                f"gradient_checkpointing: {type(model).__name__} has no gradient_checkpointing_enable (not a transformers model)"
            )
    if cfg.lora_rank and not is_lora(model):
        model = apply_lora(
            model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_modules, seed=cfg.seed
        )
    return model


def reference_of(model: torch.nn.Module, cfg: TrainConfig) -> Reference | None:
    """The KL reference (the starting policy), ``None`` without a KL term: for LoRA the same
    model with its adapter disabled (no copy), otherwise a frozen copy."""
    if cfg.kl_coef <= 0:
        return None
    if is_lora(model):
        return AdapterDisabled(model)
    ref = copy.deepcopy(model)
    ref.eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def _sum_hook(group: Any, bucket: Any) -> Any:
    """DDP comm hook: gradients are summed, not averaged (each rank's loss is its global share)."""
    import torch.distributed as dist

    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


_sum_hook.__annotations__ = {}  # DDP checks real annotations; these are strings (__future__)


class Policy:
    """The trained model of a run with its reference and its data-parallel wrapping (module
    docstring). ``model`` is trained in place; ``reference`` is the KL reference (or ``None``);
    ``parallel`` is this process's place in the job (its collectives)."""

    def __init__(
        self, model: torch.nn.Module, reference: Reference | None = None, parallel: Parallel = SINGLE
    ) -> None:
        self.model = model
        self.reference = reference
        self.parallel = parallel
        self._ddp: torch.nn.Module | None = None  # the DDP wrapper of the model (kind ddp)
        self._rollout_copy: torch.nn.Module | None = None  # full weights for the engine (kind fsdp2)
        self._fsdp: list[torch.nn.Module] = []  # every fully_shard-ed module (kind fsdp2)

    @classmethod
    def build(cls, model: torch.nn.Module, cfg: TrainConfig, parallel: Parallel = SINGLE) -> Policy:
        """The run's policy from a loaded ``model``: :func:`prepare_model`, :func:`reference_of`,
        then :meth:`distribute` over ``parallel``'s processes on ``cfg.device``."""
        model = prepare_model(model, cfg)  # + gradient checkpointing, LoRA adapter
        policy = cls(model, reference_of(model, cfg), parallel)  # the starting policy as reference
        policy.distribute(cfg.device)  # DDP, or FSDP2 shards (several processes only)
        return policy

    @property
    def sharded(self) -> bool:
        """Whether the weights are FSDP2 shards (full weights only in the rollout copy)."""
        return self._rollout_copy is not None

    # -- set-up -----------------------------------------------------------------------------------

    def distribute(self, device: str = "cpu") -> None:
        """Make the model (and a frozen reference model) data-parallel in place: DDP
        (``broadcast_buffers=False``, summed gradients) or FSDP2 (``fully_shard`` of each decoder
        layer and the root, gradients summed; a full copy kept for the rollout engine). One
        process: nothing."""
        par = self.parallel
        if not par.active:
            return
        if par.kind == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            dev = torch.device(device)
            ids = [dev.index or 0] if dev.type == "cuda" else None
            # no buffer broadcast in forward (a collective even under no_grad); newer torch names it
            # forward_sync_buffers (which still syncs once at init: the buffers are equal anyway)
            new = "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
            no_bcast = {"forward_sync_buffers": False} if new else {"broadcast_buffers": False}
            self._ddp = DDP(self.model, device_ids=ids, **no_bcast)
            self._ddp.register_comm_hook(None, _sum_hook)
            return
        if is_lora(self.model):
            raise ConfigError(
                "parallel=fsdp2 does not train LoRA adapters; use parallel=ddp with lora_rank > 0"
            )
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(torch.device(device).type, (par.world,))
        self._rollout_copy = copy.deepcopy(self.model)
        ref = self.reference
        for m in [self.model] + ([ref] if isinstance(ref, torch.nn.Module) else []):
            for sub in m.modules():
                if type(sub).__name__.endswith("DecoderLayer"):
                    fully_shard(sub, mesh=mesh)
                    self._fsdp.append(sub)
            fully_shard(m, mesh=mesh)
            self._fsdp.append(m)
            logprobs._SPLIT_HEAD[m] = False  # the decoder alone skips the root's all-gather: full logits
        for m in self._fsdp:
            m.set_gradient_divide_factor(1.0)  # type: ignore[operator]
            m.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]  # plain SUM (gloo has no PREMUL_SUM)

    # -- views ------------------------------------------------------------------------------------

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters the optimizer steps: all, or the LoRA adapter's."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def grad_module(self) -> torch.nn.Module:
        """The module gradient-taking forwards go through: the DDP wrapper, else the model."""
        return self._ddp if self._ddp is not None else self.model

    def local_module(self) -> torch.nn.Module:
        """A module with the full current weights whose forward is no collective (for the packing
        probe): the model, or FSDP2's rollout copy."""
        return self._rollout_copy if self._rollout_copy is not None else self.model

    def rollout_module(self) -> torch.nn.Module:
        """The module the rollout engine samples from (:func:`~treegrpo.models.lora.sampling_module`
        of the model); under FSDP2 the full copy, first refreshed from the shards (a collective:
        every rank calls it)."""
        if self._rollout_copy is None:
            return sampling_module(self.model)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        with torch.no_grad():
            self._rollout_copy.load_state_dict(full)
        return self._rollout_copy

    @contextlib.contextmanager
    def sync(self, last: bool) -> Iterator[None]:
        """Around one micro-batch's forward and backward: gradients are reduced across ranks only
        on the ``last`` micro-batch of a mini-batch (DDP ``no_sync`` / FSDP2 gradient sync off)."""
        if self._ddp is not None and not last:
            with self._ddp.no_sync():  # type: ignore[operator]
                yield
            return
        for m in self._fsdp:
            m.set_requires_gradient_sync(last)  # type: ignore[operator]
        yield

    # -- save and restore -------------------------------------------------------------------------

    def save(
        self,
        folder: Path,
        run: RunState,
        tokenizer: Any,
        optimizer: torch.optim.Optimizer,
        cfg: TrainConfig,
        extra_files: dict[str, str] | None = None,
    ) -> None:
        """Checkpoint the run into ``folder`` (:func:`~treegrpo.training.checkpoint.save_run`: full
        weights — a LoRA model merged, with its adapter —, tokenizer, optimizer, ``run``, config).
        Every rank calls it (FSDP2 gathers weights and optimizer state); rank 0 writes."""
        weights = self.rollout_module() if self.sharded else self.model
        opt_state = self.optimizer_state(optimizer)
        if self.parallel.main:
            save_run(folder, run, weights, tokenizer, optimizer, cfg, extra_files, opt_state)

    def restore(self, ck: Checkpoint, optimizer: torch.optim.Optimizer) -> None:
        """Load ``ck``'s weights (a LoRA model: its adapter, from ``lora_adapter/``, exactly; the
        base stays the run's frozen ``--model``) and optimizer state (FSDP2: each rank keeps its
        shard); a checkpoint that does not fit is one :class:`ConfigError` line."""
        try:
            if is_lora(self.model):
                load_adapter(self.model, ck.folder)
            else:
                self.load_weights(load_model(ck.folder, dtype=_dtype(self.model)).state_dict())
            self.load_optimizer_state(optimizer, ck.optimizer)
        except (RuntimeError, ValueError, KeyError, OSError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(
                f"cannot load the checkpoint {ck.folder} into this run's model: {first[:200]}"
            ) from None

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load full weights into the model (FSDP2: each rank keeps its shard)."""
        if not self.sharded:
            self.model.load_state_dict(weights)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(self.model, weights, options=StateDictOptions(full_state_dict=True))

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state as one process's ``optimizer.state_dict()`` (parameters by
        index); FSDP2 gathers it from the shards (a collective; ``{}`` on ranks other than 0)."""
        if not self.sharded:
            return optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        full = get_optimizer_state_dict(
            self.model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if not full:  # cpu_offload: only rank 0 receives it (the rank that writes)
            return {}
        index = {name: i for i, name in enumerate(self._trainable_names())}
        return {
            "state": {index[k]: v for k, v in full["state"].items()},
            "param_groups": [{**g, "params": [index[k] for k in g["params"]]} for g in full["param_groups"]],
        }

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Load an :meth:`optimizer_state` (FSDP2: each rank keeps its shard)."""
        if not self.sharded:
            optimizer.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        names = self._trainable_names()
        full = {
            "state": {names[int(k)]: v for k, v in state["state"].items()},
            "param_groups": [
                {**g, "params": [names[int(i)] for i in g["params"]]} for g in state["param_groups"]
            ],
        }
        set_optimizer_state_dict(self.model, optimizer, full, options=StateDictOptions(full_state_dict=True))

    def _trainable_names(self) -> list[str]:
        return [n for n, p in self.model.named_parameters() if p.requires_grad]


def _dtype(model: torch.nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


__all__ = ["Policy", "Reference", "prepare_model", "reference_of", "with_reference"]
