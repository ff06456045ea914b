"""Policy loss, KL and entropy terms, and loss aggregation (DESIGN.md §5.5).

Modelled on verl's ``trainer/ppo/core_algos.py`` (``agg_loss``, ``compute_policy_loss``). Shapes:
B = sequences (root→leaf paths), T = tokens per sequence (padded), V = vocabulary.

Masking (DESIGN.md §3.5): ``mask_B_T`` is the policy mask, 1 on tokens the policy generated and 0
on prompt, observation and padding tokens. Masked-out positions contribute nothing to the loss or
its gradient, whatever values (even NaN/inf) the inputs hold there: every input is replaced by 0
at masked positions before any arithmetic, and the aggregation selects masked tokens only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from treegrpo.algos.kl import KL_ESTIMATORS, kl_penalty
from treegrpo.registry import add, lookup

AGG_MODES = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
    "seq-mean-token-sum-norm-legacy",
)


@dataclass(frozen=True)
class LossConfig:
    """Options of :func:`compute_loss`.

    Attributes:
        clip_ratio_low: the ratio is clipped below at ``1 - clip_ratio_low``.
        clip_ratio_high: the ratio is clipped above at ``1 + clip_ratio_high`` (DAPO's clip-higher
            when larger than ``clip_ratio_low``).
        dual_clip: apply dual-clip PPO (arXiv 1912.09729) on tokens with negative advantage: the
            per-token loss is capped at ``-A * clip_ratio_c``. verl always applies it; here it is
            opt-in.
        clip_ratio_c: the dual-clip constant, > 1.
        kl_coef: weight of the KL-to-reference term (used only when reference log-probs are given).
        kl_kind: KL estimator name, see :data:`treegrpo.algos.kl.KL_ESTIMATORS`.
        entropy_coef: weight of the entropy bonus (subtracted from the loss).
        agg_mode: how token losses become a scalar, see :func:`agg_loss`.
        policy_loss: name in :data:`POLICY_LOSSES`.
    """

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    dual_clip: bool = False
    clip_ratio_c: float = 3.0
    kl_coef: float = 0.001
    kl_kind: str = "k3"
    entropy_coef: float = 0.0
    agg_mode: str = "token-mean"
    policy_loss: str = "ppo_clip"

    def __post_init__(self) -> None:
        if not 0.0 <= self.clip_ratio_low < 1.0:
            raise ValueError(f"clip_ratio_low must be in [0, 1), got {self.clip_ratio_low}")
        if self.clip_ratio_high < 0.0:
            raise ValueError(f"clip_ratio_high must be >= 0, got {self.clip_ratio_high}")
        if self.clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c (dual clip) must be > 1, got {self.clip_ratio_c}")
        if self.agg_mode not in AGG_MODES:
            raise ValueError(f"unknown agg_mode {self.agg_mode!r}; known: {', '.join(AGG_MODES)}")
        if self.kl_kind not in KL_ESTIMATORS:
            raise ValueError(f"unknown kl_kind {self.kl_kind!r}; known: {', '.join(sorted(KL_ESTIMATORS))}")


# -- masking and aggregation --------------------------------------------------------------------


@dataclass(frozen=True)
class LossNormalizers:
    """The denominators of :func:`agg_loss` for a whole mini-batch.

    A mini-batch is often computed in pieces — token-capped micro-batches, packed rows, and (with
    data parallelism) ranks. Each piece divided by its *own* counts and width gives a different
    gradient from the mini-batch in one piece; dividing every piece by the mini-batch's figures
    makes the pieces' losses (and gradients) add up to it exactly, for every mode.

    Attributes:
        n_tokens: policy tokens of the mini-batch (``token-mean``).
        n_seqs: sequences with at least one policy token (the ``seq-mean-*`` modes).
        horizon: ``T`` of ``seq-mean-token-sum-norm`` (and ``-legacy``): the longest sequence of
            the mini-batch, or a constant (verl's ``loss_scale_factor``, TRL's
            ``max_completion_length``) to keep the normaliser fixed across steps.
    """

    n_tokens: float
    n_seqs: float
    horizon: float

    @classmethod
    def of(cls, policy_masks: Iterable[Sequence[float]], horizon: float | None = None) -> LossNormalizers:
        """The figures of sequences given by their policy masks; ``horizon`` defaults to the
        longest mask."""
        n_tokens = n_seqs = longest = 0
        for m in policy_masks:
            k = sum(1 for x in m if x)
            n_tokens += sum(m)
            n_seqs += k > 0
            longest = max(longest, len(m))
        return cls(float(n_tokens), float(n_seqs), float(longest if horizon is None else horizon))

    @classmethod
    def combine(cls, parts: Iterable[LossNormalizers]) -> LossNormalizers:
        """The figures of the union of disjoint pieces (what an all-reduce across data-parallel
        ranks computes: counts add up, the horizon is the largest)."""
        ps = list(parts)
        return cls(
            sum(p.n_tokens for p in ps), sum(p.n_seqs for p in ps), max((p.horizon for p in ps), default=0.0)
        )


def _check_pair(x_B_T: torch.Tensor, mask_B_T: torch.Tensor, what: str) -> None:
    if x_B_T.shape != mask_B_T.shape:
        raise ValueError(f"{what} has shape {tuple(x_B_T.shape)} but the mask has {tuple(mask_B_T.shape)}")
    if x_B_T.dim() != 2:
        raise ValueError(f"{what} must be 2-D [B, T], got shape {tuple(x_B_T.shape)}")


def masked_fill_zero(x_B_T: torch.Tensor, mask_B_T: torch.Tensor) -> torch.Tensor:
    """``x`` with every masked-out (mask == 0) position replaced by 0; no gradient flows there.

    Args:
        x_B_T: [B, T] values (may hold anything, NaN included, at masked positions).
        mask_B_T: [B, T] policy mask (bool, int or float).
    """
    return torch.where(mask_B_T != 0, x_B_T, torch.zeros_like(x_B_T))


def agg_loss(
    loss_mat_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    mode: str = "token-mean",
    norm: LossNormalizers | None = None,
) -> torch.Tensor:
    """Aggregate per-token losses into a scalar, as verl's ``agg_loss``.

    With ``N`` the number of masked tokens, ``S`` the number of sequences that have at least one
    and ``T`` the horizon — this batch's own figures (``T`` = its padded width), or the
    mini-batch's when ``norm`` is given (so the losses of a mini-batch's pieces add up to it):

    Modes:
        - ``"token-mean"``: sum over masked tokens / ``N``.
        - ``"seq-mean-token-sum"``: per-sequence sum over its masked tokens, then the mean over
          the ``S`` sequences.
        - ``"seq-mean-token-mean"``: per-sequence mean over its masked tokens, then the mean over
          the ``S`` sequences.
        - ``"seq-mean-token-sum-norm"``: sum over all masked tokens / (``S`` · ``T``) — Dr. GRPO's
          constant normaliser, as verl 0.9.1's ``agg_loss`` (per sequence: token sum /
          ``loss_scale_factor``, then the mean over the batch's sequences) and TRL's ``dr_grpo``
          (token sum / (sequences × ``max_completion_length``)) define it.
        - ``"seq-mean-token-sum-norm-legacy"``: sum over all masked tokens / ``T``, without the
          sequence count — what the verl fork shipped with the official Tree-GRPO code computes
          (``S`` times the current definition); kept for reproducing that code.

    Sequences whose mask is all zero are left out of ``S`` (verl's ``agg_loss`` excludes fully
    masked sequences the same way; TRL counts every completion, which never has an empty mask).
    A mask that is all zero gives a loss of 0 that is still attached to the graph. A float mask
    acts as weights.

    Args:
        loss_mat_B_T: [B, T] per-token losses.
        mask_B_T: [B, T] policy mask.
        mode: one of :data:`AGG_MODES`.
        norm: the mini-batch's denominators; ``None``: this batch's own.

    Returns:
        a scalar tensor.
    """
    _check_pair(loss_mat_B_T, mask_B_T, "loss_mat")
    m_B_T = mask_B_T.to(loss_mat_B_T.dtype)
    weighted_B_T = masked_fill_zero(loss_mat_B_T, mask_B_T) * m_B_T
    if mode == "token-mean":
        n_tokens = torch.clamp(m_B_T.sum(), min=1e-8) if norm is None else max(norm.n_tokens, 1e-8)
        return weighted_B_T.sum() / n_tokens
    horizon = max(loss_mat_B_T.shape[-1] if norm is None else norm.horizon, 1)
    if mode == "seq-mean-token-sum-norm-legacy":
        return weighted_B_T.sum() / horizon
    valid_B = (mask_B_T != 0).any(dim=-1)
    if norm is None:
        n_seqs = torch.clamp(valid_B.sum().to(loss_mat_B_T.dtype), min=1.0)
    else:
        n_seqs = max(norm.n_seqs, 1.0)
    if mode == "seq-mean-token-sum-norm":
        return weighted_B_T.sum() / (n_seqs * horizon)
    count_B = m_B_T.sum(dim=-1)
    seq_B = weighted_B_T.sum(dim=-1)
    if mode == "seq-mean-token-mean":
        seq_B = seq_B / torch.clamp(count_B, min=1e-8)
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"unknown agg_mode {mode!r}; known: {', '.join(AGG_MODES)}")
    seq_B = torch.where(valid_B, seq_B, torch.zeros_like(seq_B))
    return seq_B.sum() / n_seqs


def masked_mean(x_B_T: torch.Tensor, mask_B_T: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over masked tokens (0 when none). Shapes: [B, T], [B, T] -> scalar."""
    return agg_loss(x_B_T, mask_B_T, "token-mean")


