"""Per-token KL estimators between the policy and a reference policy (DESIGN.md §5.5).

Modelled on verl's ``core_algos.kl_penalty``; see http://joschu.net/blog/kl-approx.html. Each
estimator maps ``(logprob_B_T, ref_logprob_B_T) -> kl_B_T`` elementwise (any matching shapes);
masking and aggregation are the caller's job (:func:`treegrpo.algos.losses.agg_loss`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from treegrpo.registry import add, lookup

KLFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

KL_ESTIMATORS: dict[str, KLFn] = {}


def register_kl(*names: str) -> Callable[[KLFn], KLFn]:
    """Decorator: register a KL estimator under one or more names (aliases)."""

    def deco(fn: KLFn) -> KLFn:
        for name in names:
            add(KL_ESTIMATORS, name, fn, "KL estimator")
        return fn

    return deco


def get_kl_estimator(kind: str) -> KLFn:
    """The KL estimator registered as ``kind``; ValueError naming the known ones otherwise."""
    return lookup(KL_ESTIMATORS, kind, "KL estimator")


@register_kl("k1", "kl")
def kl_k1(logprob_B_T: torch.Tensor, ref_logprob_B_T: torch.Tensor) -> torch.Tensor:
    """k1: ``logp - ref`` (unbiased, high variance, can be negative). Shapes: [B, T] -> [B, T]."""
    return logprob_B_T - ref_logprob_B_T


@register_kl("k2", "mse")
def kl_k2(logprob_B_T: torch.Tensor, ref_logprob_B_T: torch.Tensor) -> torch.Tensor:
    """k2: ``0.5 * (logp - ref)^2``. Shapes: [B, T] -> [B, T]."""
    return 0.5 * (logprob_B_T - ref_logprob_B_T).square()


@register_kl("k3", "low_var_kl")
def kl_k3(logprob_B_T: torch.Tensor, ref_logprob_B_T: torch.Tensor) -> torch.Tensor:
    """k3 (``low_var_kl``): ``exp(ref - logp) - (ref - logp) - 1``, non-negative.

    As in verl, ``ref - logp`` is clamped to [-20, 20] before the exp and the result to
    [-10, 10]. Shapes: [B, T] -> [B, T].
    """
    log_ratio = torch.clamp(ref_logprob_B_T - logprob_B_T, min=-20.0, max=20.0)
    kld = torch.exp(log_ratio) - log_ratio - 1.0
    return torch.clamp(kld, min=-10.0, max=10.0)


@register_kl("abs")
def kl_abs(logprob_B_T: torch.Tensor, ref_logprob_B_T: torch.Tensor) -> torch.Tensor:
    """``|logp - ref|`` (verl's ``abs``). Shapes: [B, T] -> [B, T]."""
    return (logprob_B_T - ref_logprob_B_T).abs()


def kl_penalty(logprob_B_T: torch.Tensor, ref_logprob_B_T: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token KL estimate of the policy from the reference.

    Args:
        logprob_B_T: [B, T] log-probs of the sampled tokens under the current policy.
        ref_logprob_B_T: [B, T] log-probs of the same tokens under the reference policy.
        kind: ``"k1"`` (alias ``"kl"``), ``"k2"`` (``"mse"``), ``"k3"`` (``"low_var_kl"``) or
            ``"abs"``.

    Returns:
        kl_B_T: [B, T], unmasked.
    """
    if logprob_B_T.shape != ref_logprob_B_T.shape:
        raise ValueError(
            f"logprob and ref_logprob shapes differ: {tuple(logprob_B_T.shape)} vs {tuple(ref_logprob_B_T.shape)}"
        )
    return get_kl_estimator(kind)(logprob_B_T, ref_logprob_B_T)
