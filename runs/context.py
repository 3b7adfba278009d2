"""Which folder each step of an iteration reads from and writes to.

An iteration's steps run in a fixed order. A normal run writes every step into ``iter-<k>/``. A
re-run of iteration k from step S (``pettingflow rerun``) writes S and everything after it into a
new ``iter-<k>/attempt-<a>/`` and reads the steps before S from the original, so stored rollouts are
reused and nothing the original attempt wrote is ever overwritten.
"""

from __future__ import annotations

from dataclasses import dataclass

from pettingflow.storage import RunLayout, Step, StepName
from pettingflow.storage.layout import step_kind

#: the steps of an attempt, in order (``baseline`` is the run's, before iteration 0: a re-run never writes one and
#: always reads the original's)
STEP_ORDER = tuple(step for step in StepName if step is not StepName.BASELINE)
__all__ = ["STEP_ORDER", "IterationContext", "step_kind"]


@dataclass(frozen=True)
class IterationContext:
    """One attempt of one iteration of one run."""

    layout: RunLayout
    iteration: int
    attempt: int = 0
    from_step: str = StepName.ROLLOUTS

    def __post_init__(self) -> None:
        first = step_kind(self.from_step)
        if first is StepName.BASELINE:
            raise ValueError("the baseline is the run's, not an attempt's: re-run from a step after rollouts")
        if self.attempt == 0 and first is not StepName.ROLLOUTS:
            raise ValueError("attempt 0 is the original iteration; a re-run from a later step needs attempt >= 1")
        if self.attempt > 0 and first is StepName.ROLLOUTS:
            raise ValueError(f"a re-run reuses stored rollouts: from_step must come after '{StepName.ROLLOUTS}'")

    @property
    def first(self) -> StepName:
        """The step this attempt starts at (the steps before it are read from the original)."""
        return step_kind(self.from_step)

    def runs(self, step: StepName) -> bool:
        """Whether this attempt runs ``step`` (it comes at or after ``from_step``); the baseline is iteration 0's
        and belongs to the original attempt."""
        if step is StepName.BASELINE:
            return self.attempt == 0 and self.first is StepName.ROLLOUTS
        return STEP_ORDER.index(step) >= STEP_ORDER.index(self.first)

    def step(self, name: str) -> Step:
        """The folder of step ``name`` (``update-<policy>`` for an update) as this attempt sees it."""
        kind = step_kind(name)
        if kind is StepName.BASELINE:
            return self.layout.step(self.iteration, name)
        return self.layout.step(self.iteration, name, attempt=self.attempt if self.runs(kind) else None)

    @property
    def label(self) -> str:
        return f"iter-{self.iteration}" + (f"/attempt-{self.attempt}" if self.attempt else "")
