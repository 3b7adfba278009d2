"""Code env: ground-truth parsing, the harness protocol, rewards, state updates and termination.

Most tests use ``FakeSandbox``, which runs no model code: it reads the jobs embedded in the
program and answers from Python implementations registered per solution text. The tests marked
``sandbox`` use the real sandbox (``make_sandbox``) on HumanEval problems.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from pettingflow.configs.settings import SandboxSettings
from pettingflow.envs.code_env import (
    HARNESS,
    CaseResult,
    CodeEnv,
    CodeEnvConfig,
    Job,
    SuiteResult,
    build_program,
    code_reward,
    code_success,
    generated_suite,
    parse_ground_truth,
    parse_program_output,
    read_program_spec,
    unit_test_reward,
)
from pettingflow.envs.humaneval import load_humaneval

# --------------------------------------------------------------------------------------------------
# a toy task and a fake sandbox (shared with test_agents.py)
# --------------------------------------------------------------------------------------------------
TOY_TASK: dict[str, str] = {
    "task_id": "Toy/0",
    "prompt": 'def add(a: int, b: int) -> int:\n    """Return a + b.\n    >>> add(2, 3)\n    5\n    """\n',
    "canonical_solution": "    return a + b\n",
    "test": (
        "\n\nMETADATA = {}\n\n\ndef check(candidate):\n"
        "    assert candidate(2, 3) == 5\n    assert candidate(0, 0) == 0\n    assert candidate(-1, 1) == 0\n"
        "    assert True\n"
    ),
    "entry_point": "add",
}
GOLDEN = TOY_TASK["prompt"] + TOY_TASK["canonical_solution"]
GOOD_CODE = "def add(a, b):\n    return a + b"
BUGGY_CODE = "def add(a, b):\n    return a - b"  # passes only add(0, 0) == 0 of the ground truth


@dataclass(frozen=True)
class FakeExecResult:
    exit_code: int | None
    timed_out: bool
    stdout: str
    stderr: str = ""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    duration_s: float = 0.0
    killed_reason: str | None = None

    @property
    def passed(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


class FakeSandbox:
    """Answers harness programs without running them.

    ``impls`` maps a solution's exact text to a Python callable standing in for it; each case (test
    authored text, never model output) is evaluated with that callable bound to the entry point.
    A solution not in ``impls`` "does not define the function".
    """

    def __init__(self, impls: dict[str, Callable[..., Any]] | None = None, *, result: FakeExecResult | None = None):
        self.impls = {GOLDEN: lambda a, b: a + b, GOOD_CODE: lambda a, b: a + b, BUGGY_CODE: lambda a, b: a - b}
        self.impls.update(impls or {})
        self.result = result
        self.programs: list[str] = []  # the stdin (spec) of each run

    def run(self, code: str, *, stdin: str = "", timeout_s: float | None = None) -> FakeExecResult:
        assert code == HARNESS, "the program is always the harness; the jobs travel on stdin"
        self.programs.append(stdin)
        if self.result is not None:
            return self.result
        spec = read_program_spec(stdin)
        lines = [spec["marker"] + json.dumps([i, self._job(j)]) for i, j in enumerate(spec["jobs"])]
        return FakeExecResult(0, False, "noise\n" + "\n".join(lines) + "\n")

    async def run_async(self, code: str, *, stdin: str = "", timeout_s: float | None = None) -> FakeExecResult:
        return self.run(code, stdin=stdin, timeout_s=timeout_s)

    def _job(self, job: dict[str, Any]) -> dict[str, Any]:
        impl = self.impls.get(job["solution"])
        cases = [s["source"] for s in job["steps"] if s["case"]]
        if impl is None:
            err = f"the solution does not define a function named {job['entry_point']}"
            return {"setup_error": err, "cases": [[False, err] for _ in cases]}
        names = {job["entry_point"]: impl}
        if job["candidate_name"]:
            names[job["candidate_name"]] = impl
        out = []
        for case in cases:
            try:
                exec(case, dict(names))
                out.append([True, None])
            except Exception as exc:
                out.append([False, type(exc).__name__])
        return {"setup_error": None, "cases": out}


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def toy_env(max_turns: int = 4, sandbox: Any = None, **config: Any) -> CodeEnv:
    return CodeEnv(TOY_TASK, {"max_turns": max_turns, **config}, sandbox=sandbox or FakeSandbox())


# --------------------------------------------------------------------------------------------------
# ground truth parsing
# --------------------------------------------------------------------------------------------------
def test_ground_truth_cases_skip_constant_asserts() -> None:
    suite = parse_ground_truth(TOY_TASK["test"])
    assert suite.cases == ["assert candidate(2, 3) == 5", "assert candidate(0, 0) == 0", "assert candidate(-1, 1) == 0"]
    assert suite.candidate_name == "candidate"
    assert "METADATA = {}" in suite.preamble
    assert [s.is_case for s in suite.steps] == [True, True, True, False]


def test_ground_truth_asserts_in_the_test_grammar_are_also_call_cases() -> None:
    """`assert candidate(<literals>) == <literal>` (and the other exact forms, without a message) carries its call
    case, so the judge can send the call ahead; a message, a tolerance form or a non-literal stays source only."""
    source = (
        "def check(candidate):\n"
        "    assert candidate(2, 3) == 5\n"
        "    assert candidate(1, 1) is not None\n"
        "    assert candidate(0, 0) == 0, 'zero'\n"
        "    assert abs(candidate(1, 0) - 1) < 1e-6\n"
        "    assert candidate(2, 2) == 2 * 2\n"
    )
    steps = parse_ground_truth(source).steps
    assert [s.call["check"] if s.call else None for s in steps] == ["==", "is not", None, None, None]
    assert all(s.is_case for s in steps)


def test_ground_truth_loop_is_one_case_and_setup_is_not_a_case() -> None:
    source = "def check(f):\n    import math\n    for i in range(3):\n        assert f(i, 0) == i\n    x = 1\n"
    suite = parse_ground_truth(source)
    assert suite.candidate_name == "f"
    assert [s.is_case for s in suite.steps] == [False, True, False]


def test_ground_truth_without_check_uses_top_level_asserts() -> None:
    suite = parse_ground_truth("import math\nassert add(1, 2) == 3\nassert add(0, 1) == 1\n")
    assert suite.candidate_name is None
    assert suite.cases == ["assert add(1, 2) == 3", "assert add(0, 1) == 1"]


def test_every_humaneval_test_has_cases() -> None:
    for task in load_humaneval():
        assert parse_ground_truth(task["test"]).cases, task["task_id"]


def test_task_without_real_asserts_is_rejected() -> None:
    with pytest.raises(ValueError, match="no assert that can fail"):
        CodeEnv({**TOY_TASK, "test": "def check(candidate):\n    assert True\n"}, sandbox=FakeSandbox())


def test_task_missing_keys_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"missing keys \['test'\]"):
        CodeEnv({k: v for k, v in TOY_TASK.items() if k != "test"}, sandbox=FakeSandbox())


# --------------------------------------------------------------------------------------------------
# the harness protocol
# --------------------------------------------------------------------------------------------------
def test_program_round_trips_its_spec_on_stdin_and_the_program_holds_none_of_it() -> None:
    suite = generated_suite(["assert add(1, 1) == 2"], "add")
    job = Job("def add(a, b): return 0", "add", suite, context="x = '\\n'")
    program = build_program([job], case_timeout_s=1.5, budget_s=3.0, marker="@@M@@ ")
    spec = read_program_spec(program.stdin)
    assert spec["marker"] == "@@M@@ "
    assert spec["case_timeout_s"] == 1.5
    assert spec["jobs"] == [job.to_json()]
    assert program.code == HARNESS and "@@M@@" not in program.code and "add(1, 1)" not in program.code
    compile(program.code, "<harness>", "exec")  # the whole program is valid Python


def test_missing_summary_fails_every_case_with_a_reason() -> None:
    job = Job(GOOD_CODE, "add", generated_suite(["assert add(1, 1) == 2", "assert add(1, 2) == 3"], "add"))
    timed_out = FakeExecResult(None, True, "partial output")
    [res] = parse_program_output(timed_out, [job], "@@M@@ ")
    assert res.total == 2 and res.passed == 0
    assert "timed out" in (res.cases[0].error or "")
    crashed = FakeExecResult(1, False, "", stderr="Traceback ...\nMemoryError")
    [res] = parse_program_output(crashed, [job], "@@M@@ ")
    assert "MemoryError" in (res.setup_error or "")
    cut = FakeExecResult(0, False, "x" * 100, stdout_truncated=True)  # ran to the end, summary cut off
    [res] = parse_program_output(cut, [job], "@@M@@ ")
    assert res.passed == 0 and "cut at the sandbox's cap" in (res.setup_error or "")


def test_result_lines_are_found_among_other_output_and_forged_ones_without_the_marker_are_ignored() -> None:
    job = Job(GOOD_CODE, "add", generated_suite(["assert add(1, 1) == 2", "assert add(1, 2) == 4"], "add"))
    forged = "__PETTINGFLOW_RESULT_0__ " + json.dumps([0, {"setup_error": None, "cases": [[True, None]] * 2}])
    entry = {"setup_error": None, "cases": [[True, None], [False, "AssertionError"]]}
    out = f"hello\n{forged}\n@@M@@ " + json.dumps([0, entry]) + "\n@@M@@ " + json.dumps([0, {"cases": []}])
    [res] = parse_program_output(FakeExecResult(0, False, out), [job], "@@M@@ ")
    assert res.flags() == [True, False]
    assert res.cases[1] == CaseResult("assert add(1, 2) == 4", False, "AssertionError")
    assert res.ratio == 0.5


# --------------------------------------------------------------------------------------------------
# reward formulas (the examples of docs/code-env.md)
# --------------------------------------------------------------------------------------------------
def _suite(*flags: bool) -> SuiteResult:
    return SuiteResult(tuple(CaseResult(f"case{i}", f) for i, f in enumerate(flags)))


def test_code_reward_is_ground_truth_pass_ratio() -> None:
    assert code_reward(_suite(True, False, False)) == pytest.approx(1 / 3)
    assert code_success(_suite(True, True, True)) is True
    assert code_success(_suite(True, True, False)) is False
    assert code_reward(_suite()) == 0.0 and code_success(_suite()) is False


def test_test_reward_validity_plus_catch_bonus() -> None:
    # 3 asserts: valid, invalid, valid. The code fails the 1st (caught) and passes the 3rd.
    r = unit_test_reward([True, False, True], [False, False, True], 1 / 3, 0.5)
    assert r.validity == pytest.approx(2 / 3)
    assert r.caught == 1 and r.bonus_applies
    assert r.reward == pytest.approx(0.5 * 2 / 3 + 0.5)
    assert r.success is False


def test_test_reward_invalid_assert_that_fails_the_code_is_not_a_catch() -> None:
    # the only failing assert on the code is also wrong about the canonical solution
    r = unit_test_reward([False, True], [False, True], 0.0, 0.5)
    assert r.caught == 0
    assert r.reward == pytest.approx(0.5 * 0.5)


def test_test_reward_all_valid_no_catch() -> None:
    r = unit_test_reward([True, True], [True, True], 0.5, 0.5)
    assert r.reward == pytest.approx(0.5) and r.success is True


def test_test_reward_without_buggy_code_is_validity() -> None:
    assert unit_test_reward([True, False], None, None, 0.5).reward == pytest.approx(0.5)
    # code that passes the ground truth: no bonus to earn
    assert unit_test_reward([True, True], [True, False], 1.0, 0.5).reward == pytest.approx(1.0)


def test_test_reward_empty_is_zero() -> None:
    r = unit_test_reward([], [], 0.0, 0.5)
    assert (r.reward, r.success) == (0.0, False)


def test_test_reward_weight_extremes() -> None:
    assert unit_test_reward([True, False], [False, True], 0.0, 0.0).reward == pytest.approx(0.5)
    assert unit_test_reward([True, False], [False, True], 0.0, 1.0).reward == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("tests", "expected_reward", "expected_success"),
    [
        (["assert add(2, 3) == 5", "assert add(1, 1) == 3", "assert add(0, 0) == 0"], 0.5 * 2 / 3 + 0.5, False),
        (["assert add(0, 0) == 0"], 0.5, True),
        (["assert add(1, 1) == 3"], 0.0, False),
        (["assert add(2, 3) == 5", "assert add(4, 1) == 5"], 1.0, True),
        ([], 0.0, False),
    ],
)
def test_docs_examples_after_buggy_code(tests: list[str], expected_reward: float, expected_success: bool) -> None:
    """The test-agent table of docs/code-env.md, through the env (code ``a - b`` first, w = 0.5)."""
    env = toy_env()
    assert code_reward(run(env.submit_code(BUGGY_CODE)).ground_truth) == pytest.approx(1 / 3)
    ev = run(env.submit_tests(tests))
    flags_on_code = ev.on_code.flags() if ev.on_code is not None else None
    r = unit_test_reward(ev.on_golden.flags(), flags_on_code, ev.code_ground_truth_ratio, 0.5)
    assert (r.reward, r.success) == (pytest.approx(expected_reward), expected_success)


def test_docs_worked_example_tests_before_code() -> None:
    env = toy_env()
    ev = run(env.submit_tests(["assert add(2, 3) == 5", "assert add(2, 2) == 5"]))
    assert ev.on_code is None and ev.code_ground_truth_ratio is None
    assert unit_test_reward(ev.on_golden.flags(), None, None, 0.5).reward == pytest.approx(0.5)


# --------------------------------------------------------------------------------------------------
# the env with the fake sandbox
# --------------------------------------------------------------------------------------------------
def test_initial_state() -> None:
    env = toy_env()
    s = env.state
    assert (s.task_id, s.entry_point, s.problem) == ("Toy/0", "add", TOY_TASK["prompt"])
    assert s.golden_code == GOLDEN
    assert len(s.ground_truth_cases) == 3
    assert s.generated_code is None and s.generated_tests == []
    assert (env.current_turn, env.done, env.max_turns) == (0, False, 4)


def test_submit_code_scores_ground_truth_in_one_sandbox_call() -> None:
    sandbox = FakeSandbox()
    env = toy_env(sandbox=sandbox)
    ev = run(env.submit_code(BUGGY_CODE))
    assert ev.ground_truth.flags() == [False, True, False]
    assert ev.generated_tests is None
    s = env.state
    assert s.generated_code == BUGGY_CODE and s.generated_code_history == [BUGGY_CODE]
    assert s.ground_truth_test_vs_generated_code_match_ratio == pytest.approx(1 / 3)
    assert len(sandbox.programs) == 1
    # the generated code runs after the prompt (context) and must define the entry point itself
    job = read_program_spec(sandbox.programs[0])["jobs"][0]
    assert job["context"] == TOY_TASK["prompt"] and job["candidate_name"] == "candidate"


def test_submit_tests_checks_golden_and_code_in_one_call() -> None:
    sandbox = FakeSandbox()
    env = toy_env(sandbox=sandbox)
    run(env.submit_code(BUGGY_CODE))
    tests = ["assert add(2, 3) == 5", "assert add(1, 1) == 3", "assert add(0, 0) == 0"]
    ev = run(env.submit_tests(tests))
    assert len(sandbox.programs) == 2
    assert ev.on_golden.flags() == [True, False, True]
    assert ev.on_code is not None and ev.on_code.flags() == [False, False, True]
    assert ev.code_ground_truth_ratio == pytest.approx(1 / 3)
    s = env.state
    assert s.generated_tests == tests and s.generated_test_history == [tests]
    assert s.generated_test_validity == [True, False, True]
    assert s.generated_test_vs_golden_code_match_ratio == pytest.approx(2 / 3)
    assert s.generated_test_vs_generated_code_match_ratio == pytest.approx(1 / 3)
    assert [c.source for c in s.mismatch_cases] == tests[:2]
    history = s.generated_test_vs_generated_code_mismatch_cases_history
    assert history[-1]["code_version"] == 0
    assert [m["test"] for m in history[-1]["mismatches"]] == tests[:2]


def test_new_code_is_checked_against_latest_tests() -> None:
    env = toy_env()
    run(env.submit_code(BUGGY_CODE))
    run(env.submit_tests(["assert add(2, 3) == 5"]))
    ev = run(env.submit_code(GOOD_CODE))
    assert ev.generated_tests is not None and ev.generated_tests.flags() == [True]
    s = env.state
    assert s.generated_test_vs_generated_code_match_ratio == 1.0 and s.mismatch_cases == []
    assert len(s.generated_test_vs_generated_code_mismatch_cases_history) == 2
    assert s.generated_code_history == [BUGGY_CODE, GOOD_CODE]


def test_tests_are_capped() -> None:
    env = toy_env(max_generated_tests=2)
    run(env.submit_tests([f"assert add({i}, 0) == {i}" for i in range(5)]))
    assert len(env.state.generated_tests) == 2


def test_empty_tests_make_no_sandbox_call() -> None:
    sandbox = FakeSandbox()
    env = toy_env(sandbox=sandbox)
    ev = run(env.submit_tests([]))
    assert ev.on_golden.total == 0 and sandbox.programs == []


def test_episode_ends_on_success() -> None:
    env = toy_env(max_turns=4)
    run(env.submit_code(BUGGY_CODE))
    env.finish_turn()
    assert not env.done
    run(env.submit_code(GOOD_CODE))
    env.finish_turn()
    assert env.done and not env.truncated and env.solved() and env.outcome == "solved"
    assert env.current_turn == 2


def test_episode_ends_at_max_turns() -> None:
    env = toy_env(max_turns=2)
    run(env.submit_code(BUGGY_CODE))
    env.finish_turn()
    run(env.submit_tests(["assert add(2, 3) == 5"]))
    env.finish_turn()
    assert env.done and env.truncated and not env.solved() and env.outcome == "max_turns"
    with pytest.raises(RuntimeError, match="already done"):
        env.finish_turn()


def test_reset_restores_initial_state() -> None:
    env = toy_env()
    run(env.submit_code(GOOD_CODE))
    env.finish_turn()
    env.reset(seed=7)
    assert env.state.generated_code is None and env.current_turn == 0 and not env.done and env.seed == 7
    assert env.history == []


def test_config_errors_name_the_key() -> None:
    with pytest.raises(ValueError, match="catch_bonus_weight"):
        toy_env(catch_bonus_weight=2.0)
    with pytest.raises(ValueError, match="max_turn"):
        CodeEnv(TOY_TASK, {"max_turn": 3}, sandbox=FakeSandbox())
    assert isinstance(toy_env().config, CodeEnvConfig)


# --------------------------------------------------------------------------------------------------
# the package (envs/code_env/): one name for the env class, one knob for merging
# --------------------------------------------------------------------------------------------------
def test_the_env_class_keeps_its_registry_path() -> None:
    """Class paths are cache keys and row labels: the split into modules must not change them."""
    from pettingflow.envs.registry import ENV_REGISTRY

    assert ENV_REGISTRY.class_path("code-env") == "pettingflow.envs.code_env:CodeEnv"
    assert ENV_REGISTRY.short_name("pettingflow.envs.code_env:CodeEnv") == "code-env"


def test_max_merged_episodes_is_read_at_call_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/rollout.py's ablation sets ``batching.MAX_MERGED_EPISODES`` after import."""
    from pettingflow.envs.code_env import batching

    monkeypatch.setattr(batching, "MAX_MERGED_EPISODES", 1)

    async def max_batch() -> int:
        return batching.SandboxBatcher.get(FakeSandbox(), CodeEnvConfig()).max_batch

    assert asyncio.run(max_batch()) == 1


