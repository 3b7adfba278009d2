"""Exact replays (runs/replay.py): a re-run that starts from the original's exact state reproduces its update
bitwise, one that cannot says why before it starts and in its metrics, and the snapshots that make replays exact
stay within ``training.replay_snapshots``.

The flow-level control re-run (a two-iteration run, iteration 1 re-run with no override: the same weights file)
is in ``test_flows.py::test_train_two_iterations_then_resume_then_rerun``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_learner import batches, chain_spec, safetensors_of, tiny_model_dir  # noqa: F401 (session fixture)
from test_training_worker import in_process  # noqa: F401 (fixture)

from pettingflow.analysis.inspect import optimizer_lines
from pettingflow.configs.loader import load_config
from pettingflow.runs.replay import (
    PRUNED_BY,
    plan_replay,
    prune_replay_snapshots,
    start_optimizer,
    verify_replay,
)
from pettingflow.storage import RunLayout
from pettingflow.training.checkpoint import optimizer_snapshot_written, replay_snapshot_kept

#: what a resident update of iteration 1 records (UpdateWorker.numerics and its row metrics)
NUMBERS = {
    "dtype": "bf16",
    "master_weights": "fp32",
    "num_processes": 1,
    "zero_stage": 0,
    "torch_threads": 2,
    "torch_version": torch.__version__,
    "device": "cpu",
    "global_step_start": 3,
    "adam_step_start": 3,
}


def test_every_update_writes_a_snapshot_and_only_the_window_and_the_schedule_keep_theirs() -> None:
    assert [k for k in range(6) if optimizer_snapshot_written(4, 2, k, 6)] == [0, 1, 2, 3, 4, 5]
    assert [k for k in range(6) if optimizer_snapshot_written(4, 0, k, 6)] == [3, 5]  # replay off: the schedule
    assert not any(optimizer_snapshot_written(0, 2, k, 6) for k in range(6))  # save_optimizer_every 0: none at all
    # after iteration 6's snapshot: iteration 3's is due (every 4th), 4-6 are the window (the 2 last iterations'
    # starting states and the newest); 0-2 go
    assert [k for k in range(7) if replay_snapshot_kept(k, 6, 4, 2, 10)] == [3, 4, 5, 6]
    assert [k for k in range(7) if replay_snapshot_kept(k, 6, 4, 0, 10)] == [3]
    assert [k for k in range(3) if replay_snapshot_kept(k, 2, 4, 2, 3)] == [0, 1, 2]  # make run's 3 iterations


@pytest.fixture
def stored(tmp_path: Path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    config = load_config("code-env", [f"policies.0.model={base}", "run.iterations=10"])
    return RunLayout(str(tmp_path / "runs"), "r1"), config


def commit_update(layout: RunLayout, k: int, *, snapshot: str | None, attempt: int | None = None, **metrics) -> None:
    """A committed update of iteration ``k`` with its metrics; ``snapshot``: 'inline' (deepspeed/ in the update
    step), 'background' (an optimizer-shared step) or None."""
    step = layout.step(k, "update-shared", attempt=attempt)
    step.begin()
    step.write_bytes("model/model.safetensors", b"w%d" % k)
    if snapshot == "inline":
        step.write_bytes("deepspeed/latest", b"global_step%d" % k)
    step.write_json("metrics.json", metrics)
    step.commit({"skipped": False, "metrics": metrics})
    if snapshot == "background":
        opt = layout.step(k, "optimizer-shared")
        opt.begin()
        opt.write_bytes("deepspeed/latest", b"global_step%d" % k)
        opt.commit({"policy": "shared"})


def test_replay_snapshots_out_of_the_window_are_pruned_and_say_so(stored) -> None:
    layout, config = stored  # save_optimizer_every 4, replay_snapshots 2 (the defaults), 10 iterations
    assert (config.training.save_optimizer_every, config.training.replay_snapshots) == (4, 2)
    for k in range(5):
        commit_update(layout, k, snapshot="background" if k % 2 else "inline")
    assert prune_replay_snapshots(layout, config, "shared", 4) == [1, 0]
    for k, step in ((0, "update-shared"), (1, "optimizer-shared")):
        pruned = layout.step(k, step).pruned()
        assert [(p["by"], p["prefixes"]) for p in pruned] == [(PRUNED_BY, ["deepspeed/"])], (k, pruned)
    assert any(f.name.startswith("model/") for f in layout.step(0, "update-shared").manifest().files)  # weights stay
    assert [start_optimizer(layout, "shared", k)[:2] for k in (1, 2, 3, 4, 5)] == [
        ("reset", None),  # iteration 0's snapshot went: a re-run of 1 would restart Adam
        ("reset", None),
        ("restored", 0),
        ("restored", 0),  # 3's is due (every 4th) and kept however old
        ("restored", 0),
    ]
    assert prune_replay_snapshots(layout, config, "shared", 4) == []  # nothing more to do
    commit_update(layout, 5, snapshot="background")
    assert prune_replay_snapshots(layout, config, "shared", 5) == [2]  # 3 is due; stops at 1 (pruned before)
    off = load_config("code-env", ["training.replay_snapshots=0", f"policies.0.model={config.policies[0].model}"])
    assert prune_replay_snapshots(layout, off, "shared", 9) == []  # off: snapshots are the schedule's, never pruned


def test_the_replay_verdict_before_a_rerun_starts(stored) -> None:
    layout, config = stored
    commit_update(layout, 0, snapshot="background", optimizer_state="new", optimizer_age=0, **NUMBERS)
    commit_update(layout, 1, snapshot=None, optimizer_state="resident", optimizer_age=0, **NUMBERS)
    commit_update(layout, 2, snapshot=None, optimizer_state="resident", optimizer_age=0, **NUMBERS)
    commit_update(layout, 3, snapshot=None, optimizer_state="resident", optimizer_age=0)  # recorded no numerics

    plan = plan_replay(layout, config, 1, [])
    assert plan.exact and plan.threads == {"shared": 2}, plan
    assert plan.line.startswith("exact replay: shared starts from the snapshot ")
    assert "iter-0/optimizer-shared" in plan.line and "at optimizer step 3 with 2 torch thread(s)" in plan.line
    assert plan.line.endswith("expect the original's update bitwise") and "\n" not in plan.line
    lr = [{"key": "training.lr", "old": 2e-5, "new": 1e-6}]
    assert plan_replay(layout, config, 1, lr).line.endswith("by its overrides alone (training.lr)")
    threads = [{"key": "training.num_threads", "old": None, "new": 1}]
    assert plan_replay(layout, config, 1, threads).line.startswith(
        "not an exact replay: training.num_threads overridden"
    )
    # iteration 2 starts from iteration 1's weights, whose snapshot was not kept: only older moments exist
    line = plan_replay(layout, config, 2, []).line
    assert line.startswith(
        "not an exact replay: no optimizer snapshot of the weights of 'shared' after iteration 1 "
    ), line
    assert "the newest is 1 update(s) older" in line and "training.replay_snapshots=2" in line
    assert plan_replay(layout, config, 3, []).line.startswith(
        "not an exact replay: the original update of 'shared' recorded neither its thread count nor its optimizer step"
    )
    assert plan_replay(layout, config, 4, []).line == (
        "not an exact replay: the original update of 'shared' never committed (the run stopped before it): "
        "nothing to replay"
    )


def test_a_replay_is_exact_only_when_every_recorded_number_matches() -> None:
    original = {"optimizer_state": "resident", "optimizer_age": 0, **NUMBERS}
    replay = {**original, "optimizer_state": "restored"}
    assert verify_replay(original, replay, []) is None
    assert verify_replay(original, replay, [{"key": "training.lr"}]) is None  # exact apart from the override
    assert verify_replay(original, {**replay, "torch_threads": 1}, []) == "torch_threads 1, the original's 2"
    assert verify_replay(
        original, {**replay, "adam_step_start": 0, "optimizer_state": "reset", "optimizer_age": None}, []
    ) == ("optimizer state reset (age None), the original's start needs restored; adam_step_start 0, the original's 3")
    assert verify_replay(original, {**replay, "zero_stage": 2}, [{"key": "training.zero_stage"}]) == (
        "training.zero_stage overridden"
    )
    old = {"optimizer_state": "resident", "optimizer_age": 0}
    assert "recorded no numerics" in verify_replay(old, replay, [])
    assert verify_replay({"skipped": True}, {"skipped": True}, []) is None


def test_runs_show_lists_each_attempts_optimizer_state_and_whether_it_replays(stored) -> None:
    layout, _ = stored
    commit_update(layout, 1, snapshot=None, optimizer_state="resident", optimizer_age=0, **NUMBERS)
    replay = {"optimizer_state": "restored", "optimizer_age": 0, **NUMBERS, "exact_replay": True, "replay_reason": ""}
    commit_update(layout, 1, snapshot=None, attempt=1, **replay)
    reason = "optimizer state reset (age None), the original's start needs restored"
    other = {
        **replay,
        "optimizer_state": "reset",
        "optimizer_age": None,
        "exact_replay": False,
        "replay_reason": reason,
    }
    commit_update(layout, 1, snapshot=None, attempt=2, **other)
    assert optimizer_lines(layout, 1) == [
        "  optimizer of shared, attempt 0 (original): resident, from step 3, bf16 (fp32 masters), 2 thread(s), "
        "1 rank(s), ZeRO-0",
        "  optimizer of shared, attempt 1: restored, from step 3, bf16 (fp32 masters), 2 thread(s), 1 rank(s), "
        "ZeRO-0, exact replay",
        "  optimizer of shared, attempt 2: reset, from step 3, bf16 (fp32 masters), 2 thread(s), 1 rank(s), ZeRO-0, "
        f"not an exact replay: {reason}",
    ]


def test_a_replay_from_the_snapshot_equals_the_resident_update_bitwise(tiny_model_dir, tmp_path, in_process):  # noqa: F811
    """The original: update 0, its snapshot written afterwards (as in the background), update 1 in the same resident
    worker, bf16 with fp32 masters (ZeRO-0), 2 threads. A fresh worker restoring that snapshot makes update 1 again:
    the same weights bitwise, the same loss and gradient norm, the same recorded numbers. Without the snapshot (Adam
    restarts, bf16 masters from model/) and with another learning rate the weights differ."""
    from pettingflow.training.worker import UpdateWorker

    data = batches(tmp_path, 2)
    threads = {"num_threads": 2}
    worker = UpdateWorker()
    try:
        m0 = worker.update(
            chain_spec(data[0], tmp_path / "u0", tiny_model_dir, 0, None, save_resume_state=False, **threads)
        )
        worker.save_optimizer_snapshot(str(tmp_path / "snap0"), "v0")
        m1 = worker.update(
            chain_spec(data[1], tmp_path / "u1", tiny_model_dir, 1, m0, save_resume_state=False, **threads)
        )
    finally:
        worker.cleanup()
    assert (m0["optimizer_state"], m1["optimizer_state"]) == ("new", "resident")
    assert (m1["master_weights"], m1["torch_threads"], m1["global_step_start"]) == ("fp32", 2, 1)

    def replay(name: str, snapshot: bool, **kw) -> dict:
        resume = {"resume_dir": str(tmp_path / "snap0" / "deepspeed")} if snapshot else {}
        spec = chain_spec(data[1], tmp_path / name, tiny_model_dir, 1, m0, save_resume_state=False, **threads, **resume)
        if kw:
            spec = spec.model_copy(update={"training": spec.training.model_copy(update=kw)})
        return in_process(spec)

    control = replay("control", snapshot=True)
    assert control["optimizer_state"] == "restored" and verify_replay(m1, control, []) is None
    assert (control["loss"], control["grad_norm"]) == (m1["loss"], m1["grad_norm"])
    want, got = safetensors_of(m1), safetensors_of(control)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)

    reset = replay("reset", snapshot=False)  # what a re-run without the snapshot did before
    assert "optimizer state reset" in verify_replay(m1, reset, [])
    assert any(not torch.equal(want[k], v) for k, v in safetensors_of(reset).items())

    lr = replay("lr", snapshot=True, lr=TRAIN_LR * 10)
    assert verify_replay(m1, lr, [{"key": "training.lr"}]) is None  # the same start, another learning rate
    assert lr["loss"] == m1["loss"]  # the first step's loss is taken before the learning rate acts
    assert any(not torch.equal(want[k], v) for k, v in safetensors_of(lr).items())


TRAIN_LR = 1e-2  # test_learner.TRAIN's


def test_pettingflow_rerun_prints_the_verdict_before_the_flow_starts(stored, monkeypatch) -> None:
    """The CLI's one line comes from storage alone and is its first output line, before the rerun flow (a stub here)."""
    from typer.testing import CliRunner

    import pettingflow.flows.rerun as rerun_module
    from pettingflow.cli import app

    layout, config = stored
    layout.write_run_info({"run_id": "r1", "config": config.model_dump(mode="json"), "overrides": []})
    for k in (0, 1):
        for name in ("rollouts", "filtered", "advantages"):
            layout.step(k, name).begin().commit({})
    commit_update(layout, 0, snapshot="background", optimizer_state="new", optimizer_age=0, **NUMBERS)
    commit_update(layout, 1, snapshot=None, optimizer_state="resident", optimizer_age=0, **NUMBERS)
    calls = []

    def flow(**kw):
        calls.append(kw)
        return {"attempt": 1, "report": "done"}

    monkeypatch.setattr(rerun_module, "rerun", flow)
    args = ["rerun", "r1", "-k", "1", "--from-step", "update", "--root", layout.root]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    first = result.output.splitlines()[0]
    assert first.startswith("exact replay: shared starts from the snapshot ") and calls, result.output
    result = CliRunner().invoke(app, [*args, "training.num_threads=1"])
    assert result.output.splitlines()[0].startswith("not an exact replay: training.num_threads overridden")
