"""Env-row task files: rows that name their env load from JSONL, Parquet and datasets folders;
bad rows fail with the file, the row and the field."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pettingflow.configs import load_config
from pettingflow.configs.loader import CONFIG_DIR
from pettingflow.configs.settings import DatasetSettings
from pettingflow.envs import EnvSpec, TaskFileError, load_task_file, load_tasks, task_specs_from_rows
from pettingflow.envs.task_files import save_task_file

EXAMPLE = CONFIG_DIR / "tasks" / "mixed-example.jsonl"
FORMATS = ["jsonl", "parquet", "hf"]

CODE_TASK = {
    "task_id": "add/1",
    "prompt": "def add(a, b):\n",
    "canonical_solution": "    return a + b\n",
    "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n",
    "entry_point": "add",
}
PLAN_CONFIG = {"max_turns": 4, "rows": 4, "cols": 4}


def code_row(**task: Any) -> dict[str, Any]:
    return {"env_class_path": "code-env", "task_data": {**CODE_TASK, **task}}


def plan_row(task_id: str = "plan/1", config: dict[str, Any] | None = None, **task: Any) -> dict[str, Any]:
    return {
        "env_class_path": "plan-path",
        "env_config": PLAN_CONFIG if config is None else config,
        "task_data": {"task_id": task_id, "seed": 3, **task},
    }


def write(rows: list[dict[str, Any]], tmp_path: Path, fmt: str) -> Path:
    """Rows as the format's own writer stores them (pyarrow and datasets directly: no normalizing helper)."""
    full = [
        {k: r.get(k) for k in ("env_class_path", "env_config", "task_data") if k in r or k == "env_config"}
        for r in rows
    ]  # every row gets env_config (null) so the first row does not decide the columns
    if fmt == "jsonl":
        path = tmp_path / "tasks.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "parquet":
        path = tmp_path / "tasks.parquet"
        pq.write_table(pa.Table.from_pylist(full), path)
    else:
        import datasets

        path = tmp_path / "tasks-hf"
        datasets.Dataset.from_list(full).save_to_disk(str(path))
    return path


def where(fmt: str, index: int) -> str:
    """How an error names row ``index`` (0-based): JSONL by line (1-based), the others by row."""
    return f"line {index + 1}" if fmt == "jsonl" else f"row {index}"


# ------------------------------------------------------------------------------------------ good files
def test_shipped_example_mixes_code_env_plan_path_and_math_tool_rows() -> None:
    rows = load_task_file(EXAMPLE)
    assert len(rows) == 24
    assert {r["env_class_path"] for r in rows} == {"code-env", "plan-path", "math-tool"}
    default = EnvSpec.of("code-env", {"max_turns": 4})
    specs = task_specs_from_rows(rows, default)
    plan = [s for s in specs if s.env.class_path.endswith(":PlanPathEnv")]
    code = [s for s in specs if s.env.class_path.endswith(":CodeEnv")]
    math = [s for s in specs if s.env.class_path.endswith(":MathToolEnv")]
    assert len(plan) == len(code) == len(math) == 8
    assert len({s.env for s in math}) == 1 and math[0].env.config["answer_prefix"] is True
    assert {s.env for s in code} == {default}  # no env_config: the configured env's settings
    assert len({s.env for s in plan}) == 1 and plan[0].env.config["rows"] == 4
    assert all("task_id" in s.task and "env_class_path" not in s.task for s in specs)


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_loads_the_same_rows(tmp_path: Path, fmt: str) -> None:
    rows = load_task_file(EXAMPLE)
    path = write(rows, tmp_path, fmt)
    assert load_task_file(path) == rows  # struct-column nulls (code rows' plan-path fields) are dropped again


@pytest.mark.parametrize("fmt", FORMATS)
def test_save_task_file_round_trips(tmp_path: Path, fmt: str) -> None:
    rows = [code_row(), plan_row()]  # the first row has no env_config: the helper still keeps the column
    name = {"jsonl": "t.jsonl", "parquet": "t.parquet", "hf": "t-hf"}[fmt]
    assert load_task_file(save_task_file(rows, tmp_path / name)) == rows