# --------------------------------------------------------------------------------------------------
# the real sandbox (pettingflow.envs.sandbox, written separately); these need bubblewrap or docker
# --------------------------------------------------------------------------------------------------
def real_env(task: dict[str, Any], timeout_s: float = 20, **config: Any) -> CodeEnv:
    from pettingflow.envs.sandbox import make_sandbox

    settings = SandboxSettings(timeout_s=timeout_s)
    return CodeEnv(task, {"sandbox": settings.model_dump(), **config}, sandbox=make_sandbox(settings))


def humaneval(task_id: str) -> dict[str, Any]:
    return next(t for t in load_humaneval() if t["task_id"] == task_id)


@pytest.mark.sandbox
@pytest.mark.parametrize("task_id", ["HumanEval/0", "HumanEval/32", "HumanEval/38", "HumanEval/53", "HumanEval/163"])
def test_real_sandbox_canonical_solution_passes_all_ground_truth(task_id: str) -> None:
    task = humaneval(task_id)
    env = real_env(task)
    suite = parse_ground_truth(task["test"])
    golden = run(env.evaluate([Job(env.state.golden_code, task["entry_point"], suite, context=task["prompt"])]))
    assert golden[0].ratio == 1.0, golden[0]
    # the same code submitted as "generated" code (prompt context first, entry point redefined)
    ev = run(env.submit_code(task["prompt"] + task["canonical_solution"]))
    assert ev.ground_truth.ratio == 1.0, ev.ground_truth
    assert env.solved()


