"""KL estimators (DESIGN.md §5.5), hand-derived values."""

from __future__ import annotations

import math

import pytest
import torch

from treegrpo.algos import KL_ESTIMATORS, get_kl_estimator, kl_penalty

LN2 = math.log(2.0)


def _t(*xs: float) -> torch.Tensor:
    return torch.tensor([list(xs)], dtype=torch.float64)


def test_k1_k2_k3_hand_values() -> None:
    # p = 0.5, ref = 0.25: logp - ref = ln 2
    logp, ref = _t(math.log(0.5)), _t(math.log(0.25))
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(LN2, abs=1e-9)  # 0.693147
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5 * LN2**2, abs=1e-9)  # 0.240227
    # k3: x = ref - logp = -ln2; e^x - x - 1 = 0.5 + ln2 - 1 = 0.193147
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(0.5 + LN2 - 1, abs=1e-9)
    # swapped: x = ln2; 2 - ln2 - 1 = 0.306853; k1 negative
    assert kl_penalty(ref, logp, "k3").item() == pytest.approx(1 - LN2, abs=1e-9)
    assert kl_penalty(ref, logp, "k1").item() == pytest.approx(-LN2, abs=1e-9)
    assert kl_penalty(ref, logp, "abs").item() == pytest.approx(LN2, abs=1e-9)


def test_aliases_and_default() -> None:
    logp = torch.tensor([[-0.3, -1.2, -2.0]])
    ref = torch.tensor([[-0.5, -0.7, -2.5]])
    assert torch.equal(kl_penalty(logp, ref, "low_var_kl"), kl_penalty(logp, ref, "k3"))
    assert torch.equal(kl_penalty(logp, ref), kl_penalty(logp, ref, "k3"))
    assert torch.equal(kl_penalty(logp, ref, "kl"), kl_penalty(logp, ref, "k1"))
    assert torch.equal(kl_penalty(logp, ref, "mse"), kl_penalty(logp, ref, "k2"))
    assert {"k1", "k2", "k3", "low_var_kl"} <= set(KL_ESTIMATORS)


def test_k3_is_zero_at_equality_nonnegative_and_clamped() -> None:
    x = torch.linspace(-5, 5, 41, dtype=torch.float64).reshape(1, -1)
    assert torch.all(kl_penalty(x, x, "k3") == 0)
    assert torch.all(kl_penalty(x, x.flip(-1), "k3") >= 0)
    # ref - logp = 30 -> clamped to 20 -> e^20 - 21 -> clamped to 10
    assert kl_penalty(_t(-30.0), _t(0.0), "k3").item() == 10.0
    # ref - logp = -30 -> clamped to -20 -> e^-20 + 19 -> clamped to 10
    assert kl_penalty(_t(0.0), _t(-30.0), "k3").item() == 10.0
    # e^-3 + 3 - 1 = 2.049787 is below the clamp
    assert kl_penalty(_t(0.0), _t(-3.0), "k3").item() == pytest.approx(math.exp(-3) + 2, abs=1e-9)


def test_k3_gradient_finite_when_clamped() -> None:
    logp = torch.tensor([[-50.0, -1.0]], requires_grad=True)
    kl_penalty(logp, torch.zeros(1, 2), "k3").sum().backward()
    assert logp.grad is not None and torch.isfinite(logp.grad).all()


def test_unknown_kind_and_shape_mismatch() -> None:
    with pytest.raises(ValueError, match=r"unknown KL estimator 'k9'.*k1"):
        get_kl_estimator("k9")
    with pytest.raises(ValueError, match="shapes differ"):
        kl_penalty(torch.zeros(1, 2), torch.zeros(1, 3))
