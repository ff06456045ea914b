"""The policy update over one rollout batch: packed (each shared token once) or per path.

:func:`update` is the one entry point the trainer calls, with the batch's forests and their
per-token advantages. It dispatches to

- :func:`update_packed`: each forest (or the part of it in a mini-batch) is one packed row, every
  shared token computed once in forward and backward (:mod:`treegrpo.training.packing`), with loss
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
(:func:`~treegrpo.training.logprobs.model_logprobs`: the full-vocabulary log-softmax a chunk of
positions at a time, also under autograd). The reference policy is a frozen model or, with LoRA,
the policy itself with its adapter disabled (:func:`~treegrpo.training.policy.with_reference`).

Both implementations split the batch's paths into ``cfg.mini_batches`` contiguous chunks in
``forest_sequences`` order (whole forests stay together, so packing keeps its sharing) and take one
optimizer step per chunk; for a given configuration they compute the same update.

Data parallel (the policy's ``parallel``, :mod:`treegrpo.training.distributed`): each rank holds its own forests; the
mini-batches are those of one process holding all of them, normalised by all-reduced
:class:`~treegrpo.algos.losses.LossNormalizers`, with gradients summed across ranks, the same
number of micro-batches on every rank (empty ones of weight 0 where a rank has fewer) and one
packing decision; the metrics are merged as one process would report them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from treegrpo.algos.losses import LossConfig, LossNormalizers, compute_loss
from treegrpo.training.batching import (
    TrainSequence,
    collate,
    forest_sequences,
    micro_batches,
    token_logprobs,
)
from treegrpo.training.config import TrainConfig
from treegrpo.training.distributed import (
    SINGLE,
    Parallel,
    clip_grad_norm,
    minibatch_selects,
    split_minibatches,
)
from treegrpo.training.logprobs import effective_temperature
from treegrpo.training.packing.forward import attention_pair_cost, packed_logprobs
from treegrpo.training.packing.layout import PackedBatch, empty_batch, pack_forests
from treegrpo.training.packing.loss import packed_loss
from treegrpo.training.packing.probe import _PACKING_CHECKED, packing_supported, wants_packing  # noqa: F401
from treegrpo.training.policy import Policy, with_reference
from treegrpo.tree import Forest

_log = logging.getLogger("treegrpo.training")


def chunk_tokens(cfg: TrainConfig) -> int | None:
    """``cfg.logprob_chunk_tokens`` as the read-out takes it: None when off (0, or ``auto`` not
    resolved by the trainer: direct callers get the full logits)."""
    v = cfg.logprob_chunk_tokens
    return v if isinstance(v, int) and v > 0 else None


def update(
    policy: Policy,
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
        policy: the policy (its model trained in place), with its KL reference (a frozen model,
            an :class:`~treegrpo.models.lora.AdapterDisabled` view of a LoRA policy, or ``None``
            for no KL term) and its data parallelism (this rank's ``forests``).
        optimizer: steps once per mini-batch.
        forests: the batch's forests.
        advantages: per forest, per path, per token (``token_advantages`` output).
        cfg: ``mini_batches``, ``micro_batch_tokens``, ``grad_clip``, ``packing``, ``sampler``, ``device``,
            ``temperature``, ``logprob_chunk_tokens``.
        loss_cfg: the loss options.
        pad_id: padding token id.
        log: where the one-line packing fallback notice goes (default: the ``treegrpo.training`` logger).

    Returns:
        metrics averaged over the mini-batches, plus ``update/packed`` (1.0 or 0.0),
        ``update/skipped_prompts`` (forests with no policy token, :func:`trains`, when there are any),
        ``rollout/logprob_diff`` and ``update/positions``: the positions the training forwards ran
        (each micro-batch's rows × padded width, packed or per path), summed over the mini-batches
        (the no-grad forwards of the reference and old log-probs, when there are any, are not in it);
        packed, also ``update/tokens_packed`` (real packed tokens) and ``update/tokens_paths`` (what
        a per-path update would compute, unpadded).
    """
    strict = cfg.packing == "on"
    par = policy.parallel
    counts = par.gather([f.n_trajectories() if trains(f) else 0 for f in forests])  # a skipped forest: no path
    selects = minibatch_selects(counts, par.rank, cfg.mini_batches)
    keep = [i for i, f in enumerate(forests) if trains(f)]
    skipped = len(forests) - len(keep)
    if skipped:  # prompts longer than the context: no forward over them (not even the probe's)
        forests, advantages = [forests[i] for i in keep], [advantages[i] for i in keep]
        selects = [[mini[i] for i in keep] for mini in selects]
        if not forests and not par.active:  # nothing left to train on: no forward, no optimizer step
            return {"update/skipped_prompts": float(skipped), "update/packed": 0.0}
    packed = wants_packing(cfg, loss_cfg) and packing_supported(
        policy.local_module(),
        forests,
        pad_id,
        cfg.device,
        strict=strict and not par.active,
        log=log,
        chunk_tokens=chunk_tokens(cfg),
    )
    if par.active:  # one decision for all ranks: packed only if every rank can
        packed = par.all_true(packed)
        if strict and not packed:
            raise RuntimeError("packing=on, but the model cannot train packed on some rank")
    if packed:
        metrics = update_packed(policy, optimizer, forests, advantages, cfg, loss_cfg, pad_id, selects)
        metrics["update/packed"] = 1.0
    else:
        seqs = forest_sequences(forests, advantages)
        metrics = update_paths(policy, optimizer, seqs, cfg, loss_cfg, pad_id, _flat(forests, selects))
        metrics["update/packed"] = 0.0
    if skipped:
        metrics["update/skipped_prompts"] = float(skipped)
    return metrics