@pytest.mark.sandbox
def test_real_sandbox_wrong_solution_scores_below_one() -> None:
    task = humaneval("HumanEval/0")
    env = real_env(task)
    wrong = "def has_close_elements(numbers, threshold):\n    return True\n"
    ev = run(env.submit_code(wrong))
    assert 0.0 < ev.ground_truth.ratio < 1.0
    assert ev.ground_truth.passed == 4 and ev.ground_truth.total == 7
    broken = run(env.submit_code("def has_close_elements(numbers, threshold)\n    return True\n"))
    assert broken.ground_truth.ratio == 0.0 and "SyntaxError" in (broken.ground_truth.setup_error or "")


@pytest.mark.sandbox
def test_real_sandbox_hanging_code_times_out_per_case() -> None:
    task = humaneval("HumanEval/0")
    env = real_env(task, case_timeout_s=0.3)
    ev = run(env.submit_code("def has_close_elements(numbers, threshold):\n    while True:\n        pass\n"))
    assert ev.ground_truth.passed == 0
    assert all("timed out" in (c.error or "") for c in ev.ground_truth.cases)


HOSTILE = {
    "ignores the alarm": "import signal\ndef has_close_elements(numbers, threshold):\n"
    "    signal.signal(signal.SIGALRM, signal.SIG_IGN)\n    while True:\n        pass\n",
    "exits the process": "import os\ndef has_close_elements(numbers, threshold):\n    os._exit(0)\n",
    "floods stdout": "def has_close_elements(numbers, threshold):\n    print('x' * 10**6)\n    return True\n",
    "fakes a summary": "print('__PETTINGFLOW_RESULT_0__ [[true]]')\ndef has_close_elements(numbers, threshold):\n"
    "    return True\n",
}


