"""The code env (PettingLLMs' agent/env interface): a code agent writes a function, a test agent writes asserts for it.

Turn order is code -> test -> code -> ... (taken from the config's agent list by the engine). The
env holds the shared ``CodeEnvState``: the problem, the latest code, the latest tests and how they
fared against each other, the hidden ground truth, and histories. The episode ends when the latest
code passes every ground-truth test, or after ``max_turns`` agent calls. See docs/code-env.md for
the rewards, with worked examples.

Generated tests are ``assert`` statements that call the entry point (``assert add(2, 3) == 5``), not
input/output pairs as in PettingLLMs: HumanEval functions take Python values, not stdin, and its
ground truth is itself asserts, so one format and one harness serve both.

Every evaluation runs in the sandbox as ONE program (``build_program``) that executes a list of
jobs -- (solution, test suite) pairs -- each in a forked child process, each assert separately under a
per-case time limit, and prints one JSON summary line behind a random marker. So one agent turn
costs one sandbox call however many asserts it checks, and the pass ratios are per assert.
"""

from __future__ import annotations

import ast
import asyncio
import functools
import json
import logging
import re
import secrets
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import Field

from pettingflow.configs.settings import SandboxSettings
from pettingflow.envs.base import Env, EnvConfig, TaskDataError

if TYPE_CHECKING:
    from pettingflow.envs.sandbox import ExecResult, Sandbox

log = logging.getLogger(__name__)

TASK_KEYS: tuple[str, ...] = ("task_id", "prompt", "canonical_solution", "test", "entry_point")


class CodeEnvConfig(EnvConfig):
    """Settings of ``code-env``; every key has a default so ``{}`` is a valid config."""

    sandbox: SandboxSettings = Field(default_factory=SandboxSettings)
    case_timeout_s: float = Field(2.0, gt=0.0, description="Time limit for one assert (and for loading a solution).")
    budget_fraction: float = Field(
        0.7,
        gt=0.0,
        lt=1.0,
        description="Share of sandbox.timeout_s the harness may spend on cases; the rest covers process start.",
    )
    max_generated_tests: int = Field(8, ge=1, description="Asserts kept from one test-agent reply (first ones).")
    catch_bonus_weight: float = Field(
        0.5, ge=0.0, le=1.0, description="w in r_test = (1 - w) * validity + w * caught (docs/code-env.md)."
    )


# --------------------------------------------------------------------------------------------------
# test suites: what a job checks
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SuiteStep:
    """One statement of a test body; ``is_case`` when it contains a real (non-constant) assert."""

    source: str
    is_case: bool


@dataclass(frozen=True)
class AssertSuite:
    """Statements run in order after the solution is loaded; each case is scored on its own.

    ``preamble`` runs once (module-level code of a HumanEval ``test``: imports, METADATA, helpers).
    ``candidate_name`` is bound to the entry point (``check(candidate)``'s parameter) when set.
    """

    steps: tuple[SuiteStep, ...]
    preamble: str = ""
    candidate_name: str | None = None

    @property
    def cases(self) -> list[str]:
        return [s.source for s in self.steps if s.is_case]


def _is_case(stmt: ast.stmt) -> bool:
    return any(isinstance(n, ast.Assert) and not isinstance(n.test, ast.Constant) for n in ast.walk(stmt))


@functools.lru_cache(maxsize=1024)
def parse_ground_truth(test_source: str) -> AssertSuite:
    """Split a HumanEval ``test`` into cases: one per top-level statement of ``check`` that asserts.

    A ``for`` loop full of asserts is one case; ``assert True`` is not a case (it cannot fail and
    would only inflate ratios). Without a ``check`` function, the module's own top-level statements
    are the steps (a file of bare asserts works too).
    """
    try:
        tree = ast.parse(test_source)
    except SyntaxError as exc:
        raise ValueError(f"ground-truth test does not parse: {exc}") from exc
    check = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"), None)
    if check is None:
        steps = tuple(SuiteStep(ast.unparse(s), _is_case(s)) for s in tree.body)
        return AssertSuite(steps=steps)
    rest = [n for n in tree.body if n is not check]
    params = check.args.posonlyargs + check.args.args
    steps = tuple(SuiteStep(ast.unparse(s), _is_case(s)) for s in check.body)
    return AssertSuite(
        steps=steps,
        preamble=ast.unparse(ast.Module(body=rest, type_ignores=[])),
        candidate_name=params[0].arg if params else None,
    )