def trains(forest: Forest) -> bool:
    """Whether ``forest`` has a policy token to train on. One without (every trajectory ended
    before its first step: a prompt longer than the context) is skipped before any forward — it
    would add nothing to the loss, and a forward over its whole prompt can take minutes."""
    return any(any(p.policy_mask_T) for p in forest.paths())


def _flat(forests: Sequence[Forest], selects: list[list[list[int]]]) -> list[list[int]]:
    """Per mini-batch, the selected paths as indices into ``forest_sequences`` order."""
    offsets, n = [], 0
    for f in forests:
        offsets.append(n)
        n += f.n_trajectories()
    return [[off + j for off, sel in zip(offsets, mini, strict=True) for j in sel] for mini in selects]


# -- the two implementations ---------------------------------------------------------------------


def update_packed(
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    forests: Sequence[Forest],
    advantages: Sequence[list[list[float]]],
    cfg: TrainConfig,
    loss_cfg: LossConfig,
    pad_id: int,
    selects: list[list[list[int]]] | None = None,
) -> dict[str, float]:
    """PPO update on packed rows: one optimizer step per mini-batch, its loss accumulated over
    token-capped packed micro-batches whose weights are normalised over the mini-batch (so no
    per-micro-batch share is needed). Old log-probs (``cfg.mini_batches > 1``) and reference
    log-probs are computed packed, per packed token, before the first step. A forest is one row
    unless the model's dense attention over a long row would cost more than its sharing saves
    (:func:`~treegrpo.training.packing.forward.attention_pair_cost`,
    :func:`~treegrpo.training.packing.rows.split_rows`). ``selects``: per mini-batch, per forest,
    its paths (default: ``cfg.mini_batches`` contiguous chunks of all paths)."""
    model, ref_model, par = policy.model, policy.reference, policy.parallel
    model.train()
    if selects is None:
        selects = minibatch_selects([[f.n_trajectories() for f in forests]], 0, cfg.mini_batches)
    norms = (
        par.global_norms(
            [
                LossNormalizers.of(
                    forests[fi].paths()[j].policy_mask_T for fi, sel in enumerate(mini) for j in sel
                )
                for mini in selects
            ]
        )
        if par.active
        else [None] * len(selects)
    )
    plans: list[list[PackedBatch]] = []
    pair_cost = attention_pair_cost(model)  # split a forest's row where dense attention outweighs sharing
    for select, norm in zip(selects, norms, strict=True):
        plans.append(
            pack_forests(
                forests,
                advantages,
                agg_mode=loss_cfg.agg_mode,
                max_tokens=cfg.micro_batch_tokens,
                pad_id=pad_id,
                select=select,
                pair_cost=pair_cost,
                norm=norm,
            )
        )
    if par.active:  # the same number of micro-batches on every rank: empty ones of weight 0
        for plan, n_mb, norm in zip(plans, par.padded([len(p) for p in plans]), norms, strict=True):
            plan.extend(empty_batch(pad_id, norm.n_tokens) for _ in range(n_mb - len(plan)))  # type: ignore[union-attr]
    # Old log-probs: with one optimizer step per batch the policy has not moved (ratio 1).
    temp, chunk = effective_temperature(cfg.temperature), chunk_tokens(cfg)
    ent_grad = loss_cfg.entropy_coef > 0  # otherwise the entropy is a metric: no graph of its own
    old = None if cfg.mini_batches == 1 else _plan_logprobs(model, plans, cfg.device, temp, chunk)
    ref = (
        with_reference(ref_model, lambda m: _plan_logprobs(m, plans, cfg.device, temp, chunk))
        if ref_model is not None
        else None
    )
    tally = _Tally(len(plans))
    tokens_paths = tokens_packed = positions = 0
    grad_model = policy.grad_module()
    for k, plan in enumerate(plans):
        optimizer.zero_grad(set_to_none=True)
        ratio_max = 0.0
        for j, mb in enumerate(plan):
            mb = mb.to(cfg.device)
            with policy.sync(last=j == len(plan) - 1):
                lp, ent = packed_logprobs(
                    grad_model, mb, with_entropy=True, temperature=temp, chunk_tokens=chunk, entropy_grad=ent_grad
                )
                tally.engine_diff(mb.sample_logprobs_B_L, old[k][j] if old is not None else lp, mb.count_B_L)
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
                tally.add(key, v)
            with torch.no_grad():
                assert ent is not None
                tally.add("actor/entropy", float((ent * mb.count_B_L).sum()) / max(mb.count_total, 1.0))
            tokens_paths += mb.n_path_tokens
            tokens_packed += mb.n_packed_tokens
            positions += mb.input_ids_B_L.numel()  # the rows with their padding: what the forward ran
            del lp, ent, loss  # this micro-batch's graph, before the next forward
        tally.step(model, optimizer, cfg.grad_clip, ratio_max)
    model.eval()
    tokens = {
        "update/tokens_paths": float(tokens_paths),
        "update/tokens_packed": float(tokens_packed),
        "update/positions": float(positions),
    }
    return tally.metrics(par, tokens)  # tokens_paths: what a per-path update would compute (unpadded)


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
            [
                packed_logprobs(model, mb.to(device), temperature=temperature, chunk_tokens=chunk)[0]
                for mb in plan
            ]
            for plan in plans
        ]
    finally:
        model.train(was_training)