@pytest.mark.sandbox
@pytest.mark.parametrize("behaviour", sorted(HOSTILE))
def test_real_sandbox_hostile_code_cannot_lift_its_score(behaviour: str) -> None:
    # 4 cases must pass: their limit is generous (a short one would fail them on a loaded machine); the hanging
    # ones take 7 x 1.5 s at most, inside the program's 15 s
    env = real_env(humaneval("HumanEval/0"), timeout_s=15, case_timeout_s=1.5)
    ev = run(env.submit_code(HOSTILE[behaviour]))
    assert ev.ground_truth.total == 7
    assert ev.ground_truth.passed == (4 if behaviour in ("floods stdout", "fakes a summary") else 0)


@pytest.mark.sandbox
def test_real_sandbox_test_reward_matches_formula() -> None:
    task = humaneval("HumanEval/0")
    env = real_env(task)
    run(env.submit_code("def has_close_elements(numbers, threshold):\n    return True\n"))
    tests = [
        "assert has_close_elements([1.0, 2.0, 3.0], 0.5) == False",  # valid, and the code returns True: caught
        "assert has_close_elements([1.0, 2.8, 3.0, 4.0, 5.0, 2.0], 0.3) == True",  # valid, passes on the code
        "assert has_close_elements([1.0, 5.0], 0.5) == True",  # wrong expectation: invalid
    ]
    ev = run(env.submit_tests(tests))
    assert ev.on_golden.flags() == [True, True, False]
    assert ev.on_code is not None and ev.on_code.flags() == [False, True, True]
    r = unit_test_reward(ev.on_golden.flags(), ev.on_code.flags(), ev.code_ground_truth_ratio, 0.5)
    assert r.caught == 1
    assert r.reward == pytest.approx(0.5 * (2 / 3) + 0.5)
    # the code agent is told which generated test failed and what the function returned
    [failed] = env.state.mismatch_cases
    assert failed.source == tests[0] and "left side was True" in (failed.error or "")


