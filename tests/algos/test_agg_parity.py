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

from treegrpo.algos.losses import AGG_MODES, agg_loss


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
