"""The sandbox harness (``envs/code_env/harness.py``) on its own: its functions called directly, and the
program ``build_program`` makes from it run as a plain subprocess.

Model code here is test code only. ``main`` and ``clean_slate`` are never called in this process, and no
program with ``groups`` runs outside the sandbox: ``clean_slate`` kills every process it may signal.
"""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from pettingflow.envs.code_env import (
    HARNESS,
    Job,
    build_program,
    generated_suite,
    parse_ground_truth,
    read_program_spec,
)
from pettingflow.envs.code_env import harness as h

GOOD = "def add(a, b):\n    return a + b"
BUGGY = "def add(a, b):\n    return a - b"
GROUND_TRUTH = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(0, 0) == 0\n"


@pytest.fixture(autouse=True)
def _alarm_restored():
    """The harness sets SIGALRM's handler and the real-time timer; pytest-timeout uses both in this process."""
    handler = signal.getsignal(signal.SIGALRM)
    delay, interval = signal.getitimer(signal.ITIMER_REAL)
    yield
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, handler)
    if delay:
        signal.setitimer(signal.ITIMER_REAL, delay, interval)


@pytest.fixture
def null_fd():
    fd = os.open(os.devnull, os.O_RDWR)
    yield fd
    os.close(fd)


def job(solution: str, tests: list[str] | None = None, context: str = "") -> dict[str, Any]:
    suite = generated_suite(tests) if tests is not None else parse_ground_truth(GROUND_TRUTH)
    return Job(solution, "add", suite, context=context).to_json()


