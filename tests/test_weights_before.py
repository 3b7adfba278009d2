"""Which weights and which optimizer snapshot an iteration starts from, read from committed steps only."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_storage import s3_server  # noqa: F401 (module fixture: moto's S3 server on loopback)

from pettingflow.configs.loader import load_config
from pettingflow.runs.lineage import start_version, weights_before
from pettingflow.storage import RunLayout
from pettingflow.training.checkpoint import BASE_WEIGHTS, optimizer_snapshot_due


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
    step.write_json("metrics.json", {"loss": float(k)})  # as a real update step: what pruning must keep
    step.commit({"skipped": skipped})
    return step.uri


def test_start_weights_and_snapshot_age(setup) -> None:
    layout, config, base = setup
    start = weights_before(layout, config, "shared", 0)
    assert (start.source, start.model_dir, start.deepspeed_dir, start.optimizer_age) == (BASE_WEIGHTS, base, None, 0)
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
    # the same versions from the markers alone (what the advantage step records as each row's lag)
    assert [start_version(layout, "shared", k) for k in range(5)] == [0, 1, 2, 2, 4]
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


def test_weights_on_s3_are_downloaded_verified_and_cached(setup, s3_server, tmp_path, monkeypatch) -> None:  # noqa: F811
    """On S3 the starting weights are a verified local copy under ``$PETTINGFLOW_HOME/cache`` (vLLM and
    transformers need folders): never half-written, re-downloaded when the marker changes, refused when corrupt."""
    from pettingflow.runs.lineage import COMPLETE, local_copy
    from pettingflow.storage.commits import CorruptFileError

    _, config, base = setup
    monkeypatch.setenv("PETTINGFLOW_HOME", str(tmp_path / "home"))
    layout = RunLayout("s3://pf-bucket/weights", "r-s3", storage_options=s3_server)
    u0 = commit_update(layout, 0, snapshot=True)
    start = weights_before(layout, config, "shared", 1)
    cache = tmp_path / "home" / "cache"
    assert start.source == u0 and start.base_dir == base
    assert Path(start.model_dir).is_relative_to(cache) and Path(start.deepspeed_dir).is_relative_to(cache)
    assert (Path(start.model_dir) / "model.safetensors").read_bytes() == b"w0"
    assert (Path(start.deepspeed_dir) / "latest").read_bytes() == b"global_step0"
    assert [p.name for p in cache.iterdir()] == [Path(start.model_dir).parent.name]  # no temp folder left

    # a cached copy is used as long as the step has the marker it was made from
    step = layout.step(0, "update-shared")
    layout.fs.pipe(f"{step.path}/model/model.safetensors", b"w9")  # changed behind the marker's back
    assert (local_copy(step) / "model" / "model.safetensors").read_bytes() == b"w0"
    # not verified against the marker: refused, and nothing half-downloaded is left in the cache
    (local_copy(step) / COMPLETE).unlink()  # as if the download had crashed before it finished
    with pytest.raises(CorruptFileError, match="does not match the sha256"):
        local_copy(step)
    assert sorted(p.name for p in cache.iterdir()) == [Path(start.model_dir).parent.name]
    layout.fs.pipe(f"{step.path}/model/model.safetensors", b"w0")
    assert (local_copy(step) / "model" / "model.safetensors").read_bytes() == b"w0"
    # a step committed again (new marker) is downloaded again
    layout.fs.rm(step.path, recursive=True)
    step = layout.step(0, "update-shared").begin()
    step.write_bytes("model/model.safetensors", b"w0-again")
    step.commit()
    assert (local_copy(step) / "model" / "model.safetensors").read_bytes() == b"w0-again"
    assert not (local_copy(step) / "deepspeed").exists()


class _FakeLearner:
    """The surface ``snapshot_in_background`` uses: each rank writes its files, or the save fails."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.calls: list[tuple[str, str]] = []

    def save_optimizer(self, out_dir: str, version: str, timeout_s: float | None = None, **_: object) -> dict:
        self.calls.append((out_dir, version))
        Path(out_dir, "deepspeed").mkdir(parents=True, exist_ok=True)
        Path(out_dir, "deepspeed", "latest").write_text("global_step9")
        if self.fail:
            raise RuntimeError("rank 1 died")
        return {"save_s": 0.1, "global_steps": 9}


