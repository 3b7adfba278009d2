"""Test suites: turning a HumanEval ``test`` (or generated asserts) into separately scored cases.

A suite is a list of statements run in order; the ones that contain an assert that can fail are the
cases, each scored on its own so that pass ratios are per assert. A ``Job`` pairs a solution with a
suite: it is what the sandbox harness (``harness.py``) receives, one per (code, tests) evaluation.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


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
