"""A re-run request refused before anything starts, and a re-run that leaves the original as it was in the UI.

Fast: a stored run of committed step folders (no servers, no training). The flow-level checks use the session's
Prefect test server (``prefect_env``) with the ``iteration`` subflow replaced by a stand-in that records its call.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from typer.testing import CliRunner

from pettingflow.configs.loader import load_config
from pettingflow.runs.context import IterationContext
from pettingflow.runs.run import (
    RerunOverrideError,
    RerunRequestError,
    RunRef,
    check_rerun,
    rerun_config,
    start_or_resume,
)
from pettingflow.storage import RunLayout

ORIGINAL_STEPS = ("rollouts", "filtered", "advantages")


def commit_iteration(layout: RunLayout, k: int, steps: tuple[str, ...] = ORIGINAL_STEPS, update: bool = True) -> None:
    """Commit the original attempt's step folders of iteration ``k`` (a marker each; an update holds weights)."""
    for name in steps:
        step = layout.step(k, name).begin()
        step.write_json("metrics.json", {"k": k})
        step.commit()
    if update:
        step = layout.step(k, "update-shared").begin()
        step.write_bytes("model/model.safetensors", b"w%d" % k)
        step.commit({"skipped": False})


@pytest.fixture
def three_iterations(tmp_path) -> RunRef:
    """A run whose iterations 0 and 1 committed every step and whose iteration 2 stopped after ``filtered``."""
    config = load_config("code-env", [f"run.storage_root={tmp_path}"])
    ref, _ = start_or_resume(config, "code-env", [], "run-a", {})
    layout = ref.layout()
    commit_iteration(layout, 0)
    commit_iteration(layout, 1)
    commit_iteration(layout, 2, ("rollouts", "filtered"), update=False)
    return ref


@pytest.mark.parametrize(
    ("iteration", "from_step", "expected"),
    [
        (7, "update", r"run 'run-a' has no iteration 7: it has iterations 0-2"),
        (-1, "update", r"iteration -1 of run 'run-a': iterations are numbered from 0 \(this run has iterations 0-2\)"),
        (2, "update", r"no committed 'advantages' step .* re-run with --from-step advantages"),
        (1, "sideways", r"--from-step 'sideways': no such step; a re-run starts from filtered, advantages or update"),
        (1, "rollouts", r"--from-step 'rollouts': a re-run reuses the stored rollouts"),
    ],
)
def test_a_request_that_cannot_run_is_refused_in_one_line(three_iterations, iteration, from_step, expected) -> None:
    with pytest.raises(RerunRequestError, match=expected) as err:
        check_rerun(three_iterations, iteration, from_step, ["training.lr=1e-6"])
    assert "\n" not in str(err.value)


def test_what_a_request_may_ask_for_is_accepted_with_its_config(three_iterations) -> None:
    config, changes = check_rerun(three_iterations, 2, "advantages", ["training.lr=1e-6"])
    assert config.training.lr == 1e-6 and changes == rerun_config(three_iterations, ["training.lr=1e-6"])[1]
    assert check_rerun(three_iterations, 1, "update-shared")[1] == []  # a policy's update folder names the step
    with pytest.raises(RerunOverrideError, match=r"env\.group_size"):  # the overrides are checked too
        check_rerun(three_iterations, 1, "update", ["env.group_size=4"])
    with pytest.raises(RerunRequestError, match=r"no run 'nope' under .*pettingflow runs list"):
        check_rerun(RunRef(root=three_iterations.root, run_id="nope"), 0)


def test_missing_rollouts_leave_nothing_to_rerun_from(three_iterations) -> None:
    layout = three_iterations.layout()
    layout.step(3, "rollouts").begin()  # the run stopped while collecting iteration 3's rollouts
    with pytest.raises(RerunRequestError, match=r"no committed 'rollouts' step .* nothing to re-run from"):
        check_rerun(three_iterations, 3, "filtered")


