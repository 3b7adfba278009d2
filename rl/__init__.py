"""Pure RL math: group UIDs, sample filters, advantages and PPO/GRPO losses (numpy/torch, no I/O).

See docs/rl.md for every formula, its source and where it deviates from PettingLLMs and verl. What the config
selects by name (advantage estimator, filter method, KL estimator, loss aggregation mode) is looked up in a
``Registry`` (``registry.py``), to which each implementation adds itself with one decorator.
"""

from pettingflow.rl.advantages import (
    ADVANTAGE_ESTIMATORS,
    broadcast_advantages,
    compute_advantages,
)
from pettingflow.rl.filters import FILTER_METHODS, FilterResult, filter_samples, range_normalized_variance
from pettingflow.rl.losses import (
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    LossAggMode,
    entropy_from_logits,
    kl_penalty,
    loss_denominator,
    masked_aggregate,
    policy_loss,
    total_loss,
)
from pettingflow.rl.registry import Registry
from pettingflow.rl.uids import PETTINGFLOW_UID_NAMESPACE, assign_uids, group_indices

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "FILTER_METHODS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "PETTINGFLOW_UID_NAMESPACE",
    "FilterResult",
    "LossAggMode",
    "Registry",
    "assign_uids",
    "broadcast_advantages",
    "compute_advantages",
    "entropy_from_logits",
    "filter_samples",
    "group_indices",
    "kl_penalty",
    "loss_denominator",
    "masked_aggregate",
    "policy_loss",
    "range_normalized_variance",
    "total_loss",
]
