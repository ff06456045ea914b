"""When to train packed: what the configuration asks (:func:`wants_packing`) and whether the
model trains correctly on packed rows (:func:`packing_supported`, probed once per model)."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence

import torch

from treegrpo.algos.losses import LossConfig
from treegrpo.training.batching import TrainSequence, collate, token_logprobs
from treegrpo.training.config import TrainConfig
from treegrpo.training.packing.forward import packed_logprobs
from treegrpo.training.packing.layout import pack_forests
from treegrpo.training.packing.loss import PACKABLE_POLICY_LOSSES
from treegrpo.tree import Forest

_log = logging.getLogger("treegrpo.training")

# Per model: None = packing verified, str = why the model cannot train packed.
_PACKING_CHECKED: weakref.WeakKeyDictionary[torch.nn.Module, str | None] = weakref.WeakKeyDictionary()

__all__ = ["_PACKING_CHECKED", "packing_supported", "wants_packing"]


def wants_packing(cfg: TrainConfig, loss_cfg: LossConfig) -> bool:
    """Whether the configuration asks for packed training (before asking the model)."""
    if cfg.packing == "off":
        return False
    if loss_cfg.policy_loss not in PACKABLE_POLICY_LOSSES:
        if cfg.packing == "on":
            raise ValueError(
                f"packing=on needs a token-wise policy loss ({', '.join(sorted(PACKABLE_POLICY_LOSSES))}); "
                f"got {loss_cfg.policy_loss!r}"
            )
        return False
    return True


def packing_supported(
    model: torch.nn.Module,
    forests: Sequence[Forest],
    pad_id: int,
    device: str | torch.device = "cpu",
    strict: bool = False,
    log: Callable[[str], object] | None = None,
    chunk_tokens: int | None = None,
) -> bool:
    """Whether ``model`` trains correctly on packed rows; probed once per model, then cached.

    The probe packs up to three paths of the largest forest, runs one packed forward (no grad,
    eval mode) and compares its log-probs with the per-path forward of the same paths. An
    exception (a model that rejects a 4D mask or ``position_ids``) or a mismatch (a model that
    silently ignores them) marks the model as not packable: one line goes to ``log`` and the
    caller trains per path; with ``strict`` a RuntimeError is raised instead. ``chunk_tokens``:
    both forwards read their log-probs as training does (``logprob_chunk_tokens``, see
    :func:`~treegrpo.training.logprobs.model_logprobs`), so the probe never holds the full logits
    of three whole paths (3 × 4k tokens × 49152 ids × 4 bytes = 2.4 GB per copy for SmolLM2).
    """
    if model not in _PACKING_CHECKED:
        decided, reason = _probe(model, forests, pad_id, device, chunk_tokens)
        if not decided:
            return True  # no path to probe on, so nothing to train either: decide on the next batch
        _PACKING_CHECKED[model] = reason
        if reason is not None and not strict:
            (log or _log.warning)(
                f"packed training off: the model rejects custom 4D attention masks ({reason}); training per path"
            )
    reason = _PACKING_CHECKED[model]
    if reason is not None and strict:
        raise RuntimeError(f"packing=on, but the model cannot train packed: {reason}")
    return reason is None


@torch.no_grad()
def _probe(
    model: torch.nn.Module,
    forests: Sequence[Forest],
    pad_id: int,
    device: str | torch.device,
    chunk_tokens: int | None = None,
) -> tuple[bool, str | None]:
    """``(decided, reason)``: reason None when packed log-probs match per-path ones on a few real
    paths; ``decided`` is False when the batch has no path to probe on."""
    if not forests or not any(f.n_trajectories() for f in forests):
        return False, None
    big = max(range(len(forests)), key=lambda i: forests[i].n_trajectories())
    n = forests[big].n_trajectories()
    pick = sorted({0, n // 2, max(n - 1, 0)}) if n else []
    select = [pick if i == big else [] for i in range(len(forests))]
    was_training = model.training
    model.eval()
    try:
        (mb,) = pack_forests(forests, select=select, pad_id=pad_id, max_tokens=1 << 30)
        mb = mb.to(device)
        packed = mb.unpack(packed_logprobs(model, mb, chunk_tokens=chunk_tokens)[0])
        paths = forests[big].paths()
        seqs = [
            TrainSequence(
                paths[j].tokens_T, paths[j].policy_mask_T, [0.0] * len(paths[j].tokens_T), paths[j].logprobs_T
            )
            for j in pick
        ]
        ref, _ = token_logprobs(model, collate(seqs, pad_id).to(device), chunk_tokens=chunk_tokens)
    except Exception as e:  # the model rejected the mask or the position ids
        return True, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")
    finally:
        model.train(was_training)
    diff = float((packed.float() - ref.float()).abs().max()) if packed.numel() else 0.0
    half = packed.dtype in (torch.float16, torch.bfloat16) or any(
        p.dtype in (torch.float16, torch.bfloat16) for p in model.parameters()
    )
    tol = 0.25 if half else 1e-3
    if not diff <= tol:
        return True, f"packed log-probs differ from per-path ones by {diff:.3g} > {tol:g}"
    return True, None
