"""Sample filters applied to a batch before advantages: ``none | mean | std | dapo | uid`` (``FILTER_METHODS``).

Source: PettingLLMs' trainer (``_assign_consistent_uids``); ``dapo`` is DAPO's dynamic sampling
(Yu et al. 2025, "DAPO", drop prompts whose samples all got the same reward). With ``n`` UID groups
and ``ratio`` in [0, 1):

- ``mean``: drop the ``int(n * ratio)`` groups with the lowest mean reward.
- ``std``:  drop the ``int(n * ratio)`` groups with the lowest range-normalized variance
  ``var(r, ddof=0) / (max(r) - min(r))**2``; a zero-range group (incl. a single sample) has value 0.
- ``dapo``: drop every group whose range-normalized variance is 0 (``ratio`` unused).
- ``uid``:  inside each group of size ``g`` drop the ``int(g * ratio)`` samples with the largest
  ``|r - mean(group)|``; whole groups are never dropped because ``ratio < 1``.

Ties (exactly equal floats) are broken by first appearance: among groups with the same score the
one seen first in ``uids`` is dropped first; inside a group the sample with the lower index is
dropped first. Nothing is random, so a re-run on stored data removes the same samples.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from pettingflow.rl.registry import Registry
from pettingflow.rl.uids import check_rewards, group_indices

# (rewards [N] float64, {uid: sample positions} in first-seen order, ratio) -> (keep [N] bool, reason)
SampleFilter = Callable[[np.ndarray, dict[str, list[int]], float], tuple[np.ndarray, str]]
FILTER_METHODS: Registry[SampleFilter] = Registry("filter method", "algorithm.filter_method")


@dataclass(frozen=True, eq=False)
class FilterResult:
    """Outcome of a filter. ``keep[i]`` says whether sample ``i`` stays (read-only bool array).

    ``removed_uids`` lists groups whose samples were all removed, in first-seen order. A filter may
    remove everything (e.g. ``dapo`` on a batch where every group is uniform): check ``empty``.
    """

    keep: np.ndarray
    removed_uids: list[str]
    removed_samples: int
    reason: str

    @property
    def empty(self) -> bool:
        """True when no sample is kept; the caller decides whether to skip the update or fail."""
        return not bool(self.keep.any())

    @property
    def kept_samples(self) -> int:
        return int(self.keep.sum())


def range_normalized_variance(rewards: np.ndarray) -> float:
    """``var(r, ddof=0) / (max(r) - min(r))**2``, defined as 0.0 when the range is 0 (PettingLLMs' trainer)."""
    r = np.asarray(rewards, dtype=np.float64)
    if r.size == 0:
        raise ValueError("range_normalized_variance needs at least one reward, got an empty array")
    spread = float(r.max() - r.min())
    if spread == 0.0:
        return 0.0
    return float(np.var(r, ddof=0) / spread**2)


def _lowest_groups(groups: dict[str, list[int]], scores: dict[str, float], n_drop: int) -> list[str]:
    """UIDs to drop: the ``n_drop`` lowest scores (stable, so ties go to the first-seen group)."""
    order = sorted(groups, key=lambda uid: scores[uid])  # sorted() is stable; dict order = first seen
    chosen = set(order[:n_drop])
    return [uid for uid in groups if uid in chosen]


def filter_samples(
    uids: Sequence[str], rewards: Sequence[float] | np.ndarray, method: str, ratio: float
) -> FilterResult:
    """Apply one filter (see module docstring for the exact rules) and say what it removed.

    Looks ``method`` up in ``FILTER_METHODS``; ``removed_uids`` are the groups of which it kept no sample.
    """
    fn = FILTER_METHODS.get(method)
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float, np.floating)) or not 0.0 <= ratio < 1.0:
        raise ValueError(f"filter ratio must be a number in [0, 1), got {ratio!r}")
    r = check_rewards(rewards, uids)
    groups = group_indices(uids)
    keep, reason = fn(r, groups, ratio)
    keep = np.array(keep, dtype=bool)  # a copy: the result's array is made read-only below
    if keep.shape != r.shape:
        raise ValueError(f"filter method {method!r} returned a keep mask of shape {keep.shape}, expected {r.shape}")
    removed_uids = [uid for uid, idx in groups.items() if not keep[idx].any()]
    keep.setflags(write=False)
    removed = int(len(r) - keep.sum())
    if removed == len(r) and len(r) > 0:
        reason += "; EVERY sample was removed"
    return FilterResult(keep=keep, removed_uids=removed_uids, removed_samples=removed, reason=reason)


@FILTER_METHODS.register("none")
def _none(rewards: np.ndarray, groups: dict[str, list[int]], ratio: float) -> tuple[np.ndarray, str]:
    return np.ones(len(rewards), dtype=bool), "none: kept every sample"


def _drop_lowest(
    rewards: np.ndarray, groups: dict[str, list[int]], ratio: float, method: str, score_fn: Callable, what: str
) -> tuple[np.ndarray, str]:
    """Drop the ``int(n * ratio)`` groups with the lowest ``score_fn`` of their rewards."""
    scores = {uid: float(score_fn(rewards[idx])) for uid, idx in groups.items()}
    n_drop = int(len(groups) * ratio)
    keep = np.ones(len(rewards), dtype=bool)
    for uid in _lowest_groups(groups, scores, n_drop):
        keep[groups[uid]] = False
    return keep, f"{method}: removed {n_drop} of {len(groups)} UID groups ({what}, ratio={ratio})"


@FILTER_METHODS.register("mean")
def _mean(rewards: np.ndarray, groups: dict[str, list[int]], ratio: float) -> tuple[np.ndarray, str]:
    return _drop_lowest(rewards, groups, ratio, "mean", np.mean, "lowest mean reward")


@FILTER_METHODS.register("std")
def _std(rewards: np.ndarray, groups: dict[str, list[int]], ratio: float) -> tuple[np.ndarray, str]:
    return _drop_lowest(rewards, groups, ratio, "std", range_normalized_variance, "lowest range-normalized variance")


@FILTER_METHODS.register("dapo")
def _dapo(rewards: np.ndarray, groups: dict[str, list[int]], ratio: float) -> tuple[np.ndarray, str]:
    keep = np.ones(len(rewards), dtype=bool)
    removed = [uid for uid, idx in groups.items() if range_normalized_variance(rewards[idx]) == 0.0]
    for uid in removed:
        keep[groups[uid]] = False
    return keep, f"dapo: removed {len(removed)} of {len(groups)} UID groups with zero reward variance"


@FILTER_METHODS.register("uid")
def _uid(rewards: np.ndarray, groups: dict[str, list[int]], ratio: float) -> tuple[np.ndarray, str]:
    keep = np.ones(len(rewards), dtype=bool)
    for idx in groups.values():
        n_drop = int(len(idx) * ratio)
        if n_drop == 0:
            continue
        deviation = np.abs(rewards[idx] - rewards[idx].mean())
        by_deviation = sorted(range(len(idx)), key=lambda j: -deviation[j])  # stable: lower index first
        keep[[idx[j] for j in by_deviation[:n_drop]]] = False
    return keep, f"uid: removed {int((~keep).sum())} samples farthest from their group mean (ratio={ratio})"
