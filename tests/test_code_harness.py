"""The sandbox harness (``envs/code_env/harness.py``) on its own: its functions called directly (the runner
as a real child process of this one), and the program ``build_program`` makes from it run as a subprocess.

Model code here is test code only. ``kill_strays`` and ``clean_slate`` do nothing outside a pid namespace of
their own, which this process is not (a test checks it).
"""

from __future__ import annotations

import ast
import json
import math
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
    TestGrammarError,
    build_program,
    generated_suite,
    parse_call_case,
    parse_ground_truth,
    read_program_spec,
)
from pettingflow.envs.code_env import harness as h

GOOD = "def add(a, b):\n    return a + b"
BUGGY = "def add(a, b):\n    return a - b"
GROUND_TRUTH = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(0, 0) == 0\n"
PROGRAM = h.__file__  # the runner is this very file, run with --runner


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


def job(solution: str, tests: list[str] | None = None, context: str = "") -> dict[str, Any]:
    suite = generated_suite(tests, "add") if tests is not None else parse_ground_truth(GROUND_TRUTH)
    return Job(solution, "add", suite, context=context).to_json()


def source_job(solution: str, steps: list[str], context: str = "") -> dict[str, Any]:
    """Trusted test text run by the judge (as ground truth is), one case per statement."""
    return Job(solution, "add", parse_ground_truth("\n".join(steps)), context=context).to_json()


def run_here(spec_job: dict[str, Any], case_timeout_s: float = 2.0, budget_s: float = 30.0) -> dict[str, Any]:
    return h.run_job(spec_job, time.monotonic() + budget_s, case_timeout_s, PROGRAM)


