"""Results of a sandbox run: per-case outcomes, and reading them from the harness's output.

The harness prints one JSON line per job, ``marker + [index, result]``, as each job ends; anything else on
stdout is ignored (only the harness's judge knows the marker). A job with no line (the run was killed, or its
judge was) fails every case with the reason (``parse_program_output``); the jobs done before stand.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pettingflow.envs.code_env.suites import Job
    from pettingflow.envs.sandbox import ExecResult


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

    def digest(self, max_cases: int = 8, max_chars: int = 240) -> list[dict[str, Any]]:
        """What the sandbox said, small enough for a row's ``info_json``: the setup error, then each case (the
        first ``max_cases``), passed or failed with its error, texts cut to ``max_chars``.

        Why: the trajectory viewer shows it beside the turn, which is where a surprising reward is explained."""

        def cut(text: str | None) -> str | None:
            return text if text is None or len(text) <= max_chars else text[: max_chars - 1] + "…"

        out: list[dict[str, Any]] = []
        if self.setup_error:
            out.append({"case": "(loading the solution)", "passed": False, "error": cut(self.setup_error)})
        out += [{"case": cut(c.source), "passed": c.passed, "error": cut(c.error)} for c in self.cases[:max_cases]]
        if len(self.cases) > max_cases:
            out.append({"case": f"... {len(self.cases) - max_cases} more cases", "passed": None, "error": None})
        return out


def job_results(result: ExecResult, marker: str, n_jobs: int) -> dict[int, dict[str, Any]]:
    """The results the harness printed, by job index (never raises: a malformed line is skipped, and only the
    first line of an index counts)."""
    found: dict[int, dict[str, Any]] = {}
    for line in result.stdout.splitlines():
        if not line.startswith(marker):
            continue
        try:
            index, entry = json.loads(line[len(marker) :])
        except (ValueError, TypeError):
            continue
        ok_entry = isinstance(entry, dict) and isinstance(entry.get("cases"), list)
        if type(index) is int and 0 <= index < n_jobs and ok_entry and index not in found:
            found[index] = entry
    return found


def complete_summary(result: ExecResult, marker: str, n_jobs: int) -> list[Any] | None:
    """Every job's result in order when the output holds all ``n_jobs`` of them, else None (never raises)."""
    found = job_results(result, marker, n_jobs)
    return [found[i] for i in range(n_jobs)] if len(found) == n_jobs else None


def _no_result_reason(result: ExecResult) -> str:
    if result.timed_out:
        return "timed out (the sandbox killed the run)"
    if getattr(result, "killed_reason", None):
        return f"killed by the sandbox: {result.killed_reason}"
    if getattr(result, "stdout_truncated", False):  # the result line was past the output cap
        return f"the test run's output was cut at the sandbox's cap (exit code {result.exit_code})"
    tail = (result.stderr or "").strip().splitlines()[-1:] or ["no output"]
    return f"the test run produced no result (exit code {result.exit_code}): {tail[0][:200]}"


def parse_program_output(result: ExecResult, jobs: Sequence[Job], marker: str) -> list[SuiteResult]:
    """Per-job results from the sandbox output; every case of a job without a result fails.

    A missing result means the program was killed (wall-clock, memory) before that job ended, or its output
    cut: that is the solution's fault as far as rewards go, and the reason is kept in each case's error.
    """
    found = job_results(result, marker, len(jobs))
    out = []
    for i, job in enumerate(jobs):
        sources = job.suite.cases
        res = found.get(i)
        if res is None or len(res["cases"]) != len(sources):
            reason = _no_result_reason(result)
            out.append(SuiteResult(tuple(CaseResult(c, False, reason) for c in sources), setup_error=reason))
            continue
        cases = tuple(CaseResult(src, bool(ok), err) for src, (ok, err) in zip(sources, res["cases"], strict=True))
        out.append(SuiteResult(cases, res.get("setup_error")))
    return out
