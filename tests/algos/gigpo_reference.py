"""Test-only restatement of verl-agent's GiGPO advantage (``gigpo/core_gigpo.py`` of
github.com/langfengQ/verl-agent: ``compute_gigpo_outcome_advantage``, ``episode_norm_reward``,
``build_step_group``, ``step_norm_reward``, ``compute_step_discounted_returns``, ``are_similar``),
written from reading that code, in its own loop-over-rows style and with its token-level
interface (``(bs, response_length)`` rewards and masks), for the parity test. Not vendored: the
same steps, our words. One deliberate difference: float64 instead of float32 (see
:mod:`treegrpo.algos.gigpo`), so that an all-equal group is exactly 0 in both.

verl-agent's behaviour restated here:

- the episode score of a row is ``token_level_rewards[i].sum()``; its group is ``index[i]``; with
  ``compute_mean_std_cross_steps=True`` (the default, and what ``compute_gigpo_outcome_advantage``
  uses) every row of the group counts, one per step; a group of one row gets mean 0 and std 1;
  otherwise mean and *unbiased* std;
- step groups: within each ``index``, rows with identical anchor observations (or, with
  similarity, the first cluster whose representative — its first member — has a
  ``SequenceMatcher(None, obs, rep).ratio() >= thresh``; else a new cluster);
- the step score is the discounted return; a step group of one row gets its own score as mean
  and std 1;
- ``mean_norm`` subtracts the mean, ``mean_std_norm`` also divides by ``std + epsilon``;
- the result ``episode + step_advantage_w * step``, broadcast over the response tokens (× mask).
"""

from __future__ import annotations

from collections import defaultdict
from difflib import SequenceMatcher
from typing import Any

import numpy as np
import torch


def ref_discounted_returns(rewards: np.ndarray, traj_uids: np.ndarray, gamma: float) -> torch.Tensor:
    returns = np.zeros(len(rewards), dtype=np.float64)
    for uid in np.unique(traj_uids):
        where = np.where(traj_uids == uid)[0]
        running = 0.0
        for t in reversed(range(len(where))):
            running = float(rewards[where[t]]) + gamma * running
            returns[where[t]] = running
    return torch.tensor(returns, dtype=torch.float64)


def _mean_std(values: list[float], singleton_mean: float | None) -> tuple[float, float]:
    t = torch.tensor(values, dtype=torch.float64)
    if len(values) == 1:
        return (float(t[0]) if singleton_mean is None else singleton_mean), 1.0
    return float(t.mean()), float(t.std())  # torch.std: unbiased


def ref_episode_norm(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float,
    remove_std: bool,
) -> torch.Tensor:
    scores = token_level_rewards.sum(dim=-1)
    by: dict[Any, list[float]] = defaultdict(list)
    for i in range(len(scores)):
        by[index[i]].append(float(scores[i]))
    stats = {k: _mean_std(v, singleton_mean=0.0) for k, v in by.items()}
    out = scores.clone()
    for i in range(len(scores)):
        mean, std = stats[index[i]]
        out[i] = scores[i] - mean if remove_std else (scores[i] - mean) / (std + epsilon)
    return out.unsqueeze(-1).tile([1, response_mask.shape[-1]]) * response_mask


def ref_build_step_group(
    anchor_obs: np.ndarray, index: np.ndarray, enable_similarity: bool, thresh: float
) -> np.ndarray:
    uids = np.empty(len(anchor_obs), dtype=object)
    counter = 0
    for idx in np.unique(index):
        locs = np.where(index == idx)[0]
        if not enable_similarity:
            clusters: dict[Any, list[int]] = defaultdict(list)
            for loc in locs:
                clusters[anchor_obs[loc]].append(loc)
            for members in clusters.values():
                for loc in members:
                    uids[loc] = f"g{counter}"
                counter += 1
        else:
            reps: list[dict[str, Any]] = []
            for loc in locs:
                obs = anchor_obs[loc]
                for c in reps:
                    if SequenceMatcher(None, obs, c["rep"]).ratio() >= thresh:
                        c["locs"].append(loc)
                        break
                else:
                    reps.append({"rep": obs, "locs": [loc]})
            for c in reps:
                for loc in c["locs"]:
                    uids[loc] = f"g{counter}"
                counter += 1
    assert not any(u is None for u in uids)
    return uids


def ref_step_norm(
    step_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    uids: np.ndarray,
    epsilon: float,
    remove_std: bool,
) -> torch.Tensor:
    by: dict[Any, list[float]] = defaultdict(list)
    for i in range(len(step_rewards)):
        by[uids[i]].append(float(step_rewards[i]))
    stats = {k: _mean_std(v, singleton_mean=None) for k, v in by.items()}
    out = step_rewards.clone()
    for i in range(len(step_rewards)):
        mean, std = stats[uids[i]]
        out[i] = step_rewards[i] - mean if remove_std else (step_rewards[i] - mean) / (std + epsilon)
    return out.unsqueeze(-1).tile([1, response_mask.shape[-1]]) * response_mask


def ref_gigpo(
    token_level_rewards: torch.Tensor,
    step_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    anchor_obs: np.ndarray,
    index: np.ndarray,
    epsilon: float = 1e-6,
    step_advantage_w: float = 1.0,
    mode: str = "mean_norm",
    enable_similarity: bool = False,
    similarity_thresh: float = 0.95,
) -> tuple[torch.Tensor, np.ndarray]:
    """Per-token advantages ``(bs, response_length)`` and the step-group labels."""
    if mode not in ("mean_norm", "mean_std_norm"):
        raise ValueError(mode)
    remove_std = mode == "mean_norm"
    episode = ref_episode_norm(token_level_rewards, response_mask, index, epsilon, remove_std)
    uids = ref_build_step_group(anchor_obs, index, enable_similarity, similarity_thresh)
    step = ref_step_norm(step_rewards, response_mask, uids, epsilon, remove_std)
    return episode + step_advantage_w * step, uids
