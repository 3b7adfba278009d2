"""``pettingflow runs timeline``: the text Gantt chart of when each step ran, rebuilt from a run's commit markers,
on a fake async run with known times (iteration 1's rollouts collected beside iteration 0's update)."""

from __future__ import annotations

import time

import pytest
from typer.testing import CliRunner

from pettingflow.analysis.inspect import timeline_spans, timeline_text
from pettingflow.cli import app
from pettingflow.storage import RunLayout

T0 = 1_800_000_000.0  # 2027-01-15 08:00:00 UTC


def commit_at(monkeypatch, layout: RunLayout, k: int, name: str, at: float, metadata=None, metrics=None) -> None:
    """Commit step ``name`` of iteration ``k`` as if at ``T0 + at``."""
    step = layout.step(k, name).begin()
    step.write_json("metrics.json", metrics or {})
    with monkeypatch.context() as m:
        m.setattr(time, "time", lambda: T0 + at)
        step.commit(metadata)


@pytest.fixture
def fake_run(tmp_path, monkeypatch) -> RunLayout:
    layout = RunLayout(str(tmp_path), "fake-async-run")
    layout.write_run_info({"config_name": "code-env"})
    # iteration 0: rollouts 0-10 s, update 12-40 s; iteration 1's rollouts collected ahead 12-30 s
    commit_at(monkeypatch, layout, 0, "rollouts", 10, {"started_at": T0, "finished_at": T0 + 10})
    commit_at(monkeypatch, layout, 0, "filtered", 11)
    commit_at(monkeypatch, layout, 0, "advantages", 12)
    commit_at(monkeypatch, layout, 0, "update-shared", 40, {"metrics": {"duration_s": 20.0}})
    commit_at(monkeypatch, layout, 1, "rollouts", 30, {"started_at": T0 + 12, "finished_at": T0 + 30})
    commit_at(monkeypatch, layout, 0, "sync", 42)
    report0 = {
        "duration/filtered_s": 1.0,
        "duration/advantages_s": 1.0,
        "duration/update-shared_s": 28.0,
        "duration/sync_s": 2.0,
        "async/next_rollouts_s": 18.0,
        "async/overlap_s": 18.0,
        "async/update_s": 28.0,
    }
    commit_at(monkeypatch, layout, 0, "report", 43, metrics=report0)
    # iteration 1: its rollouts were committed already; update 44-64 s, no next iteration
    commit_at(monkeypatch, layout, 1, "filtered", 43.5)
    commit_at(monkeypatch, layout, 1, "advantages", 44)
    commit_at(monkeypatch, layout, 1, "update-shared", 64, {"metrics": {"duration_s": 19.0}})
    commit_at(monkeypatch, layout, 1, "report", 66, metrics={"duration/update-shared_s": 20.0})
    return layout


def test_timeline_spans_come_from_markers_and_reports(fake_run) -> None:
    spans = {(s.iteration, s.label): (s.start - T0, s.end - T0) for s in timeline_spans(fake_run)}
    assert spans[(0, "rollouts")] == (0, 10)
    assert spans[(0, "update-shared")] == (12, 40)  # the task's 28 s, longer than the learner's own 20 s
    assert spans[(1, "rollouts (ahead)")] == (12, 30)  # iteration 0's report says it collected them ahead
    assert spans[(1, "update-shared")] == (44, 64)
    assert spans[(1, "filtered")] == (43.5, 43.5)  # no duration in the report: a point at its marker
    assert spans[(0, "report")] == (43, 43)
    starts = [s.start for s in timeline_spans(fake_run)]
    assert starts == sorted(starts)


def test_timeline_text_draws_the_overlap(fake_run) -> None:
    text = timeline_text(fake_run, width=66)  # one column = 1 s
    lines = text.splitlines()
    assert "one column = 1.0 s" in lines[0] and "08:00:00 UTC" in lines[0]
    bars = {line[:32].strip(): line[33:99] for line in lines[2:] if line.startswith("iter-")}
    update, ahead = bars["iter-0 update-shared"], bars["iter-1 rollouts (ahead)"]
    assert update.index("#") == ahead.index("#") == 12
    assert ahead.rindex("#") < update.rindex("#")  # the collection ended while the update still ran
    assert bars["iter-0 report"].strip() == "*"  # a point: the report commits at once
    assert "iter-0: rollouts of iter-1 collected ahead in 18.0 s, 18.0 s of it beside the update (28.0 s)" in lines
    assert not any(line.startswith("iter-1: rollouts of") for line in lines)


def test_runs_timeline_cli(fake_run, tmp_path) -> None:
    out = CliRunner().invoke(app, ["runs", "timeline", "fake-async-run", "--root", str(tmp_path)])
    assert out.exit_code == 0, out.output
    assert "iter-1 rollouts (ahead)" in out.output
    missing = CliRunner().invoke(app, ["runs", "timeline", "no-such-run", "--root", str(tmp_path)])
    assert missing.exit_code == 2 and "no run 'no-such-run'" in missing.output
