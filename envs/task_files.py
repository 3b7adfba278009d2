"""Task files on disk: JSONL, Parquet or a Hugging Face ``datasets`` folder, and env rows.

A task file holds either bare tasks (HumanEval-shaped rows, checked by ``humaneval.validate_tasks``) or
env rows that name their own env (``{"env_class_path", "env_config"?, "task_data"}``), so one
dataset -- and one batch -- can mix envs. Env rows are checked here, when the file is loaded, so a
bad row fails with its file, row and field before any server starts, not in the middle of a rollout.

Columnar formats (Parquet, ``datasets``) store ``env_config`` and ``task_data`` as struct columns whose
fields are the union over all rows; a row gets ``null`` for the fields it did not have. Those nulls are
dropped again on reading (so a code-env row does not get plan-path's ``rows: null``). A value that must
really be ``null`` survives only when the column holds JSON text instead, which is accepted everywhere.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from pettingflow.envs.base import EnvConfigError, TaskDataError
from pettingflow.envs.registry import RegistryError, registered_envs, resolve_env_class

ENV_ROW_KEYS: tuple[str, ...] = ("env_class_path", "env_config", "task_data")
JSONL_SUFFIXES: tuple[str, ...] = (".jsonl", ".jsonl.gz", ".json.gz", ".ndjson")
MAX_REPORTED_ERRORS = 10


class TaskFileError(ValueError):
    """A task file that cannot be read, or whose rows cannot be run (the message says where and how to fix)."""


@dataclass(frozen=True)
class RawRows:
    """Rows as read, each with where it came from (``line 7`` for JSONL, ``row 6`` otherwise)."""

    rows: list[dict[str, Any]]
    where: list[str]
    columnar: bool  # Parquet / datasets: struct columns fill absent fields with null
    columns: list[str] | None = None


def read_rows(path: Path) -> RawRows:
    """The rows of a ``.jsonl``/``.jsonl.gz``/``.ndjson``, ``.parquet`` or ``datasets.save_to_disk`` folder."""
    if not path.exists():
        raise TaskFileError(f"task file {path} does not exist")
    name = path.name.lower()
    if path.is_dir():
        return _read_hf_folder(path)
    if name.endswith(JSONL_SUFFIXES):
        return _read_jsonl(path)
    if name.endswith(".parquet"):
        return _read_parquet(path)
    raise TaskFileError(
        f"task file {path} must end in .jsonl, .jsonl.gz or .parquet, or be a folder written by "
        "datasets' Dataset.save_to_disk"
    )


def is_env_row_file(rows: list[dict[str, Any]]) -> bool:
    """Whether the rows are env rows (any row has one of ``env_class_path``, ``env_config``, ``task_data``)."""
    return any(set(ENV_ROW_KEYS) & set(row) for row in rows)


def validate_env_rows(raw: RawRows, source: str) -> list[dict[str, Any]]:
    """Check env rows and return them normalized: ``{"env_class_path", "env_config"?, "task_data"}``.

    Checks per row: only the three keys; ``env_class_path`` resolves to an ``Env`` class; ``env_config`` (if
    given) validates against that class's ``Config``; ``task_data`` is an object with a ``task_id`` that no other
    row has and passes the class's ``validate_task``. Up to ``MAX_REPORTED_ERRORS`` bad rows are reported at once.
    """
    out: list[dict[str, Any]] = []
    errors: list[str] = []
    first_seen: dict[str, str] = {}
    for row, where in zip(raw.rows, raw.where, strict=True):
        try:
            checked = _check_env_row(row, raw.columnar)
            task_id = str(checked["task_data"]["task_id"])
            if task_id in first_seen:
                raise _RowError(
                    "task_data.task_id",
                    f"{task_id!r} is already used by {first_seen[task_id]}; task ids must be unique in the file",
                )
            first_seen[task_id] = where
            out.append(checked)
        except _RowError as exc:
            errors.append(f"{source}: {where}: field '{exc.field}': {exc}")
            if len(errors) >= MAX_REPORTED_ERRORS:
                errors.append("(stopped after the first bad rows)")
                break
    if errors:
        raise TaskFileError("\n".join(errors) if len(errors) > 1 else errors[0])
    if not out:
        raise TaskFileError(f"{source}: no tasks")
    return out


class _RowError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _check_env_row(row: Mapping[str, Any], columnar: bool) -> dict[str, Any]:
    extra = sorted(set(row) - set(ENV_ROW_KEYS))
    if extra:
        raise _RowError(
            extra[0],
            f"is not an env-row key; a row holds only {list(ENV_ROW_KEYS)}: move task fields into task_data",
        )
    class_path = row.get("env_class_path")
    if not isinstance(class_path, str) or not class_path.strip():
        raise _RowError(
            "env_class_path",
            f"is missing or empty; name the env class: one of {registered_envs()} or 'package.module:Class'",
        )
    try:
        env_cls = resolve_env_class(class_path)
    except RegistryError as exc:
        raise _RowError("env_class_path", str(exc)) from exc

    config_data = _as_object(row.get("env_config"), "env_config", columnar, optional=True)
    try:
        config = env_cls.validate_config(config_data)
    except EnvConfigError as exc:
        raise _config_error(exc, env_cls) from exc

    if "task_data" not in row or row["task_data"] is None:
        raise _RowError("task_data", "is missing; put the task (its task_id and the env's task fields) under task_data")
    task = _as_object(row["task_data"], "task_data", columnar, optional=False)
    task_id = task.get("task_id")
    if isinstance(task_id, bool) or not isinstance(task_id, (str, int)) or not str(task_id).strip():
        raise _RowError(
            "task_data.task_id", "is missing or empty; every task needs a unique id (the held-out split hashes it)"
        )
    try:
        env_cls.validate_task(task, config)
    except TaskDataError as exc:
        raise _RowError(f"task_data.{exc.field}", f"{exc} (for {class_path})") from exc
    except (ValueError, TypeError, KeyError) as exc:
        raise _RowError("task_data", f"{class_path} cannot run this task: {exc}") from exc
    out: dict[str, Any] = {"env_class_path": class_path, "task_data": task}
    if config_data is not None:
        out["env_config"] = config_data
    return out


def _as_object(value: Any, field: str, columnar: bool, *, optional: bool) -> dict[str, Any] | None:
    """A JSON object (or JSON text of one); struct-column nulls dropped for columnar files."""
    if value is None and optional:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise _RowError(field, f"is a string but not JSON: {exc.msg}; give an object") from exc
        columnar = False  # JSON text keeps its nulls
    if not isinstance(value, Mapping):
        raise _RowError(field, f"must be an object (a dict), got {type(value).__name__}")
    return _drop_nulls(value) if columnar else dict(value)


def _drop_nulls(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def _config_error(exc: EnvConfigError, env_cls: type) -> _RowError:
    known = ", ".join(env_cls.Config.model_fields)
    cause = exc.__cause__
    if isinstance(cause, ValidationError) and cause.errors():
        err = cause.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        field = f"env_config.{loc}" if loc else "env_config"
        return _RowError(field, f"{err['msg']} (for {env_cls.__name__}; its config keys: {known})")
    return _RowError("env_config", str(exc))


def save_task_file(rows: list[Mapping[str, Any]], path: str | Path) -> Path:
    """Write rows as ``.jsonl``, ``.parquet`` or (any other path) a ``datasets.save_to_disk`` folder.

    Why a helper: ``pyarrow.Table.from_pylist`` and ``datasets.Dataset.from_list`` take the columns from the
    first row, so a file whose first row has no ``env_config`` silently loses every row's ``env_config``.
    Env rows are written with all three keys (``null`` where absent), which the loader reads back as absent.
    """
    path = Path(path)
    if is_env_row_file([dict(r) for r in rows]):
        rows = [{k: r.get(k) for k in ENV_ROW_KEYS} for r in rows]
    name = path.name.lower()
    if name.endswith(".jsonl"):
        with path.open("w", encoding="utf-8") as fh:
            for row in rows:
                fh.write(json.dumps({k: v for k, v in row.items() if v is not None}) + "\n")
    elif name.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist([dict(r) for r in rows]), path)
    else:
        import datasets

        datasets.Dataset.from_list([dict(r) for r in rows]).save_to_disk(str(path))
    return path


# --------------------------------------------------------------------------------------------------
# readers
# --------------------------------------------------------------------------------------------------
def _read_jsonl(path: Path) -> RawRows:
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    rows: list[dict[str, Any]] = []
    where: list[str] = []
    with opener(path, "rt", encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TaskFileError(f"{path}:{lineno}: not valid JSON: {exc.msg}") from exc
            if not isinstance(row, dict):
                raise TaskFileError(f"{path}:{lineno}: each line must be a JSON object, got {type(row).__name__}")
            rows.append(row)
            where.append(f"line {lineno}")
    return RawRows(rows, where, columnar=False)


def _read_parquet(path: Path) -> RawRows:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several unrelated types for unreadable files
        raise TaskFileError(f"{path}: cannot read as Parquet: {exc}") from exc
    rows = table.to_pylist()
    return RawRows(rows, [f"row {i}" for i in range(len(rows))], columnar=True, columns=table.column_names)


def _read_hf_folder(path: Path) -> RawRows:
    """A folder written by ``Dataset.save_to_disk``; a ``DatasetDict`` folder must be narrowed to one split."""
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if (p / "dataset_info.json").is_file())
        raise TaskFileError(
            f"{path} holds a DatasetDict with splits {splits}; set env.dataset.path to one split's folder, "
            f"e.g. {path / (splits[0] if splits else 'train')}"
        )
    if not (path / "dataset_info.json").is_file():
        raise TaskFileError(
            f"{path} is a folder but not one written by datasets' Dataset.save_to_disk (no dataset_info.json); "
            "point env.dataset.path at a .jsonl or .parquet file, or at a save_to_disk folder"
        )
    try:
        import datasets
    except ImportError as exc:
        raise TaskFileError(f"{path} is a datasets folder, but the 'datasets' package is not installed") from exc
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as exc:  # datasets raises several types for damaged folders
        raise TaskFileError(f"{path}: cannot load with datasets.load_from_disk: {exc}") from exc
    rows = ds.to_list()
    return RawRows(rows, [f"row {i}" for i in range(len(rows))], columnar=True, columns=list(ds.column_names))
