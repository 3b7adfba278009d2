"""Re-run overrides and the baseline validation, without servers: what is accepted, refused, stored and shown.

The re-run itself (filter, advantages, update on stored rollouts under the overrides) runs end to end in
``test_flows.py``; here are the rules and the records around it.
"""

from __future__ import annotations

import pytest
from rich.console import Console
from typer.testing import CliRunner

from pettingflow.analysis.inspect import show_run
from pettingflow.configs.loader import ConfigError, load_config
from pettingflow.runs.context import IterationContext
from pettingflow.runs.run import (
    RerunOverrideError,
    RunRef,
    load_run_config,
    rerun_config,
    start_or_resume,
)
from pettingflow.storage import RunLayout, StepName


@pytest.fixture
def stored_run(tmp_path) -> RunRef:
    config = load_config("code-env", [f"run.storage_root={tmp_path}"])
    ref, resumed = start_or_resume(config, "code-env", [f"run.storage_root={tmp_path}"], "run-a", {})
    assert not resumed
    return ref


def test_overrides_of_algorithm_training_validation_are_applied_and_diffed(stored_run) -> None:
    overrides = [
        "algorithm.filter_method=std",
        "algorithm.filter_ratio=0.5",
        "training.lr=1e-6",
        "validation.num_tasks=3",
    ]
    config, changes = rerun_config(stored_run, overrides, "filtered")
    assert (config.algorithm.filter_method, config.algorithm.filter_ratio, config.training.lr) == ("std", 0.5, 1e-6)
    assert changes == [
        {"key": "algorithm.filter_method", "old": "dapo", "new": "std"},
        {"key": "algorithm.filter_ratio", "old": 0.0, "new": 0.5},
        {"key": "training.lr", "old": 2e-5, "new": 1e-6},
        {"key": "validation.num_tasks", "old": 30, "new": 3},
    ]
    assert rerun_config(stored_run, [], "update")[1] == []  # no overrides: the run's own config


@pytest.mark.parametrize(
    "override",
    [
        "env.group_size=4",
        "agents.code_generator.sampling.temperature=0.5",
        "policies.0.model=other",
        "rollout.max_concurrent_requests=2",
        "inference.max_model_len=4096",
        "run.seed=3",
        "specialization=lora",
    ],
)
def test_overrides_that_describe_the_stored_trajectories_are_refused(stored_run, override) -> None:
    with pytest.raises(RerunOverrideError) as err:
        rerun_config(stored_run, ["training.lr=1e-6", override], "filtered")
    message = str(err.value)
    assert override.split("=")[0] in message and "training.lr" not in message.split("\n", 1)[1]
    assert "stored trajectories were produced under" in message and "start a new run" in message
    assert "algorithm.*, training.*, validation.*" in message


def test_an_override_the_reused_steps_already_applied_is_refused(stored_run) -> None:
    with pytest.raises(
        RerunOverrideError, match=r"algorithm\.filter_method: read by the 'filtered' step.*--from-step filtered"
    ):
        rerun_config(stored_run, ["algorithm.filter_method=std"], "advantages")
    with pytest.raises(RerunOverrideError, match=r"--from-step advantages"):
        rerun_config(stored_run, ["algorithm.advantage_estimator=rloo"], "update")
    assert rerun_config(stored_run, ["algorithm.advantage_estimator=rloo"], "advantages")[0]
    with pytest.raises(RerunOverrideError, match="reuses the stored rollouts"):
        rerun_config(stored_run, [], "rollouts")


def test_invalid_override_values_are_config_errors(stored_run) -> None:
    with pytest.raises(ConfigError, match=r"training\.lr"):
        rerun_config(stored_run, ["training.lr=-1"], "filtered")
    with pytest.raises(ConfigError, match=r"algorithm\.filter_methd"):
        rerun_config(stored_run, ["algorithm.filter_methd=std"], "filtered")