def generated_suite(tests: Sequence[str]) -> AssertSuite:
    """A suite of generated asserts, each its own case, calling the entry point by name."""
    return AssertSuite(steps=tuple(SuiteStep(t, True) for t in tests))


# --------------------------------------------------------------------------------------------------
# results
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CaseResult:
    source: str
    passed: bool
    error: str | None = None


@dataclass(frozen=True)
class SuiteResult:
    """Per-case outcome of one (solution, suite) job; ``setup_error`` when the solution did not load."""

    cases: tuple[CaseResult, ...]
    setup_error: str | None = None

    @property
    def total(self) -> int:
        return len(self.cases)

    @property
    def passed(self) -> int:
        return sum(c.passed for c in self.cases)

    @property
    def ratio(self) -> float:
        """Passed / total; 0.0 for an empty suite (nothing was shown to work)."""
        return self.passed / self.total if self.cases else 0.0

    @property
    def all_passed(self) -> bool:
        return bool(self.cases) and self.passed == self.total

    def flags(self) -> list[bool]:
        return [c.passed for c in self.cases]


@dataclass(frozen=True)
class Job:
    """Run ``suite`` against ``solution``. ``context`` (the problem prompt) runs first so that helpers
    and imports it defines exist; then the entry point is removed so the solution must define it."""

    solution: str
    entry_point: str
    suite: AssertSuite
    context: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "context": self.context,
            "solution": self.solution,
            "entry_point": self.entry_point,
            "preamble": self.suite.preamble,
            "candidate_name": self.suite.candidate_name,
            "steps": [{"source": s.source, "case": s.is_case} for s in self.suite.steps],
        }


# --------------------------------------------------------------------------------------------------
# the sandboxed harness
# --------------------------------------------------------------------------------------------------
_SPEC_PLACEHOLDER = "__PETTINGFLOW_SPEC__"

