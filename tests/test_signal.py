"""No silent zero signal: an iteration whose batch has no non-zero advantage says so, and why."""

from __future__ import annotations

import pyarrow as pa
import pytest
from factories import trajectory_row

from pettingflow.configs.loader import load_config
from pettingflow.rl.signal import GroupSpread, group_spread, zero_signal_message
from pettingflow.steps.batches import learning_signal, zero_signal_policies


def test_group_spread_counts_groups_by_how_their_rewards_differ():
    uids = ["a", "a", "b", "b", "c", "c", "d", "d"]
    rewards = [0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.5, 0.5]
    assert group_spread(uids, rewards) == GroupSpread(groups=4, varied=1, all_zero=1, all_max=1, other_equal=1)
    with pytest.raises(ValueError, match="one reward per uid"):
        group_spread(["a"], [0.0, 1.0])


def test_all_zero_rewards_name_the_task_set_as_the_cause():
    message = zero_signal_message("shared", group_spread(["a", "a", "b", "b"], [0.0] * 4), 4, 4, "none")
    assert "no learning signal for policy 'shared'" in message
    assert "every reward of its 2 groups was 0" in message and "basic-python" in message


def test_all_top_rewards_and_a_filter_that_kept_nothing_are_named():
    spread = group_spread(["a", "a", "b", "b"], [1.0] * 4)
    message = zero_signal_message("shared", spread, 4, 0, "dapo")
    assert "too easy" in message
    assert "the filter (dapo) kept none of its 4 rows" in message and "dapo drops every group" in message


def test_equal_groups_at_mixed_values_suggest_more_samples():
    spread = group_spread(["a", "a", "b", "b"], [0.0, 0.0, 1.0, 1.0])
    assert spread.all_zero == 1 and spread.all_max == 1
    assert "raise the sampling temperature or env.group_size" in zero_signal_message("p", spread, 4, 4, "none")
    tree = zero_signal_message("p", spread, 4, 4, "none", "rollout.tree.branches")  # env.group_size stays 1 there
    assert "raise the sampling temperature or rollout.tree.branches" in tree and "env.group_size" not in tree


def test_no_rows_at_all_says_so():
    assert "produced no rows" in zero_signal_message("p", GroupSpread(0, 0, 0, 0, 0), 0, 0, "none")


def _rows(rewards: list[float], policy: str = "shared") -> pa.Table:
    rows = [
        trajectory_row(group_id=f"g{i // 2}", uid=f"u{i // 2}", sample_idx=i % 2, reward=r, policy_name=policy)
        for i, r in enumerate(rewards)
    ]
    return pa.Table.from_pylist(rows)


def test_learning_signal_reads_the_groups_of_each_policy():
    config = load_config("code-env", [])
    signal = learning_signal(_rows([0.0, 0.0, 0.0, 1.0]), config)
    spread, rows = signal["shared"]
    assert (spread.groups, spread.varied, rows) == (2, 1, 4)


def test_zero_signal_policies_reads_the_advantage_metrics():
    metrics = {
        "policies": {
            "a": {"nonzero_advantage_rows": 0, "zero_signal": True, "signal_message": "nothing"},
            "b": {"nonzero_advantage_rows": 3},
        }
    }
    assert zero_signal_policies(metrics) == {"a": "nothing"}
    assert zero_signal_policies({}) == {}


def test_every_reward_at_the_same_penalty_is_not_called_too_easy():
    """Groups all at -0.5 (every reply held no answer) are equal groups, not the top of a solved batch."""
    spread = group_spread(["a", "a", "b", "b"], [-0.5] * 4)
    assert spread == GroupSpread(groups=2, varied=0, all_zero=0, all_max=0, other_equal=2)
    message = zero_signal_message("shared", spread, 4, 0, "dapo")
    assert "too easy" not in message and "every sample got the same reward" in message
