"""`pettingflow update` accepts plain trajectories: it applies the config's filter and advantages first."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
from factories import trajectory_row

from pettingflow.cli import _as_batch
from pettingflow.configs import load_config
from pettingflow.storage import RunLayout, write_trajectories


def test_trajectories_become_a_policy_batch_with_advantages(tmp_path) -> None:
    rows = [
        trajectory_row(uid="u0", reward=1.0, sample_idx=0, rollout_idx=0),
        trajectory_row(uid="u0", reward=0.0, sample_idx=1, rollout_idx=1),
        trajectory_row(uid="u1", reward=0.5, sample_idx=2, rollout_idx=2, policy_name="other"),
        trajectory_row(uid="u1", reward=0.5, sample_idx=3, rollout_idx=3, policy_name="other"),
    ]
    step = RunLayout(str(tmp_path / "store"), "r").step(0, "rollouts")
    write_trajectories(step, [dict(r, policy_name=r.get("policy_name", "shared")) for r in rows])
    out = tmp_path / "out"
    batch = _as_batch(step.path, load_config("code-env"), "shared", str(out))
    table = pq.read_table(batch)
    assert table.column("policy_name").to_pylist() == ["shared", "shared"]
    assert table.column("advantage").to_pylist() == pytest.approx([0.70710, -0.70710], abs=1e-4)
    assert _as_batch(batch, load_config("code-env"), "shared", str(out)) == batch  # already a batch