# Runs inside the sandbox, stdlib only. The parent never executes model code (unless fork fails):
# each job runs in a forked child whose stdout/stderr go to /dev/null, so model code cannot flood or
# forge the summary, and a crash or hang loses only that job's remaining cases.
HARNESS = r"""
import ast, json, os, select, signal, sys, time

SPEC = json.loads(__PETTINGFLOW_SPEC__)
_OUT = os.dup(1)
_NULL = os.open(os.devnull, os.O_RDWR)
os.dup2(_NULL, 0)
os.dup2(_NULL, 1)


class _Timeout(BaseException):
    pass


def _on_alarm(signum, frame):
    raise _Timeout()


def _describe(exc):
    if isinstance(exc, _Timeout):
        return "timed out"
    text = type(exc).__name__
    msg = str(exc)
    if msg:
        text += ": " + msg
    return text[:300]


def _left_value(source, ns, deadline):
    try:
        node = ast.parse(source).body[0]
        if not (isinstance(node, ast.Assert) and isinstance(node.test, ast.Compare)):
            return ""
        expr = ast.fix_missing_locations(ast.Expression(node.test.left))
        signal.setitimer(signal.ITIMER_REAL, max(0.01, min(0.5, deadline - time.monotonic())))
        try:
            value = eval(compile(expr, "<detail>", "eval"), ns)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        return " (left side was " + repr(value)[:150] + ")"
    except BaseException:
        return ""


def _run_job(job, deadline, emit):
    signal.signal(signal.SIGALRM, _on_alarm)
    ns = {"__name__": "__pettingflow_solution__"}
    limit = SPEC["case_timeout_s"]

    def timed(source, name):
        left = deadline - time.monotonic()
        if left <= 0:
            raise _Timeout()
        signal.setitimer(signal.ITIMER_REAL, min(limit, left))
        try:
            exec(compile(source, name, "exec"), ns)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)

    entry = job["entry_point"]
    setup_error = None
    try:
        if job["context"]:
            try:
                timed(job["context"], "<prompt>")
            except Exception:
                pass
            ns.pop(entry, None)
        timed(job["solution"], "<solution>")
        if not callable(ns.get(entry)):
            setup_error = "the solution does not define a function named " + entry
    except BaseException as exc:
        setup_error = "the solution failed to load: " + _describe(exc)
    if setup_error is None:
        try:
            if job["preamble"]:
                timed(job["preamble"], "<test setup>")
            if job["candidate_name"]:
                ns[job["candidate_name"]] = ns[entry]
        except BaseException as exc:
            setup_error = "the test setup failed: " + _describe(exc)
    emit({"setup_error": setup_error})
    for i, step in enumerate(job["steps"]):
        if setup_error is not None:
            if step["case"]:
                emit({"i": i, "ok": False, "error": setup_error})
            continue
        ok, error = True, None
        try:
            try:
                timed(step["source"], "<test %d>" % i)
            except AssertionError as exc:
                ok, error = False, _describe(exc) + _left_value(step["source"], ns, deadline)
            except BaseException as exc:
                ok, error = False, _describe(exc)
        except BaseException as exc:
            ok, error = False, _describe(exc)
        if step["case"]:
            emit({"i": i, "ok": ok, "error": error})


def _run_forked(job, deadline):
    r, w = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        os.close(r)
        os.close(w)
        return None
    if pid == 0:
        try:
            os.close(r)
            os.dup2(_NULL, 2)
            _run_job(job, deadline, lambda obj: os.write(w, (json.dumps(obj) + "\n").encode()))
        finally:
            os._exit(0)
    os.close(w)
    chunks = []
    while True:
        left = deadline + 0.25 - time.monotonic()
        if left <= 0:
            break
        ready, _, _ = select.select([r], [], [], left)
        if not ready:
            continue
        data = os.read(r, 65536)
        if not data:
            break
        chunks.append(data)
    os.close(r)
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
    os.waitpid(pid, 0)
    return b"".join(chunks).decode("utf-8", "replace").splitlines()


def _collect(job, lines, deadline):
    setup_error, got = None, {}
    for line in lines:
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if "setup_error" in obj:
            setup_error = obj["setup_error"]
        elif "i" in obj:
            got[obj["i"]] = obj
    if time.monotonic() >= deadline:
        missing = "timed out (time budget of this run used up)"
    else:
        missing = "the test process died before reaching this case"
    cases = []
    for i, step in enumerate(job["steps"]):
        if step["case"]:
            rec = got.get(i)
            cases.append([bool(rec["ok"]), rec.get("error")] if rec else [False, missing])
    return {"setup_error": setup_error, "cases": cases}


def _run_group(jobs, budget_s, results):
    end = time.monotonic() + budget_s
    counts = [sum(1 for s in j["steps"] if s["case"]) for j in jobs]
    remaining = sum(counts)
    for job, n in zip(jobs, counts):
        now = time.monotonic()
        share = (end - now) * n / remaining if remaining else 0.0
        remaining -= n
        deadline = now + max(share, 0.0)
        lines = _run_forked(job, deadline)
        if lines is None:
            lines = []
            _run_job(job, deadline, lambda obj: lines.append(json.dumps(obj)))
        results.append(_collect(job, lines, deadline))


def _clean_slate():
    # Between the episodes of a merged run: what one left behind must not reach the next, as if each
    # had its own sandbox. Kill every other process we may signal (not us, not the namespace's init),
    # then empty the scratch folders.
    import shutil

    try:
        os.kill(-1, signal.SIGKILL)
    except OSError:
        pass
    for root in (os.getcwd(), "/tmp", "/dev/shm"):
        try:
            names = os.listdir(root)
        except OSError:
            continue
        for name in names:
            path = os.path.join(root, name)
            try:
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    os.unlink(path)
            except OSError:
                pass


def _main():
    jobs = SPEC["jobs"]
    groups = SPEC.get("groups") or [[len(jobs), SPEC["budget_s"]]]
    results = []
    start = 0
    for g, (n, budget_s) in enumerate(groups):
        if g:
            _clean_slate()
        _run_group(jobs[start : start + n], budget_s, results)
        start += n
    os.write(_OUT, (SPEC["marker"] + json.dumps(results) + "\n").encode())


_main()
"""


