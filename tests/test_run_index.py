"""The run index: runs started on this machine are found by id from any folder, whatever their storage root."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pettingflow.cli import app
from pettingflow.configs.loader import load_config
from pettingflow.runs.run import start_or_resume
from pettingflow.storage import run_index


@pytest.fixture()
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PETTINGFLOW_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_entries_hold_absolute_local_roots_and_remote_uris_as_given(home, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    run_index.record_run("a-1", "./outputs", "code-env")
    run_index.record_run("b-1", "s3://bucket/prefix", "plan-path", {"client_kwargs": {"endpoint_url": "x"}})
    run_index.record_run("a-1", "other", "code-env")  # the same id again: the latest entry wins
    (home / "runs.jsonl").open("a").write("not json\n{}\n")
    assert run_index.find_run("a-1")["root"] == str(tmp_path / "other")
    remote = run_index.find_run("b-1")
    assert remote["root"] == "s3://bucket/prefix" and remote["storage_options"] is True
    assert "endpoint_url" not in (home / "runs.jsonl").read_text()  # no storage options (credentials) on disk
    assert run_index.find_run("nope") is None
    # roots needing storage options are not listed without them
    assert run_index.recorded_roots() == [str(tmp_path / "outputs"), str(tmp_path / "other")]
    assert [json.loads(x)["run_id"] for x in (home / "runs.jsonl").read_text().splitlines()[:3]] == [
        "a-1",
        "b-1",
        "a-1",
    ]


def test_an_unwritable_index_never_stops_a_run(home, caplog) -> None:
    home.parent.mkdir(parents=True, exist_ok=True)
    home.write_text("a file where the home folder should be")
    run_index.record_run("a-1", "/tmp/x", "code-env")
    assert "could not record run a-1" in caplog.text
    assert run_index.recorded_runs() == []


def test_runs_show_finds_a_run_of_another_root_from_another_folder(home, tmp_path, monkeypatch) -> None:
    """A run whose config stores it under a relative root of its own is found by `runs show RUN` (and listed by
    `runs list`) without --root, from another working folder."""
    monkeypatch.chdir(tmp_path)
    config = load_config("code-env", ["run.storage_root=./my-runs", "run.name=mine"])
    ref, resumed = start_or_resume(config, "code-env", ["run.storage_root=./my-runs"], None, {})
    assert not resumed and run_index.find_run(ref.run_id)["root"] == str(tmp_path / "my-runs")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    runner = CliRunner()
    shown = runner.invoke(app, ["runs", "show", ref.run_id])
    assert shown.exit_code == 0, shown.output
    assert ref.run_id in shown.output
    listed = runner.invoke(app, ["runs", "list"], env={"COLUMNS": "250"})
    assert listed.exit_code == 0 and ref.run_id in listed.output and "my-runs" in listed.output
    missing = runner.invoke(app, ["trajectories", "show", "mine-20000101-000000-abcd"])
    assert missing.exit_code != 0
