"""Pure RL math: group UIDs, sample filters, advantages and PPO/GRPO losses (numpy/torch, no I/O).

See docs/rl.md for every formula, its source and where it deviates from PettingLLMs and verl. What the config
selects by name (advantage estimator, filter method, policy loss, KL estimator, loss aggregation mode) is looked up in a
``Registry`` (``registry.py``), to which each implementation adds itself with one decorator.

The names below load their module on first use: ``configs`` imports ``rl.advantages``, ``rl.filters`` and
``rl.loss_terms`` (no torch) to validate names against the registries, and must not pull in torch through
``rl.losses``.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "advantages": ("ADVANTAGE_ESTIMATORS", "broadcast_advantages", "compute_advantages"),
    "filters": ("FILTER_METHODS", "FilterResult", "filter_samples", "range_normalized_variance"),
    "loss_terms": (
        "KL_ESTIMATORS",
        "LOSS_AGG_MODES",
        "POLICY_LOSSES",
        "ClipParams",
        "LossAggMode",
        "PolicyLoss",
        "PolicyLossTerms",
    ),
    "losses": (
        "entropy_from_logits",
        "kl_penalty",
        "loss_denominator",
        "masked_aggregate",
        "policy_loss",
        "total_loss",
    ),
    "registry": ("Registry",),
    "uids": ("PETTINGFLOW_UID_NAMESPACE", "assign_uids", "group_indices"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'pettingflow.rl' has no attribute {name!r}")
    return getattr(importlib.import_module(f"pettingflow.rl.{_MODULE_OF[name]}"), name)


def __dir__() -> list[str]:
    return __all__
