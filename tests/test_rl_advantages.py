"""Advantage estimators per UID group and their placement on response tokens."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pettingflow.rl import broadcast_advantages, compute_advantages, group_indices

EPS = 1e-6
# group a: [1, 0, 0] (mean 1/3), group b: [2, 2] (zero variance), group c: [5] (single sample)
UIDS = ["a", "b", "a", "c", "b", "a"]
REWARDS = [1.0, 2.0, 0.0, 5.0, 2.0, 0.0]


def test_grpo_hand_computed() -> None:
    std_a = math.sqrt((4 / 9 + 1 / 9 + 1 / 9) / 2)  # ddof=1
    hi, lo = (2 / 3) / (std_a + EPS), (-1 / 3) / (std_a + EPS)
    adv = compute_advantages(REWARDS, UIDS, "grpo")
    np.testing.assert_allclose(adv, [hi, 0.0, lo, 0.0, 0.0, lo], rtol=1e-12, atol=0)
    assert adv.dtype == np.float64


def test_grpo_no_std_hand_computed() -> None:
    adv = compute_advantages(REWARDS, UIDS, "grpo_no_std")
    np.testing.assert_allclose(adv, [2 / 3, 0.0, -1 / 3, 0.0, 0.0, -1 / 3], rtol=1e-12, atol=1e-15)


def test_rloo_hand_computed() -> None:
    # 1 - mean(0, 0) = 1;  0 - mean(1, 0) = -0.5
    adv = compute_advantages(REWARDS, UIDS, "rloo")
    np.testing.assert_allclose(adv, [1.0, 0.0, -0.5, 0.0, 0.0, -0.5], rtol=1e-12, atol=1e-15)


def test_reinforce_pp_hand_computed() -> None:
    centered = np.array([2 / 3, 0.0, -1 / 3, 0.0, 0.0, -1 / 3])
    batch_std = math.sqrt((4 / 9 + 1 / 9 + 1 / 9) / 5)  # ddof=1 over the 6 centered values
    adv = compute_advantages(REWARDS, UIDS, "reinforce_pp")
    np.testing.assert_allclose(adv, centered / (batch_std + EPS), rtol=1e-12, atol=1e-15)


def test_eps_is_used() -> None:
    big = compute_advantages([0.0, 1.0], ["g", "g"], "grpo", eps=1.0)
    std = math.sqrt(0.5)
    np.testing.assert_allclose(big, [-0.5 / (std + 1.0), 0.5 / (std + 1.0)], rtol=1e-12)


@pytest.mark.parametrize("estimator", ["grpo", "grpo_no_std", "rloo", "reinforce_pp"])
@pytest.mark.parametrize("value", [0.1, 0.7, 3.0, -2.5])
def test_zero_variance_group_gets_exactly_zero(estimator: str, value: float) -> None:
    # np.mean([0.7] * 3) != 0.7 exactly; a naive r - mean leaves ~1e-16 (and ~1e-10 after / (std + eps)).
    uids = ["z", "z", "z", "v", "v"]
    adv = compute_advantages([value, value, value, 0.0, 1.0], uids, estimator)
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]
    assert adv[3] < 0 < adv[4]


@pytest.mark.parametrize("estimator", ["grpo", "grpo_no_std", "rloo", "reinforce_pp"])
def test_all_uniform_or_single_batch_is_all_zero(estimator: str) -> None:
    assert compute_advantages([1.0, 1.0, 0.0], ["a", "a", "b"], estimator).tolist() == [0.0, 0.0, 0.0]
    assert compute_advantages([4.0], ["a"], estimator).tolist() == [0.0]
    assert compute_advantages([], [], estimator).shape == (0,)


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        ({"estimator": "gae"}, "unknown advantage estimator 'gae'"),
        ({"eps": 0.0}, "eps must be > 0"),
        ({"rewards": [1.0, float("inf")]}, r"rewards\[1\] = inf"),
        ({"rewards": [1.0]}, "rewards has 1 entries but uids has 2"),
        ({"rewards": [[1.0], [2.0]]}, "must be 1-D"),
    ],
)
def test_advantage_input_is_validated(kwargs: dict, text: str) -> None:
    args = {"rewards": [1.0, 2.0], "uids": ["a", "a"], "estimator": "grpo"} | kwargs
    with pytest.raises(ValueError, match=text):
        compute_advantages(**args)


@st.composite
def grouped_rewards(draw: st.DrawFn) -> tuple[list[str], list[float]]:
    sizes = draw(st.lists(st.integers(1, 6), min_size=1, max_size=6))
    uids = [f"g{g}" for g, size in enumerate(sizes) for _ in range(size)]
    order = draw(st.permutations(range(len(uids))))
    values = st.one_of(st.sampled_from([0.0, 1.0]), st.floats(-100, 100, allow_nan=False))
    rewards = draw(st.lists(values, min_size=len(uids), max_size=len(uids)))
    return [uids[i] for i in order], rewards


@settings(max_examples=150, deadline=None)
@given(batch=grouped_rewards())
def test_group_relative_properties(batch: tuple[list[str], list[float]]) -> None:
    uids, rewards = batch
    r = np.asarray(rewards)
    grpo = compute_advantages(rewards, uids, "grpo")
    no_std = compute_advantages(rewards, uids, "grpo_no_std")
    rloo = compute_advantages(rewards, uids, "rloo")
    rpp = compute_advantages(rewards, uids, "reinforce_pp")
    for adv in (grpo, no_std, rloo, rpp):
        assert np.isfinite(adv).all()
    for idx in group_indices(uids).values():
        assert abs(grpo[idx].mean()) < 1e-9
        assert abs(no_std[idx].mean()) < 1e-9 * max(1.0, np.abs(r[idx]).max())
        if len(idx) > 1:
            np.testing.assert_allclose(rloo[idx], no_std[idx] * len(idx) / (len(idx) - 1), rtol=1e-9, atol=1e-9)
        if r[idx].max() == r[idx].min():
            assert (grpo[idx] == 0).all() and (no_std[idx] == 0).all() and (rloo[idx] == 0).all()
            assert (rpp[idx] == 0).all()
    # the sign of every estimator agrees with r - mean_g
    for adv in (grpo, rloo, rpp):
        assert np.array_equal(np.sign(adv), np.sign(no_std))


# ---------------------------------------------------------------- token placement


def test_broadcast_advantages() -> None:
    mask = torch.tensor([[1, 0, 1], [0, 0, 0]])
    out = broadcast_advantages(torch.tensor([0.5, -2.0]), mask)
    assert torch.equal(out, torch.tensor([[0.5, 0.0, 0.5], [0.0, 0.0, 0.0]]))


@pytest.mark.parametrize("fn", [broadcast_advantages])
def test_token_helpers_validate(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
    with pytest.raises(ValueError, match="must be 1-D"):
        fn(torch.zeros(2, 1), torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"mask must be \[B, T\] with B=2"):
        fn(torch.zeros(2), torch.ones(3, 3))
    with pytest.raises(ValueError, match="only 0 and 1"):
        fn(torch.zeros(2), torch.full((2, 3), 2))
