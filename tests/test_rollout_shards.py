"""Rollouts commit group by group: a crash mid-rollout keeps the finished groups, the next attempt collects
only the others, and the step holds every group's rows exactly once (the same rows as an uninterrupted run)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from factories import crash_after_first_shard, trajectory_row
from test_storage import s3_server  # noqa: F401 (module fixture: moto's S3 server on loopback)

from bench.scripted_server import ScriptedServer
from pettingflow.configs import load_config
from pettingflow.envs import EnvCache, load_humaneval
from pettingflow.runs.context import IterationContext
from pettingflow.runs.endpoint import PolicyEndpoint
from pettingflow.steps.rollouts import collect_step
from pettingflow.storage import RunLayout, Step, TrajectoryShards, read_step_trajectories
from pettingflow.storage.commits import MARKER

# the columns that depend on the run id (UIDs are namespaced by it): everything else must match
RUN_SPECIFIC = {"run_id", "uid"}


def test_shards_survive_a_crash_and_commit_once_in_key_order(tmp_path: Path) -> None:
    step = RunLayout(str(tmp_path), "run-shards").step(0, "rollouts")
    shards = TrajectoryShards(step)
    shards.write(2, [trajectory_row(env_idx=2, sample_idx=0), trajectory_row(env_idx=2, sample_idx=1)])
    shards.write(0, [trajectory_row(env_idx=0, sample_idx=0)])
    # a crashed writer of shard 1: a file without a marker
    leftover = tmp_path / "runs" / "run-shards" / "iter-0" / "rollouts" / "shards" / "000001"
    assert leftover.parent.is_dir(), "shards live inside the step folder"
    leftover.mkdir()
    (leftover / "part-00000.parquet").write_bytes(b"half a file")

    stored = TrajectoryShards(step).committed()  # what a retry sees
    assert sorted(stored) == [0, 2] and stored[2].num_rows == 2
    assert not step.is_committed()

    stored[1] = shards.write(1, [trajectory_row(env_idx=1, sample_idx=0)])
    manifest = shards.commit(stored, metadata={"note": "x"})
    assert manifest.rows == 4
    rows = read_step_trajectories(Step(step.fs, step.path)).to_pylist()
    assert [(r["env_idx"], r["sample_idx"]) for r in rows] == [(0, 0), (1, 0), (2, 0), (2, 1)]
    folder = tmp_path / "runs" / "run-shards" / "iter-0" / "rollouts"
    assert sorted(p.name for p in folder.iterdir()) == [MARKER, "part-00000.parquet"]
    assert TrajectoryShards(step).committed() == {}  # a committed step has no shards to resume from


@pytest.mark.sandbox
def test_collect_step_resumes_from_committed_groups(
    tmp_path, default_tokenizer, default_model_dir, monkeypatch, caplog
):
    solutions = {t["entry_point"]: t["prompt"] + t["canonical_solution"] for t in load_humaneval()}
    with ScriptedServer(default_tokenizer, solutions) as server:
        config = load_config(
            "code-env",
            [
                f"run.storage_root={tmp_path}",
                f"policies.0.model={default_model_dir}",
                "rollout.use_ray=false",
                "env.tasks_per_iteration=3",
                "env.group_size=2",
            ],
        )
        endpoints = {
            "shared": PolicyEndpoint(
                policy="shared", url=server.url, served_model="shared", model_dir=str(default_model_dir)
            )
        }

        def collect(run_id: str):
            layout = RunLayout(str(tmp_path), run_id)
            return layout, collect_step(
                IterationContext(layout, 0), config, endpoints, env_cache=EnvCache(), show_progress=False
            )

        reference_layout, reference = collect("run-straight")

        # attempt 1 dies when its second group is complete: the first group's shard is committed
        with crash_after_first_shard(monkeypatch) as writes:
            collect("run-crash")
        layout = RunLayout(str(tmp_path), "run-crash")
        assert not layout.step(0, "rollouts").is_committed()
        assert sorted(TrajectoryShards(layout.step(0, "rollouts")).committed()) == writes

        with caplog.at_level(logging.INFO, logger="pettingflow.steps.rollouts"):
            _, resumed = collect("run-crash")
    assert "1 of 3 groups were committed by an earlier attempt; collecting the other 2" in caplog.text
    assert resumed.metrics["groups_resumed"] == 1
    assert resumed.metrics["episodes"] == 2 * 2  # only the missing groups ran again
    assert reference.metrics["groups_resumed"] == 0

    def comparable(layout: RunLayout) -> list[dict]:
        rows = read_step_trajectories(layout.step(0, "rollouts")).to_pylist()
        return [{k: v for k, v in r.items() if k not in RUN_SPECIFIC} for r in rows]

    got, want = comparable(layout), comparable(reference_layout)
    assert len(got) == len(want) == resumed.rows == reference.rows
    assert got == want  # every group exactly once, same seeds, same order


@pytest.mark.parametrize("where", ["local", "s3"])
def test_stale_rollouts_are_set_aside_whole(
    where: str, tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``set_aside`` (stale rollouts under async rollouts): the step disappears, its copy stays committed and
    readable beside it. On S3 (no rename) by copy, then the original's marker, then its files."""
    from factories import trajectory_rows

    from pettingflow.steps.rollouts import set_aside
    from pettingflow.storage import write_trajectories

    if where == "s3":
        layout = RunLayout("s3://pf-bucket/aside", "run-aside", storage_options=request.getfixturevalue("s3_server"))
    else:
        layout = RunLayout(str(tmp_path), "run-aside")
    step = layout.step(1, "rollouts")
    files = write_trajectories(step, trajectory_rows(3)).files
    removed: list[str] = []
    if where == "s3":  # the marker goes first: a crash midway must not leave a committed step with files missing
        rm = layout.fs.rm
        monkeypatch.setattr(layout.fs, "rm", lambda path, *a, **kw: (removed.append(path), rm(path, *a, **kw))[1])
    assert set_aside(step) == step.uri + ".stale-0"
    assert removed[:1] == ([step.marker_path] if where == "s3" else [])
    assert not step.is_committed() and not layout.fs.exists(step.path)
    old = Step(layout.fs, step.path + ".stale-0")
    assert old.manifest().files == files and read_step_trajectories(old).num_rows == 3
    write_trajectories(step, trajectory_rows(2))  # collected again, then found stale again
    assert set_aside(step) == step.uri + ".stale-1"
    assert read_step_trajectories(Step(layout.fs, step.path + ".stale-1")).num_rows == 2
    assert read_step_trajectories(old).num_rows == 3


