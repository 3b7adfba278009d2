"""The code env (PettingLLMs' agent/env interface): a code agent writes a function, a test agent writes asserts for it.

Generated tests are ``assert`` statements that call the entry point (``assert add(2, 3) == 5``), not
input/output pairs as in PettingLLMs: HumanEval functions take Python values, not stdin, and its
ground truth is itself asserts, so one format and one harness serve both. docs/code-env.md explains
the turns, the evaluation and the rewards.

One concern per module; this package re-exports their public names, so
``from pettingflow.envs.code_env import X`` is the import to use:

* ``suites``: HumanEval / generated test code -> separately scored asserts (``AssertSuite``, ``Job``);
* ``harness``: the stdlib-only program that runs in the sandbox: a judge, and a runner holding the model's code;
* ``program``: ``build_program`` (the harness, and the jobs' spec for its stdin) and ``read_program_spec``;
* ``results``: per-case results and reading them from the sandbox output;
* ``rewards``: the code agent's and the test agent's rewards;
* ``batching``: ``SandboxBatcher``, merging evaluations that queue behind a busy sandbox;
* ``env``: ``CodeEnv`` (the state machine), ``CodeEnvConfig`` and ``CodeEnvState``.
"""

from __future__ import annotations

from pettingflow.envs.code_env.batching import SandboxBatcher
from pettingflow.envs.code_env.env import (
    TASK_KEYS,
    CodeEnv,
    CodeEnvConfig,
    CodeEnvState,
    CodeEvaluation,
    UnitTestEvaluation,
)
from pettingflow.envs.code_env.program import HARNESS, Program, build_program, new_marker, read_program_spec
from pettingflow.envs.code_env.results import CaseResult, SuiteResult, complete_summary, parse_program_output
from pettingflow.envs.code_env.rewards import UnitTestReward, code_reward, code_success, unit_test_reward
from pettingflow.envs.code_env.suites import (
    AssertSuite,
    Job,
    SuiteStep,
    TestGrammarError,
    generated_suite,
    parse_call_case,
    parse_ground_truth,
)

# The env registry names a class by ``module:QualName`` (class paths in the env cache, row labels, task
# files); the code env's has always been ``pettingflow.envs.code_env:CodeEnv``, and stays so.
CodeEnv.__module__ = __name__

__all__ = [
    "HARNESS",
    "TASK_KEYS",
    "AssertSuite",
    "CaseResult",
    "CodeEnv",
    "CodeEnvConfig",
    "CodeEnvState",
    "CodeEvaluation",
    "Job",
    "Program",
    "SandboxBatcher",
    "SuiteResult",
    "SuiteStep",
    "TestGrammarError",
    "UnitTestEvaluation",
    "UnitTestReward",
    "build_program",
    "code_reward",
    "code_success",
    "complete_summary",
    "generated_suite",
    "new_marker",
    "parse_call_case",
    "parse_ground_truth",
    "parse_program_output",
    "read_program_spec",
    "unit_test_reward",
]
