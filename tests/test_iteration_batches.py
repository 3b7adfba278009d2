"""Filter and advantage steps over committed Parquet, and attempt folders for re-runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from factories import trajectory_row

from pettingflow.configs import load_config
from pettingflow.configs.loader import CONFIG_DIR, validate_config
from pettingflow.runs.context import IterationContext
from pettingflow.steps.batches import advantage_step, batch_file, filter_step
from pettingflow.storage import RunLayout, read_step_trajectories, write_trajectories


def _rollouts(layout: RunLayout) -> None:
    """Three UID groups of 2: g0 rewards (1, 0) for code; g1 (0.5, 0.5) uniform; g2 (1, 1) test agent."""
    spec = [
        ("u0", "code_generator", 1.0),
        ("u0", "code_generator", 0.0),
        ("u1", "code_generator", 0.5),
        ("u1", "code_generator", 0.5),
        ("u2", "test_generator", 1.0),
        ("u2", "test_generator", 0.0),
    ]
    rows = [
        trajectory_row(uid=uid, agent_name=agent, policy_name="shared", reward=reward, sample_idx=i, rollout_idx=i)
        for i, (uid, agent, reward) in enumerate(spec)
    ]
    write_trajectories(layout.step(0, "rollouts"), rows)


@pytest.fixture
def layout(tmp_path: Path) -> RunLayout:
    layout = RunLayout(str(tmp_path), "run-b")
    _rollouts(layout)
    return layout


def test_dapo_filter_drops_uniform_groups_and_grpo_advantages(layout: RunLayout) -> None:
    config = load_config("code-env", ["algorithm.filter_method=dapo"])
    ctx = IterationContext(layout, 0)
    out = filter_step(ctx, config)
    assert (out.rows, out.metrics["removed_groups"], out.skipped) == (4, 1, False)
    kept = read_step_trajectories(ctx.step("filtered"))
    assert "u1" not in kept.column("uid").to_pylist()
    adv = advantage_step(ctx, config)
    assert adv.rows == 4
    batch = ctx.step("advantages").read_table(batch_file("shared"))
    by_uid = {}
    for uid, a in zip(batch.column("uid").to_pylist(), batch.column("advantage").to_pylist(), strict=True):
        by_uid.setdefault(uid, []).append(a)
    # GRPO with sample std (ddof=1) of (1, 0) = 0.7071: advantages +-0.7071
    assert by_uid["u0"] == pytest.approx([0.70710, -0.70710], abs=1e-4)
    assert by_uid["u2"] == pytest.approx([0.70710, -0.70710], abs=1e-4)


def test_steps_are_skipped_once_committed(layout: RunLayout) -> None:
    config = load_config("code-env", ["algorithm.filter_method=none"])
    ctx = IterationContext(layout, 0)
    first = filter_step(ctx, config)
    again = filter_step(ctx, config)
    assert again.skipped and again.rows == first.rows == 6
    advantage_step(ctx, config)
    assert advantage_step(ctx, config).skipped


def test_batch_per_policy_holds_only_that_policys_rows(tmp_path: Path) -> None:
    layout = RunLayout(str(tmp_path), "run-c")
    rows = [
        trajectory_row(
            uid=f"u{i // 2}",
            policy_name=["p_code", "p_test"][i // 2 % 2],
            reward=float(i % 2),
            sample_idx=i,
            rollout_idx=i,
        )
        for i in range(8)
    ]
    write_trajectories(layout.step(0, "rollouts"), rows)
    raw = yaml.safe_load((CONFIG_DIR / "code-env.yaml").read_text())
    raw["specialization"] = "full"
    raw["policies"] = [{"name": "p_code"}, {"name": "p_test"}]
    raw["agents"][0]["policy"], raw["agents"][1]["policy"] = "p_code", "p_test"
    config = validate_config(raw)
    ctx = IterationContext(layout, 0)
    filter_step(ctx, config)
    out = advantage_step(ctx, config)
    assert out.metrics["policies"]["p_code"]["rows"] == 4
    step = ctx.step("advantages")
    assert set(step.read_table(batch_file("p_test")).column("policy_name").to_pylist()) == {"p_test"}


def test_rerun_attempt_reads_original_rollouts_and_writes_its_own_folder(layout: RunLayout) -> None:
    ctx0 = IterationContext(layout, 0)
    filter_step(ctx0, load_config("code-env", ["algorithm.filter_method=none"]))
    ctx1 = IterationContext(layout, 0, attempt=1, from_step="filtered")
    assert ctx1.step("rollouts").path == ctx0.step("rollouts").path
    assert ctx1.step("filtered").path.endswith("iter-0/attempt-1/filtered")
    assert ctx1.step("update-shared").path.endswith("iter-0/attempt-1/update-shared")
    out = filter_step(ctx1, load_config("code-env", ["algorithm.filter_method=dapo"]))
    assert out.rows == 4 and not out.skipped
    assert read_step_trajectories(ctx0.step("filtered")).num_rows == 6  # the original is untouched


def test_context_rejects_inconsistent_attempts(layout: RunLayout) -> None:
    with pytest.raises(ValueError, match="attempt >= 1"):
        IterationContext(layout, 0, attempt=0, from_step="filtered")
    with pytest.raises(ValueError, match="reuses stored rollouts"):
        IterationContext(layout, 0, attempt=1, from_step="rollouts")
    with pytest.raises(ValueError, match="unknown step"):
        IterationContext(layout, 0, attempt=1, from_step="bogus")


def _episodes(layout: RunLayout) -> None:
    """Two independent episodes of one task (G = 2): agent 0 acts at turns 0 and 2, agent 1 at turn 1.

    local rewards (turn 0, 1, 2): episode 0 = (1, 0.5, 0) with team reward 1; episode 1 = (0, 0.5, 0.25), team 0.
    """
    episodes = [((1.0, 0.5, 0.0), 1.0), ((0.0, 0.5, 0.25), 0.0)]
    rows = []
    for ep, (rewards, team) in enumerate(episodes):
        for turn, reward in enumerate(rewards):
            rows.append(
                trajectory_row(
                    uid=f"t{turn}",
                    rollout_idx=ep,
                    sample_idx=ep,
                    turn_idx=turn,
                    agent_idx=turn % 2,
                    agent_name=["code_generator", "test_generator"][turn % 2],
                    reward=reward,
                    info_json=json.dumps({"team_reward": team}),
                )
            )
    write_trajectories(layout.step(0, "rollouts"), rows)


def _advantages_by_uid(step) -> dict[str, list[float]]:
    batch = step.read_table(batch_file("shared"))
    out: dict[str, list[float]] = {}
    for uid, a in zip(batch.column("uid").to_pylist(), batch.column("advantage").to_pylist(), strict=True):
        out.setdefault(uid, []).append(a)
    return out


def test_team_reward_and_returns_drive_filter_and_advantages_and_a_rerun_recomputes_them(tmp_path: Path) -> None:
    layout = RunLayout(str(tmp_path), "run-mix")
    _episodes(layout)
    mix = ["algorithm.team_reward_weight=0.5", "algorithm.gamma=1.0", "algorithm.advantage_estimator=grpo_no_std"]
    config = load_config("code-env", [*mix, "algorithm.filter_method=mean", "algorithm.filter_ratio=0.34"])
    ctx = IterationContext(layout, 0)
    # m = local + 0.5 * team: episode 0 = (1.5, 1.0, 0.5), episode 1 = (0, 0.5, 0.25)
    # returns over agent 0's turns 0 and 2 (gamma 1): episode 0 = 1.5 + 0.5 = 2.0, episode 1 = 0 + 0.25 = 0.25
    # group means: t0 (2.0, 0.25) 1.125; t1 (1.0, 0.5) 0.75; t2 (0.5, 0.25) 0.375 -> mean filter removes t2
    out = filter_step(ctx, config)
    assert out.metrics["removed_groups"] == 1 and out.metrics["team_reward_weight"] == 0.5
    assert "t2" not in read_step_trajectories(ctx.step("filtered")).column("uid").to_pylist()
    adv = advantage_step(ctx, config)
    assert adv.metrics["gamma"] == 1.0
    # t0's returns need turn 2, which the filter removed: they come from the rollouts (not 1.5 and 0)
    assert _advantages_by_uid(ctx.step("advantages")) == {
        "t0": pytest.approx([0.875, -0.875]),
        "t1": pytest.approx([0.25, -0.25]),
    }
    batch = ctx.step("advantages").read_table(batch_file("shared"))
    assert batch.column("training_reward").to_pylist() == pytest.approx([2.0, 1.0, 0.25, 0.5])
    assert batch.column("team_reward").to_pylist() == [1.0, 1.0, 0.0, 0.0]
    assert {json.loads(m)["team_reward_weight"] for m in batch.column("reward_mix").to_pylist()} == {0.5}

    # a re-run from the filter with local rewards only: t0 (1, 0), t1 (0.5, 0.5), t2 (0, 0.25) -> t2 removed again
    plain = load_config(
        "code-env",
        ["algorithm.advantage_estimator=grpo_no_std", "algorithm.filter_method=mean", "algorithm.filter_ratio=0.34"],
    )
    rerun = IterationContext(layout, 0, attempt=1, from_step="filtered")
    filter_step(rerun, plain)
    advantage_step(rerun, plain)
    assert _advantages_by_uid(rerun.step("advantages")) == {"t0": pytest.approx([0.5, -0.5]), "t1": [0.0, 0.0]}


def test_a_team_weight_without_team_rewards_is_refused(layout: RunLayout) -> None:
    config = load_config("code-env", ["algorithm.team_reward_weight=1.0"])
    with pytest.raises(ValueError, match=r"no row reports a team reward .* set algorithm.team_reward_weight=0"):
        filter_step(IterationContext(layout, 0), config)


def test_a_batch_without_signal_is_flagged_in_the_metrics_report_and_warnings(tmp_path: Path) -> None:
    """Every reward 0 (SmolLM2 on HumanEval): the dapo filter keeps nothing and no advantage is non-zero. The
    advantages step says so, with the cause, and the report metrics and warnings carry it."""
    from pettingflow.steps.report import iteration_metrics, iteration_warnings

    layout = RunLayout(str(tmp_path), "run-zero")
    rows = [
        trajectory_row(uid=f"u{i // 2}", policy_name="shared", reward=0.0, sample_idx=i % 2, rollout_idx=i)
        for i in range(4)
    ]
    write_trajectories(layout.step(0, "rollouts"), rows)
    config = load_config("code-env", ["algorithm.filter_method=dapo"])
    ctx = IterationContext(layout, 0)
    outcomes = {"filtered": vars(filter_step(ctx, config)), "advantages": vars(advantage_step(ctx, config))}
    shared = outcomes["advantages"]["metrics"]["policies"]["shared"]
    assert shared["zero_signal"] and (shared["groups"], shared["groups_varied"]) == (2, 0)
    assert "every reward of its 2 groups was 0" in shared["signal_message"]
    assert "the filter (dapo) kept none of its 4 rows" in shared["signal_message"]
    metrics = iteration_metrics(outcomes, {})
    assert metrics["advantages/shared/zero_signal"] == 1.0
    assert metrics["advantages/shared/nonzero_advantage_rows"] == 0.0
    assert iteration_warnings(outcomes) == [shared["signal_message"]]


def test_a_batch_with_signal_is_not_flagged(layout: RunLayout) -> None:
    from pettingflow.steps.report import iteration_metrics, iteration_warnings

    config = load_config("code-env", ["algorithm.filter_method=none"])
    ctx = IterationContext(layout, 0)
    outcomes = {"filtered": vars(filter_step(ctx, config)), "advantages": vars(advantage_step(ctx, config))}
    shared = outcomes["advantages"]["metrics"]["policies"]["shared"]
    assert "zero_signal" not in shared and (shared["groups"], shared["groups_varied"]) == (3, 2)
    assert iteration_metrics(outcomes, {})["advantages/shared/zero_signal"] == 0.0
    assert iteration_warnings(outcomes) == []
