"""Group UIDs and sample filters (PettingLLMs' ``_assign_consistent_uids``), with exact hand-built cases."""

from __future__ import annotations

import json
import uuid

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pettingflow.rl import FilterResult, assign_uids, filter_samples, group_indices
from pettingflow.rl.filters import range_normalized_variance
from pettingflow.rl.uids import PETTINGFLOW_UID_NAMESPACE

# ---------------------------------------------------------------- UIDs


def test_same_group_turn_agent_share_a_uid_and_others_differ() -> None:
    # sample_num=2: rollouts 0,1 -> group 0; 2,3 -> group 1
    rollout = [0, 1, 2, 3, 0, 1, 0, 1]
    turn = [0, 0, 0, 0, 1, 1, 0, 0]
    agent = [0, 0, 0, 0, 0, 0, 1, 1]
    u = assign_uids(rollout, turn, agent, sample_num=2)
    assert u[0] == u[1]  # same group, turn, agent
    assert u[2] == u[3]
    assert u[4] == u[5]
    assert u[6] == u[7]
    assert len({u[0], u[2], u[4], u[6]}) == 4  # other group / other turn / other agent


def test_uids_are_deterministic_uuid5_and_pinned() -> None:
    args = ([0, 1, 2, 3, 4, 5], [0, 0, 0, 1, 1, 1], [1, 1, 1, 0, 0, 0])
    first = assign_uids(*args, sample_num=3, namespace="run-a/iter-0")
    assert first == assign_uids(*args, sample_num=3, namespace="run-a/iter-0")
    # The exact recipe is part of the stored-data contract: changing it would change every UID.
    expected = str(uuid.uuid5(PETTINGFLOW_UID_NAMESPACE, json.dumps(["run-a/iter-0", 0, 0, 1])))
    assert first[0] == expected
    assert assign_uids([0], [0], [0], sample_num=1) == ["4e3542ce-f173-56a1-8a26-648a3212e878"]
    assert all(uuid.UUID(u).version == 5 for u in first)


def test_namespace_changes_uids() -> None:
    a = assign_uids([0, 1], [0, 0], [0, 0], sample_num=2, namespace="run-a/iter-0")
    b = assign_uids([0, 1], [0, 0], [0, 0], sample_num=2, namespace="run-a/iter-1")
    assert a[0] == a[1] and b[0] == b[1]
    assert a[0] != b[0]


def test_namespace_and_key_cannot_be_confused() -> None:
    # A naive "namespace/group/turn/agent" string would make these two equal.
    a = assign_uids([1], [2], [3], sample_num=1, namespace="x/0")
    b = assign_uids([0], [1], [2], sample_num=1, namespace="x")
    assert a != b


def test_numpy_integers_are_accepted() -> None:
    r = np.array([0, 1, 2, 3], dtype=np.int64)
    z = np.zeros(4, dtype=np.int32)
    assert assign_uids(r, z, z, sample_num=2) == assign_uids([0, 1, 2, 3], [0] * 4, [0] * 4, sample_num=2)


@pytest.mark.parametrize(
    ("sample_num", "error", "text"),
    [(0, ValueError, "sample_num must be >= 1"), (-2, ValueError, ">= 1"), (1.5, TypeError, "integer"),
     (True, TypeError, "integer"), ("2", TypeError, "integer")],
)  # fmt: skip
def test_sample_num_is_validated(sample_num: object, error: type[Exception], text: str) -> None:
    with pytest.raises(error, match=text):
        assign_uids([0], [0], [0], sample_num=sample_num)  # type: ignore[arg-type]


def test_bad_indices_are_rejected() -> None:
    with pytest.raises(ValueError, match="same length"):
        assign_uids([0, 1], [0], [0, 0], sample_num=1)
    with pytest.raises(ValueError, match=r"turn_idx\[1\] must be >= 0"):
        assign_uids([0, 1], [0, -1], [0, 0], sample_num=1)
    with pytest.raises(TypeError, match=r"agent_idx\[0\] must be an integer"):
        assign_uids([0], [0], [0.0], sample_num=1)  # type: ignore[list-item]


