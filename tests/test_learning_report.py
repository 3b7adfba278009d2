"""The learning-run summary: curves from stored reports, the results table, the plot."""

from __future__ import annotations

import math

from pettingflow.analysis.figures import learning_png, markdown_table
from pettingflow.analysis.learning import ArmResult, final_successes, results_table
from pettingflow.analysis.stats import first_last_mean, paired_bootstrap, smooth


def _arm(config: str, before: float, after: float, rewards: list[float]) -> ArmResult:
    def scores(rate: float) -> dict:
        return {
            "sampled": {"code_generator": {"success_rate": rate, "reward_mean": rate, "episodes": 120.0}},
            "greedy": {"code_generator": {"success_rate": rate / 2, "reward_mean": rate / 2, "episodes": 30.0}},
        }

    curve = [{"iteration": float(i), "train_reward": r} for i, r in enumerate(rewards)]
    return ArmResult(config, f"run-{config}", f"file:///runs/{config}", scores(before), scores(after), curve)


def test_smooth_is_a_trailing_mean():
    assert smooth([0.0, 1.0, 2.0, 3.0, 4.0], window=2) == [0.0, 0.5, 1.5, 2.5, 3.5]
    assert smooth([]) == []


def test_first_last_mean_uses_at_most_half_of_the_points():
    assert first_last_mean([0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]) == (0.0, 1.0)
    assert first_last_mean([0.0, 1.0, 2.0]) == (0.0, 2.0)  # n shrinks to 1 for 3 points
    start, end = first_last_mean([])
    assert math.isnan(start) and math.isnan(end)


def test_results_table_reports_held_out_change_and_train_trend():
    rows = results_table([_arm("solo", 0.25, 0.40, [0.1, 0.2, 0.2, 0.3, 0.5, 0.5, 0.6, 0.6])])
    (row,) = rows
    assert row["heldout_before"] == 0.25 and row["heldout_after"] == 0.40
    assert math.isclose(row["heldout_delta"], 0.15)
    assert (row["greedy_before"], row["greedy_after"]) == (0.125, 0.20)
    assert math.isclose(row["train_reward_first4"], 0.2) and math.isclose(row["train_reward_last4"], 0.55)
    assert row["iterations"] == 8
    table = markdown_table(rows)
    expected = (
        "| `solo` | 25.0 % | 40.0 % | +15.0 pts | 12.5 % | 20.0 % | n/a (no task drawn twice) | 0.200 | 0.550 | 8 |"
    )
    assert expected in table
    arm = _arm("solo", 0.25, 0.40, [0.1, 0.2])
    arm.revisits = {"first_mean": 0.25, "last_mean": 0.5, "ci95_low": 0.1, "ci95_high": 0.4, "tasks": 12.0}
    assert "25.0 % → 50.0 % [+10.0, +40.0], 12 tasks" in markdown_table(results_table([arm]))


def test_missing_agent_scores_show_as_not_available():
    arm = _arm("duo", 0.5, 0.5, [0.5])
    arm.after = {}
    (row,) = results_table([arm])
    assert row["heldout_after"] is None and row["heldout_delta"] is None
    assert "n/a" in markdown_table([row])


def test_plot_is_a_png():
    png = learning_png([_arm("solo", 0.2, 0.3, [0.1, 0.3]), _arm("duo", 0.1, 0.2, [0.2, 0.2])])
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_final_successes_take_each_episodes_last_turn_of_the_agent():
    rows = [
        {"env_idx": 0, "sample_idx": 0, "turn_idx": 0, "agent_name": "code_generator", "success": False},
        {"env_idx": 0, "sample_idx": 0, "turn_idx": 1, "agent_name": "test_generator", "success": True},
        {"env_idx": 0, "sample_idx": 0, "turn_idx": 2, "agent_name": "code_generator", "success": True},
        {"env_idx": 0, "sample_idx": 1, "turn_idx": 0, "agent_name": "code_generator", "success": False},
        {"env_idx": 1, "sample_idx": 0, "turn_idx": 0, "agent_name": "code_generator", "success": True},
    ]
    assert final_successes(rows) == {0: [True, False], 1: [True]}
    assert final_successes(rows, "test_generator") == {0: [True]}


def test_paired_bootstrap_counts_tasks_and_brackets_the_change():
    before = {t: [False, False, True, False] for t in range(10)}
    after = {t: [True, True, True, False] if t < 6 else [False, False, True, False] for t in range(10)}
    out = paired_bootstrap(before, after, n_boot=2000, seed=1)
    assert math.isclose(out["delta"], 0.3)  # 6 of 10 tasks gained 2 of 4 samples
    assert (out["tasks"], out["tasks_better"], out["tasks_worse"]) == (10.0, 6.0, 0.0)
    assert 0.0 < out["ci95_low"] < out["delta"] < out["ci95_high"] <= 0.5
    same = paired_bootstrap(before, before)
    assert same["delta"] == same["ci95_low"] == same["ci95_high"] == 0.0


def test_paired_bootstrap_needs_shared_tasks():
    import pytest

    with pytest.raises(ValueError, match="share no held-out task"):
        paired_bootstrap({0: [True]}, {1: [True]})


def test_iteration_metrics_report_the_time_outside_step_tasks():
    from pettingflow.steps.report import iteration_metrics

    flat = iteration_metrics({}, {"rollouts": 10.0, "update-shared": 28.0}, iteration_s=40.0)
    assert flat["orchestration/outside_step_tasks_s"] == 2.0
    assert flat["orchestration/outside_step_tasks_share"] == 0.05
    assert "orchestration/outside_step_tasks_s" not in iteration_metrics({}, {"rollouts": 1.0})