def test_json_text_columns_are_accepted_and_keep_their_nulls(tmp_path: Path) -> None:
    rows = [
        {"env_class_path": "plan-path", "env_config": json.dumps(PLAN_CONFIG), "task_data": json.dumps(t)}
        for t in ({"task_id": "a", "seed": 1, "note": None}, {"task_id": "b", "seed": 2})
    ]
    path = tmp_path / "text.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    loaded = load_task_file(path)
    assert loaded[0]["env_config"] == PLAN_CONFIG
    assert loaded[0]["task_data"] == {"task_id": "a", "seed": 1, "note": None}


def test_mixed_config_loads_its_file_from_any_working_directory(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # the config names tasks/mixed-example.jsonl: found under configs/
    config = load_config("mixed-envs")
    split = load_tasks(config.env.dataset)
    assert len(split.train) + len(split.validation) == 24
    held_out = sorted(r["env_class_path"] for r in split.validation)
    assert held_out == ["code-env"] * 2 + ["math-tool"] * 2 + ["plan-path"] * 2  # split_seed: every env validated
    train_ids = {r["task_data"]["task_id"] for r in split.train}
    assert train_ids.isdisjoint(r["task_data"]["task_id"] for r in split.validation)
    assert {a.name: a.envs for a in config.agents}["planner"] == ["plan-path"]


def test_bare_humaneval_rows_still_load(tmp_path: Path) -> None:
    path = tmp_path / "bare.jsonl"
    path.write_text(json.dumps(CODE_TASK) + "\n")
    assert load_task_file(path) == [CODE_TASK]


# ------------------------------------------------------------------------------------------ bad files
# (rows, index of the bad row, field named, words of the message)
BAD: dict[str, tuple[list[dict[str, Any]], int, str, str]] = {
    "unknown env class": (
        [code_row(), {**plan_row(), "env_class_path": "nope-env"}],
        1,
        "env_class_path",
        "unknown env 'nope-env'; registered names: code-env, math-tool, plan-path, sudoku",
    ),
    "missing task_data": (
        [code_row(), {"env_class_path": "plan-path", "env_config": PLAN_CONFIG}],
        1,
        "task_data",
        "is missing; put the task",
    ),
    "config key unknown": (
        [plan_row(config={"rowz": 4})],
        0,
        "env_config.rowz",
        "Extra inputs are not permitted (for PlanPathEnv; its config keys: max_turns, ",
    ),
    "config value invalid": (
        [plan_row("a"), plan_row("b", config={"rows": 0})],
        1,
        "env_config.rows",
        "greater than or equal to",
    ),
    "missing task_id": (
        [code_row(), {**code_row(), "task_data": {k: v for k, v in CODE_TASK.items() if k != "task_id"}}],
        1,
        "task_data.task_id",
        "is missing or empty; every task needs a unique id",
    ),
    "duplicate task_id": (
        [plan_row("same"), code_row(), plan_row("same")],
        2,
        "task_data.task_id",
        "'same' is already used by",
    ),
    "code task without test": (
        [code_row(), code_row(task_id="x/2", test="")],
        1,
        "task_data.test",
        "must be a non-empty string",
    ),
    "code test that cannot fail": (
        [code_row(test="def check(candidate):\n    assert True\n")],
        0,
        "task_data.test",
        "has no assert that can fail",
    ),
    "unreachable plan-path grid": (
        [plan_row(grid=["S#.", "##G"])],
        0,
        "task_data.grid",
        "the goal cannot be reached",
    ),
    "missing env_class_path": (
        [code_row(), {"env_config": PLAN_CONFIG, "task_data": {"task_id": "p", "seed": 1}}],
        1,
        "env_class_path",
        "is missing or empty; name the env class",
    ),
}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_rows_name_file_row_and_field(tmp_path: Path, fmt: str, case: str) -> None:
    rows, index, field, words = BAD[case]
    path = write(rows, tmp_path, fmt)
    with pytest.raises(TaskFileError) as err:
        load_task_file(path)
    message = str(err.value)
    assert message.startswith(f"{path}: {where(fmt, index)}: field '{field}': "), message
    assert words in message, message


def test_several_bad_rows_are_reported_together(tmp_path: Path) -> None:
    rows = [code_row(), {**plan_row("p1"), "env_class_path": "nope"}, plan_row("p2", config={"rowz": 1})]
    path = write(rows, tmp_path, "jsonl")
    with pytest.raises(TaskFileError) as err:
        load_task_file(path)
    lines = str(err.value).splitlines()
    assert [re.sub(r": field '([^']+)'.*", r" \1", line) for line in lines] == [
        f"{path}: line 2 env_class_path",
        f"{path}: line 3 env_config.rowz",
    ]


def test_jsonl_only_shapes(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({**code_row(), "task_id": "x"}) + "\n")
    with pytest.raises(TaskFileError, match=r"line 1: field 'task_id': is not an env-row key.*move task fields"):
        load_task_file(path)
    path.write_text(json.dumps({**plan_row(), "env_config": [1]}) + "\n")
    with pytest.raises(TaskFileError, match=r"line 1: field 'env_config': must be an object"):
        load_task_file(path)
    path.write_text(json.dumps({**plan_row(), "task_data": "{not json"}) + "\n")
    with pytest.raises(TaskFileError, match=r"line 1: field 'task_data': is a string but not JSON"):
        load_task_file(path)


def test_bad_folders_and_paths(tmp_path: Path) -> None:
    import datasets

    dd = tmp_path / "dd"
    datasets.DatasetDict({"train": datasets.Dataset.from_list([code_row()])}).save_to_disk(str(dd))
    with pytest.raises(TaskFileError, match=r"holds a DatasetDict with splits \['train'\].*dd/train"):
        load_task_file(dd)
    (tmp_path / "plain").mkdir()
    with pytest.raises(TaskFileError, match=r"not one written by datasets' Dataset\.save_to_disk"):
        load_task_file(tmp_path / "plain")
    with pytest.raises(TaskFileError, match=r"does not exist \(looked in .* and in .*configs"):
        load_tasks(DatasetSettings(source="file", path="tasks/no-such-file.jsonl"))
    with pytest.raises(TaskFileError, match=r"path is not set; set it to a \.jsonl"):
        load_tasks(DatasetSettings(source="file"))


def test_bare_rows_are_tasks_of_the_default_env(tmp_path) -> None:
    """A file of bare rows (a task per row) belongs to the config's env.class_path: for plan-path each row is
    checked by PlanPathEnv.validate_task (a bad one fails naming its line and field) and runs in the default
    env; for the code env (or no default) bare rows must still be HumanEval-shaped."""

    path = tmp_path / "grids.jsonl"
    path.write_text("".join(json.dumps({"task_id": f"g{s}", "seed": s}) + "\n" for s in range(5)))
    rows = load_task_file(path, "plan-path")
    assert rows[0] == {"env_class_path": "plan-path", "task_data": {"task_id": "g0", "seed": 0}}
    split = load_tasks(DatasetSettings(source="file", path=str(path), validation_fraction=0.4), "plan-path")
    assert len(split.train) + len(split.validation) == 5
    with pytest.raises(TaskFileError, match="missing columns"):
        load_task_file(path, "code-env")
    with pytest.raises(TaskFileError, match="missing columns"):
        load_task_file(path)
    path.write_text(path.read_text() + json.dumps({"task_id": "g9"}) + "\n")
    with pytest.raises(TaskFileError, match=r"grids.jsonl: line 6: field 'task_data.*seed"):
        load_task_file(path, "plan-path")