def test_group_indices_keeps_first_seen_order() -> None:
    groups = group_indices(["b", "a", "b", "c", "a"])
    assert list(groups) == ["b", "a", "c"]
    assert groups == {"b": [0, 2], "a": [1, 4], "c": [3]}
    assert group_indices([]) == {}
    with pytest.raises(TypeError, match=r"uids\[1\] must be a str"):
        group_indices(["a", 3])  # type: ignore[list-item]


# ---------------------------------------------------------------- filters: exact cases


def kept(result: FilterResult) -> list[int]:
    return np.flatnonzero(result.keep).tolist()


def test_mean_drops_groups_with_lowest_mean() -> None:
    uids = ["A", "B", "C", "D"] * 2
    rewards = [1.0, 0.0, 1.0, 0.2, 0.0, 0.0, 1.0, 0.4]  # means A .5, B 0, C 1, D .3
    res = filter_samples(uids, rewards, "mean", 0.5)  # int(4 * .5) = 2 groups
    assert res.removed_uids == ["B", "D"]
    assert kept(res) == [0, 2, 4, 6]
    assert res.removed_samples == 4
    assert not res.empty
    assert res.reason.startswith("mean: removed 2 of 4")
    # int() floors: 4 * 0.49 = 1.96 -> 1 group
    assert filter_samples(uids, rewards, "mean", 0.49).removed_uids == ["B"]


def test_std_uses_range_normalized_variance_not_raw_variance() -> None:
    # X: var 18.75, range 10 -> 0.1875.  Y: var 0.25, range 1 -> 0.25.  U: range 0 -> 0.
    uids = ["X", "Y", "X", "U", "X", "Y", "X", "U"]
    rewards = [0.0, 0.0, 0.0, 3.0, 0.0, 1.0, 10.0, 3.0]
    assert range_normalized_variance(np.array([0.0, 0.0, 0.0, 10.0])) == pytest.approx(0.1875)
    assert range_normalized_variance(np.array([0.0, 1.0])) == pytest.approx(0.25)
    assert range_normalized_variance(np.array([3.0, 3.0])) == 0.0
    one = filter_samples(uids, rewards, "std", 0.4)  # int(3 * .4) = 1
    assert one.removed_uids == ["U"]
    two = filter_samples(uids, rewards, "std", 0.7)  # int(3 * .7) = 2
    assert two.removed_uids == ["X", "U"]  # raw variance would have picked Y (0.25) over X (18.75)
    assert kept(two) == [1, 5]


def test_dapo_drops_exactly_the_zero_variance_groups_and_ignores_ratio() -> None:
    uids = ["a", "b", "c", "d", "a", "b", "d", "d"]
    rewards = [1.0, 0.0, 0.0, 0.5, 1.0, 1.0, 0.5, 0.5]  # a uniform, b varies, c single, d uniform
    for ratio in (0.0, 0.9):
        res = filter_samples(uids, rewards, "dapo", ratio)
        assert res.removed_uids == ["a", "c", "d"]
        assert kept(res) == [1, 5]
        assert res.removed_samples == 6


def test_uid_drops_farthest_from_group_mean_with_index_tie_break() -> None:
    # A: [0,0,0,10] mean 2.5, deviations 2.5,2.5,2.5,7.5 -> drop 2: the 10, then the first 0.
    # B: [1,2,3] mean 2, deviations 1,0,1 -> drop int(3*.5)=1: tie between 1 and 3 -> the first (1).
    uids = ["A", "B", "A", "B", "A", "B", "A"]
    rewards = [0.0, 1.0, 0.0, 2.0, 0.0, 3.0, 10.0]
    res = filter_samples(uids, rewards, "uid", 0.5)
    assert kept(res) == [2, 3, 4, 5]
    assert res.removed_uids == []
    assert res.removed_samples == 3


def test_none_and_ratio_zero_remove_nothing() -> None:
    uids = ["a", "a", "b", "b"]
    rewards = [0.0, 1.0, 2.0, 5.0]
    for method in ("none", "mean", "std", "uid"):
        res = filter_samples(uids, rewards, method, 0.0)
        assert res.keep.all() and res.removed_uids == [] and res.removed_samples == 0
    assert filter_samples(uids, rewards, "none", 0.9).keep.all()


