"""What every step of an iteration returns, and how a step that is already committed says so.

Each step module (rollouts, batches, updates, report) and the Prefect tasks above them use these two,
so they live apart from any one step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pettingflow.storage import Step


@dataclass(frozen=True)
class StepOutcome:
    """What a task returns: small metadata only (never the data itself)."""

    step: str
    uri: str
    rows: int
    skipped: bool
    metrics: dict[str, Any]


def already_done(step: Step) -> StepOutcome | None:
    """The outcome of a committed step (``skipped=True``), or None when it still has to run."""
    if not step.is_committed():
        return None
    m = step.manifest()
    return StepOutcome(step.name, step.uri, m.rows, True, m.metadata)
