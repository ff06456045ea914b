"""The policy update over one rollout batch: packed (each shared token once) or per path.

:func:`update` is the one entry point the trainer calls, with the batch's forests and their
per-token advantages. It dispatches to

- :func:`update_packed`: each forest (or the part of it in a mini-batch) is one packed row, every
  shared token computed once in forward and backward (:mod:`treegrpo.train.packing`), with loss
  weights that make the loss and its gradient equal to the per-path ones; or
- :func:`update_paths`: one padded row per root→leaf path (``batching.collate``).

``cfg.packing``: ``"off"`` → per path; ``"on"`` → packed, an error if the model cannot do it;
``"auto"`` (default) → packed, and per path for a model that rejects custom 4D attention masks.
Chains share only their prompt, but packed rows still win for them: measured on the default tiny
agent, chain G=4 updates took 0.3–0.4 s packed against 1.2–1.6 s per path (same losses). That is checked once
per model by a probe — a small packed forward compared with the per-path forward of the same paths
— so a model that raises *and* one that silently ignores the mask (or the position ids) are both
caught; the fallback is logged in one line.

Every log-prob — old, current and reference, packed or per path — is computed at the rollout's
sampling temperature ``cfg.temperature`` (logits / T, as verl; greedy T = 0 counts as 1), so the
PPO ratio compares the distributions the tokens were drawn from. ``rollout/logprob_diff`` in the
returned metrics is the mean |engine log-prob − trainer log-prob| over policy path-tokens, the
trainer's taken before any optimizer step (a check that rollout and training agree).

Log-probs and entropies are read from the model with ``cfg.logprob_chunk_tokens``
(:func:`~treegrpo.train.logprobs.model_logprobs`: the full-vocabulary log-softmax a chunk of
positions at a time, also under autograd). The reference policy is a frozen model or, with LoRA,
the policy itself with its adapter disabled (:func:`with_reference`).

Both implementations split the batch's paths into ``cfg.mini_batches`` contiguous chunks in
``forest_sequences`` order (whole forests stay together, so packing keeps its sharing) and take one
optimizer step per chunk; for a given configuration they compute the same update.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from treegrpo.algos.losses import LossConfig, LossNormalizers, compute_loss
from treegrpo.models.lora import AdapterDisabled
from treegrpo.train.batching import (
    TrainSequence,
    collate,
    forest_sequences,
    micro_batches,
    token_logprobs,
)
from treegrpo.train.config import TrainConfig
from treegrpo.train.logprobs import effective_temperature
from treegrpo.train.packing.forward import attention_pair_cost, packed_logprobs
from treegrpo.train.packing.layout import PackedBatch, pack_forests
from treegrpo.train.packing.loss import PACKABLE_POLICY_LOSSES, packed_loss
from treegrpo.tree import Forest

_log = logging.getLogger("treegrpo.train")

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


def chunk_tokens(cfg: TrainConfig) -> int | None:
    """``cfg.logprob_chunk_tokens`` as the read-out takes it: None when off (0, or ``auto`` not
    resolved by the trainer: direct callers get the full logits)."""
    v = cfg.logprob_chunk_tokens
    return v if isinstance(v, int) and v > 0 else None

# Per model: None = packing verified, str = why the model cannot train packed.
_PACKING_CHECKED: weakref.WeakKeyDictionary[torch.nn.Module, str | None] = weakref.WeakKeyDictionary()


def update(
    model: torch.nn.Module,
    ref_model: Reference | None,
    optimizer: torch.optim.Optimizer,
    forests: Sequence[Forest],
    advantages: Sequence[list[list[float]]],
    cfg: TrainConfig,
    loss_cfg: LossConfig,
    pad_id: int,
    log: Callable[[str], object] | None = None,
) -> dict[str, float]:
    """One PPO update on a rollout batch: packed or per path (see the module docstring).

    Args:
        model: the policy (trained in place).
        ref_model: the frozen reference policy, an :class:`~treegrpo.models.lora.AdapterDisabled`
            view of a LoRA policy, or ``None`` for no KL term.
        optimizer: steps once per mini-batch.
        forests: the batch's forests.
        advantages: per forest, per path, per token (``token_advantages`` output).
        cfg: ``mini_batches``, ``micro_batch_tokens``, ``grad_clip``, ``packing``, ``sampler``, ``device``,
            ``temperature``, ``logprob_chunk_tokens``.
        loss_cfg: the loss options.
        pad_id: padding token id.
        log: where the one-line packing fallback notice goes (default: the ``treegrpo.train`` logger).

    Returns:
        metrics averaged over the mini-batches, plus ``update/packed`` (1.0 or 0.0) and
        ``rollout/logprob_diff``.
    """
    if wants_packing(cfg, loss_cfg) and packing_supported(
        model, forests, pad_id, cfg.device, strict=cfg.packing == "on", log=log
    ):
        metrics = update_packed(model, ref_model, optimizer, forests, advantages, cfg, loss_cfg, pad_id)
        metrics["update/packed"] = 1.0
    else:
        seqs = forest_sequences(forests, advantages)
        metrics = update_paths(model, ref_model, optimizer, seqs, cfg, loss_cfg, pad_id)
        metrics["update/packed"] = 0.0
    return metrics


# -- when to pack ---------------------------------------------------------------------------------


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
) -> bool:
    """Whether ``model`` trains correctly on packed rows; probed once per model, then cached.

    The probe packs up to three paths of the largest forest, runs one packed forward (no grad,
    eval mode) and compares its log-probs with the per-path forward of the same paths. An
    exception (a model that rejects a 4D mask or ``position_ids``) or a mismatch (a model that
    silently ignores them) marks the model as not packable: one line goes to ``log`` and the
    caller trains per path; with ``strict`` a RuntimeError is raised instead.
    """
    if model not in _PACKING_CHECKED:
        decided, reason = _probe(model, forests, pad_id, device)
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
    model: torch.nn.Module, forests: Sequence[Forest], pad_id: int, device: str | torch.device
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
        packed = mb.unpack(packed_logprobs(model, mb)[0])
        paths = forests[big].paths()
        seqs = [
            TrainSequence(
                paths[j].tokens_T, paths[j].policy_mask_T, [0.0] * len(paths[j].tokens_T), paths[j].logprobs_T
            )
            for j in pick
        ]
        ref, _ = token_logprobs(model, collate(seqs, pad_id).to(device))
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


# -- the two implementations ---------------------------------------------------------------------


def split_minibatches(n_items: int, n_minis: int) -> list[list[int]]:
    """``range(n_items)`` in ``n_minis`` contiguous chunks whose sizes differ by at most one
    (empty chunks dropped)."""
    k = max(1, n_minis)
    bounds = [round(i * n_items / k) for i in range(k + 1)]
    return [list(range(bounds[i], bounds[i + 1])) for i in range(k) if bounds[i + 1] > bounds[i]]


def update_packed(
    model: torch.nn.Module,
    ref_model: Reference | None,
    optimizer: torch.optim.Optimizer,
    forests: Sequence[Forest],
    advantages: Sequence[list[list[float]]],
    cfg: TrainConfig,
    loss_cfg: LossConfig,
    pad_id: int,
) -> dict[str, float]:
    """PPO update on packed rows: one optimizer step per mini-batch, its loss accumulated over
    token-capped packed micro-batches whose weights are normalised over the mini-batch (so no
    per-micro-batch share is needed). Old log-probs (``cfg.mini_batches > 1``) and reference
    log-probs are computed packed, per packed token, before the first step. A forest is one row
    unless the model's dense attention over a long row would cost more than its sharing saves
    (:func:`~treegrpo.train.packing.forward.attention_pair_cost`,
    :func:`~treegrpo.train.packing.rows.split_rows`)."""
    model.train()
    offsets, n_paths = [], 0
    for f in forests:
        offsets.append(n_paths)
        n_paths += f.n_trajectories()
    plans: list[list[PackedBatch]] = []
    pair_cost = attention_pair_cost(model)  # split a forest's row where dense attention outweighs sharing
    for mini in split_minibatches(n_paths, cfg.mini_batches):
        chosen = set(mini)
        select = [
            [j for j in range(f.n_trajectories()) if off + j in chosen]
            for f, off in zip(forests, offsets, strict=True)
        ]
        plans.append(
            pack_forests(
                forests,
                advantages,
                agg_mode=loss_cfg.agg_mode,
                max_tokens=cfg.micro_batch_tokens,
                pad_id=pad_id,
                select=select,
                pair_cost=pair_cost,
            )
        )
    # Old log-probs: with one optimizer step per batch the policy has not moved (ratio 1).
    temp, chunk = effective_temperature(cfg.temperature), chunk_tokens(cfg)
    old = None if cfg.mini_batches == 1 else _plan_logprobs(model, plans, cfg.device, temp, chunk)
    ref = (
        with_reference(ref_model, lambda m: _plan_logprobs(m, plans, cfg.device, temp, chunk))
        if ref_model is not None
        else None
    )
    n = len(plans)
    sums: dict[str, float] = {}
    tokens_paths = tokens_packed = 0
    diff_sum = diff_count = 0.0

    def add(key: str, value: float) -> None:
        sums[key] = sums.get(key, 0.0) + value / n

    skipped = 0
    for k, plan in enumerate(plans):
        optimizer.zero_grad(set_to_none=True)
        ratio_max = 0.0
        for j, mb in enumerate(plan):
            mb = mb.to(cfg.device)
            lp, ent = packed_logprobs(model, mb, with_entropy=True, temperature=temp, chunk_tokens=chunk)
            with torch.no_grad():  # engine vs trainer, before any step (old = the policy that sampled)
                before = old[k][j] if old is not None else lp
                diff_sum += float(((mb.sample_logprobs_B_L - before).abs() * mb.count_B_L).sum())
                diff_count += float(mb.count_B_L.sum())
            loss, m = packed_loss(
                lp,
                mb,
                old[k][j] if old is not None else None,
                ref[k][j] if ref is not None else None,
                ent if loss_cfg.entropy_coef > 0 else None,
                loss_cfg,
            )
            loss.backward()
            ratio_max = max(ratio_max, m.pop("actor/ratio_max", 0.0))
            for key, v in m.items():
                add(key, v)
            with torch.no_grad():
                assert ent is not None
                add("actor/entropy", float((ent * mb.count_B_L).sum()) / max(mb.count_total, 1.0))
            tokens_paths += mb.n_path_tokens
            tokens_packed += mb.n_packed_tokens
        add("actor/ratio_max", ratio_max)
        if not clip_and_step(model, optimizer, cfg.grad_clip, add):
            skipped += 1
    model.eval()
    if skipped:
        sums["update/skipped_steps"] = float(skipped)
    sums["update/tokens_paths"] = float(tokens_paths)  # what a per-path update would compute
    sums["update/tokens_packed"] = float(tokens_packed)
    sums["rollout/logprob_diff"] = diff_sum / max(diff_count, 1.0)
    return sums


@torch.no_grad()
def _plan_logprobs(
    model: torch.nn.Module,
    plans: Sequence[Sequence[PackedBatch]],
    device: str | torch.device,
    temperature: float,
    chunk: int | None = None,
) -> list[list[torch.Tensor]]:
    """``logprobs_B_L`` of every packed micro-batch of every mini-batch at ``temperature``, in
    eval mode."""
    was_training = model.training
    model.eval()
    try:
        return [
            [packed_logprobs(model, mb.to(device), temperature=temperature, chunk_tokens=chunk)[0] for mb in plan]
            for plan in plans
        ]
    finally:
        model.train(was_training)


def update_paths(
    model: torch.nn.Module,
    ref_model: Reference | None,
    optimizer: torch.optim.Optimizer,
    seqs: Sequence[TrainSequence],
    cfg: TrainConfig,
    loss_cfg: LossConfig,
    pad_id: int,
) -> dict[str, float]:
    """PPO-clip over ``cfg.mini_batches`` optimizer steps, one padded row per path; each
    mini-batch's loss is accumulated over token-capped micro-batches, each aggregated with the
    mini-batch's :class:`~treegrpo.algos.losses.LossNormalizers` (policy tokens, sequences with
    policy tokens, longest path) so the sum equals the whole-mini-batch loss in every mode."""
    model.train()
    minis = split_minibatches(len(seqs), cfg.mini_batches)
    # Old log-probs: with one optimizer step per batch the policy has not moved, so the ratio is 1
    # and old = current (detached); otherwise they are recomputed before any step.
    old = None if cfg.mini_batches == 1 else _precompute_logprobs(model, seqs, cfg, pad_id)
    ref = (
        with_reference(ref_model, lambda m: _precompute_logprobs(m, seqs, cfg, pad_id))
        if ref_model is not None
        else None
    )
    temp, chunk = effective_temperature(cfg.temperature), chunk_tokens(cfg)
    sums: dict[str, float] = {}
    diff_sum = diff_count = 0.0

    def add(key: str, value: float) -> None:
        sums[key] = sums.get(key, 0.0) + value / len(minis)

    skipped = 0
    for mini in minis:
        mini_seqs = [seqs[i] for i in mini]
        norm = LossNormalizers.of(s.policy_mask for s in mini_seqs)
        optimizer.zero_grad(set_to_none=True)
        ratio_max = 0.0
        for local in micro_batches([len(s.tokens) for s in mini_seqs], cfg.micro_batch_tokens):
            ids = [mini[j] for j in local]
            mb = collate([seqs[i] for i in ids], pad_id).to(cfg.device)
            lp, ent = token_logprobs(model, mb, with_entropy=True, temperature=temp, chunk_tokens=chunk)
            old_lp = _gather(old, ids, lp)
            with torch.no_grad():  # engine vs trainer, before any step (old = the policy that sampled)
                before = old_lp if old_lp is not None else lp
                pm = mb.policy_mask_B_T
                diff_sum += float(((mb.sample_logprobs_B_T - before).abs() * pm).sum())
                diff_count += float(pm.sum())
            loss, m = compute_loss(
                lp,
                old_lp,
                _gather(ref, ids, lp),
                mb.advantages_B_T,
                mb.policy_mask_B_T,
                ent if loss_cfg.entropy_coef > 0 else None,
                loss_cfg,
                norm,
            )
            loss.backward()
            # loss/* are this micro-batch's share already; actor/* are its token means
            token_share = float(mb.policy_mask_B_T.sum()) / max(norm.n_tokens, 1.0)
            ratio_max = max(ratio_max, m.pop("actor/ratio_max", 0.0))
            for k, v in m.items():
                add(k, v if k.startswith("loss/") else v * token_share)
            with torch.no_grad():
                add("actor/entropy", float((ent * mb.policy_mask_B_T).sum()) / max(norm.n_tokens, 1.0))
        add("actor/ratio_max", ratio_max)
        if not clip_and_step(model, optimizer, cfg.grad_clip, add):
            skipped += 1
    model.eval()
    if skipped:
        sums["update/skipped_steps"] = float(skipped)
    sums["rollout/logprob_diff"] = diff_sum / max(diff_count, 1.0)
    return sums


def clip_and_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float, add: Callable[[str, float], None]
) -> bool:
    """Clip the gradient and take the optimizer step, unless the gradient is not finite (a NaN or
    inf loss): then the gradients are dropped and no step is taken, so one bad batch cannot poison
    the weights or the optimizer state. Returns whether the step was taken (``actor/grad_norm``
    is added only then; the caller counts skips in ``update/skipped_steps``)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    if not torch.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        return False
    optimizer.step()
    add("actor/grad_norm", float(grad_norm))
    return True


def _gather(table: dict[int, torch.Tensor] | None, ids: list[int], like: torch.Tensor) -> torch.Tensor | None:
    if table is None:
        return None
    out = torch.zeros_like(like)
    for row, i in enumerate(ids):
        v = table[i]
        out[row, : v.shape[0]] = v
    return out


@torch.no_grad()
def _precompute_logprobs(
    model: torch.nn.Module, seqs: Sequence[TrainSequence], cfg: TrainConfig, pad_id: int
) -> dict[int, torch.Tensor]:
    was_training = model.training
    model.eval()
    out: dict[int, torch.Tensor] = {}
    for ids in micro_batches([len(s.tokens) for s in seqs], cfg.micro_batch_tokens):
        mb = collate([seqs[i] for i in ids], pad_id).to(cfg.device)
        lp, _ = token_logprobs(
            model, mb, temperature=effective_temperature(cfg.temperature), chunk_tokens=chunk_tokens(cfg)
        )
        for row, i in enumerate(ids):
            out[i] = lp[row, : len(seqs[i].tokens)]
    model.train(was_training)
    return out
