"""The disk guard (``runs/disk_guard.py``): what a step is expected to write (what it wrote last time, or an
estimate before the first update), the one message when the free space is below it, and that Prefect does not
retry a step the guard stopped. The guard against a real run on a small filesystem is
tests/test_disk_guard_run.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from prefect.states import Failed

from pettingflow.configs.loader import load_config
from pettingflow.runs import disk_guard
from pettingflow.runs.context import IterationContext
from pettingflow.runs.disk_guard import DiskSpaceError, check_step, estimate_update, not_disk_full, step_need
from pettingflow.storage import RunLayout

MODEL = 1_000_000  # bytes of the fake base model's weights


@pytest.fixture
def run(tmp_path: Path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    (base / "model.safetensors").write_bytes(b"m" * MODEL)
    config = load_config("code-env", [f"policies.0.model={base}", "run.iterations=10", "disk.margin_mb=1"])
    return RunLayout(str(tmp_path / "runs"), "guarded"), config


def commit(layout: RunLayout, k: int, name: str, size: int) -> None:
    step = layout.step(k, name)
    step.begin()
    step.write_bytes("deepspeed/state.pt" if name.startswith("optimizer-") else "model/model.safetensors", b"x" * size)
    step.write_json("metrics.json", {})
    step.commit({})


def test_a_step_needs_what_it_wrote_last_time(run) -> None:
    layout, config = run
    commit(layout, 0, "update-shared", 3000)
    commit(layout, 0, "optimizer-shared", 20000)
    commit(layout, 0, "rollouts", 500)
    need = step_need(IterationContext(layout, 1), config, "update-shared")
    assert need.bytes > 23000 and need.bytes < 23400 and "iteration 0" in need.basis  # + the metrics files
    assert 500 < step_need(IterationContext(layout, 1), config, "rollouts").bytes < 600
    assert step_need(IterationContext(layout, 1), config, "filtered").bytes == 0  # never ran: the margin covers it
    # a prune does not make a step look smaller: the marker records what went
    layout.step(0, "update-shared").prune(("model/",), {"by": "test"})
    layout.step(0, "optimizer-shared").prune(("deepspeed/",), {"by": "test"})
    assert step_need(IterationContext(layout, 1), config, "update-shared").bytes == need.bytes


def test_the_first_update_is_estimated_from_the_model(run) -> None:
    layout, config = run
    need = step_need(IterationContext(layout, 0), config, "update-shared")
    # replay_snapshots 2: every update writes a snapshot; full weights (1x) and the snapshot (7x) of the model
    assert need.bytes == estimate_update(config, "shared", True, MODEL) == 8 * MODEL and "estimate" in need.basis


def test_below_the_need_the_step_stops_with_one_message(run, monkeypatch: pytest.MonkeyPatch) -> None:
    layout, config = run
    layout.write_run_info({"config": {}})
    ctx = IterationContext(layout, 0)
    needed = 8 * MODEL + 2**20
    monkeypatch.setattr(disk_guard, "free_bytes", lambda path: needed - 1)
    with pytest.raises(DiskSpaceError) as caught:
        check_step(ctx, config, "update-shared")
    text = str(caught.value)
    assert f"{layout.run_path} has 9.0 MB free, the step needs about 9.0 MB" in text  # 8 MB + 1 MiB margin
    assert "an estimate for a first update from the model's size: 8.0 MB, plus disk.margin_mb 1.0 MB" in text
    assert f"`pettingflow runs prune guarded --root {layout.root} --keep-last 1 --yes`" in text
    assert "--run-id guarded" in text and "before the step wrote anything" in text
    assert not Path(layout.step(0, "update-shared").path).exists()  # nothing written
    monkeypatch.setattr(disk_guard, "free_bytes", lambda path: needed)
    assert check_step(ctx, config, "update-shared").bytes == 8 * MODEL
    # a committed step writes nothing: not checked; nor with the guard off
    monkeypatch.setattr(disk_guard, "free_bytes", lambda path: 0)
    commit(layout, 0, "update-shared", 10)
    assert check_step(ctx, config, "update-shared") is None
    off = config.model_copy(update={"disk": config.disk.model_copy(update={"guard": False})})
    assert check_step(ctx, off, "rollouts") is None


def test_free_bytes_is_the_filesystem_of_the_nearest_existing_folder(tmp_path: Path) -> None:
    assert disk_guard.free_bytes(str(tmp_path / "not" / "yet")) == shutil.disk_usage(tmp_path).free


def test_remote_storage_is_not_guarded(run, monkeypatch: pytest.MonkeyPatch) -> None:
    _, config = run
    monkeypatch.setattr(disk_guard, "free_bytes", lambda path: 0)
    remote = RunLayout("memory://bucket", "remote")
    assert check_step(IterationContext(remote, 0), config, "rollouts") is None


def test_prefect_does_not_retry_a_step_the_guard_stopped() -> None:
    assert not not_disk_full(None, None, Failed(data=DiskSpaceError("full")))
    assert not_disk_full(None, None, Failed(data=RuntimeError("server hiccup")))