def build_program(
    jobs: Sequence[Job],
    *,
    case_timeout_s: float,
    budget_s: float,
    marker: str | None = None,
    groups: Sequence[int] | None = None,
) -> str:
    """The complete Python program that runs ``jobs`` and prints ``marker + json(results)``.

    ``groups`` (job counts, summing to ``len(jobs)``) merges the evaluations of several episodes into one
    run: each group gets its own ``budget_s``, and between groups the harness kills every process the
    previous one left and empties the scratch folders. The summary stays one flat list, one per job.
    """
    spec: dict[str, Any] = {
        "marker": marker or f"__PETTINGFLOW_RESULT_{secrets.token_hex(8)}__ ",
        "case_timeout_s": case_timeout_s,
        "budget_s": budget_s,
        "jobs": [j.to_json() for j in jobs],
    }
    if groups is not None:
        if sum(groups) != len(jobs) or any(n < 1 for n in groups):
            raise ValueError(f"groups {list(groups)} do not partition {len(jobs)} jobs")
        spec["groups"] = [[n, budget_s] for n in groups]
    return HARNESS.replace(_SPEC_PLACEHOLDER, repr(json.dumps(spec)), 1)


def read_program_spec(program: str) -> dict[str, Any]:
    """The spec embedded by ``build_program`` (for debugging a sandbox call, and for fake sandboxes)."""
    match = re.search(r"^SPEC = json\.loads\((.*)\)$", program, flags=re.MULTILINE)
    if match is None:
        raise ValueError("not a program made by build_program: no SPEC line")
    return json.loads(ast.literal_eval(match.group(1)))


def parse_program_output(result: ExecResult, jobs: Sequence[Job], marker: str) -> list[SuiteResult]:
    """Per-job results from the sandbox output; every case fails when the summary is missing.

    A missing summary means the whole program was killed (wall-clock, memory) or its output cut:
    that is the solution's fault as far as rewards go, and the reason is kept in each case's error.
    """
    summary = None
    for line in reversed(result.stdout.splitlines()):
        if line.startswith(marker):
            summary = json.loads(line[len(marker) :])
            break
    if summary is None or len(summary) != len(jobs):
        if result.timed_out:
            reason = "timed out (the sandbox killed the run)"
        elif getattr(result, "killed_reason", None):
            reason = f"killed by the sandbox: {result.killed_reason}"
        elif getattr(result, "stdout_truncated", False):  # the summary line was past the output cap
            reason = f"the test run's output was cut at the sandbox's cap (exit code {result.exit_code})"
        else:
            tail = (result.stderr or "").strip().splitlines()[-1:] or ["no output"]
            reason = f"the test run produced no result (exit code {result.exit_code}): {tail[0][:200]}"
        return [
            SuiteResult(tuple(CaseResult(c, False, reason) for c in job.suite.cases), setup_error=reason)
            for job in jobs
        ]
    out = []
    for job, res in zip(jobs, summary, strict=True):
        sources = job.suite.cases
        cases = tuple(CaseResult(src, bool(ok), err) for src, (ok, err) in zip(sources, res["cases"], strict=True))
        out.append(SuiteResult(cases, res.get("setup_error")))
    return out


# --------------------------------------------------------------------------------------------------
# rewards (docs/code-env.md has worked examples)
# --------------------------------------------------------------------------------------------------
def code_reward(ground_truth: SuiteResult) -> float:
    """r_code = fraction of ground-truth cases the code passes."""
    return ground_truth.ratio


def code_success(ground_truth: SuiteResult) -> bool:
    """The code agent succeeds when its code passes every ground-truth case."""
    return ground_truth.all_passed


@dataclass(frozen=True)
class UnitTestReward:
    """The test agent's reward and its parts."""

    reward: float
    validity: float
    caught: int
    bonus_applies: bool
    success: bool