def update_paths(
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    seqs: Sequence[TrainSequence],
    cfg: TrainConfig,
    loss_cfg: LossConfig,
    pad_id: int,
    minis: list[list[int]] | None = None,
) -> dict[str, float]:
    """PPO-clip over ``cfg.mini_batches`` optimizer steps, one padded row per path; each
    mini-batch's loss is accumulated over token-capped micro-batches, each aggregated with the
    mini-batch's :class:`~treegrpo.algos.losses.LossNormalizers` (policy tokens, sequences with
    policy tokens, longest path) so the sum equals the whole-mini-batch loss in every mode.
    ``minis``: the indices into ``seqs`` of each mini-batch (default: ``cfg.mini_batches``
    contiguous chunks)."""
    model, ref_model, par = policy.model, policy.reference, policy.parallel
    model.train()
    if minis is None:
        minis = split_minibatches(len(seqs), cfg.mini_batches)
    # Old log-probs: with one optimizer step per batch the policy has not moved, so the ratio is 1
    # and old = current (detached); otherwise they are recomputed before any step.
    old = None if cfg.mini_batches == 1 else _precompute_logprobs(model, seqs, cfg, pad_id, par)
    ref = (
        with_reference(ref_model, lambda m: _precompute_logprobs(m, seqs, cfg, pad_id, par))
        if ref_model is not None
        else None
    )
    temp, chunk = effective_temperature(cfg.temperature), chunk_tokens(cfg)
    ent_grad = loss_cfg.entropy_coef > 0  # otherwise the entropy is a metric: no graph of its own
    norms = par.global_norms([LossNormalizers.of(seqs[i].policy_mask for i in mini) for mini in minis])
    micro: list[list[list[int]]] = [
        [
            [mini[j] for j in local]
            for local in micro_batches([len(seqs[i].tokens) for i in mini], cfg.micro_batch_tokens)
        ]
        for mini in minis
    ]
    if par.active:  # the same number of micro-batches on every rank: empty ones
        for mbs, n_mb in zip(micro, par.padded([len(m) for m in micro]), strict=True):
            mbs.extend([] for _ in range(n_mb - len(mbs)))
    tally = _Tally(len(minis))
    grad_model = policy.grad_module()
    positions = 0
    for mbs, norm in zip(micro, norms, strict=True):
        optimizer.zero_grad(set_to_none=True)
        ratio_max = 0.0
        for j, ids in enumerate(mbs):
            mb = collate([seqs[i] for i in ids] if ids else [_EMPTY], pad_id).to(cfg.device)
            positions += mb.input_ids_B_T.numel()  # the rows with their padding: what the forward ran
            with policy.sync(last=j == len(mbs) - 1):
                lp, ent = token_logprobs(
                    grad_model, mb, with_entropy=True, temperature=temp, chunk_tokens=chunk, entropy_grad=ent_grad
                )
                old_lp = _gather(old, ids, lp)
                before = old_lp if old_lp is not None else lp  # old = the policy that sampled
                tally.engine_diff(mb.sample_logprobs_B_T, before, mb.policy_mask_B_T)
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
                tally.add(k, v if k.startswith("loss/") else v * token_share)
            with torch.no_grad():
                tally.add("actor/entropy", float((ent * mb.policy_mask_B_T).sum()) / max(norm.n_tokens, 1.0))
            del lp, ent, loss  # this micro-batch's graph, before the next forward
        tally.step(model, optimizer, cfg.grad_clip, ratio_max)
    model.eval()
    return tally.metrics(par, {"update/positions": float(positions)})


