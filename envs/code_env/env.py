"""The code env's state machine: ``CodeEnv``, its config and the shared ``CodeEnvState``.

Turn order is code -> test -> code -> ... (taken from the config's agent list by the engine). The
env holds the shared ``CodeEnvState``: the problem, the latest code, the latest tests and how they
fared against each other, the hidden ground truth, and histories. The episode ends when the latest
code passes every ground-truth test, or after ``max_turns`` agent calls. See docs/code-env.md for
the rewards, with worked examples.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import Field

from pettingflow.configs.settings import SandboxSettings
from pettingflow.envs.base import Env, EnvConfig, TaskDataError
from pettingflow.envs.code_env.batching import SandboxBatcher
from pettingflow.envs.code_env.results import CaseResult, SuiteResult
from pettingflow.envs.code_env.suites import AssertSuite, Job, generated_suite, parse_ground_truth

if TYPE_CHECKING:
    from pettingflow.envs.sandbox import Sandbox

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
            jobs.append(self._code_job(code, generated_suite(s.generated_tests, s.entry_point)))
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
        suite = generated_suite(tests, s.entry_point)
        jobs = [Job(s.golden_code, s.entry_point, suite, context=s.problem)] if tests else []
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
