"""The refactor-equality check (``run_outputs.check_against_golden``) can fail on the bugs it is there for: a
metric the old substring filter dropped, a float off in its sixth digit, a missing or new metric, and a rewrite of
the record never passes for a check. Runs on the stored record alone (no run needed)."""

from __future__ import annotations

import copy
import json

import pytest
import run_outputs


@pytest.fixture
def golden(monkeypatch) -> dict:
    """The stored record as a run's outputs (without its own key), checked on the kernels that wrote it."""
    record = json.loads(run_outputs.GOLDEN.read_text())
    written = record.pop(run_outputs.META)["cpu_capability"]
    monkeypatch.setattr(run_outputs, "cpu_capability", lambda: written)
    return record


def test_the_record_equals_itself(golden) -> None:
    run_outputs.check_against_golden(copy.deepcopy(golden))


@pytest.mark.parametrize(
    ("key", "change"),
    [
        ("update/shared/optimizer_steps", lambda v: v + 1),  # dropped by the old filter ("_s")
        ("update/shared/global_step", lambda v: v + 2),  # dropped by the old filter ("_s")
        ("update/shared/rows_skipped_zero_advantage", lambda v: v + 1),  # dropped by the old filter ("_s")
        ("advantages/shared/zero_signal", lambda v: v + 1),  # dropped by the old filter ("_s")
        ("update/shared/learner_starts", lambda v: v + 1),  # dropped by the old filter ("learner_")
        ("update/shared/grad_norm", lambda v: v * (1 + 1e-6)),  # passed the old 1 % tolerance
    ],
)
def test_a_changed_metric_fails_the_check(golden, key: str, change) -> None:
    planted = copy.deepcopy(golden)
    planted["iter-1"]["metrics"][key] = change(planted["iter-1"]["metrics"][key])
    with pytest.raises(AssertionError, match=f"iter-1 metrics differ .*'{key}'"):
        run_outputs.check_against_golden(planted)


def test_a_missing_or_new_metric_fails_the_check(golden) -> None:
    missing = copy.deepcopy(golden)
    del missing["iter-0"]["metrics"]["update/shared/loss"]
    with pytest.raises(AssertionError, match="update/shared/loss"):
        run_outputs.check_against_golden(missing)
    new = copy.deepcopy(golden)
    new["iter-0"]["metrics"]["update/shared/something_new"] = 1.0
    with pytest.raises(AssertionError, match=r"new keys: \['update/shared/something_new'\]"):
        run_outputs.check_against_golden(new)


def test_volatile_metrics_are_named_not_matched(golden) -> None:
    """Only times, rates and memory are left out, by exact name: no compared metric is in the volatile set."""
    volatile = run_outputs.volatile_metrics(["shared"])
    assert "update/shared/wall_s" in volatile and "duration/update-shared_s" in volatile
    for record in golden.values():
        assert not volatile & set(record["metrics"])


def test_rewriting_the_record_fails_the_test(golden, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PETTINGFLOW_WRITE_OUTPUTS", "1")
    monkeypatch.setattr(run_outputs, "GOLDEN", tmp_path / "record.json")
    with pytest.raises(pytest.fail.Exception, match=r"rewrote .* run the test again without the flag"):
        run_outputs.check_against_golden(golden)
    written = json.loads((tmp_path / "record.json").read_text())
    assert written.pop(run_outputs.META) and written == golden


@pytest.mark.parametrize(
    ("factor", "passes"),
    [(1 + 1e-5, True), (1 + 1e-3, False)],  # the gap AVX2 vs AVX-512 kernels made: 1.6e-5 at most
)
def test_other_kernels_allow_their_measured_rounding_and_no_more(golden, monkeypatch, factor, passes) -> None:
    monkeypatch.setattr(run_outputs, "cpu_capability", lambda: "SOME_OTHER_KERNELS")
    planted = copy.deepcopy(golden)
    planted["iter-1"]["metrics"]["update/shared/grad_norm"] *= factor
    if passes:
        run_outputs.check_against_golden(planted)
    else:
        with pytest.raises(AssertionError, match="update/shared/grad_norm"):
            run_outputs.check_against_golden(planted)


def test_a_rewritten_record_says_which_kernels_wrote_it(golden, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PETTINGFLOW_WRITE_OUTPUTS", "1")
    monkeypatch.setattr(run_outputs, "GOLDEN", tmp_path / "record.json")
    with pytest.raises(pytest.fail.Exception):
        run_outputs.check_against_golden(golden)
    written = json.loads((tmp_path / "record.json").read_text())
    assert written.pop(run_outputs.META) == {"cpu_capability": run_outputs.cpu_capability()}
