"""Loss aggregation, PPO-clip, entropy and the total loss (DESIGN.md §5.5), hand-derived values."""

from __future__ import annotations

import math

import pytest
import torch

from treegrpo.algos import (
    AGG_MODES,
    POLICY_LOSSES,
    LossConfig,
    agg_loss,
    compute_loss,
    entropy_from_logits,
    get_policy_loss,
    masked_mean,
    ppo_clip_loss,
    register_policy_loss,
)

TOL = 1e-6
LN2 = math.log(2.0)


# -- agg_loss -------------------------------------------------------------------------------------

LOSS = torch.tensor([[1.0, 2.0, 3.0, 10.0], [4.0, 5.0, 6.0, 10.0], [7.0, 8.0, 9.0, 10.0]])
MASK = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]])  # last sequence fully masked


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 7 / 3),  # (1 + 2 + 4) / 3 tokens
        ("seq-mean-token-sum", 3.5),  # (3 + 4) / 2 sequences; the empty one is skipped
        ("seq-mean-token-mean", 2.75),  # (1.5 + 4) / 2
        ("seq-mean-token-sum-norm", 7 / 8),  # (1 + 2 + 4) / (2 non-empty sequences × T=4)
        ("seq-mean-token-sum-norm-legacy", 7 / 4),  # (1 + 2 + 4) / T=4
    ],
)
def test_agg_modes(mode: str, expected: float) -> None:
    out = agg_loss(LOSS, MASK, mode)
    assert out.dim() == 0
    assert out.item() == pytest.approx(expected, abs=TOL)
    # float and bool masks give the same
    assert agg_loss(LOSS, MASK.bool(), mode).item() == pytest.approx(expected, abs=TOL)
    assert agg_loss(LOSS, MASK.float(), mode).item() == pytest.approx(expected, abs=TOL)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_agg_all_masked_is_zero_not_nan(mode: str) -> None:
    x = torch.randn(2, 3, requires_grad=True)
    out = agg_loss(x, torch.zeros(2, 3), mode)
    assert out.item() == 0.0
    out.backward()
    assert x.grad is not None and torch.equal(x.grad, torch.zeros(2, 3))


def test_agg_ignores_nan_at_masked_positions() -> None:
    x = LOSS.clone()
    x[2] = float("nan")
    x[0, 3] = float("inf")
    for mode in AGG_MODES:
        assert agg_loss(x, MASK, mode).item() == pytest.approx(agg_loss(LOSS, MASK, mode).item(), abs=TOL)


def test_agg_errors() -> None:
    with pytest.raises(ValueError, match="unknown agg_mode"):
        agg_loss(LOSS, MASK, "seq-sum")
    with pytest.raises(ValueError, match="shape"):
        agg_loss(LOSS, MASK[:, :3], "token-mean")
    assert masked_mean(LOSS, MASK).item() == pytest.approx(7 / 3, abs=TOL)


# -- ppo_clip ---------------------------------------------------------------------------------------


