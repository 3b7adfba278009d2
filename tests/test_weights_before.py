"""Which weights and which optimizer snapshot an iteration starts from, read from committed steps only."""

from __future__ import annotations

from pathlib import Path

import pytest

from pettingflow.configs.loader import load_config
from pettingflow.iteration.weights import weights_before
from pettingflow.storage import RunLayout
from pettingflow.training.checkpoint import BASE_VERSION, optimizer_snapshot_due


@pytest.fixture
def setup(tmp_path: Path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    config = load_config("code-env", [f"policies.0.model={base}"])
    return RunLayout(str(tmp_path / "runs"), "r1"), config, str(base)


def commit_update(layout: RunLayout, k: int, *, snapshot: bool, skipped: bool = False) -> str:
    step = layout.step(k, "update-shared")
    step.begin()
    if not skipped:
        step.write_bytes("model/model.safetensors", b"w%d" % k)
        if snapshot:
            step.write_bytes("deepspeed/latest", b"global_step%d" % k)
    step.commit({"skipped": skipped})
    return step.uri


def test_start_weights_and_snapshot_age(setup) -> None:
    layout, config, base = setup
    start = weights_before(layout, config, "shared", 0)
    assert (start.source, start.model_dir, start.deepspeed_dir, start.optimizer_age) == (BASE_VERSION, base, None, 0)
    assert start.version == 0

    u0 = commit_update(layout, 0, snapshot=True)
    u1 = commit_update(layout, 1, snapshot=False)
    commit_update(layout, 2, snapshot=False, skipped=True)  # no rows: not a new state
    u3 = commit_update(layout, 3, snapshot=False)

    exact = weights_before(layout, config, "shared", 1)
    assert (
        exact.source == u0
        and exact.optimizer_age == 0
        and exact.deepspeed_dir.endswith("iter-0/update-shared/deepspeed")
    )

    one_old = weights_before(layout, config, "shared", 2)
    assert one_old.source == u1 and one_old.model_dir.endswith("iter-1/update-shared/model")
    assert one_old.deepspeed_dir.endswith("iter-0/update-shared/deepspeed") and one_old.optimizer_age == 1

    two_old = weights_before(layout, config, "shared", 4)  # the skipped update 2 does not count
    assert two_old.source == u3 and two_old.optimizer_age == 2
    # a version names the update that wrote the weights: iteration k's update writes version k + 1
    assert (exact.version, one_old.version, weights_before(layout, config, "shared", 3).version) == (1, 2, 2)
    assert two_old.version == 4
    assert two_old.deepspeed_dir.endswith("iter-0/update-shared/deepspeed")


def test_no_snapshot_at_all(setup) -> None:
    layout, config, _ = setup
    u0 = commit_update(layout, 0, snapshot=False)
    start = weights_before(layout, config, "shared", 1)
    assert start.source == u0 and start.deepspeed_dir is None and start.optimizer_age == 0


def test_snapshot_cadence() -> None:
    assert [k for k in range(12) if optimizer_snapshot_due(4, k, 12)] == [3, 7, 11]
    assert [k for k in range(6) if optimizer_snapshot_due(4, k, 6)] == [3, 5]  # and the run's last update
    assert [k for k in range(3) if optimizer_snapshot_due(1, k, 3)] == [0, 1, 2]
    assert not any(optimizer_snapshot_due(0, k, 3) for k in range(3))