class _Runtime:
    """A runtime's ``services``: one ``PolicyService`` without a server or a learner, whose snapshot thread
    (``track_snapshot``/``wait_snapshot``) runs for real."""

    def __init__(self) -> None:
        from pettingflow.runs.policy_service import PolicyService

        self.services = {"shared": PolicyService("shared", None, "snapshot-test", Path("/nonexistent-state"))}

    def wait_snapshots(self) -> None:
        self.services["shared"].wait_snapshot()


def test_a_background_snapshot_is_found_once_committed_and_never_half_written(setup) -> None:
    from pettingflow.runs.context import IterationContext
    from pettingflow.steps.updates import snapshot_in_background

    layout, config, _ = setup
    u0 = commit_update(layout, 0, snapshot=False)
    runtime = _Runtime()
    failing = _FakeLearner(fail=True)
    snapshot_in_background(IterationContext(layout, 0), "shared", failing, runtime, u0, None)
    runtime.wait_snapshots()
    assert failing.calls == [(layout.step(0, "optimizer-shared").path, u0)]
    # the save failed after writing files: nothing committed, the files are not a snapshot
    assert not layout.step(0, "optimizer-shared").is_committed()
    assert weights_before(layout, config, "shared", 1).deepspeed_dir is None
    snapshot_in_background(IterationContext(layout, 0), "shared", _FakeLearner(), runtime, u0, None)
    runtime.wait_snapshots()
    step = layout.step(0, "optimizer-shared")
    assert step.is_committed() and step.manifest().metadata["for_update"] == u0
    start = weights_before(layout, config, "shared", 1)
    assert start.deepspeed_dir.endswith("iter-0/optimizer-shared/deepspeed") and start.optimizer_age == 0
    commit_update(layout, 1, snapshot=False)
    assert weights_before(layout, config, "shared", 2).optimizer_age == 1  # one update newer than the snapshot


def test_a_snapshot_a_crash_cut_short_is_removed_once_its_update_is_committed(setup) -> None:
    """The half-written optimizer-<policy> folder of a crash mid-snapshot is given back: by the resumed update
    step of its own iteration, or by the next iteration's update. Committed snapshots, and snapshots of an update
    not committed yet, are never touched."""
    from pettingflow.steps.updates import discard_lost_snapshot

    layout, _, _ = setup
    lost = layout.step(0, "optimizer-shared")
    lost.begin()
    lost.write_bytes("deepspeed/latest", b"global_step0")
    update = layout.step(0, "update-shared")
    assert not discard_lost_snapshot(lost, update) and lost.fs.exists(lost.path)  # its update is not committed
    commit_update(layout, 0, snapshot=False)
    assert discard_lost_snapshot(lost, update) and not lost.fs.exists(lost.path)
    assert not discard_lost_snapshot(lost, update)  # nothing left
    kept = layout.step(1, "optimizer-shared")
    kept.begin()
    kept.write_bytes("deepspeed/latest", b"global_step1")
    kept.commit({})
    commit_update(layout, 1, snapshot=False)
    assert not discard_lost_snapshot(kept, layout.step(1, "update-shared")) and kept.is_committed()


