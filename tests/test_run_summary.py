"""The run summary (``make run``'s last lines, the run's last artifact): honest about what a short run shows."""

from __future__ import annotations

import pytest

from pettingflow.analysis.summary import HeldOut, IterationLine, RunSummary, summary_lines, summary_markdown, verdict


def _summary(ci: tuple[float, float], zero: list[str] | None = None) -> RunSummary:
    lines = [
        IterationLine(0, {"code_generator": 0.3, "test_generator": 0.1}, {"code_generator": 0.25}, 3000, 96),
        IterationLine(1, {"code_generator": 0.5, "test_generator": 0.2}, {"code_generator": 0.5}, 2900, 0, zero or []),
    ]
    held = HeldOut("code_generator", 0.3, 0.45, 1, 0.15, ci, 30, 60)
    warnings = ["iteration 1: no learning signal for policy 'shared': ..."] if zero else []
    phases = {"rollouts": 200.0, "update": 100.0, "validation": 60.0, "other": 5.0}
    return RunSummary("run-x", lines, held, None, 5900, phases, 365.0, warnings)


def test_an_interval_above_zero_says_it_rose_and_one_across_zero_says_a_short_run_cannot_tell():
    assert verdict(_summary((0.05, 0.25)).heldout).startswith("held-out success rose")
    assert verdict(_summary((-0.2, -0.01)).heldout).startswith("held-out success fell")
    assert "cannot tell" in verdict(_summary((-0.05, 0.3)).heldout)


def test_the_lines_carry_rewards_per_iteration_heldout_tokens_and_phases():
    text = "\n".join(summary_lines(_summary((0.05, 0.25))))
    assert "iter 0: code_generator 0.300 (25%)  test_generator 0.100" in text and "rows trained 96" in text
    assert "30.0% before -> 45.0% after iteration 1, change +15.0 pts (95 % CI [+5.0, +25.0])" in text
    assert "tokens generated in training: 5,900" in text
    assert "rollouts 200 s" in text and "update 100 s" in text and "weight sync" not in text  # 0 s phases left out
    assert "NO LEARNING SIGNAL" not in text and "warning" not in text


def test_an_iteration_without_signal_is_marked_and_warned_about():
    summary = _summary((0.05, 0.25), zero=["shared"])
    text = "\n".join(summary_lines(summary))
    assert "iter 1: " in text and "NO LEARNING SIGNAL (shared)" in text
    assert text.rstrip().endswith("iteration 1: no learning signal for policy 'shared': ...")
    assert summary_markdown(summary).startswith("# Run summary: run-x")


def test_a_run_without_baseline_says_why_there_is_no_heldout_change():
    summary = _summary((0.0, 0.0))
    summary.heldout, summary.heldout_missing = None, "no baseline (validation.at_start is off)"
    assert "held-out success: not measured (no baseline (validation.at_start is off))" in summary_lines(summary)[4]


def test_a_run_stored_with_the_old_metric_names_reads_under_the_step_names(tmp_path) -> None:
    """Reports written before the metric families took the step names (rollout/, filter/, signal/) still
    summarize: their rewards, tokens, rows and zero-signal flags are read as rollouts/, filtered/, advantages/."""
    from pettingflow.analysis.summary import summarize_run
    from pettingflow.steps.report import current_names, history
    from pettingflow.storage import RunLayout

    layout = RunLayout(str(tmp_path), "run-old")
    old = {
        "rollout/code_generator/reward_mean": 0.5,
        "rollout/code_generator/success_rate": 0.25,
        "rollout/tokens_generated": 1200.0,
        "filter/rows_kept": 12.0,
        "signal/shared/zero_signal": 1.0,
        "update/shared/loss": 0.1,
    }
    report = layout.step(0, "report").begin()
    report.write_json("metrics.json", old)
    report.commit()
    assert history(layout)[0] == {"iteration": 0, **current_names(old)}
    assert set(current_names(old)) == {
        "rollouts/code_generator/reward_mean",
        "rollouts/code_generator/success_rate",
        "rollouts/tokens_generated",
        "filtered/rows_kept",
        "advantages/shared/zero_signal",
        "update/shared/loss",
    }
    line = summarize_run(layout).iterations[0]
    assert (line.rewards, line.success, line.tokens, line.rows_trained) == (
        {"code_generator": 0.5},
        {"code_generator": 0.25},
        1200,
        12,
    )
    assert line.zero_signal == ["shared"]