def _ppo_case(ratios: list[float], advs: list[float], cfg: LossConfig) -> tuple[float, list[float], dict]:
    """One sequence; old logp 0, logp = ln(ratio). Returns (loss, d loss / d logp, metrics)."""
    logp = torch.tensor([[math.log(r) for r in ratios]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros_like(logp)
    adv = torch.tensor([advs], dtype=torch.float64)
    loss, metrics = ppo_clip_loss(logp, old, adv, torch.ones_like(adv), cfg)
    loss.backward()
    assert logp.grad is not None
    return loss.item(), logp.grad[0].tolist(), metrics


def test_ppo_clip_both_sides() -> None:
    # token | ratio | A  | -A*r | -A*clip(r, .8, 1.2) | max    | clipped | d/dlogp (=-A*r if unclipped)
    # 0     | 1.5   | +1 | -1.5 | -1.2                | -1.2   | yes     | 0
    # 1     | 0.5   | -1 | 0.5  | 0.8                 | 0.8    | yes     | 0
    # 2     | 1.1   | +1 | -1.1 | -1.1                | -1.1   | no      | -1.1
    # 3     | 1.5   | -1 | 1.5  | 1.2                 | 1.5    | no      | 1.5
    # 4     | 0.5   | +2 | -1.0 | -1.6                | -1.0   | no      | -1.0
    # token-mean: (-1.2 + 0.8 - 1.1 + 1.5 - 1.0) / 5 = -1.0 / 5 = -0.2; grads / 5
    loss, grad, m = _ppo_case([1.5, 0.5, 1.1, 1.5, 0.5], [1, -1, 1, -1, 2], LossConfig())
    assert loss == pytest.approx(-0.2, abs=TOL)
    assert grad == pytest.approx([0.0, 0.0, -1.1 / 5, 1.5 / 5, -1.0 / 5], abs=TOL)
    assert grad[0] == 0.0 and grad[1] == 0.0  # exactly zero where clipped
    assert m["actor/clipfrac"] == pytest.approx(2 / 5, abs=TOL)
    assert m["actor/clipfrac_lower"] == 0.0
    # approx_kl = mean(old - logp) = -mean(ln r)
    assert m["actor/approx_kl"] == pytest.approx(
        -sum(math.log(r) for r in [1.5, 0.5, 1.1, 1.5, 0.5]) / 5, abs=TOL
    )
    assert m["actor/ratio_max"] == pytest.approx(1.5, abs=TOL)


def test_ppo_asymmetric_clip_higher() -> None:
    # clip_ratio_high 0.28 (DAPO): ratio 1.25 with A=1 is inside [0.8, 1.28] -> -1.25, grad -1.25;
    # ratio 1.5 -> clipped to 1.28 -> -1.28, grad 0.  mean = (-1.25 - 1.28) / 2 = -1.265
    loss, grad, _ = _ppo_case([1.25, 1.5], [1, 1], LossConfig(clip_ratio_high=0.28))
    assert loss == pytest.approx(-1.265, abs=TOL)
    assert grad == pytest.approx([-1.25 / 2, 0.0], abs=TOL)


def test_ppo_dual_clip() -> None:
    # ratio 4, A=-1: max(4, 1.2) = 4; dual clip caps at -A*c = 3 -> loss 3, grad 0.
    # ratio 4, A=+1: max(-4, -1.2) = -1.2 (ordinary clip), dual clip does not apply (A > 0).
    # ratio 2, A=-1: max(2, 1.2) = 2 < 3 -> not capped, grad -A*r = 2.
    cfg = LossConfig(dual_clip=True)
    loss, grad, m = _ppo_case([4.0, 4.0, 2.0], [-1, 1, -1], cfg)
    assert loss == pytest.approx((3.0 - 1.2 + 2.0) / 3, abs=TOL)
    assert grad == pytest.approx([0.0, 0.0, 2.0 / 3], abs=TOL)
    assert m["actor/clipfrac_lower"] == pytest.approx(1 / 3, abs=TOL)
    # without dual clip the first token costs 4 and has gradient -A*r = 4
    loss, grad, m = _ppo_case([4.0, 4.0, 2.0], [-1, 1, -1], LossConfig())
    assert loss == pytest.approx((4.0 - 1.2 + 2.0) / 3, abs=TOL)
    assert grad == pytest.approx([4.0 / 3, 0.0, 2.0 / 3], abs=TOL)
    assert m["actor/clipfrac_lower"] == 0.0


def test_ppo_on_policy_is_minus_mean_advantage() -> None:
    # ratio 1 everywhere: loss = -mean(A), d/dlogp = -A / N
    loss, grad, m = _ppo_case([1.0, 1.0, 1.0], [0.5, -2.0, 1.0], LossConfig())
    assert loss == pytest.approx(0.5 / 3, abs=TOL)
    assert grad == pytest.approx([-0.5 / 3, 2.0 / 3, -1.0 / 3], abs=TOL)
    assert m["actor/clipfrac"] == 0.0 and m["actor/approx_kl"] == 0.0


def test_policy_loss_registry() -> None:
    assert POLICY_LOSSES["ppo_clip"] is ppo_clip_loss
    with pytest.raises(ValueError, match=r"unknown policy loss 'nope'.*ppo_clip"):
        get_policy_loss("nope")

    @register_policy_loss("_test_zero")
    def zero(logp, old, adv, mask, cfg, norm):  # type: ignore[no-untyped-def]
        return (logp * 0).sum(), {}

    try:
        x = torch.zeros(1, 2)
        loss, m = compute_loss(x, x, None, x, torch.ones(1, 2), None, LossConfig(policy_loss="_test_zero"))
        assert loss.item() == 0.0 and m["loss/policy"] == 0.0
        with pytest.raises(ValueError, match="already registered"):
            register_policy_loss("_test_zero")(zero)
    finally:
        del POLICY_LOSSES["_test_zero"]


def test_loss_config_validation() -> None:
    with pytest.raises(ValueError, match="clip_ratio_c"):
        LossConfig(clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="agg_mode"):
        LossConfig(agg_mode="sum")
    with pytest.raises(ValueError, match="kl_kind"):
        LossConfig(kl_kind="k4")
    with pytest.raises(ValueError, match="clip_ratio_low"):
        LossConfig(clip_ratio_low=1.0)
    cfg = LossConfig()
    assert (cfg.clip_ratio_low, cfg.clip_ratio_high, cfg.clip_ratio_c) == (0.2, 0.2, 3.0)
    assert (cfg.kl_coef, cfg.kl_kind, cfg.entropy_coef, cfg.agg_mode) == (0.001, "k3", 0.0, "token-mean")


# -- entropy ------------------------------------------------------------------------------------------


def test_entropy_from_logits() -> None:
    # uniform over 4 -> ln 4; p = (1/2, 1/4, 1/4) -> 1/2 ln2 + 2 * 1/4 ln4 = 1.5 ln2
    logits = torch.tensor(
        [[[0.0, 0.0, 0.0, 0.0], [math.log(0.5), math.log(0.25), math.log(0.25), -float("inf")]]],
        dtype=torch.float64,
    )
    ent = entropy_from_logits(logits)
    assert ent.shape == (1, 2)
    assert ent[0, 0].item() == pytest.approx(math.log(4), abs=TOL)
    # -inf logit: p = 0 contributes 0 (softmax * logit would be 0 * -inf = nan without care)
    z = torch.randn(3, 5, 7, dtype=torch.float64) * 3
    ref = torch.distributions.Categorical(logits=z).entropy()
    assert torch.allclose(entropy_from_logits(z), ref, atol=1e-9)
    finite = torch.tensor([[[math.log(0.5), math.log(0.25), math.log(0.25)]]], dtype=torch.float64)
    assert entropy_from_logits(finite).item() == pytest.approx(1.5 * LN2, abs=TOL)
    assert torch.isfinite(ent[0, 1]) and ent[0, 1].item() == pytest.approx(1.5 * LN2, abs=TOL)
    z = logits.clone().requires_grad_(True)
    entropy_from_logits(z).sum().backward()
    assert z.grad is not None and torch.isfinite(z.grad).all()


# -- compute_loss ---------------------------------------------------------------------------------------


def test_compute_loss_composition() -> None:
    # one sequence, 2 policy tokens + 1 observation token; on-policy (ratio 1)
    # policy = -(2 + 1) / 2 = -1.5
    # kl: p = .5, ref = .25 per token -> k3 = 0.5 + ln2 - 1 = 0.193147 each -> agg 0.193147
    # entropy [1, 3] -> 2;  total = -1.5 + 0.1 * 0.193147 - 0.01 * 2 = -1.5006853
    logp = torch.tensor([[math.log(0.5), math.log(0.5), 0.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.full((1, 3), math.log(0.25), dtype=torch.float64)
    adv = torch.tensor([[2.0, 1.0, 99.0]], dtype=torch.float64)
    ent = torch.tensor([[1.0, 3.0, 50.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0]])
    cfg = LossConfig(kl_coef=0.1, entropy_coef=0.01)
    total, m = compute_loss(logp, logp.detach(), ref, adv, mask, ent, cfg)
    k3 = 0.5 + LN2 - 1
    assert m["loss/policy"] == pytest.approx(-1.5, abs=TOL)
    assert m["loss/kl"] == pytest.approx(k3, abs=TOL)
    assert m["loss/entropy"] == pytest.approx(2.0, abs=TOL)
    assert total.item() == pytest.approx(-1.5 + 0.1 * k3 - 0.02, abs=TOL)
    assert m["loss/total"] == pytest.approx(total.item(), abs=TOL)
    assert "actor/clipfrac" in m and "actor/approx_kl" in m
    # old=None means on-policy; ref=None and entropy=None drop those terms
    total2, m2 = compute_loss(logp, None, None, adv, mask, None, cfg)
    assert total2.item() == pytest.approx(-1.5, abs=TOL)
    assert "loss/kl" not in m2 and "loss/entropy" not in m2


def test_compute_loss_kl_gradient() -> None:
    # k1 with token-mean over 2 tokens: d/dlogp (kl_coef * mean(logp - ref)) = kl_coef / 2;
    # policy part with A = 0 contributes nothing.
    logp = torch.zeros(1, 2, dtype=torch.float64, requires_grad=True)
    cfg = LossConfig(kl_coef=0.5, kl_kind="k1")
    total, _ = compute_loss(
        logp,
        None,
        torch.full((1, 2), -1.0, dtype=torch.float64),
        torch.zeros(1, 2),
        torch.ones(1, 2),
        None,
        cfg,
    )
    total.backward()
    assert total.item() == pytest.approx(0.5, abs=TOL)
    assert logp.grad is not None
    assert logp.grad[0].tolist() == pytest.approx([0.25, 0.25], abs=TOL)


@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
@pytest.mark.parametrize("dual_clip", [False, True])
def test_masked_tokens_change_neither_loss_nor_gradients(agg_mode: str, dual_clip: bool) -> None:
    g = torch.Generator().manual_seed(0)
    B, T = 3, 7
    mask = (torch.rand(B, T, generator=g) < 0.6).long()
    mask[2] = 0  # an all-observation sequence
    mask[0, 0] = 1
    base = {
        "logp": -torch.rand(B, T, generator=g) * 3,
        "old": -torch.rand(B, T, generator=g) * 3,
        "ref": -torch.rand(B, T, generator=g) * 3,
        "adv": torch.randn(B, T, generator=g),
        "ent": torch.rand(B, T, generator=g) * 2,
    }
    cfg = LossConfig(dual_clip=dual_clip, agg_mode=agg_mode, kl_coef=0.1, entropy_coef=0.05)

    def run(vals: dict[str, torch.Tensor]) -> tuple[float, torch.Tensor, torch.Tensor]:
        logp = vals["logp"].clone().requires_grad_(True)
        ent = vals["ent"].clone().requires_grad_(True)
        total, _ = compute_loss(logp, vals["old"], vals["ref"], vals["adv"], mask, ent, cfg)
        total.backward()
        assert logp.grad is not None and ent.grad is not None
        return total.item(), logp.grad, ent.grad

    loss0, g_logp0, g_ent0 = run(base)
    off = mask == 0
    junk_values = [1e4, -1e4, float("nan"), float("inf"), -float("inf")]
    for junk in junk_values:
        perturbed = {k: torch.where(off, torch.full_like(v, junk), v) for k, v in base.items()}
        loss1, g_logp1, g_ent1 = run(perturbed)
        assert loss1 == loss0, junk
        assert torch.equal(g_logp1, g_logp0), junk
        assert torch.equal(g_ent1, g_ent0), junk
    assert torch.all(g_logp0[off] == 0) and torch.all(g_ent0[off] == 0)
    assert torch.isfinite(g_logp0).all()
