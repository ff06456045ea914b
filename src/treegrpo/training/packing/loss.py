r"""The exact loss over packed rows: equal, value and gradient, to the per-path loss.

Exact loss (derivation)
-----------------------
A mini-batch holds paths ``p`` with tokens ``t``, policy mask ``m_pt``, advantages ``A_pt``. The
per-path loss (:func:`treegrpo.algos.losses.compute_loss` on the collated mini-batch, which is what
``update`` computes by summing micro-batches aggregated with the mini-batch's
:class:`~treegrpo.algos.losses.LossNormalizers`) is::

    L = Σ_p Σ_t m_pt w_pt [ ℓ(ρ_pt, A_pt) + β k(π_pt, π^ref_pt) − η H_pt ]

with ``ℓ`` the token-wise policy loss (PPO-clip, dual clip), ``ρ = exp(log π − log π_old)``, ``k``
the KL estimator, ``H`` the entropy and the aggregation weight ``w_pt``:

    token-mean                        1 / N            N  = Σ_pt m_pt (policy tokens, counted per path)
    seq-mean-token-sum                1 / P'           P' = paths with at least one policy token
    seq-mean-token-mean               1 / (P' · n_p)   n_p = Σ_t m_pt
    seq-mean-token-sum-norm           1 / (P' · T)     T  = longest path (or a given horizon)
    seq-mean-token-sum-norm-legacy    1 / T

Let ``φ(p, t) = u`` map a path token to its packed token. The mask and position ids give ``u``
exactly the causal context of ``(p, t)`` on its own path, so ``log π_pt = log π_u``, ``H_pt = H_u``
and likewise for the reference and old policies (old/ref log-probs are computed packed, one per
``u``). Only ``m``, ``w`` and ``A`` depend on the path. Hence::

    L = Σ_u Σ_{(p,t) ∈ φ⁻¹(u)} m_pt w_pt ℓ(ρ_u, A_pt)  +  β Σ_u W_u k_u  −  η Σ_u W_u H_u,
    W_u = Σ_{(p,t) ∈ φ⁻¹(u)} m_pt w_pt.

KL and entropy are functions of ``u`` alone, so they merge into one weight ``W_u``. The policy term
does not: ``ℓ`` clips on the ratio in a way that depends on the sign of ``A`` (a shared token may be
clipped for one path and not for another), so ``ℓ(ρ, ΣA) ≠ Σ ℓ(ρ, A)``. It is exact to group the
paths through ``u`` by *distinct advantage value* ``a``::

    Σ_{φ⁻¹(u)} m w ℓ(ρ_u, A) = Σ_a W_ua ℓ(ρ_u, a),      W_ua = Σ_{φ⁻¹(u), A_pt = a} m_pt w_pt.

Each ``(u, a, W_ua)`` is one *term*; the packed loss is ``Σ_terms W ℓ(ρ_u, a) + β Σ_u W_u k_u −
η Σ_u W_u H_u``. Gradients are equal too, not only values: θ enters only through ``log π_u`` and
``∂ log π_pt/∂θ = ∂ log π_u/∂θ``, so the chain rule sums the same per-path contributions. The number
of terms of a token is the number of distinct advantages among the paths through it: 1 for
``treerl`` (advantages are per node), at most the number of distinct leaf advantages of its tree
for ``tree_grpo``/``grpo``. (For PPO-clip, ``ℓ(ρ, a) = |a| ℓ(ρ, sign a)``, so two terms per token
would do; grouping by value needs only that ``ℓ`` is token-wise, see
:data:`PACKABLE_POLICY_LOSSES`.) The weights are normalised over the whole mini-batch (``N``,
``P'`` and ``T`` are its figures, :class:`~treegrpo.algos.losses.LossNormalizers`), so the packed
losses of its micro-batches — and, with data parallelism, of its ranks — add up to the
mini-batch loss.

Metrics returned by :func:`packed_loss` are additive over the micro-batches of one mini-batch
(``actor/ratio_max``: take the max): ``loss/*`` are the micro-batch's share of the mini-batch loss;
``actor/*`` are path-token means (each packed token counted once per path through it, as the
per-path masked means count it).
"""

from __future__ import annotations

import dataclasses

import torch

from treegrpo.algos.kl import kl_penalty
from treegrpo.algos.losses import LossConfig, get_policy_loss
from treegrpo.training.packing.layout import PackedBatch