def test_a_role_rewarded_through_the_team_shows_what_it_was_trained_on() -> None:
    summary = _summary((0.05, 0.25))
    summary.iterations[0].credited = {"test_generator": 0.42}
    text = "\n".join(summary_lines(summary))
    assert "test_generator 0.100 (nan%) trained on 0.420" in text


def test_heldout_success_counts_every_asked_episode_and_the_same_tasks_before_and_after(tmp_path) -> None:
    """Episodes that ended before the code writer's turn, or left no row, are its failures; the counts add up."""
    import pyarrow as pa
    from factories import trajectory_row

    from pettingflow.analysis.summary import summarize_run
    from pettingflow.configs.loader import load_config
    from pettingflow.runs.run import start_or_resume
    from pettingflow.storage import trajectories_to_table, write_trajectories

    overrides = [f"run.storage_root={tmp_path}"]
    ref, _ = start_or_resume(load_config("code-env", overrides), "code-env", overrides, "run-sum", {})
    layout = ref.layout()

    def row(task: int, sample: int, agent: str, success: bool, **kw) -> dict:
        return trajectory_row(
            env_idx=task,
            sample_idx=sample,
            rollout_idx=2 * task + sample,
            agent_name=agent,
            agent_idx=int(agent != "code_generator"),
            success=success,
            reward=float(success),
            **kw,
        )

    # before: the coder solved 1 of 6 (task 0 sample 1 ended before its turn, task 2 left no row)
    before = [
        row(0, 0, "code_generator", True),
        row(0, 1, "test_generator", False, outcome="failed"),
        row(1, 0, "code_generator", False, outcome="max_turns"),
        row(1, 1, "code_generator", False, outcome="max_turns"),
    ]
    after = [row(0, 0, "code_generator", True), row(0, 1, "code_generator", True), row(1, 0, "code_generator", True)]
    after += [row(2, s, "code_generator", False, outcome="max_turns") for s in (0, 1)]
    asked = {"tasks": ["a", "b", "c"], "samples_per_task": 2}
    write_trajectories(layout.step(0, "baseline").begin(), before, metadata=asked)
    write_trajectories(layout.step(0, "validation").begin(), after, metadata=asked)
    batch = trajectories_to_table([row(0, 0, "code_generator", True), row(0, 1, "test_generator", False)])
    batch = batch.append_column("training_reward", pa.array([1.0, 0.6], pa.float32()))
    advantages = layout.step(0, "advantages").begin()
    advantages.write_table("batch-shared.parquet", batch)
    advantages.commit()
    report = layout.step(0, "report").begin()
    report.write_json("metrics.json", {"rollouts/test_generator/reward_mean": 0.0})
    report.commit()

    summary = summarize_run(layout)
    held = summary.heldout
    assert held is not None and (held.before, held.after) == (1 / 6, 3 / 6)
    assert (held.tasks, held.episodes) == (3, 6)  # the same three tasks on both sides
    counts = held.counts_before
    assert counts.episodes == sum(counts.outcomes.values()) == counts.agent_acted + counts.ended_before_agent == 6
    assert counts.outcomes == {"solved": 1, "failed": 1, "max_turns": 2, "no_rows": 2}
    assert counts.ended_before_agent == 3
    assert summary.iterations[0].credited == {"code_generator": 1.0, "test_generator": pytest.approx(0.6)}
    text = "\n".join(summary_lines(summary))
    assert "held-out success of code_generator (3 tasks, 6 episodes): 16.7% before -> 50.0% after" in text
    assert (
        "held-out episodes before: 3 tasks x 2 samples = 6 episodes (1 solved, 1 failed, 2 ended at max turns, "
        "2 left no rows); 3 ended before code_generator's turn, counted as failures"
    ) in text