def unit_test_reward(
    valid: Sequence[bool],
    passes_on_code: Sequence[bool] | None,
    code_ground_truth_ratio: float | None,
    catch_bonus_weight: float,
) -> UnitTestReward:
    """Reward asserts that are right about the canonical solution and that catch a buggy code.

    n = number of asserts; V = (asserts that pass on the canonical solution) / n.
    The bonus applies when there is code and it fails some ground-truth case (ratio < 1).
    caught = asserts that pass on the canonical solution AND fail on the code; B = 1 if caught > 0.
    r_test = (1 - w) * V + w * B when the bonus applies, else V;  r_test = 0 when n = 0.
    success = n > 0 and every assert passes on the canonical solution.
    """
    n = len(valid)
    if n == 0:
        return UnitTestReward(0.0, 0.0, 0, False, False)
    validity = sum(bool(v) for v in valid) / n
    applies = passes_on_code is not None and code_ground_truth_ratio is not None and code_ground_truth_ratio < 1.0
    if applies:
        if len(passes_on_code) != n:
            raise ValueError(f"{n} validity flags but {len(passes_on_code)} results on the code")
        caught = sum(bool(v) and not bool(p) for v, p in zip(valid, passes_on_code, strict=True))
        reward = (1.0 - catch_bonus_weight) * validity + catch_bonus_weight * (1.0 if caught else 0.0)
    else:
        caught, reward = 0, validity
    return UnitTestReward(reward, validity, caught, applies, all(valid))


# --------------------------------------------------------------------------------------------------
# state and env
# --------------------------------------------------------------------------------------------------
@dataclass
class CodeEnvState:
    """What agents share. Fields under "hidden" are for rewards only; prompts must not show them.

    ``generated_tests`` replaces PettingLLMs' ``generated_test_input/output``: asserts calling the
    entry point. ``ground_truth_test`` replaces ``ground_truth_test_input/output`` (the HumanEval
    ``check`` source) and ``ground_truth_cases`` lists its scored statements.
    """

    # the problem (visible)
    task_id: str
    problem: str
    entry_point: str
    # hidden
    golden_code: str
    ground_truth_test: str
    ground_truth_cases: list[str]
    # the latest artifacts
    generated_code: str | None = None
    generated_tests: list[str] = field(default_factory=list)
    # how the latest artifacts fare
    ground_truth_test_vs_generated_code_match_ratio: float = 0.0  # hidden
    ground_truth_results: list[bool] = field(default_factory=list)  # hidden, per ground-truth case
    generated_test_vs_generated_code_match_ratio: float | None = None
    generated_test_results: list[CaseResult] = field(default_factory=list)  # latest tests on latest code
    generated_test_vs_golden_code_match_ratio: float | None = None  # hidden: validity of the latest tests
    generated_test_validity: list[bool] = field(default_factory=list)  # hidden
    # history
    generated_code_history: list[str] = field(default_factory=list)
    generated_test_history: list[list[str]] = field(default_factory=list)
    generated_test_vs_generated_code_mismatch_cases_history: list[dict[str, Any]] = field(default_factory=list)

    @property
    def mismatch_cases(self) -> list[CaseResult]:
        """Latest tests that fail on the latest code (what the code agent is told)."""
        return [r for r in self.generated_test_results if not r.passed]


@dataclass(frozen=True)
class CodeEvaluation:
    ground_truth: SuiteResult
    generated_tests: SuiteResult | None


@dataclass(frozen=True)
class UnitTestEvaluation:
    on_golden: SuiteResult
    on_code: SuiteResult | None
    code_ground_truth_ratio: float | None


