"""Filter and advantage steps over committed Parquet, and attempt folders for re-runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from factories import trajectory_row

from pettingflow.configs import load_config
from pettingflow.configs.loader import CONFIG_DIR, validate_config
from pettingflow.iteration.batches import advantage_step, batch_file, filter_step
from pettingflow.iteration.context import IterationContext
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
    config = load_config("code-env")
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
    filter_step(ctx0, load_config("code-env"))
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
