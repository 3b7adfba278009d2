"""``runs/lineage.py``'s answers that other modules used to compute themselves: each row's lag (the advantages
step), which steps hold an update's checkpoint and snapshot (retention, ``runs prune``), and which optimizer
snapshot a crash cut short (the update step)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pyarrow as pa
from test_weights_before import commit_update, setup  # noqa: F401 (setup: a run layout and a config on a fake base model)

from pettingflow.runs.lineage import (
    lag_metrics,
    lost_snapshot,
    optimizer_step_name,
    policy_lags,
    row_lags,
    update_checkpoints,
    update_with_snapshot,
)
from pettingflow.storage.layout import StepName


def test_row_lags_count_versions_behind_the_start_and_never_below_zero() -> None:
    lags = row_lags(np.array([3, 2, 0, 5]), start_version=3)  # 5: a file whose version is its iteration
    assert lags.tolist() == [0, 1, 3, 0] and lags.dtype == np.int64
    assert row_lags([], start_version=2).tolist() == []


def test_policy_lags_and_their_metrics() -> None:
    table = pa.table({"policy_version": pa.array([1, 1, 0, 2], pa.int64())})
    lags = policy_lags(table, start_version=2)
    assert lags == Counter({1: 2, 2: 1, 0: 1}) and all(type(k) is int for k in lags)
    assert lag_metrics(lags) == {"policy_lag_max": 2, "policy_lag/0": 1, "policy_lag/1": 2, "policy_lag/2": 1}
    assert lag_metrics(Counter()) == {"policy_lag_max": 0}


def test_update_checkpoints_lists_updates_that_did_work_with_their_snapshots(setup) -> None:  # noqa: F811
    layout, _, _ = setup
    commit_update(layout, 0, snapshot=True)
    commit_update(layout, 1, snapshot=False)
    commit_update(layout, 2, snapshot=False, skipped=True)  # no rows: no checkpoint
    background = layout.step(1, optimizer_step_name("shared"))
    background.begin()
    background.write_bytes("deepspeed/latest", b"global_step1")
    background.commit({})
    uncommitted = layout.step(3, StepName.UPDATE.folder("shared"))
    uncommitted.begin()

    found = update_checkpoints(layout, "shared", range(5))
    assert sorted(found) == [0, 1]
    assert [step.name for step, _ in found[0]] == [StepName.UPDATE.folder("shared")]
    assert [step.name for step, _ in found[1]] == [StepName.UPDATE.folder("shared"), optimizer_step_name("shared")]
    assert [m.files[0].name for _, m in found[1]] == ["metrics.json", "deepspeed/latest"]
    assert update_checkpoints(layout, "other", range(5)) == {}
    assert update_checkpoints(layout, "shared", [1]).keys() == {1}


def test_lost_snapshot_only_when_its_update_committed_without_it(setup) -> None:  # noqa: F811
    layout, _, _ = setup
    update, snapshot = update_with_snapshot(layout, 0, "shared")
    assert (update.name, snapshot.name) == (StepName.UPDATE.folder("shared"), optimizer_step_name("shared"))
    assert not lost_snapshot(snapshot, update)  # nothing there
    snapshot.begin()
    snapshot.write_bytes("deepspeed/latest", b"global_step0")
    assert not lost_snapshot(snapshot, update)  # the update is not committed: the snapshot may still come
    commit_update(layout, 0, snapshot=False)
    assert lost_snapshot(snapshot, update)
    snapshot.commit({})
    assert not lost_snapshot(snapshot, update)  # committed: it is the snapshot