# --------------------------------------------------------------------------------------------------
# the file itself
# --------------------------------------------------------------------------------------------------
def test_the_harness_imports_only_the_standard_library() -> None:
    tree = ast.parse(Path(h.__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported - {"__future__"} <= set(sys.stdlib_module_names), imported


def test_the_program_is_the_harness_file_and_the_spec_travels_on_stdin() -> None:
    assert Path(h.__file__).read_text() == HARNESS
    program = build_program(
        [Job(GOOD, "add", generated_suite(["assert add(1, 2) == 3"], "add"))], case_timeout_s=1.0, budget_s=5.0
    )
    assert program.code == HARNESS
    spec = read_program_spec(program.stdin)
    assert spec["jobs"][0]["solution"] == GOOD and spec["case_timeout_s"] == 1.0
    assert spec["marker"] not in program.code


def test_killing_strays_does_nothing_outside_a_pid_namespace_of_our_own() -> None:
    assert not h.in_own_pid_namespace()
    h.kill_strays()  # would kill every process of ours on this machine if the guard were wrong
    h.clean_slate()
    assert Path(h.__file__).exists()


#: Modules the harness must not import when it starts: each costs 1-3 ms at every sandbox start (measured in
#: bench/reward_boundary.py); the harness imports its few uses lazily or does without.
HEAVY_AT_START = {"socket", "typing", "contextlib", "ast", "ctypes", "subprocess", "shutil", "base64"}


def test_the_harness_starts_without_its_heavy_imports_and_still_becomes_undumpable() -> None:
    probe = (
        "import sys\n"
        f"ns = {{'__name__': 'harness'}}\n"
        f"exec(compile(open({h.__file__!r}).read(), 'harness', 'exec'), ns)\n"
        "print(' '.join(sorted(m for m in sys.modules if '.' not in m)))\n"
        "print(ns['make_undumpable']())\n"
        "import ctypes\n"
        "print(ctypes.CDLL(None).prctl(3, 0, 0, 0, 0))\n"  # 3 = PR_GET_DUMPABLE
    )
    out = subprocess.run(["/usr/bin/python3", "-I", "-c", probe], capture_output=True, text=True, check=True)
    modules, took, dumpable = out.stdout.splitlines()
    assert HEAVY_AT_START.isdisjoint(modules.split()), sorted(HEAVY_AT_START & set(modules.split()))
    assert (took, dumpable) == ("True", "0")


# --------------------------------------------------------------------------------------------------
# plain data: the only values that cross the boundary
# --------------------------------------------------------------------------------------------------
PLAIN_VALUES = [
    None,
    True,
    0,
    -(10**40),
    2**63,
    1.5,
    float("inf"),
    "text",
    b"\x00\xff",
    [1, [2, "x"]],
    (1, (2,)),
    {1, "a"},
    frozenset({(1, 2)}),
    {"a": [1], 2: (3,), (4, 5): None},
    [],
    (),
    {},
]


@pytest.mark.parametrize("value", PLAIN_VALUES, ids=repr)
def test_plain_values_round_trip_through_json_with_their_exact_types(value: Any) -> None:
    back = h.decode(json.loads(json.dumps(h.encode(value))))
    assert back == value and type(back) is type(value)


def test_nan_round_trips() -> None:
    assert math.isnan(h.decode(json.loads(json.dumps(h.encode(float("nan"))))))


class _Int(int):
    def __eq__(self, other: object) -> bool:
        return True

    __hash__ = int.__hash__


@pytest.mark.parametrize(
    ("value", "named"),
    [
        (_Int(3), "_Int"),
        (object(), "object"),
        ((x for x in []), "generator"),
        ([1, {2: 1j}], "complex"),
        (bytearray(b"x"), "bytearray"),
        (range(3), "range"),
    ],
)
def test_anything_else_is_refused_with_its_type(value: Any, named: str) -> None:
    with pytest.raises(h.NotPlain, match=f"type .*{named}, not plain data"):
        h.encode(value)


def test_values_too_big_or_too_deep_are_refused() -> None:
    with pytest.raises(h.NotPlain, match="larger than"):
        h.encode("x" * (h.MAX_VALUE_BYTES + 1))
    deep: list[Any] = []
    for _ in range(h.MAX_DEPTH + 2):
        deep = [deep]
    with pytest.raises(h.NotPlain, match="deeper"):
        h.encode(deep)


@pytest.mark.parametrize(
    "data", [{"x": 1}, {"t": 1}, {"d": [[1]]}, {"s": [[1]]}, {"b": "***"}, {"i": "zz"}, {"t": [1], "s": [2]}]
)
def test_decode_accepts_only_the_encoding(data: Any) -> None:
    with pytest.raises(h.NotPlain):
        h.decode(data)


# --------------------------------------------------------------------------------------------------
# the test grammar (parse_call_case, host side) and its evaluation by the judge
# --------------------------------------------------------------------------------------------------
def test_the_grammar_reads_a_call_and_a_literal() -> None:
    case = parse_call_case("assert add(1, b=[2]) == (3,)", "add")
    assert h.decode(case["args"]) == [1] and h.decode(case["kwargs"]) == {"b": [2]}
    assert case["check"] == "==" and h.decode(case["expected"]) == (3,)
    assert parse_call_case("assert 3 == add(1, 2)", "add")["check"] == "=="
    assert parse_call_case("assert add(1, 2) is None", "add")["check"] == "is"
    assert parse_call_case("assert not add(0, 0)", "add")["check"] == "falsy"
    close = parse_call_case("assert abs(add(0.1, 0.2) - 0.3) <= 1e-6", "add")
    assert close["check"] == "close" and close["abs_tol"] == 1e-6 and close["rel_tol"] == 0.0
    assert parse_call_case("assert math.isclose(add(1, 2), 3.0, rel_tol=0.01)", "add")["rel_tol"] == 0.01


@pytest.mark.parametrize(
    ("test", "why"),
    [
        ("assert True", "expected a call of add"),
        ("assert add(1, 1) == 2 or True", "expected a call of add"),
        ("assert add(x, 1) == 2", "is not a literal"),
        ("assert add(1, 1) == len('ab')", "is not a literal"),
        ("assert add(*[1, 1]) == 2", r"\*args"),
        ("assert add(1, 1) < 3", "not one of"),
        ("assert add(1, 1) is 2", "only with True, False or None"),
        ("x = add(1, 1)", "one assert statement"),
        ("assert add(1, 1) == 2; import os", "one assert statement"),
        ("assert add(1, 1) == 1j", "not plain data"),
        ("assert abs(add(1, 1) - 'x') < 1", "numbers only"),
        ("assert add(1,", "does not parse"),
    ],
)
def test_the_grammar_refuses_what_is_outside_it_and_says_why(test: str, why: str) -> None:
    with pytest.raises(TestGrammarError, match=why):
        parse_call_case(test, "add")


def test_a_test_outside_the_grammar_is_a_failing_case_with_the_reason() -> None:
    [step] = generated_suite(["assert True"], "add").steps
    assert step.is_case and step.call is None and step.invalid is not None
    assert run_here(job(GOOD, ["assert True"]))["cases"] == [
        [False, "not a test this harness runs: expected a call of add(...), found `True` (docs/code-env.md)"]
    ]


def test_bool_and_int_are_told_apart_where_the_test_asks() -> None:
    returns_one = "def add(a, b):\n    return 1"
    result = run_here(job(returns_one, ["assert add(1, 0) is True", "assert add(1, 0) == True", "assert add(0, 1)"]))
    assert [ok for ok, _ in result["cases"]] == [False, True, True]  # 1 == True in Python; `is True` is not


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
# run_job: the judge here, the solution in a runner process
# --------------------------------------------------------------------------------------------------
def test_run_job_scores_each_case_on_its_own() -> None:
    steps = ["assert add(2, 3) == 5", "assert add(0, 0) == 0", "assert add(1, '') == 1"]
    result = run_here(source_job(BUGGY, steps))
    assert result["setup_error"] is None
    assert result["cases"] == [
        [False, "AssertionError (left side was -1)"],
        [True, None],
        [False, "TypeError: unsupported operand type(s) for -: 'int' and 'str'"],
    ]
    # the same asserts written by a model: parsed, then judged on the returned values
    assert run_here(job(BUGGY, steps))["cases"] == result["cases"]


def test_run_job_binds_the_candidate_of_check_and_runs_its_preamble() -> None:
    suite = parse_ground_truth("LIMIT = 5\n\ndef check(f):\n    assert f(2, 3) == LIMIT\n    assert True\n")
    spec_job = Job(GOOD, "add", suite).to_json()
    assert run_here(spec_job) == {"setup_error": None, "cases": [[True, None]]}


def test_the_prompt_runs_first_in_both_processes_but_the_solution_must_define_the_entry_point() -> None:
    context = 'def helper(x):\n    return x\n\ndef add(a, b):\n    """the stub of the prompt"""\n'
    uses_helper = "def add(a, b):\n    return helper(a) + b"
    # the runner sees the prompt's helper; so does the judge's check (as HumanEval/32's check uses `poly`)
    steps = ["assert add(1, 2) == 3", "assert helper(add(1, 2)) == 3"]
    assert run_here(source_job(uses_helper, steps, context=context))["cases"] == [[True, None], [True, None]]
    result = run_here(job("x = 1", ["assert add(1, 2) == 3"], context=context))
    assert result["setup_error"] == "the solution does not define a function named add"
    assert result["cases"] == [[False, "the solution does not define a function named add"]]


def test_the_judge_never_sees_the_solutions_own_names() -> None:
    # a solution that redefines a helper the check uses changes nothing for the check
    shadows = "def helper(x):\n    return 0\ndef add(a, b):\n    return a + b"
    context = "def helper(x):\n    return x\n"
    result = run_here(source_job(shadows, ["assert helper(add(1, 2)) == 3"], context=context))
    assert result["cases"] == [[True, None]]


def test_a_solution_that_does_not_load_fails_every_case_with_the_reason() -> None:
    result = run_here(job("def add(a, b) return", None))
    assert result["setup_error"].startswith("the solution failed to load: SyntaxError")
    assert [ok for ok, _ in result["cases"]] == [False, False]


def test_a_case_that_hangs_times_out_alone_and_the_next_gets_a_fresh_runner() -> None:
    hangs = "def add(a, b):\n    while a == 1:\n        pass\n    return a + b"
    # the limit is also the passing case's: generous (a fresh runner starts in it), not tuned to an idle machine
    result = run_here(job(hangs, ["assert add(1, 2) == 3", "assert add(2, 3) == 5"]), case_timeout_s=2.0)
    assert result["cases"] == [[False, "timed out"], [True, None]]


def test_a_runner_that_dies_loses_only_its_case() -> None:
    dies = "import os\ndef add(a, b):\n    if a == 1:\n        os._exit(3)\n    return a + b"
    result = run_here(job(dies, ["assert add(2, 3) == 5", "assert add(1, 1) == 2", "assert add(0, 0) == 0"]))
    assert [ok for ok, _ in result["cases"]] == [True, False, True]
    assert result["cases"][1][1].startswith("the solution's process failed during the call")


def test_exceptions_cross_as_builtin_classes_and_never_as_base_exceptions() -> None:
    raises = "def add(a, b):\n    if a == 0:\n        raise ValueError('no zero')\n    raise SystemExit(0)\n"
    steps = [
        "try:\n    add(0, 1)\n    assert False\nexcept ValueError as e:\n    assert str(e) == 'no zero'",
        "assert add(1, 1) == 2",
    ]
    result = run_here(source_job(raises, steps))
    assert result["cases"] == [[True, None], [False, "SystemExit: 0"]]


def test_runners_forked_by_the_zygote_score_as_fresh_ones_and_a_dead_zygote_falls_back() -> None:
    jobs = [job(GOOD), job(BUGGY), job("import os\nos._exit(1)", ["assert add(1, 1) == 2"])]
    fresh = [run_here(j) for j in jobs]
    zygote = h.Zygote()
    try:
        assert zygote.alive
        forked = [h.run_job(j, time.monotonic() + 30.0, 2.0, PROGRAM, zygote) for j in jobs]
        assert forked == fresh
        os.kill(zygote.pid, signal.SIGKILL)  # as a runner could: the next runner is a fresh interpreter
        assert h.run_job(jobs[1], time.monotonic() + 30.0, 2.0, PROGRAM, zygote) == fresh[1]
        assert not zygote.alive
    finally:
        zygote.close()


def test_calls_sent_ahead_score_as_calls_sent_one_by_one(monkeypatch) -> None:
    """With a zygote, a job of parsed tests sends every call behind the solution (``send_ahead``): a case that
    hangs or kills its runner still fails alone, the cases after it run on a fresh runner, and a solution with
    state sees its calls in the same order: the same results as one call at a time (fresh runners, no zygote)."""
    hangs = "def add(a, b):\n    while a == 1:\n        pass\n    return a + b"
    dies = "import os\ndef add(a, b):\n    if a == 1:\n        os._exit(3)\n    return a + b"
    counts = "seen = []\ndef add(a, b):\n    seen.append(a)\n    return a + b + len(seen) - 1"
    tests = ["assert add(2, 3) == 5", "assert add(1, 2) == 3", "assert add(0, 0) == 0", "assert add(4, 4) != 9"]
    jobs = [job(code, tests) for code in (hangs, dies, counts)]
    fresh = [run_here(j, case_timeout_s=2.0) for j in jobs]  # the passing cases' limit too: generous
    sent: list[int] = []
    send_ahead = h.Runner.send_ahead

    def spy(runner, calls):
        sent.append(len(calls))
        return send_ahead(runner, calls)

    monkeypatch.setattr(h.Runner, "send_ahead", spy)
    zygote = h.Zygote()
    try:
        ahead = [h.run_job(j, time.monotonic() + 60.0, 2.0, PROGRAM, zygote) for j in jobs]
    finally:
        zygote.close()
    assert sent == [4, 4, 4]  # every call of each job went ahead
    assert ahead == fresh
    assert [[ok for ok, _ in r["cases"]] for r in ahead] == [
        [True, False, True, True],
        [True, False, True, True],
        [True, False, False, True],
    ]


def test_run_group_emits_one_entry_per_job_in_order() -> None:
    jobs = [job(GOOD), job(BUGGY), job(GOOD, [])]
    results: list[dict[str, Any]] = []
    h.run_group(jobs, 30.0, results.append, 2.0, PROGRAM)
    assert [r["cases"] for r in results] == [
        [[True, None], [True, None]],
        [[False, "AssertionError (left side was -1)"], [True, None]],
        [],
    ]


# --------------------------------------------------------------------------------------------------
# the whole program, as a subprocess
# --------------------------------------------------------------------------------------------------
def test_the_program_prints_only_the_marked_results_one_line_per_job(tmp_path: Path) -> None:
    noisy = "import sys\nprint('noise')\nsys.stderr.write('more')\ndef add(a, b):\n    return a + b"
    jobs = [
        Job(noisy, "add", parse_ground_truth(GROUND_TRUTH)),
        Job(BUGGY, "add", generated_suite(["assert add(1, 1) == 2"], "add")),
    ]
    program = build_program(jobs, case_timeout_s=2.0, budget_s=30.0, marker="__MARK__ ")
    (tmp_path / "main.py").write_text(program.code)
    run = subprocess.run(
        [sys.executable, "-I", "main.py"],
        input=program.stdin,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert all(line.startswith("__MARK__ ") for line in lines)
    assert [json.loads(line[len("__MARK__ ") :]) for line in lines] == [
        [0, {"setup_error": None, "cases": [[True, None], [True, None]]}],
        [1, {"setup_error": None, "cases": [[False, "AssertionError (left side was 0)"]]}],
    ]
