"""Trajectory storage: schema round trip, commit markers, corruption, S3 and third-party readers."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from factories import trajectory_row, trajectory_rows

from pettingflow.storage import (
    SCHEMA_VERSION,
    CorruptFileError,
    RunLayout,
    SchemaError,
    StepAlreadyCommittedError,
    StepNotCommittedError,
    list_runs,
    new_run_id,
    read_step_trajectories,
    read_trajectories,
    trajectories_to_table,
    write_trajectories,
)
from pettingflow.storage.commits import MARKER
from pettingflow.storage.schema import META_SCHEMA_VERSION


@pytest.fixture
def layout(tmp_path: Path) -> RunLayout:
    return RunLayout(str(tmp_path / "store"), "run-a")


def test_round_trip_keeps_tokens_masks_uids_and_version(layout: RunLayout) -> None:
    rows = trajectory_rows(6)
    rows[3]["response_ids"] = [7] * 9
    rows[3]["response_mask"] = [0, 0, 1, 1, 1, 0, 0, 1, 1]
    rows[3]["sampler_logprobs"] = [-1.25] * 9
    step = layout.step(0, "rollouts")
    manifest = write_trajectories(step, rows, rows_per_file=4)
    assert manifest.rows == 6
    assert [f.name for f in manifest.files] == ["part-00000.parquet", "part-00001.parquet"]
    table = read_step_trajectories(step)
    assert table.num_rows == 6
    back = table.to_pylist()
    for original, read in zip(rows, back, strict=True):
        for key in ("response_ids", "response_mask", "uid", "prompt_ids", "agent_name", "lora_name"):
            assert read[key] == original[key]
        assert read["sampler_logprobs"] == pytest.approx(original["sampler_logprobs"])
    # the schema version travels in the file metadata
    file_path = f"{step.path}/part-00000.parquet"
    assert pq.read_schema(file_path).metadata[META_SCHEMA_VERSION].decode() == SCHEMA_VERSION


def test_reader_filters_by_iteration_policy_and_agent(layout: RunLayout) -> None:
    for k in range(3):
        write_trajectories(layout.step(k, "rollouts"), trajectory_rows(4, iteration=k))
    assert read_trajectories(layout).num_rows == 12
    assert read_trajectories(layout, iterations=1).column("iteration").to_pylist() == [1] * 4
    assert set(read_trajectories(layout, iterations=[0, 2]).column("iteration").to_pylist()) == {0, 2}
    only_test = read_trajectories(layout, agent="test_generator")
    assert set(only_test.column("agent_name").to_pylist()) == {"test_generator"}
    assert only_test.num_rows == 6
    assert read_trajectories(layout, policy="p_code", agent="test_generator").num_rows == 0
    assert read_trajectories(layout, policy=["p_code", "p_test"]).num_rows == 12


def test_uncommitted_step_is_invisible(layout: RunLayout) -> None:
    write_trajectories(layout.step(0, "rollouts"), trajectory_rows(2))
    step1 = layout.step(1, "rollouts").begin()
    step1.write_table("part-00000.parquet", trajectories_to_table(trajectory_rows(2, iteration=1)))
    # data is on disk but there is no marker: readers must not see it
    assert not step1.is_committed()
    with pytest.raises(StepNotCommittedError, match="not committed"):
        read_step_trajectories(step1)
    assert read_trajectories(layout).num_rows == 2


def test_crash_then_retry_never_duplicates_rows(layout: RunLayout) -> None:
    step = layout.step(0, "rollouts")
    # attempt 1 crashes after writing two parts and before the marker
    step.begin()
    step.write_table("part-00000.parquet", trajectories_to_table(trajectory_rows(3)))
    step.write_table("part-00007.parquet", trajectories_to_table(trajectory_rows(3)))
    # attempt 2 writes the whole step again and commits
    manifest = write_trajectories(layout.step(0, "rollouts"), trajectory_rows(3))
    assert manifest.rows == 3
    assert read_step_trajectories(step).num_rows == 3
    assert sorted(p.rsplit("/", 1)[-1] for p in step.fs.ls(step.path, detail=False)) == [MARKER, "part-00000.parquet"]


def test_recommit_is_idempotent(layout: RunLayout) -> None:
    step = layout.step(0, "rollouts")
    first = write_trajectories(step, trajectory_rows(4))
    again = write_trajectories(layout.step(0, "rollouts"), trajectory_rows(10))
    assert again == first
    assert read_step_trajectories(step).num_rows == 4
    assert step.commit() == first
    with pytest.raises(StepAlreadyCommittedError):
        step.begin()
    with pytest.raises(StepAlreadyCommittedError):
        step.write_bytes("extra.json", b"{}")


def test_truncated_file_raises_naming_path(layout: RunLayout) -> None:
    step = layout.step(0, "rollouts")
    write_trajectories(step, trajectory_rows(4))
    path = Path(step.path) / "part-00000.parquet"
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(CorruptFileError, match=r"part-00000\.parquet"):
        read_step_trajectories(step)


def test_garbage_with_matching_size_raises_naming_path(layout: RunLayout) -> None:
    step = layout.step(0, "rollouts")
    write_trajectories(step, trajectory_rows(4))
    path = Path(step.path) / "part-00000.parquet"
    size = path.stat().st_size
    path.write_bytes(b"x" * size)
    with pytest.raises(CorruptFileError, match="sha256"):
        read_step_trajectories(step)
    # without checksum verification the Parquet reader itself must still refuse it
    with pytest.raises(CorruptFileError, match=r"part-00000\.parquet.*not a readable Parquet"):
        read_step_trajectories(step, verify=False)


def test_missing_file_raises_naming_path(layout: RunLayout) -> None:
    step = layout.step(0, "rollouts")
    write_trajectories(step, trajectory_rows(4))
    (Path(step.path) / "part-00000.parquet").unlink()
    with pytest.raises(CorruptFileError, match="missing"):
        read_step_trajectories(step)


def test_schema_rejects_mask_length_mismatch_and_bad_values() -> None:
    with pytest.raises(SchemaError, match="response_mask has 3 entries but response_ids has 4"):
        trajectories_to_table([trajectory_row(response_mask=[1, 1, 1])])
    with pytest.raises(SchemaError, match="other than 0 and 1"):
        trajectories_to_table([trajectory_row(response_mask=[1, 2, 0, 1])])
    with pytest.raises(SchemaError, match="missing required column 'uid'"):
        row = trajectory_row()
        del row["uid"]
        trajectories_to_table([row])
    with pytest.raises(SchemaError, match="not in the trajectory schema"):
        trajectories_to_table([trajectory_row(advantage=1.0)])


def test_run_layout_paths_and_listing(tmp_path: Path) -> None:
    root = str(tmp_path / "store")
    run_id = new_run_id("code env!")
    assert run_id.startswith("code-env-")
    layout = RunLayout(root, run_id)
    layout.write_run_info({"config": {"a": 1}})
    write_trajectories(layout.step(0, "rollouts"), trajectory_rows(1))
    write_trajectories(layout.step(10, "rollouts"), trajectory_rows(1))
    write_trajectories(layout.step(2, "rollouts"), trajectory_rows(1))
    assert layout.iterations() == [0, 2, 10]
    assert layout.step(3, "filtered").path.endswith(f"runs/{run_id}/iter-3/filtered")
    assert layout.step(3, "filtered", attempt=2).path.endswith(f"runs/{run_id}/iter-3/attempt-2/filtered")
    assert layout.attempts(0) == [0]
    assert layout.next_attempt(0) == 1
    assert list_runs(root) == [run_id]
    assert layout.read_run_info() == {"config": {"a": 1}}
    with pytest.raises(ValueError, match="run id"):
        RunLayout(root, "../escape")


def test_files_open_without_project_code(layout: RunLayout) -> None:
    import duckdb
    import pandas as pd
    from datasets import load_dataset

    step = layout.step(0, "rollouts")
    write_trajectories(step, trajectory_rows(5))
    pattern = f"{step.path}/*.parquet"
    df = pd.read_parquet(step.path)
    assert len(df) == 5
    assert list(df["response_mask"].iloc[0]) == [1, 1, 0, 1]
    count = duckdb.sql(f"select count(*), sum(len(response_ids)) from read_parquet('{pattern}')").fetchall()[0]
    assert count == (5, 20)
    ds = load_dataset("parquet", data_files=pattern, split="train")
    assert ds.num_rows == 5
    assert ds[0]["uid"] == "u0"


def test_memory_filesystem_round_trip() -> None:
    layout = RunLayout("memory://pf-test", "run-mem")
    manifest = write_trajectories(layout.step(0, "rollouts"), trajectory_rows(3))
    assert manifest.rows == 3
    assert read_trajectories(layout).num_rows == 3


@pytest.fixture(scope="module")
def s3_server():
    """A real S3-compatible server (moto's server mode) on loopback."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    creds = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": "us-east-1"}
    boto3.client("s3", endpoint_url=endpoint, **creds).create_bucket(Bucket="pf-bucket")
    options = {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
    }
    yield options
    server.stop()


def test_s3_round_trip(s3_server) -> None:
    layout = RunLayout("s3://pf-bucket/prefix", "run-s3", storage_options=s3_server)
    step = layout.step(0, "rollouts")
    assert not step.is_committed()
    manifest = write_trajectories(step, trajectory_rows(6), rows_per_file=4)
    assert manifest.rows == 6
    assert step.uri.startswith("s3://pf-bucket/prefix/runs/run-s3/iter-0/rollouts")
    table = read_trajectories(layout, agent="code_generator")
    assert table.num_rows == 3
    # an uncommitted S3 step is invisible too
    other = layout.step(1, "rollouts").begin()
    other.write_table("part-00000.parquet", trajectories_to_table(trajectory_rows(2)))
    assert read_trajectories(layout).num_rows == 6
    marker = json.loads(step.fs.cat_file(step.marker_path))
    assert {f["name"] for f in marker["files"]} == {"part-00000.parquet", "part-00001.parquet"}
    assert all(len(f["sha256"]) == 64 for f in marker["files"])


def test_table_schema_mismatch_is_rejected(layout: RunLayout) -> None:
    table = trajectories_to_table(trajectory_rows(2)).drop_columns(["info_json"])
    with pytest.raises(SchemaError, match="info_json"):
        write_trajectories(layout.step(0, "rollouts"), table)
    bad = trajectories_to_table(trajectory_rows(2))
    bad = bad.set_column(bad.schema.get_field_index("reward"), "reward", pa.array([1.0, 2.0], pa.float64()))
    with pytest.raises(SchemaError, match="reward"):
        write_trajectories(layout.step(0, "rollouts"), bad)


def test_add_tree_uploads_or_registers_in_place(tmp_path: Path) -> None:
    src = tmp_path / "ckpt"
    (src / "model").mkdir(parents=True)
    (src / "model" / "weights.bin").write_bytes(b"w" * 1000)
    (src / "metrics.json").write_text("{}")
    # a different place: files are copied and hashed
    remote = RunLayout("memory://pf-tree", "run-t").step(0, "update-shared").begin()
    entries = remote.add_tree(src)
    remote.commit()
    assert sorted(e.name for e in entries) == ["metrics.json", "model/weights.bin"]
    assert remote.read_bytes("model/weights.bin") == b"w" * 1000
    # the step folder itself (a worker wrote into it): registered in place, nothing copied
    layout = RunLayout(str(tmp_path / "store"), "run-t")
    step = layout.step(0, "update-shared").begin()
    assert step.local_path is not None
    (step.local_path / "model").mkdir(parents=True)
    (step.local_path / "model" / "weights.bin").write_bytes(b"v" * 10)
    step.add_tree(step.local_path)
    manifest = step.commit()
    assert [f.name for f in manifest.files] == ["model/weights.bin"]
    assert step.read_bytes("model/weights.bin") == b"v" * 10
    with pytest.raises(ValueError, match="invalid file name"):
        layout.step(1, "x").begin().write_bytes("../escape", b"")


def _write_foreign_version(step, table: pa.Table, version: str) -> None:
    """Commit ``table`` as a file that claims trajectory schema ``version`` (as an older pettingflow wrote it)."""
    meta = {META_SCHEMA_VERSION: version.encode(), b"pettingflow.kind": b"trajectories"}
    step.begin()
    step.write_table("part-00000.parquet", table.replace_schema_metadata(meta))
    step.commit()


def test_version_1_files_are_read_with_policy_version_filled_in(layout: RunLayout) -> None:
    """Files written before ``policy_version`` existed stay readable: it is their iteration (sync rollouts)."""
    new = trajectories_to_table(trajectory_rows(3, iteration=4))
    old = new.drop_columns(["policy_version", "branch_idx", "continued", "inference_server", "outcome"]).append_column(
        "advantage", pa.array([0.5, -1.0, 0.0], pa.float32())
    )
    step = layout.step(4, "advantages")
    _write_foreign_version(step, old, "1")
    table = read_step_trajectories(step)
    assert table.column("policy_version").to_pylist() == [4, 4, 4]
    # where a current batch has them: the trajectory columns in schema order, then the advantage
    assert table.column_names[-6:] == [
        "policy_version",
        "branch_idx",
        "continued",
        "inference_server",
        "outcome",
        "advantage",
    ]
    assert table.column("branch_idx").to_pylist() == [0, 0, 0] and table.column("continued").to_pylist() == [True] * 3
    assert table.column("inference_server").to_pylist() == [None] * 3  # older files do not say
    assert read_step_trajectories(step, columns=["uid", "policy_version"]).num_columns == 2
    # rows read from an old file are written back in the current schema
    rewritten = write_trajectories(layout.step(4, "copy"), table.drop_columns(["advantage"]))
    assert rewritten.rows == 3


def test_version_2_files_are_read_as_independent_rollouts(layout: RunLayout) -> None:
    """Files written before tree rollouts: every row is branch 0 of its call and on its episode's path."""
    new = trajectories_to_table(trajectory_rows(4, iteration=1, policy_version=1))
    step = layout.step(1, "rollouts")
    _write_foreign_version(step, new.drop_columns(["branch_idx", "continued", "inference_server", "outcome"]), "2")
    table = read_step_trajectories(step)
    assert table.column("branch_idx").to_pylist() == [0] * 4
    assert table.column("continued").to_pylist() == [True] * 4
    assert table.column("policy_version").to_pylist() == [1] * 4  # stored, not derived
    assert table.column_names == new.column_names
    assert read_step_trajectories(step, columns=["continued"]).column("continued").to_pylist() == [True] * 4
    assert write_trajectories(layout.step(1, "copy"), table).rows == 4  # written back in the current schema


def test_version_4_files_get_an_outcome_derived_from_done_and_truncated(layout: RunLayout) -> None:
    """Files written before the ``outcome`` column: solved where done and not truncated, max_turns where both,
    not_finished where neither (they could not say failed)."""
    rows = trajectory_rows(3)
    for row, (done, truncated) in zip(rows, [(True, False), (True, True), (False, True)], strict=True):
        row.update(done=done, truncated=truncated)
        row.pop("outcome", None)
    new = trajectories_to_table(rows)
    assert new.column("outcome").to_pylist() == ["solved", "max_turns", "not_finished"]  # hand-made rows too
    step = layout.step(0, "rollouts")
    _write_foreign_version(step, new.drop_columns(["outcome"]), "4")
    table = read_step_trajectories(step)
    assert table.column("outcome").to_pylist() == ["solved", "max_turns", "not_finished"]
    assert table.column_names == new.column_names


def test_files_of_a_newer_schema_are_refused_with_a_reason(layout: RunLayout) -> None:
    step = layout.step(0, "rollouts")
    _write_foreign_version(step, trajectories_to_table(trajectory_rows(1)), "99")
    with pytest.raises(CorruptFileError, match="schema version 99; this pettingflow reads 1, 2, 3"):
        read_step_trajectories(step)