# -- policy losses ------------------------------------------------------------------------------

PolicyLossFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, LossConfig, "LossNormalizers | None"],
    tuple[torch.Tensor, dict[str, float]],
]

POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: register ``fn(logprobs_B_T, old_logprobs_B_T, advantages_B_T, mask_B_T, cfg,
    norm) -> (loss scalar, metrics)`` under ``name``; ``norm`` (:class:`LossNormalizers` or
    ``None``) is what the loss passes to :func:`agg_loss`."""

    def deco(fn: PolicyLossFn) -> PolicyLossFn:
        add(POLICY_LOSSES, name, fn, "policy loss")
        return fn

    return deco


def get_policy_loss(name: str) -> PolicyLossFn:
    """The policy loss registered as ``name``; ValueError naming the known ones otherwise."""
    return lookup(POLICY_LOSSES, name, "policy loss")


@register_policy_loss("ppo_clip")
def ppo_clip_loss(
    logprobs_B_T: torch.Tensor,
    old_logprobs_B_T: torch.Tensor,
    advantages_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    cfg: LossConfig,
    norm: LossNormalizers | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip on the token ratio ``exp(logp - old_logp)``, as verl's ``compute_policy_loss``.

    Per token: ``max(-A * ratio, -A * clip(ratio, 1 - low, 1 + high))``; with ``cfg.dual_clip``,
    tokens with ``A < 0`` are further capped at ``-A * clip_ratio_c``. The log-ratio is clamped
    to [-20, 20] before the exp, as in verl.

    Args:
        logprobs_B_T: [B, T] log-probs of the sampled tokens under the policy being trained.
        old_logprobs_B_T: [B, T] log-probs under the policy that sampled them (no gradient).
        advantages_B_T: [B, T] per-token advantages.
        mask_B_T: [B, T] policy mask.
        cfg: clip ratios, dual clip and aggregation mode.
        norm: the mini-batch's aggregation denominators (``None``: this batch's own).

    Returns:
        (loss, metrics): the aggregated scalar loss and ``actor/clipfrac`` (tokens where the clip
        was active), ``actor/clipfrac_lower`` (tokens capped by the dual clip), ``actor/approx_kl``
        (masked mean of ``old_logp - logp``), ``actor/ratio_mean``, ``actor/ratio_max``.
    """
    for x, what in (
        (logprobs_B_T, "logprobs"),
        (old_logprobs_B_T, "old_logprobs"),
        (advantages_B_T, "advantages"),
    ):
        _check_pair(x, mask_B_T, what)
    logp = masked_fill_zero(logprobs_B_T, mask_B_T)
    old = masked_fill_zero(old_logprobs_B_T.detach(), mask_B_T)
    adv = masked_fill_zero(advantages_B_T.detach(), mask_B_T)

    log_ratio = torch.clamp(logp - old, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    loss1 = -adv * ratio
    loss2 = -adv * torch.clamp(ratio, 1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high)
    clipped = torch.maximum(loss1, loss2)
    if cfg.dual_clip:
        loss3 = -adv * cfg.clip_ratio_c
        pg_losses = torch.where(adv < 0, torch.minimum(clipped, loss3), clipped)
        lower = (clipped > loss3) & (adv < 0)
    else:
        pg_losses = clipped
        lower = torch.zeros_like(clipped, dtype=torch.bool)
    loss = agg_loss(pg_losses, mask_B_T, cfg.agg_mode, norm)

    with torch.no_grad():
        valid = mask_B_T != 0
        metrics = {
            "actor/clipfrac": masked_mean((loss2 > loss1).to(ratio.dtype), mask_B_T).item(),
            "actor/clipfrac_lower": masked_mean(lower.to(ratio.dtype), mask_B_T).item(),
            "actor/approx_kl": masked_mean(-log_ratio, mask_B_T).item(),
            "actor/ratio_mean": masked_mean(ratio, mask_B_T).item(),
            "actor/ratio_max": ratio[valid].max().item() if bool(valid.any()) else 0.0,
        }
    return loss, metrics


# -- entropy and the total loss -----------------------------------------------------------------


def entropy_from_logits(logits_B_T_V: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax distribution at each position: ``logsumexp(z) - sum(softmax(z) * z)``.

    Vocabulary entries with probability 0 (logit -inf) contribute 0, and their gradient is 0.

    Args:
        logits_B_T_V: [B, T, V] logits (any leading dims).

    Returns:
        entropy_B_T: [B, T] in nats.
    """
    probs = torch.softmax(logits_B_T_V, dim=-1)
    # Entries with probability 0 (e.g. logits of -inf for banned tokens) contribute 0, not 0 * -inf.
    safe_logits = torch.where(probs > 0, logits_B_T_V, torch.zeros_like(logits_B_T_V))
    return torch.logsumexp(logits_B_T_V, dim=-1) - (probs * safe_logits).sum(dim=-1)


def compute_loss(
    logprobs_B_T: torch.Tensor,
    old_logprobs_B_T: torch.Tensor | None,
    ref_logprobs_B_T: torch.Tensor | None,
    advantages_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    entropy_B_T: torch.Tensor | None = None,
    cfg: LossConfig | None = None,
    norm: LossNormalizers | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Total loss: ``policy + kl_coef * agg(kl) - entropy_coef * agg(entropy)``.

    Every term is aggregated with ``cfg.agg_mode`` over the policy mask only. With ``norm`` (the
    figures of the whole mini-batch this batch is a piece of), the pieces' losses add up to the
    mini-batch's: sum them (or their gradients) instead of averaging.

    Args:
        logprobs_B_T: [B, T] log-probs of the sampled tokens under the policy being trained.
        old_logprobs_B_T: [B, T] log-probs under the sampling policy; ``None`` means on-policy
            (``logprobs_B_T.detach()``, ratio 1).
        ref_logprobs_B_T: [B, T] log-probs under the reference policy, or ``None`` for no KL term.
        advantages_B_T: [B, T] per-token advantages.
        mask_B_T: [B, T] policy mask (0 on prompt, observation and padding tokens).
        entropy_B_T: [B, T] per-token entropy (e.g. :func:`entropy_from_logits`), or ``None``.
        cfg: the loss options (defaults: :class:`LossConfig`).
        norm: aggregation denominators (:class:`LossNormalizers`); ``None``: this batch's own.

    Returns:
        (loss, metrics): the scalar loss and ``loss/total``, ``loss/policy``, ``loss/kl`` and
        ``loss/entropy`` (when computed), plus the policy loss's ``actor/...`` metrics.
    """
    cfg = cfg if cfg is not None else LossConfig()
    if old_logprobs_B_T is None:
        old_logprobs_B_T = logprobs_B_T.detach()
    policy_loss, metrics = get_policy_loss(cfg.policy_loss)(
        logprobs_B_T, old_logprobs_B_T, advantages_B_T, mask_B_T, cfg, norm
    )
    total = policy_loss
    metrics = {"loss/policy": policy_loss.item(), **metrics}
    if ref_logprobs_B_T is not None:
        _check_pair(ref_logprobs_B_T, mask_B_T, "ref_logprobs")
        kl_B_T = kl_penalty(
            masked_fill_zero(logprobs_B_T, mask_B_T),
            masked_fill_zero(ref_logprobs_B_T.detach(), mask_B_T),
            cfg.kl_kind,
        )
        kl = agg_loss(kl_B_T, mask_B_T, cfg.agg_mode, norm)
        total = total + cfg.kl_coef * kl
        metrics["loss/kl"] = kl.item()
    if entropy_B_T is not None:
        _check_pair(entropy_B_T, mask_B_T, "entropy")
        ent = agg_loss(masked_fill_zero(entropy_B_T, mask_B_T), mask_B_T, cfg.agg_mode, norm)
        total = total - cfg.entropy_coef * ent
        metrics["loss/entropy"] = ent.item()
    metrics["loss/total"] = total.item()
    return total, metrics