def test_ties_between_groups_go_to_the_first_seen_group() -> None:
    rewards = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]  # every group: mean 1, variance 0
    assert filter_samples(["P", "Q", "R"] * 2, rewards, "mean", 0.34).removed_uids == ["P"]
    assert filter_samples(["Q", "P", "R"] * 2, rewards, "mean", 0.34).removed_uids == ["Q"]
    assert filter_samples(["R", "Q", "P"] * 2, rewards, "std", 0.67).removed_uids == ["R", "Q"]


def test_everything_removed_is_visible_not_silent() -> None:
    res = filter_samples(["a", "a", "b", "b"], [1.0, 1.0, 0.0, 0.0], "dapo", 0.0)
    assert res.empty
    assert res.kept_samples == 0
    assert res.removed_samples == 4
    assert "EVERY sample was removed" in res.reason
    nothing = filter_samples([], [], "mean", 0.5)
    assert nothing.empty and nothing.keep.shape == (0,) and nothing.removed_samples == 0


def test_keep_mask_is_read_only() -> None:
    res = filter_samples(["a", "b"], [0.0, 1.0], "none", 0.0)
    with pytest.raises(ValueError, match="read-only"):
        res.keep[0] = False


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"method": "median"}, ValueError, "unknown filter method 'median'"),
        ({"ratio": 1.0}, ValueError, r"ratio must be a number in \[0, 1\), got 1.0"),
        ({"ratio": -0.1}, ValueError, "ratio must be"),
        ({"ratio": float("nan")}, ValueError, "ratio must be"),
        ({"rewards": [0.0, float("nan")]}, ValueError, r"rewards\[1\] = nan"),
        ({"rewards": [0.0]}, ValueError, "rewards has 1 entries but uids has 2"),
        ({"rewards": [[0.0], [1.0]]}, ValueError, "must be 1-D"),
    ],
)
def test_filter_input_is_validated(kwargs: dict, error: type[Exception], text: str) -> None:
    args = {"uids": ["a", "b"], "rewards": [0.0, 1.0], "method": "mean", "ratio": 0.5} | kwargs
    with pytest.raises(error, match=text):
        filter_samples(**args)


# ---------------------------------------------------------------- filters: properties


@st.composite
def batches(draw: st.DrawFn) -> tuple[list[str], list[float]]:
    sizes = draw(st.lists(st.integers(1, 5), min_size=1, max_size=8))
    uids = [f"g{g}" for g, size in enumerate(sizes) for _ in range(size)]
    order = draw(st.permutations(range(len(uids))))
    rewards = draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 3.0]), min_size=len(uids), max_size=len(uids)))
    return [uids[i] for i in order], rewards


@settings(max_examples=150, deadline=None)
@given(batch=batches(), method=st.sampled_from(["none", "mean", "std", "dapo", "uid"]), ratio=st.floats(0, 0.99))
def test_filter_properties(batch: tuple[list[str], list[float]], method: str, ratio: float) -> None:
    uids, rewards = batch
    r = np.asarray(rewards)
    res = filter_samples(uids, rewards, method, ratio)
    groups = group_indices(uids)
    assert res.keep.dtype == bool and res.keep.shape == (len(uids),)
    assert res.removed_samples == len(uids) - int(res.keep.sum())
    assert res.empty == (not res.keep.any())
    if method in ("mean", "std", "dapo"):
        for idx in groups.values():  # whole groups only
            assert res.keep[idx].all() or not res.keep[idx].any()
        assert res.removed_uids == [u for u, idx in groups.items() if not res.keep[idx].any()]
    if method in ("mean", "std"):
        assert len(res.removed_uids) == int(len(groups) * ratio)
        score = (lambda x: x.mean()) if method == "mean" else range_normalized_variance
        removed = [score(r[groups[u]]) for u in res.removed_uids]
        kept_scores = [score(r[idx]) for u, idx in groups.items() if u not in res.removed_uids]
        if removed and kept_scores:
            assert max(removed) <= min(kept_scores)
    if method == "dapo":
        assert res.removed_uids == [u for u, idx in groups.items() if r[idx].max() == r[idx].min()]
    if method == "uid":
        assert res.removed_uids == []
        for idx in groups.values():
            assert int((~res.keep[idx]).sum()) == int(len(idx) * ratio)
    if method == "none":
        assert res.keep.all()
    # deterministic
    assert np.array_equal(filter_samples(uids, rewards, method, ratio).keep, res.keep)