def test_pruned_starting_weights_are_refused_and_kept_ones_are_not(three_iterations) -> None:
    from pettingflow.runs.retention import plan_prune, prune

    layout = three_iterations.layout()
    prune(plan_prune(layout, keep_last=1))  # removes the weights after iteration 0, keeps those after 1
    with pytest.raises(
        RerunRequestError,
        match=r"iteration 1 .* policy .shared. after iteration 0, which .pettingflow runs prune. removed",
    ):
        check_rerun(three_iterations, 1, "update")
    assert check_rerun(three_iterations, 0, "update")[1] == []  # iteration 0 starts from the base model
    assert check_rerun(three_iterations, 2, "advantages")[1] == []  # from the kept weights after iteration 1


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["-k", "7"], "has no iteration 7"),
        (["-k", "-1"], "numbered from 0"),
        (["-k", "2", "--from-step", "update"], "no committed 'advantages' step"),
    ],
)
def test_cli_refuses_a_bad_request_with_one_line_and_exit_2_before_any_flow(
    three_iterations, monkeypatch, args, expected
) -> None:
    import pettingflow.flows.rerun as rerun_module
    from pettingflow.cli import app

    def no_flow(**kwargs: Any) -> None:
        raise AssertionError(f"the rerun flow started: {kwargs}")

    monkeypatch.setattr(rerun_module, "rerun", no_flow)
    result = CliRunner().invoke(app, ["rerun", "run-a", *args, "--root", three_iterations.root, "training.lr=1e-6"])
    assert result.exit_code == 2, result.output
    assert expected in result.output and len(result.output.strip().splitlines()) == 1, result.output
    assert three_iterations.layout().attempts(2) == [0]  # nothing written


def test_flow_run_names_carry_the_attempt() -> None:
    from pettingflow.flows.iteration import iteration_run_name
    from pettingflow.flows.rerun import rerun_run_name

    assert iteration_run_name("run-a", 1) == "run-a iter-1"  # the original
    assert iteration_run_name("run-a", 1, 2) == "run-a iter-1/attempt-2"
    assert rerun_run_name("run-a", 1, 2, "update") == "rerun run-a iter-1/attempt-2 from update"


class Recorder:
    """Stands in for Prefect's artifact functions and run logger: what a report published and logged."""

    def __init__(self) -> None:
        self.artifacts: list[str] = []
        self.lines: list[str] = []
        self.curves: dict[str, list[dict[str, Any]]] = {}
        self._points: list[dict[str, Any]] = []

    def artifact(self, **kwargs: Any) -> None:
        self.artifacts.append(kwargs["key"])
        if kwargs["key"].endswith("-curve"):
            self.curves[kwargs["key"]] = self._points

    def curve_png(self, points: list[dict[str, Any]]) -> bytes:
        self._points = points
        return b"png"

    def logger(self) -> logging.LoggerAdapter:
        recorder = self

        class Lines(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                recorder.lines.append(record.getMessage())

        log = logging.getLogger(f"test-report-{id(self)}")
        log.handlers, log.propagate, log.level = [Lines()], False, logging.INFO
        return logging.LoggerAdapter(log, {})


def test_reruns_publish_their_own_curve_and_never_the_original_one(three_iterations, monkeypatch) -> None:
    """Two re-runs of iteration 1 after the original's three reports: the run-wide curve stays the original's
    (every iteration), each re-run publishes a curve of its own with every original point plus its scores, and
    its log line says what was re-run and with which overrides."""
    from pettingflow.steps import report as report_step
    from pettingflow.tasks import report as report_task
    from pettingflow.tasks.pipeline import StepCall

    recorder = Recorder()
    for name in ("create_markdown_artifact", "create_table_artifact", "create_link_artifact"):
        monkeypatch.setattr(report_task, name, recorder.artifact)
    monkeypatch.setattr(report_task, "get_run_logger", recorder.logger)
    monkeypatch.setattr(report_step, "curve_png", recorder.curve_png)
    monkeypatch.setattr(report_step, "log_metrics", lambda *args, **kwargs: None)  # TensorBoard: tested elsewhere

    layout = three_iterations.layout()
    config = load_config("code-env")

    def scores(value: float) -> dict[str, Any]:
        return {"metrics": {"agents": {"code_generator": {"reward_mean": value, "success_rate": value}}}}

    for k in range(3):
        outcomes = {"rollouts": scores(0.1 * (k + 1)), "update-shared": {"metrics": {"metrics": {"loss": 1.0}}}}
        report_task.publish_report(StepCall(IterationContext(layout, k), config, outcomes=outcomes))
    original_curve = recorder.curves["run-a-curve"]
    assert [p["iteration"] for p in original_curve] == [0, 1, 2]

    for attempt, lr in ((1, "1e-6"), (2, "5e-6")):
        rerun_cfg, changes = rerun_config(three_iterations, [f"training.lr={lr}"], "update")
        info = {"from_step": "update", "overrides": [f"training.lr={lr}"], "config_changes": changes}
        layout.write_attempt_info(1, attempt, {**info, "config": rerun_cfg.model_dump(mode="json")})
        outcomes = {
            "update-shared": {"metrics": {"metrics": {"loss": 0.25 * attempt, "grad_norm": 2.0}}},
            "validation": scores(0.5 + attempt / 10),
        }
        ctx = IterationContext(layout, 1, attempt=attempt, from_step="update")
        report_task.publish_report(StepCall(ctx, rerun_cfg, outcomes=outcomes))

    curves = [key for key in recorder.artifacts if key.endswith("-curve")]
    assert curves == ["run-a-curve"] * 3 + ["run-a-iter-1-attempt-1-curve", "run-a-iter-1-attempt-2-curve"]
    assert recorder.curves["run-a-curve"] is original_curve  # no re-run replaced it
    second = recorder.curves["run-a-iter-1-attempt-2-curve"]
    assert [p["iteration"] for p in second] == [0, 1, 1, 2]  # every original point, and the re-run's
    assert second[1]["rollouts/code_generator/reward_mean"] == pytest.approx(0.2)  # the original's iteration 1
    assert second[2] == {"iteration": 1, "validation/code_generator attempt-2/success_rate": pytest.approx(0.7)} | {
        "validation/code_generator attempt-2/reward_mean": pytest.approx(0.7)
    }
    assert recorder.lines[-1].startswith(
        "re-run of iteration 1 as attempt 2, from 'update', overrides: training.lr=5e-6:"
    )
    assert (
        "update/shared/loss 0.5" in recorder.lines[-1]
        and "validation/code_generator/success_rate 0.7" in (recorder.lines[-1])
    )
    assert recorder.lines[0].startswith("iteration 0: rollouts/code_generator/success_rate 0.1")


def test_report_line_of_a_rerun_without_overrides_says_so() -> None:
    from pettingflow.tasks.report import report_line

    line = report_line(3, 1, {"update/shared/loss": 0.125, "update/shared/kl": 1.0}, {"from_step": "filtered"})
    assert line == "re-run of iteration 3 as attempt 1, from 'filtered', overrides: none (the run's own config): " + (
        "update/shared/loss 0.125"
    )


def test_the_flow_refuses_a_bad_request_in_one_line_before_any_task(three_iterations, prefect_env) -> None:
    """The deployment path: a flow run that cannot be refused before it exists fails at once, its state message one
    line, with no task run and nothing written; called in-process, it raises the refusal."""
    from pettingflow.flows.rerun import rerun

    state = rerun(run_id="run-a", iteration=7, root=three_iterations.root, from_step="update", return_state=True)
    assert state.is_failed()
    assert state.message == "re-run refused: run 'run-a' has no iteration 7: it has iterations 0-2"
    assert task_runs_of(state.state_details.flow_run_id) == []
    with pytest.raises(RerunRequestError, match="no committed 'advantages' step"):
        rerun(run_id="run-a", iteration=2, root=three_iterations.root, from_step="update")
    assert three_iterations.layout().attempts(2) == [0]


def task_runs_of(flow_run_id: Any) -> list[str]:
    """The names of the task runs of a flow run, from the Prefect API."""
    import asyncio

    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter

    async def read() -> list[str]:
        async with get_client() as client:
            runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [flow_run_id]}))
            return [run.name for run in runs]

    return asyncio.run(read())


