"""Outcome advantages per UID group, and their placement on response tokens.

Each sample ``i`` has one scalar reward ``r_i`` and belongs to one UID group ``g`` (see ``uids.py``).
Estimators (``algorithm.advantage_estimator``, each registered in ``ADVANTAGE_ESTIMATORS``):

- ``grpo``:         ``(r_i - mean_g) / (std_g + eps)``, ``std_g`` with ddof=1 (Shao et al. 2024,
                    DeepSeekMath; ddof=1 matches verl's ``torch.std``, which PettingLLMs trains with).
- ``grpo_no_std``:  ``r_i - mean_g`` (Liu et al. 2025, "Understanding R1-Zero-Like Training", Dr. GRPO).
- ``rloo``:         ``r_i - mean(r_j, j in g, j != i) = n/(n-1) * (r_i - mean_g)`` (Ahmadian et al. 2024).
- ``reinforce_pp``: ``(r_i - mean_g) / (std_batch + eps)`` where ``std_batch`` (ddof=1) is taken over
                    the group-centered values of the whole batch (Hu 2025, REINFORCE++-baseline).

Every estimator gives exactly 0.0 to a group whose rewards are all equal (including groups of one
sample): such a group carries no learning signal, and ``r - mean`` would otherwise leave float dust.

Deviations from verl: a single-sample group gets 0 (verl's GRPO returns the raw reward); the
REINFORCE++ batch normalization is per sample, not per token, and does not re-center (the centered
values already have mean 0 up to rounding), so zero-variance groups stay exactly 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from pettingflow.rl.registry import Registry
from pettingflow.rl.uids import check_rewards, group_indices

if TYPE_CHECKING:  # torch loads where tensors are made: configs import this module for its names
    import torch

# (rewards [N] float64, index lists of the UID groups whose rewards differ, eps) -> advantages [N]
AdvantageEstimator = Callable[[np.ndarray, list[list[int]], float], np.ndarray]

ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator", "algorithm.advantage_estimator")


def compute_advantages(
    rewards: Sequence[float] | np.ndarray, uids: Sequence[str], estimator: str, eps: float = 1e-6
) -> np.ndarray:
    """Per-sample advantages (float64, same order as ``rewards``); formulas in the module docstring.

    Looks ``estimator`` up in ``ADVANTAGE_ESTIMATORS`` and calls it with the rewards, the UID groups whose
    rewards differ, and ``eps``; every other group (all rewards equal, or one sample) gets exactly 0.
    """
    fn = ADVANTAGE_ESTIMATORS.get(estimator)
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps!r}")
    r = check_rewards(rewards, uids)

    varied: list[list[int]] = []
    uniform: list[int] = []
    for idx in group_indices(uids).values():
        g = r[idx]
        if g.max() == g.min():
            uniform.extend(idx)  # zero variance (or one sample): no signal
        else:
            varied.append(idx)
    adv = np.asarray(fn(r, varied, eps), dtype=np.float64)
    if adv.shape != r.shape:
        raise ValueError(f"advantage estimator {estimator!r} returned shape {adv.shape}, expected {r.shape}")
    adv[uniform] = 0.0  # exactly 0, whatever the estimator did with them
    return adv


@ADVANTAGE_ESTIMATORS.register("grpo")
def _grpo(rewards: np.ndarray, groups: list[list[int]], eps: float) -> np.ndarray:
    adv = np.zeros_like(rewards)
    for idx in groups:
        g = rewards[idx]
        adv[idx] = (g - g.mean()) / (g.std(ddof=1) + eps)
    return adv


@ADVANTAGE_ESTIMATORS.register("grpo_no_std")
def _grpo_no_std(rewards: np.ndarray, groups: list[list[int]], eps: float) -> np.ndarray:
    adv = np.zeros_like(rewards)
    for idx in groups:
        g = rewards[idx]
        adv[idx] = g - g.mean()
    return adv


@ADVANTAGE_ESTIMATORS.register("rloo")
def _rloo(rewards: np.ndarray, groups: list[list[int]], eps: float) -> np.ndarray:
    adv = np.zeros_like(rewards)
    for idx in groups:
        g = rewards[idx]
        adv[idx] = (g - g.mean()) * len(g) / (len(g) - 1)
    return adv


@ADVANTAGE_ESTIMATORS.register("reinforce_pp")
def _reinforce_pp(rewards: np.ndarray, groups: list[list[int]], eps: float) -> np.ndarray:
    adv = _grpo_no_std(rewards, groups, eps)
    if len(adv) > 1:  # the batch std of a single value is undefined; that sample's group is uniform anyway
        adv = adv / (adv.std(ddof=1) + eps)
    return adv


def _check_pair(values: torch.Tensor, mask: torch.Tensor, name: str) -> None:
    if values.dim() != 1:
        raise ValueError(f"{name} must be 1-D [B], got shape {tuple(values.shape)}")
    if mask.dim() != 2 or mask.shape[0] != values.shape[0]:
        raise ValueError(f"mask must be [B, T] with B={values.shape[0]}, got shape {tuple(mask.shape)}")
    if ((mask != 0) & (mask != 1)).any():
        raise ValueError("mask must contain only 0 and 1")


def broadcast_advantages(adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B] -> [B, T]``: ``adv[b] * mask[b, t]`` (every model token of a sample shares its advantage)."""
    _check_pair(adv, mask, "adv")
    import torch

    return torch.where(mask != 0, adv.unsqueeze(1), torch.zeros((), dtype=adv.dtype, device=adv.device))
