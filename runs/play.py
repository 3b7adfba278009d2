"""``pettingflow play``: one episode of a team on one task, the quickest way to see what training changed.

The episode runs through ``runs.evaluation.evaluate_weights`` (the validation step, one sample of one task), so it
is stored as an evaluation run like any other (``trajectories episode`` and the viewer show it) and printed with
``analysis.inspect.episode_text``, the printout of stored episodes: every turn's agent, reward, the sandbox's
verdicts (the turn info), prompt and response.
"""

from __future__ import annotations

import json
from typing import Any

from pettingflow.configs.settings import ExperimentConfig
from pettingflow.runs.evaluation import Weights, evaluate_weights
from pettingflow.storage import RunLayout
from pettingflow.storage.layout import StepName

PLAY_OVERRIDES = ["validation.samples_per_task=1"]  # one episode


class TaskError(ValueError):
    """``--task`` names no task of the config's dataset, or ``--task-json`` is no valid task; one line says which."""


def find_task(config: ExperimentConfig, wanted: str) -> dict[str, Any]:
    """The task whose id is ``wanted``, from every task of the config's dataset (held-out and train)."""
    from pettingflow.envs import load_tasks
    from pettingflow.steps.rollouts import task_id

    split = load_tasks(config.env.dataset, config.env.class_path)
    tasks = [*split.validation, *split.train]
    for i, task in enumerate(tasks):
        if task_id(task, i) == wanted:
            return task
    shown = ", ".join(task_id(t, i) for i, t in enumerate(tasks[:8]))
    raise TaskError(
        f"--task {wanted!r}: no such task in {config.env.dataset.source} ({len(tasks)} tasks, e.g. {shown}); "
        "or give one with --task-json"
    )


def task_from_json(config: ExperimentConfig, text: str) -> dict[str, Any]:
    """A task given as one JSON object, checked as a task file row is (``envs.humaneval.tasks_of_rows``)."""
    from pettingflow.envs.humaneval import tasks_of_rows
    from pettingflow.envs.task_files import RawRows

    try:
        row = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TaskError(f"--task-json is not JSON ({exc.msg} at character {exc.pos})") from None
    if not isinstance(row, dict):
        raise TaskError(f"--task-json must be one JSON object (a task file's row), got {type(row).__name__}")
    try:
        (task,) = tasks_of_rows(RawRows([row], ["line 1"], columnar=False), config.env.class_path, "the task")
    except ValueError as exc:  # TaskFileError: the row's fields
        raise TaskError(f"--task-json: {exc}") from None
    return task


def play(
    config: ExperimentConfig,
    config_name: str,
    overrides: list[str],
    weights: Weights,
    task: dict[str, Any],
    prompts: bool = True,
) -> tuple[RunLayout, list[str]]:
    """Run one episode of ``task`` with ``weights``; returns the evaluation run and its turn-by-turn printout."""
    from pettingflow.analysis.inspect import episode_text
    from pettingflow.steps.rollouts import task_id

    one = config.model_copy(update={"validation": config.validation.model_copy(update={"samples_per_task": 1})})
    (done,) = evaluate_weights(
        one, config_name, [*overrides, *PLAY_OVERRIDES], [weights], tasks=[task], extra={"plays": task_id(task, 0)}
    )
    layout = done.ref.layout()
    lines = episode_text(layout, 0, 0, StepName.VALIDATION, prompts)
    lines += [
        "",
        f"stored as {layout.run_id} (weights: {weights.label()}); again: pettingflow trajectories episode "
        f"{layout.run_id} -k 0 -e 0 --step validation; in the viewer: pettingflow trajectories view {layout.run_id}, "
        "then http://127.0.0.1:8765/episode/0/0?step=validation",
    ]
    return layout, lines