def test_an_attempt_reads_its_own_stored_config_and_runs_show_prints_the_diff(stored_run) -> None:
    layout = stored_run.layout()
    config, changes = rerun_config(stored_run, ["training.lr=1e-6"], "filtered")
    layout.write_attempt_info(0, 1, {"from_step": "filtered", "config_changes": changes, "config": config.model_dump()})
    assert layout.attempts(0) == [0, 1] and layout.next_attempt(0) == 2  # attempt.json reserves the number
    assert load_run_config(stored_run, 0, 1).training.lr == 1e-6
    assert load_run_config(stored_run, 0, 0).training.lr == 2e-5  # the original attempt: run.json
    assert load_run_config(stored_run).training.lr == 2e-5
    console = Console(record=True, width=200)
    show_run(layout, console)
    assert "attempt 1 (from filtered, no report): training.lr: 2e-05 -> 1e-06" in console.export_text()

    # with both reports committed, the headline metrics of each attempt stand side by side
    for attempt, loss in ((None, 0.25), (1, 0.125)):
        report = layout.step(0, "report", attempt=attempt).begin()
        report.write_json("metrics.json", {"update/shared/loss": loss, "rollout/reward_mean": 0.5, "other": 1.0})
        report.commit()
    console = Console(record=True, width=200)
    show_run(layout, console)
    text = console.export_text()
    assert "metrics by attempt" in text and "attempt 0 (original)" in text and "attempt 1" in text
    row = next(line for line in text.splitlines() if "update/shared/loss" in line)
    assert "0.2500" in row and "0.1250" in row and "other" not in text


def test_a_run_stored_before_a_setting_existed_still_resumes(tmp_path) -> None:
    """A new field with a default (validation.at_start) must not make every older run.json a mismatch."""
    config = load_config("code-env", [f"run.storage_root={tmp_path}"])
    layout = RunLayout(str(tmp_path), "run-old")
    stored = config.model_dump(mode="json")
    del stored["validation"]["at_start"]
    layout.write_run_info({"run_id": "run-old", "config": stored, "overrides": []})
    _, resumed = start_or_resume(config, "code-env", [], "run-old", {})
    assert resumed


def test_the_baseline_belongs_to_the_run_not_to_an_attempt(tmp_path) -> None:
    layout = RunLayout(str(tmp_path), "run-b")
    original = IterationContext(layout, 0)
    rerun = IterationContext(layout, 0, attempt=2, from_step="filtered")
    assert (
        original.step(StepName.BASELINE).path
        == rerun.step(StepName.BASELINE).path
        == f"{tmp_path}/runs/run-b/iter-0/baseline"
    )
    assert rerun.step("filtered").path.endswith("iter-0/attempt-2/filtered")


def test_baseline_is_due_once_at_the_start_unless_validation_is_off() -> None:
    from pettingflow.flows.iteration import baseline_due

    config = load_config("code-env")
    assert config.validation.at_start
    assert baseline_due(config, 0, 0)
    assert not baseline_due(config, 1, 0) and not baseline_due(config, 0, 1)  # later iterations, re-runs
    assert not baseline_due(load_config("code-env", ["validation.at_start=false"]), 0, 0)
    assert not baseline_due(load_config("code-env", ["validation.frequency=0"]), 0, 0)


def test_baseline_metrics_are_reported_and_start_the_validation_curve() -> None:
    from pettingflow.steps.report import curve_png, iteration_metrics

    scored = {"agents": {"code_generator": {"success_rate": 0.25, "reward_mean": 0.5}}}
    after = {"agents": {"code_generator": {"success_rate": 0.5, "reward_mean": 0.75}}}
    flat = iteration_metrics({"baseline": {"metrics": scored}, "validation": {"metrics": after}}, {})
    assert flat["baseline/code_generator/success_rate"] == 0.25
    assert flat["validation/code_generator/success_rate"] == 0.5
    png = curve_png([{"iteration": 0, **flat}, {"iteration": 1, "validation/code_generator/success_rate": 0.75}])
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_rerun_refuses_an_env_override_before_starting_anything(stored_run) -> None:
    from pettingflow.cli import app

    result = CliRunner().invoke(
        app, ["rerun", "run-a", "--iteration", "0", "--root", stored_run.root, "training.lr=1e-6", "env.group_size=4"]
    )
    assert result.exit_code == 2, result.output
    assert "env.group_size" in result.output and "start a new run" in result.output
    assert stored_run.layout().attempts(0) == [0]  # nothing was written


def test_validation_is_periodic_or_only_after_the_last_iteration() -> None:
    from pettingflow.flows.iteration import validation_due

    assert [k for k in range(5) if validation_due(2, k, 5)] == [0, 2, 4]
    assert [k for k in range(6) if validation_due(4, k, 6)] == [0, 4, 5]  # and the last one
    assert [k for k in range(5) if validation_due(1, k, 5, "end")] == [4]
    assert not any(validation_due(0, k, 5, "end") for k in range(5))  # frequency 0: never
    assert load_config("code-env").validation.schedule == "end"  # the default run: base weights -> last weights