class CodeEnv(Env):
    """HumanEval-style code generation with a code agent and a unit-test agent (``code-env``)."""

    Config = CodeEnvConfig
    config: CodeEnvConfig

    def __init__(
        self,
        task: Mapping[str, Any],
        config: CodeEnvConfig | Mapping[str, Any] | None = None,
        *,
        env_idx: int = 0,
        rollout_idx: int = 0,
        seed: int | None = None,
        sandbox: Sandbox | None = None,
    ) -> None:
        missing = [k for k in TASK_KEYS if k not in task]
        if missing:
            raise ValueError(
                f"code-env task {task.get('task_id', '?')!r} is missing keys {missing}; it needs {list(TASK_KEYS)}"
            )
        self._sandbox = sandbox
        super().__init__(task, config, env_idx=env_idx, rollout_idx=rollout_idx, seed=seed)

    @classmethod
    def validate_task(cls, task: Mapping[str, Any], config: EnvConfig) -> None:
        """HumanEval fields present and strings, and a ``test`` with at least one assert that can fail."""
        for key in TASK_KEYS:
            if key not in task:
                raise TaskDataError(key, f"missing; a code-env task needs {list(TASK_KEYS)}")
            value = task[key]
            if key == "task_id" and isinstance(value, int):
                continue
            if not isinstance(value, str) or (key != "canonical_solution" and not value.strip()):
                raise TaskDataError(key, f"must be a non-empty string, got {value!r:.60}")
        try:
            suite = parse_ground_truth(task["test"])
        except ValueError as exc:
            raise TaskDataError("test", str(exc)) from exc
        if not suite.cases:
            raise TaskDataError("test", "has no assert that can fail, so no code could be scored; add asserts")

    @classmethod
    def shared_resources(cls, config: EnvConfig) -> dict[str, Any]:
        """One sandbox for all episodes of this config (it owns the concurrency limit)."""
        from pettingflow.envs.sandbox import make_sandbox

        if not isinstance(config, CodeEnvConfig):
            raise TypeError(f"CodeEnv needs a CodeEnvConfig, got {type(config).__name__}")
        return {"sandbox": make_sandbox(config.sandbox)}

    @property
    def sandbox(self) -> Sandbox:
        if self._sandbox is None:
            self._sandbox = self.shared_resources(self.config)["sandbox"]
        return self._sandbox

    def initial_state(self) -> CodeEnvState:
        task = self.task
        suite = parse_ground_truth(task["test"])
        if not suite.cases:
            raise ValueError(
                f"task {task['task_id']!r}: its test has no assert that can fail, so no code could be scored"
            )
        return CodeEnvState(
            task_id=str(task["task_id"]),
            problem=task["prompt"],
            entry_point=task["entry_point"],
            golden_code=task["prompt"] + task["canonical_solution"],
            ground_truth_test=task["test"],
            ground_truth_cases=suite.cases,
        )

    def solved(self) -> bool:
        s: CodeEnvState = self.state
        return s.generated_code is not None and bool(s.ground_truth_results) and all(s.ground_truth_results)

    def fork(self) -> CodeEnv:
        """Tree rollouts: the state (code, tests, results, histories) is copied; the sandbox is shared."""
        return self._copy_episode()

    def episode_info(self) -> dict[str, Any]:
        """Per-episode values every row of the episode carries (``info_json``): the team reward.

        ``team_reward`` = share of ground-truth cases the latest code passes when the episode ends (0 without
        code): 1 exactly when the task was solved, and graded below that, so a team that got closer scores
        more (docs/code-env.md, reward mixing in docs/rl.md).
        """
        s: CodeEnvState = self.state
        ratio = s.ground_truth_test_vs_generated_code_match_ratio if s.generated_code is not None else 0.0
        return {"team_reward": float(ratio), "solved": self.solved()}

    # ----------------------------------------------------------------------------------------------
    # what agents call from step()
    # ----------------------------------------------------------------------------------------------
    async def submit_code(self, code: str) -> CodeEvaluation:
        """Record new code; score it on the ground truth and on the latest generated tests (one run)."""
        s: CodeEnvState = self.state
        jobs = [self._code_job(code, parse_ground_truth(s.ground_truth_test))]
        if s.generated_tests:
            jobs.append(self._code_job(code, generated_suite(s.generated_tests)))
        results = await self.evaluate(jobs)
        s.generated_code = code
        s.generated_code_history.append(code)
        s.ground_truth_results = results[0].flags()
        s.ground_truth_test_vs_generated_code_match_ratio = results[0].ratio
        on_tests = results[1] if len(results) > 1 else None
        if on_tests is not None:
            self._record_tests_on_code(on_tests)
        return CodeEvaluation(results[0], on_tests)

    async def submit_tests(self, tests: Sequence[str]) -> UnitTestEvaluation:
        """Record new asserts (first ``max_generated_tests``); check them on the canonical solution and
        on the latest code (one run)."""
        s: CodeEnvState = self.state
        tests = list(tests)[: self.config.max_generated_tests]
        suite = generated_suite(tests)
        jobs = [Job(s.golden_code, s.entry_point, suite)] if tests else []
        if tests and s.generated_code is not None:
            jobs.append(self._code_job(s.generated_code, suite))
        results = await self.evaluate(jobs) if jobs else []
        on_golden = results[0] if results else SuiteResult(())
        on_code = results[1] if len(results) > 1 else None
        s.generated_tests = tests
        s.generated_test_history.append(tests)
        s.generated_test_validity = on_golden.flags()
        s.generated_test_vs_golden_code_match_ratio = on_golden.ratio if tests else None
        if on_code is not None:
            self._record_tests_on_code(on_code)
        else:
            s.generated_test_results = []
            s.generated_test_vs_generated_code_match_ratio = None
        code_ratio = s.ground_truth_test_vs_generated_code_match_ratio if s.generated_code is not None else None
        return UnitTestEvaluation(on_golden, on_code, code_ratio)

    async def evaluate(self, jobs: Sequence[Job]) -> list[SuiteResult]:
        """Run ``jobs`` in one sandbox call. Sandbox infrastructure errors propagate (not a model failure).

        Calls that queue up behind a busy sandbox (many episodes finishing at once) are merged into fewer
        runs by ``SandboxBatcher``; each result is the one a run of its own would give.
        """
        return await SandboxBatcher.get(self.sandbox, self.config).evaluate(jobs)

    def _code_job(self, code: str, suite: AssertSuite) -> Job:
        return Job(code, self.state.entry_point, suite, context=self.state.problem)

    def _record_tests_on_code(self, result: SuiteResult) -> None:
        s: CodeEnvState = self.state
        s.generated_test_results = list(result.cases)
        s.generated_test_vs_generated_code_match_ratio = result.ratio if result.cases else None
        s.generated_test_vs_generated_code_mismatch_cases_history.append(
            {
                "turn": self.current_turn,
                "code_version": len(s.generated_code_history) - 1,
                "mismatches": [{"test": c.source, "error": c.error} for c in result.cases if not c.passed],
            }
        )


