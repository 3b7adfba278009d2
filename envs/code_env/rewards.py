"""Rewards of the code env's two agents (docs/code-env.md has worked examples)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pettingflow.envs.code_env.results import SuiteResult


def code_reward(ground_truth: SuiteResult) -> float:
    """r_code = fraction of ground-truth cases the code passes."""
    return ground_truth.ratio


def code_success(ground_truth: SuiteResult) -> bool:
    """The code agent succeeds when its code passes every ground-truth case."""
    return ground_truth.all_passed


@dataclass(frozen=True)
class UnitTestReward:
    """The test agent's reward and its parts."""

    reward: float
    validity: float
    caught: int
    bonus_applies: bool
    success: bool


def unit_test_reward(
    valid: Sequence[bool],
    passes_on_code: Sequence[bool] | None,
    code_ground_truth_ratio: float | None,
    catch_bonus_weight: float,
) -> UnitTestReward:
    """Reward asserts that are right about the canonical solution and that catch a buggy code.

    n = number of asserts; V = (asserts that pass on the canonical solution) / n.
    The bonus applies when there is code and it fails some ground-truth case (ratio < 1).
    caught = asserts that pass on the canonical solution AND fail on the code; B = 1 if caught > 0.
    r_test = (1 - w) * V + w * B when the bonus applies, else V;  r_test = 0 when n = 0.
    success = n > 0 and every assert passes on the canonical solution.
    """
    n = len(valid)
    if n == 0:
        return UnitTestReward(0.0, 0.0, 0, False, False)
    validity = sum(bool(v) for v in valid) / n
    applies = passes_on_code is not None and code_ground_truth_ratio is not None and code_ground_truth_ratio < 1.0
    if applies:
        if len(passes_on_code) != n:
            raise ValueError(f"{n} validity flags but {len(passes_on_code)} results on the code")
        caught = sum(bool(v) and not bool(p) for v, p in zip(valid, passes_on_code, strict=True))
        reward = (1.0 - catch_bonus_weight) * validity + catch_bonus_weight * (1.0 if caught else 0.0)
    else:
        caught, reward = 0, validity
    return UnitTestReward(reward, validity, caught, applies, all(valid))