def run_here(spec_job: dict[str, Any], case_timeout_s: float = 2.0, budget_s: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + budget_s
    return h.collect(spec_job, h.run_inline(spec_job, deadline, case_timeout_s), deadline)


# --------------------------------------------------------------------------------------------------
# the file itself
# --------------------------------------------------------------------------------------------------
def test_the_harness_imports_only_the_standard_library() -> None:
    tree = ast.parse(Path(h.__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported - {"__future__"} <= set(sys.stdlib_module_names), imported


def test_the_program_is_the_harness_file_with_the_spec_in_place_of_the_placeholder() -> None:
    assert Path(h.__file__).read_text() == HARNESS
    assert h.SPEC_JSON == "__PETTINGFLOW_SPEC__"  # importing it ran nothing
    program = build_program(
        [Job(GOOD, "add", generated_suite(["assert add(1, 2) == 3"]))], case_timeout_s=1.0, budget_s=5.0
    )
    before, after = HARNESS.split('"__PETTINGFLOW_SPEC__"')
    assert program.startswith(before) and program.endswith(after)
    spec = read_program_spec(program)
    assert spec["jobs"][0]["solution"] == GOOD and spec["case_timeout_s"] == 1.0
    ast.parse(program)


# --------------------------------------------------------------------------------------------------
# describe, left_value
# --------------------------------------------------------------------------------------------------
def test_describe_names_the_exception_and_cuts_long_messages() -> None:
    assert h.describe(ValueError("bad")) == "ValueError: bad"
    assert h.describe(AssertionError()) == "AssertionError"
    assert h.describe(h._Timeout()) == "timed out"
    assert len(h.describe(RuntimeError("x" * 1000))) == 300


def test_left_value_shows_the_left_side_of_a_comparison_only() -> None:
    ns: dict[str, Any] = {}
    exec(BUGGY, ns)
    deadline = time.monotonic() + 5.0
    assert h.left_value("assert add(2, 3) == 5", ns, deadline) == " (left side was -1)"
    assert h.left_value("assert add(2, 3)", ns, deadline) == ""  # not a comparison
    assert h.left_value("assert missing(1) == 2", ns, deadline) == ""  # evaluating it fails: no detail


# --------------------------------------------------------------------------------------------------
# run_job (in this process) and collect
# --------------------------------------------------------------------------------------------------
def test_run_job_scores_each_case_on_its_own() -> None:
    result = run_here(job(BUGGY, ["assert add(2, 3) == 5", "assert add(0, 0) == 0", "assert add(1, '') == 1"]))
    assert result["setup_error"] is None
    assert result["cases"] == [
        [False, "AssertionError (left side was -1)"],
        [True, None],
        [False, "TypeError: unsupported operand type(s) for -: 'int' and 'str'"],
    ]


def test_run_job_binds_the_candidate_of_check_and_runs_its_preamble() -> None:
    suite = parse_ground_truth("LIMIT = 5\n\ndef check(f):\n    assert f(2, 3) == LIMIT\n    assert True\n")
    spec_job = Job(GOOD, "add", suite).to_json()
    assert run_here(spec_job) == {"setup_error": None, "cases": [[True, None]]}


def test_the_prompt_runs_first_but_the_solution_must_define_the_entry_point() -> None:
    context = "def helper(x):\n    return x\n\ndef add(a, b):\n    '''the stub of the prompt'''\n"
    uses_helper = "def add(a, b):\n    return helper(a) + b"
    assert run_here(job(uses_helper, ["assert add(1, 2) == 3"], context=context))["cases"] == [[True, None]]
    result = run_here(job("x = 1", ["assert add(1, 2) == 3"], context=context))
    assert result["setup_error"] == "the solution does not define a function named add"
    assert result["cases"] == [[False, "the solution does not define a function named add"]]


def test_a_solution_that_does_not_load_fails_every_case_with_the_reason() -> None:
    result = run_here(job("def add(a, b) return", None))
    assert result["setup_error"].startswith("the solution failed to load: SyntaxError")
    assert [ok for ok, _ in result["cases"]] == [False, False]


def test_a_case_that_hangs_times_out_alone() -> None:
    hangs = "def add(a, b):\n    while a == 1:\n        pass\n    return a + b"
    result = run_here(job(hangs, ["assert add(1, 2) == 3", "assert add(2, 3) == 5"]), case_timeout_s=0.2)
    assert result["cases"] == [[False, "timed out"], [True, None]]


def test_collect_fails_the_cases_without_a_record_and_skips_garbage() -> None:
    spec_job = job(GOOD, ["assert add(1, 2) == 3", "assert add(2, 2) == 4"])
    lines = ['{"setup_error": null}', "not json", '{"i": 0, "ok": true, "error": null}']
    alive = h.collect(spec_job, lines, time.monotonic() + 60.0)
    assert alive["cases"] == [[True, None], [False, "the test process died before reaching this case"]]
    late = h.collect(spec_job, lines, time.monotonic() - 1.0)
    assert late["cases"][1] == [False, "timed out (time budget of this run used up)"]


# --------------------------------------------------------------------------------------------------
# run_forked and run_group: model code in a child
# --------------------------------------------------------------------------------------------------
def test_run_forked_loses_only_the_cases_after_the_child_died(null_fd: int) -> None:
    dies = "import os\ndef add(a, b):\n    if a == 1:\n        os._exit(3)\n    return a + b"
    spec_job = job(dies, ["assert add(2, 3) == 5", "assert add(1, 1) == 2", "assert add(0, 0) == 0"])
    deadline = time.monotonic() + 30.0
    lines = h.run_forked(spec_job, deadline, 2.0, null_fd)
    assert lines is not None
    result = h.collect(spec_job, lines, deadline)
    assert [ok for ok, _ in result["cases"]] == [True, False, False]
    assert result["cases"][1][1] == "the test process died before reaching this case"


def test_run_group_appends_one_entry_per_job_in_order(null_fd: int) -> None:
    jobs = [job(GOOD), job(BUGGY), job(GOOD, [])]
    results: list[dict[str, Any]] = []
    h.run_group(jobs, 30.0, results, 2.0, null_fd)
    assert [r["cases"] for r in results] == [
        [[True, None], [True, None]],
        [[False, "AssertionError (left side was -1)"], [True, None]],
        [],
    ]


# --------------------------------------------------------------------------------------------------
# the whole program, as a subprocess (one group: never clean_slate outside the sandbox)
# --------------------------------------------------------------------------------------------------
def test_the_program_prints_only_the_marked_summary(tmp_path: Path) -> None:
    noisy = "import sys\nprint('noise')\nsys.stderr.write('more')\ndef add(a, b):\n    return a + b"
    jobs = [
        Job(noisy, "add", parse_ground_truth(GROUND_TRUTH)),
        Job(BUGGY, "add", generated_suite(["assert add(1, 1) == 2"])),
    ]
    program = build_program(jobs, case_timeout_s=2.0, budget_s=30.0, marker="__MARK__ ")
    assert "groups" not in read_program_spec(program)
    run = subprocess.run(
        [sys.executable, "-I", "-c", program], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("__MARK__ ") and run.stdout.count("\n") == 1
    summary = json.loads(run.stdout[len("__MARK__ ") :])
    assert summary == [
        {"setup_error": None, "cases": [[True, None], [True, None]]},
        {"setup_error": None, "cases": [[False, "AssertionError (left side was 0)"]]},
    ]