# --------------------------------------------------------------------------------------------------
# merging queued evaluations: the sandbox off the critical path of a round
# --------------------------------------------------------------------------------------------------
#: Most episodes merged into one sandbox run.
MAX_MERGED_EPISODES = 16


_BATCHERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[Any, ...], SandboxBatcher]] = (
    weakref.WeakKeyDictionary()
)


def _summary(result: ExecResult, marker: str, n_jobs: int) -> list[Any] | None:
    for line in reversed(result.stdout.splitlines()):
        if line.startswith(marker):
            try:
                summary = json.loads(line[len(marker) :])
            except ValueError:
                return None
            return summary if isinstance(summary, list) and len(summary) == n_jobs else None
    return None


class SandboxBatcher:
    """Runs the evaluations of many episodes on one sandbox, merging those that wait for a free slot.

    Why: when a round's requests finish together (a one-turn workload ends every episode in the same
    decode step), 32 evaluations queue behind ``sandbox.max_concurrency`` slots, and each pays a sandbox
    start (bubblewrap, two interpreter starts: most of a run's time for a short test). The wall time of
    the round then ends with that queue, after the last token. Here a call that finds a free slot runs
    alone, exactly as before; calls that arrive while every slot is busy wait, and a slot that frees takes
    its share of the queue (at most ``MAX_MERGED_EPISODES``) as ONE program whose episodes run one after
    the other, each with its own time budget, the scratch folders emptied and leftover processes killed
    in between (``build_program(groups=...)``). The wall-clock limit of a merged run is ``timeout_s``
    per episode. If a merged run gives no complete summary (a program that killed the harness, a
    timeout), each of its episodes is run again on its own, so a misbehaving episode never changes
    another one's result.

    One batcher per (sandbox, limits, event loop): ``asyncio.run`` per round gets a fresh one.
    """

    def __init__(self, sandbox: Sandbox, config: CodeEnvConfig, slots: int, max_batch: int = MAX_MERGED_EPISODES):
        self.sandbox = sandbox
        self.config = config
        self.slots = max(1, slots)
        self.max_batch = max(1, max_batch)
        self.free = self.slots
        self.running = 0  # episodes in the runs now in flight
        self.pending: list[tuple[list[Job], asyncio.Future[list[SuiteResult]]]] = []
        self.runs = 0  # sandbox runs made (merged ones count once)
        self._tasks: set[asyncio.Task[None]] = set()

    @classmethod
    def get(cls, sandbox: Sandbox, config: CodeEnvConfig) -> SandboxBatcher:
        loop = asyncio.get_running_loop()
        per_loop = _BATCHERS.setdefault(loop, {})
        cfg = config
        key = (id(sandbox), cfg.case_timeout_s, cfg.budget_fraction, cfg.sandbox.timeout_s)
        batcher = per_loop.get(key)
        if batcher is None or batcher.sandbox is not sandbox:
            batcher = per_loop[key] = cls(
                sandbox, config, slots=cfg.sandbox.max_concurrency, max_batch=MAX_MERGED_EPISODES
            )
        return batcher

    async def evaluate(self, jobs: Sequence[Job]) -> list[SuiteResult]:
        future: asyncio.Future[list[SuiteResult]] = asyncio.get_running_loop().create_future()
        self.pending.append((list(jobs), future))
        self._dispatch()
        return await future

    def _dispatch(self) -> None:
        self.pending = [(jobs, fut) for jobs, fut in self.pending if not fut.done()]  # drop cancelled calls
        while self.free > 0 and self.pending:
            # an even share of all the work not yet done (queued + running), so that the busy slots, which
            # free soon, get work too: 2 slots, 1 episode running and 18 queued -> 10 now, 8 at the next
            share = -(-(len(self.pending) + self.running) // self.slots)
            n = max(1, min(self.max_batch, len(self.pending), share))
            batch, self.pending = self.pending[:n], self.pending[n:]
            self.free -= 1
            self.running += n
            task = asyncio.get_running_loop().create_task(self._run(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run(self, batch: list[tuple[list[Job], asyncio.Future[list[SuiteResult]]]]) -> None:
        try:
            if len(batch) == 1:
                results = [await self._alone(batch[0][0])]
            else:
                results = await self._merged([jobs for jobs, _ in batch])
        except Exception as exc:  # a sandbox infrastructure error reaches every caller of the batch
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(exc)
        except BaseException:  # cancelled (the loop is closing): so are the callers
            for _, fut in batch:
                fut.cancel()
            raise
        else:
            for (_, fut), res in zip(batch, results, strict=True):
                if not fut.done():
                    fut.set_result(res)
        finally:
            self.free += 1
            self.running -= len(batch)
            self._dispatch()

    def _budget(self) -> float:
        return self.config.sandbox.timeout_s * self.config.budget_fraction

    async def _alone(self, jobs: list[Job]) -> list[SuiteResult]:
        marker = f"__PETTINGFLOW_RESULT_{secrets.token_hex(8)}__ "
        program = build_program(jobs, case_timeout_s=self.config.case_timeout_s, budget_s=self._budget(), marker=marker)
        self.runs += 1
        result = await self.sandbox.run_async(program)
        return parse_program_output(result, jobs, marker)

    async def _merged(self, groups: list[list[Job]]) -> list[list[SuiteResult]]:
        flat = [job for jobs in groups for job in jobs]
        marker = f"__PETTINGFLOW_RESULT_{secrets.token_hex(8)}__ "
        program = build_program(
            flat,
            case_timeout_s=self.config.case_timeout_s,
            budget_s=self._budget(),
            marker=marker,
            groups=[len(jobs) for jobs in groups],
        )
        self.runs += 1
        result = await self.sandbox.run_async(program, timeout_s=self.config.sandbox.timeout_s * len(groups))
        if _summary(result, marker, len(flat)) is None:
            log.warning(
                "a merged sandbox run of %d episodes gave no complete summary (%s); running each on its own",
                len(groups),
                result.killed_reason or f"exit code {result.exit_code}",
            )
            return [await self._alone(jobs) for jobs in groups]
        results = parse_program_output(result, flat, marker)
        out, start = [], 0
        for jobs in groups:
            out.append(results[start : start + len(jobs)])
            start += len(jobs)
        return out