def test_a_rerun_is_its_own_tensorboard_run_beside_the_original(tmp_path) -> None:
    """Attempt 0 writes the run's curve; a re-run of iteration 1 writes the same tags at step 1 in its own run
    folder (iter-1-attempt-1), so TensorBoard shows both and the original curve is left as it was."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from pettingflow.steps.report import log_metrics, tensorboard_dir

    layout = RunLayout(str(tmp_path), "run-tb")
    log_metrics(layout, 0, {"update/shared/loss": 0.5}, None)
    log_metrics(layout, 1, {"update/shared/loss": 0.25}, None)
    log_metrics(layout, 1, {"update/shared/loss": 0.125}, None, attempt=1)

    def scalars(folder) -> list[tuple[int, float]]:
        events = EventAccumulator(str(folder))
        events.Reload()
        return [(e.step, e.value) for e in events.Scalars("update/shared/loss")]

    assert scalars(tensorboard_dir(layout)) == [(0, 0.5), (1, 0.25)]
    assert scalars(tensorboard_dir(layout) / "iter-1-attempt-1") == [(1, 0.125)]


def test_trajectories_episode_prints_one_episode_turn_by_turn_in_full(tmp_path) -> None:
    """`pettingflow trajectories episode RUN -k K -e N`: every turn of episode N in order, with the whole prompt and
    response (no cut), reward, tokens and episode info; from the advantages step each row's advantage; an unknown
    episode fails naming the ones there are."""
    import json as json_module

    import pyarrow as pa
    from factories import trajectory_row
    from typer.testing import CliRunner

    from pettingflow.cli import app
    from pettingflow.storage import trajectories_to_table, write_trajectories

    layout = RunLayout(str(tmp_path), "run-ep")
    long_answer = "def f(x):\n" + "    x += 1\n" * 40 + "    return x"
    info = json_module.dumps({"team_reward": 1.0, "turn": {"tests_passed": 3}})
    rows = [
        trajectory_row(
            rollout_idx=1,
            sample_idx=1,
            turn_idx=1,
            agent_idx=1,
            agent_name="tester",
            reward=0.5,
            prompt_text="tests for f?",
            prefill="assert f(",  # written by the prompt; the model wrote the rest
            response_text="1) == 2",
            info_json=info,
        ),
        trajectory_row(
            rollout_idx=1, sample_idx=1, turn_idx=0, prompt_text="write f", response_text=long_answer, info_json=info
        ),
        trajectory_row(rollout_idx=0, prompt_text="other episode", response_text="nope"),
    ]
    write_trajectories(layout.step(0, "rollouts").begin(), rows)
    batch = layout.step(0, "advantages").begin()
    table = trajectories_to_table(rows).append_column("advantage", pa.array([0.25, -0.75, 0.0], pa.float32()))
    batch.write_table("batch-shared.parquet", table)
    batch.commit()

    runner = CliRunner()
    shown = runner.invoke(app, ["trajectories", "episode", "run-ep", "-k", "0", "-e", "1", "--root", str(tmp_path)])
    assert shown.exit_code == 0, shown.output
    out = shown.output
    assert out.index("turn 0 · code_generator") < out.index("turn 1 · tester")  # in turn order
    assert long_answer in out and "write f" in out and "other episode" not in out
    assert 'episode info: {"team_reward": 1.0}' in out and 'turn info: {"tests_passed": 3}' in out
    assert "reward 0.500" in out and "tokens 3 model / 1 env" in out
    # the prefill, marked, before the model's reply: the reply as the tester's parse_response read it
    assert "[prefill: written by the prompt, not trained]\nassert f(\n[response]\n1) == 2" in out
    quiet = runner.invoke(
        app, ["trajectories", "episode", "run-ep", "-e", "1", "--no-prompts", "--root", str(tmp_path)]
    )
    assert "write f" not in quiet.output and long_answer in quiet.output
    advantages = runner.invoke(
        app, ["trajectories", "episode", "run-ep", "-e", "1", "--step", "advantages", "--root", str(tmp_path)]
    )
    assert "advantage -0.750" in advantages.output and "advantage +0.250" in advantages.output
    missing = runner.invoke(app, ["trajectories", "episode", "run-ep", "-e", "7", "--root", str(tmp_path)])
    assert missing.exit_code == 2 and "no episode 7" in missing.output and "[0, 1]" in missing.output
