"""Peer parity of the loss aggregation: on random inputs every mode equals a direct re-statement
of verl 0.9.1's ``agg_loss`` (``verl/trainer/ppo/core_algos.py``) and, for Dr. GRPO, TRL's
``dr_grpo`` loss, to 1e-7.

The references below are written from reading those sources, one formula per mode, with the
global-batch arguments at their one-process values (``dp_size = 1``, ``batch_num_tokens`` = the
batch's masked tokens, ``global_batch_size`` = its sequences with a masked token, the fully
masked ones excluded as verl's ``seq_mask`` does, ``loss_scale_factor`` = the response length
``T``).
"""

from __future__ import annotations

import pytest
import torch

from treegrpo.algos.losses import AGG_MODES, LossNormalizers, agg_loss


def verl_agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, mode: str) -> torch.Tensor:
    """verl 0.9.1 ``agg_loss`` restated (dp_size 1, its default global batch figures)."""
    mask = loss_mask.to(loss_mat.dtype)
    seq_sum = (loss_mat * mask).sum(-1)  # token-sum per sequence
    seq_mask = (mask.sum(-1) > 0).to(loss_mat.dtype)  # fully masked sequences excluded
    global_batch_size = seq_mask.sum()
    if mode == "token-mean":
        return (loss_mat * mask).sum() / mask.sum()
    if mode == "seq-mean-token-sum":
        return (seq_sum * seq_mask).sum() / global_batch_size
    if mode == "seq-mean-token-mean":
        return (seq_sum / (mask.sum(-1) + 1e-8) * seq_mask).sum() / global_batch_size
    if mode == "seq-mean-token-sum-norm":
        loss_scale_factor = loss_mask.shape[-1]
        return (seq_sum / loss_scale_factor * seq_mask).sum() / global_batch_size
    raise ValueError(mode)


def trl_dr_grpo_loss(
    per_token_loss: torch.Tensor, completion_mask: torch.Tensor, max_len: int
) -> torch.Tensor:
    """TRL's ``loss_type="dr_grpo"``: token sum / (completions × max_completion_length)."""
    return (per_token_loss * completion_mask).sum() / (per_token_loss.size(0) * max_len)


def _random_batch(seed: int, empty_row: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    B, T = 7, 13
    loss = torch.randn(B, T, generator=g, dtype=torch.float64) * 3
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).to(torch.float64)
    mask = mask * (torch.rand(B, T, generator=g) > 0.3)  # holes: observation tokens
    mask[:, 0] = 1.0  # every row keeps a policy token ...
    if empty_row:
        mask[3] = 0.0  # ... but this one (verl leaves it out of the sequence means)
    return loss, mask


@pytest.mark.parametrize("mode", [m for m in AGG_MODES if not m.endswith("-legacy")])
@pytest.mark.parametrize("empty_row", [False, True])
def test_agg_loss_matches_verl(mode: str, empty_row: bool) -> None:
    for seed in range(5):
        loss, mask = _random_batch(seed, empty_row)
        ours = agg_loss(loss, mask, mode)
        ref = verl_agg_loss(loss, mask, mode)
        assert abs(float(ours) - float(ref)) <= 1e-7, (seed, float(ours), float(ref))


def test_seq_mean_token_sum_norm_matches_trl_dr_grpo() -> None:
    for seed in range(5):
        loss, mask = _random_batch(seed, empty_row=False)  # TRL completions are never empty
        ours = agg_loss(loss, mask, "seq-mean-token-sum-norm")
        ref = trl_dr_grpo_loss(loss, mask, loss.shape[-1])
        assert abs(float(ours) - float(ref)) <= 1e-7


def test_legacy_mode_is_the_old_verl_fork_token_sum_over_t() -> None:
    loss, mask = _random_batch(0, empty_row=True)
    ref = (loss * mask).sum() / loss.shape[-1]
    assert abs(float(agg_loss(loss, mask, "seq-mean-token-sum-norm-legacy")) - float(ref)) <= 1e-7
    n_seqs = int((mask.sum(-1) > 0).sum())
    new = agg_loss(loss, mask, "seq-mean-token-sum-norm")
    assert float(new) == pytest.approx(float(ref) / n_seqs, abs=1e-12)


# -- global normalisers: the pieces of a mini-batch add up to it --------------------------------------


@pytest.mark.parametrize("mode", AGG_MODES)
def test_pieces_with_the_mini_batch_normalizers_add_up(mode: str) -> None:
    """Split a batch into pieces (micro-batches, or data-parallel ranks) of different padded
    widths: each aggregated with the whole batch's LossNormalizers, the losses and gradients add
    up to the whole batch's, which a piece's own counts and width do not give."""
    loss, mask = _random_batch(3, empty_row=True)
    loss.requires_grad_(True)
    pieces = [(0, 2, 9), (2, 5, 13), (5, 7, 6)]  # rows [a, b), padded to width w
    for a, b, w in pieces:
        mask[a:b, w:] = 0.0  # nothing of a piece lies past its width
    whole = agg_loss(loss, mask, mode)
    (g_whole,) = torch.autograd.grad(whole, loss)
    norm = LossNormalizers.of(mask.tolist())  # horizon: the full width, 13
    total = sum(agg_loss(loss[a:b, :w], mask[a:b, :w], mode, norm) for a, b, w in pieces)
    (g_total,) = torch.autograd.grad(total, loss)
    assert abs(float(total.detach()) - float(whole.detach())) <= 1e-10
    assert float((g_total - g_whole).abs().max()) <= 1e-12
    with torch.no_grad():
        local = sum(agg_loss(loss[a:b, :w], mask[a:b, :w], mode) for a, b, w in pieces)
    assert abs(float(local) - float(whole.detach())) > 1e-3  # their own figures do not add up


def test_normalizers_of_pieces_combine_like_an_all_reduce() -> None:
    _, mask = _random_batch(4, empty_row=True)
    rows = mask.tolist()
    parts = [LossNormalizers.of(rows[:3]), LossNormalizers.of(rows[3:])]
    assert LossNormalizers.combine(parts) == LossNormalizers.of(rows)
    assert LossNormalizers.of(rows) == LossNormalizers(float(mask.sum()), 6.0, 13.0)
    assert LossNormalizers.of(rows, horizon=64).horizon == 64.0