def flow_run_names(flow_run_id: Any) -> list[str]:
    """The name of a flow run, then those of its subflow runs, from the Prefect API."""
    import asyncio

    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    async def read() -> list[str]:
        async with get_client() as client:
            parent = await client.read_flow_run(flow_run_id)
            children = await client.read_flow_runs(
                flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id]))
            )
            return [parent.name, *sorted(c.name for c in children)]

    return asyncio.run(read())


def test_a_refusal_listing_several_problems_becomes_one_line(three_iterations) -> None:
    from pettingflow.flows.rerun import one_line

    with pytest.raises(RerunOverrideError) as err:
        check_rerun(three_iterations, 1, "update", ["env.group_size=4", "run.seed=3"])
    assert str(err.value).count("\n") == 2  # the CLI prints one problem per line
    line = one_line(err.value)
    assert "\n" not in line and line.startswith("refused re-run overrides of run 'run-a'")
    assert "them; run.seed: the stored" in line and line.index("env.group_size") < line.index("run.seed")


def test_report_line_of_an_iteration_says_how_its_episodes_ended() -> None:
    from pettingflow.tasks.report import report_line

    metrics = {
        "rollouts/code_generator/success_rate": 0.25,
        "rollouts/outcomes/solved": 2.0,
        "rollouts/outcomes/max_turns": 6.0,
        "rollouts/code_generator/reward_mean": 0.5,
    }
    line = report_line(0, 0, metrics)
    assert line == (
        "iteration 0: rollouts/code_generator/success_rate 0.25, rollouts/outcomes/max_turns 6, "
        "rollouts/outcomes/solved 2"
    )
