"""The basic-python task set: well-formed, solvable by its canonical solutions, and not trivially passed."""

from __future__ import annotations

import pytest

from pettingflow.configs.settings import DatasetSettings
from pettingflow.envs.basic_python import load_basic_python
from pettingflow.envs.code_env import parse_ground_truth
from pettingflow.envs.humaneval import load_tasks, validate_tasks


def _check(task: dict, code: str) -> None:
    ns: dict = {}
    exec(code + "\n" + task["test"], ns)  # our own canonical solutions, not model code
    ns["check"](ns[task["entry_point"]])


def test_one_hundred_distinct_well_formed_tasks():
    tasks = load_basic_python()
    assert len(tasks) == 100
    assert len({t["entry_point"] for t in tasks}) == 100
    validate_tasks(tasks)  # raises on a missing column or duplicate id
    assert all(len(parse_ground_truth(t["test"]).cases) >= 4 for t in tasks)


@pytest.mark.parametrize("task", load_basic_python(), ids=lambda t: t["entry_point"])
def test_canonical_solution_passes_and_a_wrong_one_fails(task):
    _check(task, task["prompt"] + task["canonical_solution"])
    with pytest.raises(AssertionError):  # the asserts can fail: returning the input is wrong for every task
        _check(task, task["prompt"] + "    return " + task["prompt"].split("(")[1].split(":")[0] + "\n")


def test_docstring_example_matches_the_solution():
    for task in load_basic_python():
        lines = task["prompt"].splitlines()
        call = next(line.strip()[4:] for line in lines if line.strip().startswith(">>> "))
        expected = lines[lines.index(next(line for line in lines if ">>> " in line)) + 1].strip()
        ns: dict = {}
        exec(task["prompt"] + task["canonical_solution"], ns)
        assert repr(eval(call, ns)) == expected, task["task_id"]


def test_config_source_splits_30_held_out_tasks():
    split = load_tasks(DatasetSettings(source="basic-python", validation_fraction=0.3, split_seed=0))
    assert (len(split.train), len(split.validation)) == (70, 30)
    assert not {t["task_id"] for t in split.train} & {t["task_id"] for t in split.validation}
