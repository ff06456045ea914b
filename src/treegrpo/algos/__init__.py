"""The algorithm layer: advantage estimators, KL estimators and policy losses (pure functions
and registries; no model, engine or environment code)."""

from treegrpo.algos.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageConfig,
    AdvantageEstimator,
    get_advantage_estimator,
    group_normalize,
    register_advantage,
    score_forest,
    token_advantages,
)
from treegrpo.algos.gigpo import gigpo_rows, shared_anchor_stats  # registers gigpo, tree_gigpo
from treegrpo.algos.kl import KL_ESTIMATORS, get_kl_estimator, kl_penalty, register_kl
from treegrpo.algos.losses import (
    AGG_MODES,
    POLICY_LOSSES,
    LossConfig,
    LossNormalizers,
    agg_loss,
    compute_loss,
    entropy_from_logits,
    get_policy_loss,
    masked_mean,
    ppo_clip_loss,
    register_policy_loss,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGG_MODES",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "AdvantageConfig",
    "AdvantageEstimator",
    "LossConfig",
    "LossNormalizers",
    "agg_loss",
    "compute_loss",
    "entropy_from_logits",
    "get_advantage_estimator",
    "get_kl_estimator",
    "get_policy_loss",
    "gigpo_rows",
    "group_normalize",
    "kl_penalty",
    "masked_mean",
    "ppo_clip_loss",
    "register_advantage",
    "register_kl",
    "register_policy_loss",
    "score_forest",
    "shared_anchor_stats",
    "token_advantages",
]