PACKABLE_POLICY_LOSSES = frozenset({"ppo_clip"})
"""Policy losses that are token-wise (the loss of a token depends on that token's ratio and
advantage only), the condition for the exact packed loss. A sequence-level loss (GSPO-style) is
not packable: train it per path."""


def packed_loss(
    logprobs_B_L: torch.Tensor,
    batch: PackedBatch,
    old_logprobs_B_L: torch.Tensor | None = None,
    ref_logprobs_B_L: torch.Tensor | None = None,
    entropy_B_L: torch.Tensor | None = None,
    cfg: LossConfig | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """This micro-batch's share of the mini-batch loss ``policy + kl_coef·kl − entropy_coef·entropy``.

    Summed over the micro-batches of one :func:`pack_forests` call it equals — value and gradient —
    :func:`~treegrpo.algos.losses.compute_loss` on the collated paths (derivation: module
    docstring). The batch's weights already encode ``cfg.agg_mode``: pack with the same mode.

    Args:
        logprobs_B_L: [B, L] from :func:`packed_logprobs` (with gradient).
        batch: the packed micro-batch.
        old_logprobs_B_L: [B, L] sampling-policy log-probs per packed token; ``None`` = on-policy.
        ref_logprobs_B_L: [B, L] reference log-probs per packed token, or ``None`` (no KL term).
        entropy_B_L: [B, L] entropy per packed token, or ``None`` (no entropy term).
        cfg: loss options (``policy_loss`` must be in :data:`PACKABLE_POLICY_LOSSES`).

    Returns:
        ``(loss, metrics)``; metrics add up over the micro-batches (``actor/ratio_max``: max).
    """
    cfg = cfg if cfg is not None else LossConfig()
    if cfg.policy_loss not in PACKABLE_POLICY_LOSSES:
        raise ValueError(f"policy loss {cfg.policy_loss!r} is not token-wise; packing cannot be exact")
    if old_logprobs_B_L is None:
        old_logprobs_B_L = logprobs_B_L.detach()
    policy_fn = get_policy_loss(cfg.policy_loss)
    r, c = batch.term_row_J, batch.term_col_J
    lp_1_J = logprobs_B_L[r, c][None]
    old_1_J = old_logprobs_B_L.detach()[r, c][None]
    adv_1_J = batch.term_adv_J[None].to(lp_1_J.dtype)
    # One row, float mask = weights, "seq-mean-token-sum": exactly Σ_j W_j ℓ(ρ_j, a_j).
    sum_cfg = dataclasses.replace(cfg, agg_mode="seq-mean-token-sum")
    policy, _ = policy_fn(lp_1_J, old_1_J, adv_1_J, batch.term_weight_J[None].to(lp_1_J.dtype), sum_cfg, None)
    total = policy
    frac = float(batch.term_count_J.sum()) / max(batch.count_total, 1.0)
    with torch.no_grad():  # path-token means of this micro-batch, scaled to add up
        mean_cfg = dataclasses.replace(cfg, agg_mode="token-mean")
        _, m = policy_fn(
            lp_1_J.detach(), old_1_J, adv_1_J, batch.term_count_J[None].to(lp_1_J.dtype), mean_cfg, None
        )
    metrics = {k: (v if k == "actor/ratio_max" else v * frac) for k, v in m.items()}
    metrics["loss/policy"] = policy.item()
    on = batch.weight_B_L > 0
    w = batch.weight_B_L.to(logprobs_B_L.dtype)
    if ref_logprobs_B_L is not None:
        zero = torch.zeros_like(logprobs_B_L)
        kl_B_L = kl_penalty(
            torch.where(on, logprobs_B_L, zero), torch.where(on, ref_logprobs_B_L.detach(), zero), cfg.kl_kind
        )
        kl = (torch.where(on, kl_B_L, zero) * w).sum()
        total = total + cfg.kl_coef * kl
        metrics["loss/kl"] = kl.item()
    if entropy_B_L is not None:
        ent = (torch.where(on, entropy_B_L, torch.zeros_like(entropy_B_L)) * w).sum()
        total = total - cfg.entropy_coef * ent
        metrics["loss/entropy"] = ent.item()
    metrics["loss/total"] = total.item()
    return total, metrics