# --------------------------------------------------------------------------------------------------
# per-turn local rewards, the team reward, forks (multi-level rewards and tree rollouts, docs/code-env.md)
# --------------------------------------------------------------------------------------------------
def test_local_turn_rewards_team_reward_and_forks() -> None:
    from rollout_fakes import CharChatTokenizer

    from pettingflow.agents.code_agents import CodeGeneratorAgent, UnitTestGeneratorAgent

    tok = CharChatTokenizer()
    coder, tester = CodeGeneratorAgent(tokenizer=tok), UnitTestGeneratorAgent(agent_idx=1, tokenizer=tok)
    env = toy_env()
    assert env.episode_info() == {"team_reward": 0.0, "solved": False}  # no code yet
    coder.update_from_env(0, env)
    coder.update_from_model(0, env, f"```python\n{BUGGY_CODE}\n```")
    run(coder.step(env))
    sandbox = coder.turn_info.pop("sandbox")  # each ground-truth case and what the sandbox said of it
    assert coder.turn_info == {"role": "code", "local_reward": 1 / 3, "ground_truth_passed": 1, "ground_truth_cases": 3}
    assert [c["passed"] for c in sandbox] == [False, True, False]
    assert all(bool(c["error"]) != c["passed"] for c in sandbox)  # an error exactly where a case failed
    assert env.episode_info()["team_reward"] == pytest.approx(1 / 3)  # graded by the latest code
    # a fork takes the tester's turn; the episode itself does not see it
    fork, fork_tester = env.fork(), tester.fork()
    assert fork.sandbox is env.sandbox
    fork_tester.update_from_env(1, fork)
    fork_tester.update_from_model(1, fork, "```python\nassert add(2, 3) == 5\nassert add(1, 1) == 3\n```")
    run(fork_tester.step(fork))
    # 2 asserts, 1 valid on the canonical solution (V = 1/2), it catches the buggy code: 0.5 * 0.5 + 0.5 = 0.75
    golden = fork_tester.turn_info.pop("sandbox")  # the asserts on the canonical solution
    assert [c["passed"] for c in golden] == [True, False] and golden[1]["case"] == "assert add(1, 1) == 3"
    assert fork_tester.turn_info == {
        "role": "test",
        "local_reward": 0.75,
        "asserts": 2,
        "validity": 0.5,
        "caught": 1,
        "bonus_applies": True,
    }
    assert fork.current_turn == 2 and fork.state.generated_tests
    assert env.current_turn == 1 and env.state.generated_tests == [] and tester.answer_history == []
    # good code on the real episode: solved, team reward 1
    coder.update_from_env(1, env)
    coder.update_from_model(1, env, f"```python\n{GOOD_CODE}\n```")
    run(coder.step(env))
    assert env.episode_info() == {"team_reward": 1.0, "solved": True}
