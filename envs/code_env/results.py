"""Results of a sandbox run: per-case outcomes, and reading them from the harness's output.

The harness prints one JSON summary line behind a random marker; anything else on stdout is
ignored. A missing or cut summary fails every case with the reason (``parse_program_output``).
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


def complete_summary(result: ExecResult, marker: str, n_jobs: int) -> list[Any] | None:
    """The summary list when the output holds one for exactly ``n_jobs`` jobs, else None (never raises)."""
    for line in reversed(result.stdout.splitlines()):
        if line.startswith(marker):
            try:
                summary = json.loads(line[len(marker) :])
            except ValueError:
                return None
            return summary if isinstance(summary, list) and len(summary) == n_jobs else None
    return None


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