class _Tally:
    """The metrics of one update, as both implementations report them: means over its ``n_minis``
    mini-batches (:meth:`add`), the engine-vs-trainer log-prob difference, each mini-batch's
    ratio maximum and the optimizer steps skipped (a non-finite gradient)."""

    def __init__(self, n_minis: int) -> None:
        self.n_minis = n_minis
        self.sums: dict[str, float] = {}
        self.diff_sum = self.diff_count = 0.0
        self.ratio_maxes: list[float] = []
        self.skipped = 0

    def add(self, key: str, value: float) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + value / self.n_minis

    @torch.no_grad()
    def engine_diff(self, sampled: torch.Tensor, before: torch.Tensor, weight: torch.Tensor) -> None:
        """Add ``|engine − trainer|`` log-probs, weighted, before any step (``before``: the old
        log-probs, i.e. the policy that sampled, else the current ones)."""
        self.diff_sum += float(((sampled - before).abs() * weight).sum())
        self.diff_count += float(weight.sum())

    def step(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float, ratio_max: float
    ) -> None:
        """End of a mini-batch: its ratio maximum, then the clipped optimizer step (or a skip)."""
        self.add("actor/ratio_max", ratio_max)
        self.ratio_maxes.append(ratio_max)
        if not clip_and_step(model, optimizer, grad_clip, self.add):
            self.skipped += 1

    def metrics(self, par: Parallel, extra: dict[str, float] | None = None) -> dict[str, float]:
        """The update's metrics (``extra`` after the skip count), merged over the ranks."""
        sums = self.sums
        if self.skipped:
            sums["update/skipped_steps"] = float(self.skipped)
        sums.update(extra or {})
        sums["rollout/logprob_diff"] = self.diff_sum / max(self.diff_count, 1.0)
        diff = (self.diff_sum, self.diff_count)
        return par.merge(sums, self.ratio_maxes, diff) if par.active else sums


_EMPTY = TrainSequence([0, 0], [0, 0], [0.0, 0.0], [0.0, 0.0])
"""An empty micro-batch's one sequence (no policy token: weight 0), for ranks with fewer."""


def clip_and_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    grad_clip: float,
    add: Callable[[str, float], None],
) -> bool:
    """Clip the gradient and take the optimizer step, unless the gradient is not finite (a NaN or
    inf loss): then the gradients are dropped and no step is taken, so one bad batch cannot poison
    the weights or the optimizer state. Returns whether the step was taken (``actor/grad_norm``
    is added only then; the caller counts skips in ``update/skipped_steps``)."""
    grad_norm = clip_grad_norm(model, grad_clip)
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
    model: torch.nn.Module,
    seqs: Sequence[TrainSequence],
    cfg: TrainConfig,
    pad_id: int,
    par: Parallel = SINGLE,
) -> dict[int, torch.Tensor]:
    was_training = model.training
    model.eval()
    out: dict[int, torch.Tensor] = {}
    mbs = micro_batches([len(s.tokens) for s in seqs], cfg.micro_batch_tokens)
    if par.active:  # as many forwards as every other rank (FSDP2's are collectives)
        mbs += [[] for _ in range(par.padded([len(mbs)])[0] - len(mbs))]
    for ids in mbs:
        mb = collate([seqs[i] for i in ids] if ids else [_EMPTY], pad_id).to(cfg.device)
        lp, _ = token_logprobs(
            model, mb, temperature=effective_temperature(cfg.temperature), chunk_tokens=chunk_tokens(cfg)
        )
        for row, i in enumerate(ids):
            out[i] = lp[row, : len(seqs[i].tokens)]
    model.train(was_training)
    return out
