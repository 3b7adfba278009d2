"""The iteration's pipeline (``tasks/pipeline.py``): one definition per step, from which the order, the Prefect
tasks, their names and the resume points are derived."""

from __future__ import annotations

import pytest

from pettingflow.configs import load_config
from pettingflow.flows.iteration import step_runs
from pettingflow.runs.context import STEP_ORDER, IterationContext
from pettingflow.storage import RunLayout, StepName
from pettingflow.storage.layout import step_kind
from pettingflow.tasks.pipeline import PIPELINE, STEPS, TASKS, task_run_name


def test_the_pipeline_runs_the_steps_in_the_order_of_their_names_and_each_has_its_task() -> None:
    assert [step.name for step in PIPELINE] == list(StepName)
    assert tuple(StepName)[1:] == STEP_ORDER  # the baseline is the run's, not an attempt's
    for step in PIPELINE:
        assert TASKS[step.name].name == str(step.name)  # the UI shows the step's own name
        assert TASKS[step.name].retries == len(step.retry_delays_s)
        order = list(StepName)
        assert all(order.index(read) < order.index(step.name) for read in step.reads), step.name
    assert [s.name for s in PIPELINE if s.per_policy] == [StepName.UPDATE]
    assert task_run_name(StepName.UPDATE, 3, "shared") == "update[shared]"
    assert task_run_name(StepName.ROLLOUTS, 4, ahead=True) == "rollouts[iter-4, ahead]"


def test_folders_map_back_to_their_step() -> None:
    assert StepName.UPDATE.folder("coder") == "update-coder" and step_kind("update-coder") is StepName.UPDATE
    assert step_kind("optimizer-coder") is StepName.UPDATE and step_kind("sync") is StepName.SYNC
    with pytest.raises(ValueError, match="per policy"):
        StepName.UPDATE.folder()
    with pytest.raises(ValueError, match=r"unknown step 'collect'.*steps are baseline, rollouts"):
        step_kind("collect")


@pytest.mark.parametrize(
    ("attempt", "from_step", "validate_now", "servers", "expected"),
    [
        # a run's first iteration: every step, the baseline first
        (0, "rollouts", True, True, list(StepName)[:-1]),
        # no validation due: sync still runs (the next rollouts sample the new weights), validation does not
        (0, "rollouts", False, True, [s for s in list(StepName)[:-1] if s is not StepName.VALIDATION]),
        # a re-run from the filter, without servers: its own filter, advantages and update, read the rest
        (1, "filtered", False, False, [StepName.FILTERED, StepName.ADVANTAGES, StepName.UPDATE]),
        # a re-run from the update that validates: servers for sync and validation
        (1, "update-shared", True, True, [StepName.UPDATE, StepName.SYNC, StepName.VALIDATION]),
    ],
)
def test_which_steps_an_attempt_runs(tmp_path, attempt, from_step, validate_now, servers, expected) -> None:
    config = load_config("code-env", [f"run.storage_root={tmp_path}"])
    ctx = IterationContext(RunLayout(str(tmp_path), "run"), 0, attempt, from_step)
    ran = [s.name for s in PIPELINE[:-1] if step_runs(s, ctx, config, validate_now, servers)]
    assert ran == expected
    assert STEPS[StepName.REPORT].reads[-1] is StepName.VALIDATION
