"""The sandbox program of one evaluation: ``harness.py``'s text as the program, the jobs' spec on its stdin.

Every evaluation runs in the sandbox as ONE program that executes a list of jobs -- (solution, test
suite) pairs -- and prints one JSON summary line behind a random marker, so one agent turn costs one
sandbox call however many asserts it checks. The harness is a real module (linted, unit-tested) and is
sent as text: the sandbox sees no project code, only this one file.

The spec (tests, expected values, the marker) travels on stdin, never inside the program: the program file
is readable by every process in the sandbox, the model's included, while the harness drains stdin before any
model code starts (harness.py explains the boundary).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from pettingflow.envs.code_env.suites import Job

#: The harness program's text, as sent to the sandbox.
HARNESS = Path(__file__).with_name("harness.py").read_text()


class Program(NamedTuple):
    """What one sandbox run gets: ``code`` (always ``HARNESS``) and ``stdin`` (the spec as JSON)."""

    code: str
    stdin: str


def new_marker() -> str:
    """A fresh result marker: 64 random bits, known to the host and the harness's judge only."""
    return f"__PETTINGFLOW_RESULT_{secrets.token_hex(8)}__ "


def build_program(
    jobs: Sequence[Job],
    *,
    case_timeout_s: float,
    budget_s: float,
    marker: str | None = None,
    groups: Sequence[int] | None = None,
) -> Program:
    """The program that runs ``jobs`` and prints ``marker + json(results)``, and the spec for its stdin.

    ``groups`` (job counts, summing to ``len(jobs)``) merges the evaluations of several episodes into one
    run: each group gets its own ``budget_s``, and between groups the harness kills every process the
    previous one left and empties the scratch folders. The summary stays one flat list, one per job.
    """
    spec: dict[str, Any] = {
        "marker": marker or new_marker(),
        "case_timeout_s": case_timeout_s,
        "budget_s": budget_s,
        "jobs": [j.to_json() for j in jobs],
    }
    if groups is not None:
        if sum(groups) != len(jobs) or any(n < 1 for n in groups):
            raise ValueError(f"groups {list(groups)} do not partition {len(jobs)} jobs")
        spec["groups"] = [[n, budget_s] for n in groups]
    return Program(HARNESS, json.dumps(spec))


def read_program_spec(stdin: str) -> dict[str, Any]:
    """The spec of a program made by ``build_program``, from its stdin (for debugging, and for fake sandboxes)."""
    try:
        spec = json.loads(stdin)
    except ValueError as exc:
        raise ValueError(f"not the stdin of a program made by build_program: {exc}") from None
    if not isinstance(spec, dict) or "jobs" not in spec:
        raise ValueError("not the stdin of a program made by build_program: no jobs")
    return spec
