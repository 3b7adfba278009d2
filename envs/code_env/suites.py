"""Test suites: turning a HumanEval ``test`` (or generated asserts) into separately scored cases.

A suite is a list of steps run in order; the ones that can fail are the cases, each scored on its own so
that pass ratios are per assert. A ``Job`` pairs a solution with a suite: it is what the sandbox harness
(``harness.py``) receives, one per (code, tests) evaluation.

Two kinds of steps, by who wrote them. Ground truth (task text, trusted) is source that the harness's judge
executes, with the entry point a proxy to the process that holds the solution. Model-written tests are never
executed: ``parse_call_case`` reads each with ``ast`` into a call case (the entry point called with literal
arguments, its value compared with a literal) that the judge evaluates on the plain value the call returned.
A test outside that grammar is kept as a failing case that says why: it earns nothing.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SuiteStep:
    """One step of a suite; ``is_case`` when it is scored. ``call`` (a model-written test in the grammar) or
    ``invalid`` (one outside it, with the reason) replace executing ``source``, which is shown in results."""

    source: str
    is_case: bool
    call: dict[str, Any] | None = None
    invalid: str | None = None

    def to_json(self) -> dict[str, Any]:
        step: dict[str, Any] = {"source": self.source, "case": self.is_case}
        if self.call is not None:
            step.update(kind="call", call=self.call)
        elif self.invalid is not None:
            step.update(kind="invalid", reason=self.invalid)
        return step


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
    candidate = params[0].arg if params else None
    steps = tuple(_ground_truth_step(s, candidate) for s in check.body)
    return AssertSuite(
        steps=steps,
        preamble=ast.unparse(ast.Module(body=rest, type_ignores=[])),
        candidate_name=candidate,
    )


#: Checks of a ground-truth assert that the judge may evaluate as a call case: the same comparison on the same
#: plain values as executing it (tolerance forms stay source: their arithmetic on a non-number differs).
_SAME_AS_SOURCE = ("==", "!=", "is", "is not", "truthy", "falsy")


def _ground_truth_step(stmt: ast.stmt, candidate: str | None) -> SuiteStep:
    """A statement of ``check``: source, or, for ``assert candidate(<literals>) == <literal>`` and the other forms
    of the test grammar without a message, also its call case. The judge then evaluates it as it evaluates a
    model-written test (the same value compared with the same literal: the same verdict and error text), which
    lets it send the call to the runner ahead of time (``harness.calls_ahead``) instead of one round trip each."""
    source = ast.unparse(stmt)
    if candidate is None or not isinstance(stmt, ast.Assert) or stmt.msg is not None:
        return SuiteStep(source, _is_case(stmt))
    try:
        case = parse_call_case(source, candidate)
    except TestGrammarError:
        return SuiteStep(source, _is_case(stmt))
    if case["check"] not in _SAME_AS_SOURCE:
        return SuiteStep(source, _is_case(stmt))
    return SuiteStep(source, True, call=case)


def generated_suite(tests: Sequence[str], entry_point: str) -> AssertSuite:
    """A suite of model-written asserts, each its own case, parsed into call cases (never executed)."""
    steps = []
    for test in tests:
        try:
            steps.append(SuiteStep(test, True, call=parse_call_case(test, entry_point)))
        except TestGrammarError as exc:
            steps.append(SuiteStep(test, True, invalid=f"not a test this harness runs: {exc} (docs/code-env.md)"))
    return AssertSuite(steps=tuple(steps))


class TestGrammarError(ValueError):
    """A model-written test outside the grammar of ``parse_call_case``; the message says what is wrong."""

    __test__ = False  # not a pytest class


#: The plain types a literal may have (what crosses the harness's process boundary, harness.encode).
_PLAIN = (type(None), bool, int, float, str, bytes, list, tuple, set, frozenset, dict)


def _literal(node: ast.expr, what: str) -> Any:
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise TestGrammarError(f"{what} `{ast.unparse(node)[:80]}` is not a literal") from None
    if not _is_plain(value):
        raise TestGrammarError(f"{what} `{ast.unparse(node)[:80]}` is not plain data")
    return value


def _is_plain(value: Any) -> bool:
    if type(value) not in _PLAIN:
        return False
    if type(value) is dict:
        return all(_is_plain(k) and _is_plain(v) for k, v in value.items())
    if type(value) in (list, tuple, set, frozenset):
        return all(_is_plain(v) for v in value)
    return True


def _entry_call(node: ast.expr, entry_point: str) -> tuple[list[Any], dict[str, Any]]:
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == entry_point):
        raise TestGrammarError(f"expected a call of {entry_point}(...), found `{ast.unparse(node)[:80]}`")
    args = []
    for arg in node.args:
        if isinstance(arg, ast.Starred):
            raise TestGrammarError("*args are not allowed in a test's call")
        args.append(_literal(arg, "the argument"))
    kwargs = {}
    for kw in node.keywords:
        if kw.arg is None:
            raise TestGrammarError("**kwargs are not allowed in a test's call")
        kwargs[kw.arg] = _literal(kw.value, "the argument")
    return args, kwargs


def _number(node: ast.expr, what: str) -> float:
    value = _literal(node, what)
    if type(value) not in (int, float) or value < 0:
        raise TestGrammarError(f"{what} must be a non-negative number")
    return float(value)


def parse_call_case(test: str, entry_point: str) -> dict[str, Any]:
    """The call case of one model-written assert, for the harness's judge (``harness.check_call``).

    The grammar (``F`` = the entry point, ``A`` = literal arguments, ``L`` = a literal of plain data):
    ``assert F(A) == L`` (or ``L == F(A)``), ``!=``, ``assert F(A) is True|False|None`` (``is not``),
    ``assert F(A)``, ``assert not F(A)``, and for floats ``assert abs(F(A) - L) < T`` (``<=``) or
    ``assert math.isclose(F(A), L[, rel_tol=T][, abs_tol=T])``. An assert message is allowed and ignored.
    Raises ``TestGrammarError`` saying what is outside it.
    """
    from pettingflow.envs.code_env.harness import NotPlain, encode  # the harness is stdlib-only; this is host side

    try:
        tree = ast.parse(test.strip())
    except SyntaxError as exc:
        raise TestGrammarError(f"it does not parse ({exc.msg})") from None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        raise TestGrammarError("a test is one assert statement")
    expr = tree.body[0].test
    case: dict[str, Any]
    if isinstance(expr, ast.Compare) and len(expr.ops) == 1:
        left, op, right = expr.left, expr.ops[0], expr.comparators[0]
        if isinstance(left, ast.Call) and isinstance(left.func, ast.Name) and left.func.id == "abs":
            if not (isinstance(op, ast.Lt | ast.LtE) and len(left.args) == 1 and isinstance(left.args[0], ast.BinOp)):
                raise TestGrammarError("use `abs(F(...) - expected) < tolerance`")
            diff = left.args[0]
            if not isinstance(diff.op, ast.Sub):
                raise TestGrammarError("use `abs(F(...) - expected) < tolerance`")
            args, kwargs = _entry_call(diff.left, entry_point)
            case = {"check": "close", "expected": _literal(diff.right, "the expected value"), "rel_tol": 0.0}
            case["abs_tol"] = _number(right, "the tolerance")
        else:
            if isinstance(right, ast.Call) and not isinstance(left, ast.Call) and isinstance(op, ast.Eq | ast.NotEq):
                left, right = right, left
            args, kwargs = _entry_call(left, entry_point)
            if isinstance(op, ast.Eq | ast.NotEq):
                check = "==" if isinstance(op, ast.Eq) else "!="
                case = {"check": check, "expected": _literal(right, "the expected value")}
            elif isinstance(op, ast.Is | ast.IsNot):
                if not (isinstance(right, ast.Constant) and right.value in (True, False, None)):
                    raise TestGrammarError("`is` compares only with True, False or None")
                case = {"check": "is" if isinstance(op, ast.Is) else "is not", "expected": right.value}
            else:
                raise TestGrammarError(f"the comparison `{type(op).__name__}` is not one of ==, !=, is, is not")
    elif isinstance(expr, ast.Call) and ast.unparse(expr.func) in ("math.isclose", "isclose"):
        if len(expr.args) != 2:
            raise TestGrammarError("use `math.isclose(F(...), expected[, rel_tol=..., abs_tol=...])`")
        args, kwargs = _entry_call(expr.args[0], entry_point)
        case = {"check": "close", "expected": _literal(expr.args[1], "the expected value"), "rel_tol": 1e-9}
        case["abs_tol"] = 0.0
        for kw in expr.keywords:
            if kw.arg not in ("rel_tol", "abs_tol"):
                raise TestGrammarError(f"math.isclose takes rel_tol and abs_tol, not {kw.arg}")
            case[kw.arg] = _number(kw.value, kw.arg)
    elif isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Not):
        args, kwargs = _entry_call(expr.operand, entry_point)
        case = {"check": "falsy", "expected": None}
    else:
        args, kwargs = _entry_call(expr, entry_point)
        case = {"check": "truthy", "expected": None}
    if case["check"] == "close" and type(case["expected"]) not in (int, float):
        raise TestGrammarError("a tolerance compares numbers only")
    try:
        case.update(args=encode(args), kwargs=encode(kwargs), expected=encode(case["expected"]))
    except NotPlain as exc:
        raise TestGrammarError(f"a literal is too large to send ({exc})") from None
    return case


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
            "steps": [s.to_json() for s in self.suite.steps],
        }
