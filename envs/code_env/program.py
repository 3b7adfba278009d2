"""The sandbox program of one evaluation: ``harness.py``'s text with the jobs' spec embedded.

Every evaluation runs in the sandbox as ONE program that executes a list of jobs -- (solution, test
suite) pairs -- and prints one JSON summary line behind a random marker, so one agent turn costs one
sandbox call however many asserts it checks. The harness is a real module (linted, unit-tested) and is
sent as text: the sandbox sees no project code, only this one file.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pettingflow.envs.code_env.suites import Job

#: The literal in ``harness.py`` that ``build_program`` replaces by the spec.
_SPEC_PLACEHOLDER = '"__PETTINGFLOW_SPEC__"'

#: The harness program's text, as sent to the sandbox (with the placeholder still in it).
HARNESS = Path(__file__).with_name("harness.py").read_text()
if HARNESS.count(_SPEC_PLACEHOLDER) != 1:  # pragma: no cover - a broken edit of harness.py
    raise RuntimeError(f"harness.py must contain {_SPEC_PLACEHOLDER} exactly once")


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
    match = re.search(r"^SPEC_JSON = (.*)$", program, flags=re.MULTILINE)
    if match is None:
        raise ValueError("not a program made by build_program: no SPEC_JSON line")
    return json.loads(ast.literal_eval(match.group(1)))