class _RecordingRuntime:
    """What ``rollouts_step`` uses of a ``Runtime`` (``RunServices``): which weights it was asked to serve, and
    when."""

    def __init__(self, events: list[str]) -> None:
        self.services = {"shared": None}  # only its policies are read
        self.env_cache = None
        self.events = events

    def served_versions(self) -> dict[str, int]:
        return {"shared": 1}

    def serve_start_of(self, layout: RunLayout, iteration: int) -> dict:
        self.events.append(f"serve the start of iteration {iteration}")
        return {}

    def endpoints(self) -> dict:
        return {}


@pytest.mark.parametrize("async_rollouts", [False, True])
def test_rollouts_step_sets_stale_rows_aside_says_why_and_collects_with_the_right_weights(
    async_rollouts: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Iteration 1 starts from version 1; its committed rows are of version 0. Sync rollouts allow no lag: the
    rows are set aside (the warning names the versions and where they went), the servers serve iteration 1's
    start weights, then the step is collected again. With async rollouts (lag 1 allowed) they are kept."""
    from pettingflow.steps import rollouts
    from pettingflow.storage import write_trajectories

    config = load_config("code-env", [f"rollout.async_rollouts={str(async_rollouts).lower()}"])
    ctx = IterationContext(RunLayout(str(tmp_path), "run-stale"), 1)
    rows = [trajectory_row(sample_idx=i, rollout_idx=i, iteration=1, policy_version=0) for i in range(2)]
    write_trajectories(ctx.step("rollouts"), rows)  # policy "shared"
    events: list[str] = []
    monkeypatch.setattr(rollouts, "start_version", lambda layout, policy, iteration: 1)
    monkeypatch.setattr(
        rollouts, "collect_step", lambda ctx, config, endpoints, **kw: events.append(f"collect {kw['policy_versions']}")
    )
    rollouts.rollouts_step(ctx, config, _RecordingRuntime(events), warn=lambda line: events.append(f"warn: {line}"))
    if async_rollouts:
        assert events == ["collect {'shared': 1}"]  # committed and within the lag bound: nothing served again
        assert ctx.step("rollouts").is_committed()
        return
    warning, *rest = events
    assert "shared rows of weights version 0" in warning and "starts from version 1: lag 1 > 0 allowed" in warning
    assert warning.endswith(f"(the old ones moved to {ctx.step('rollouts').uri}.stale-0)")
    assert rest == ["serve the start of iteration 1", "collect {'shared': 1}"]
    assert not ctx.step("rollouts").is_committed()  # set aside; collect_step (stubbed here) commits it again