def test_a_rank_on_another_node_localizes_its_start_from_the_bucket(setup, s3_server, tmp_path, monkeypatch) -> None:  # noqa: F811
    """``localize_start``: the spec the flow built names the flow node's folders; a rank on another node (its own
    ``$PETTINGFLOW_HOME``) gets the same weights and snapshot as verified downloads into its own cache, from
    ``UpdateSpec.start_sources`` alone."""
    from pettingflow.runs.lineage import localize_start
    from pettingflow.training.launch import spec_from_config

    _, config, base = setup
    layout = RunLayout("s3://pf-bucket/localize", "r-loc", storage_options=s3_server)
    u0 = commit_update(layout, 0, snapshot=True)
    monkeypatch.setenv("PETTINGFLOW_HOME", str(tmp_path / "flow-home"))
    start = weights_before(layout, config, "shared", 1)
    spec = spec_from_config(
        config, policy="shared", batch_uri="b.parquet", out_dir=str(tmp_path / "out"), start=start, iteration=1
    ).model_copy(update={"storage_options": s3_server})  # a run's are config.run.storage_options
    assert spec.start_sources.model_dump() == {"base_model": base, "weights": u0, "snapshot": u0}
    assert spec.init_model_dir.startswith(str(tmp_path / "flow-home"))

    monkeypatch.setenv("PETTINGFLOW_HOME", str(tmp_path / "node2-home"))  # the rank's node
    away = localize_start(spec)
    assert Path(away.init_model_dir).is_relative_to(tmp_path / "node2-home" / "cache")
    assert (Path(away.init_model_dir) / "model.safetensors").read_bytes() == b"w0"
    assert (Path(away.resume_dir) / "latest").read_bytes() == b"global_step0"
    assert away.base_model_dir == base and away.out_dir == spec.out_dir
    # the base model (no update yet): the policy's model, resolved on the rank's node; no snapshot
    fresh = spec_from_config(
        config, policy="shared", batch_uri="b.parquet", out_dir="o", start=weights_before(layout, config, "shared", 0)
    )
    assert fresh.start_sources.model_dump() == {"base_model": base, "weights": None, "snapshot": None}
    assert localize_start(fresh).init_model_dir == base and localize_start(fresh).resume_dir is None


def test_files_uploaded_by_another_process_are_committed_only_as_uploaded(tmp_path) -> None:
    """``Step.add_entries``: what a rank on another node uploaded (``add_tree`` on its own ``Step``) is committed
    by the flow with the rank's sizes and hashes; a missing or truncated upload is refused, naming the file."""
    from pettingflow.storage.commits import CorruptFileError, Step

    layout = RunLayout(str(tmp_path / "runs"), "r-up")
    flow_side = layout.step(0, "update-shared").begin()
    rank_dir = tmp_path / "rank0"
    (rank_dir / "model").mkdir(parents=True)
    (rank_dir / "model" / "model.safetensors").write_bytes(b"weights")
    (rank_dir / "metrics.json").write_text("{}")
    entries = Step.from_uri(flow_side.uri).add_tree(rank_dir)  # the rank, from the step's URI alone
    flow_side.add_entries(entries)
    manifest = flow_side.commit({})
    assert [e.name for e in manifest.files] == ["metrics.json", "model/model.safetensors"]
    assert flow_side.read_bytes("model/model.safetensors") == b"weights"  # size and sha256 check out

    other = layout.step(1, "update-shared").begin()
    with pytest.raises(CorruptFileError, match=r"update-shared/metrics\.json is missing"):
        other.add_entries(entries)
    other.write_bytes("model/model.safetensors", b"weigh")
    with pytest.raises(CorruptFileError, match="has 5 bytes; its writer uploaded 7"):
        other.add_entries([e for e in entries if e.name.startswith("model/")])


def test_a_rank_away_from_the_flow_writes_locally_only_with_remote_storage(tmp_path) -> None:
    """``writes_elsewhere``: ranks on the flow's node write into the step; an away rank uploads with remote
    storage, writes in place on a shared filesystem, and fails naming its node otherwise."""
    from pettingflow.training.learner import writes_elsewhere

    assert writes_elsewhere(False, "/nowhere", None, 0, "10.0.0.2") is False
    assert writes_elsewhere(True, "/nowhere", "s3://b/run/iter-0/update-shared", 0, "10.0.0.2") is True
    assert writes_elsewhere(True, str(tmp_path), None, 1, "10.0.0.2") is False  # shared filesystem
    with pytest.raises(RuntimeError, match=r"rank 1 runs on node 10\.0\.0\.2.*run\.storage_root must be storage"):
        writes_elsewhere(True, str(tmp_path / "missing"), None, 1, "10.0.0.2")
