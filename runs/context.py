"""Which folder each step of an iteration reads from and writes to.

An iteration's steps run in a fixed order. A normal run writes every step into ``iter-<k>/``. A
re-run of iteration k from step S (``pettingflow rerun``) writes S and everything after it into a
new ``iter-<k>/attempt-<a>/`` and reads the steps before S from the original, so stored rollouts are
reused and nothing the original attempt wrote is ever overwritten.
"""

from __future__ import annotations

from dataclasses import dataclass

from pettingflow.storage import RunLayout, Step

STEP_ORDER = ("rollouts", "filtered", "advantages", "update", "sync", "validation", "report")
# the base weights' validation (``validation.at_start``): iteration 0 only, before its rollouts; a step of the
# run, not of an attempt, so a re-run never writes one and always reads the original's
BASELINE_STEP = "baseline"


def step_kind(name: str) -> str:
    """``update-<policy>`` steps, and the ``optimizer-<policy>`` snapshots written after them in the background,
    share the position of ``update``."""
    kind = "update" if name.startswith(("update-", "optimizer-")) else name
    if kind not in STEP_ORDER:
        raise ValueError(f"unknown step {name!r}; steps are {', '.join(STEP_ORDER)} (update as update-<policy>)")
    return kind


@dataclass(frozen=True)
class IterationContext:
    """One attempt of one iteration of one run."""

    layout: RunLayout
    iteration: int
    attempt: int = 0
    from_step: str = "rollouts"

    def __post_init__(self) -> None:
        step_kind(self.from_step)
        if self.attempt == 0 and self.from_step != "rollouts":
            raise ValueError("attempt 0 is the original iteration; a re-run from a later step needs attempt >= 1")
        if self.attempt > 0 and self.from_step == "rollouts":
            raise ValueError("a re-run reuses stored rollouts: from_step must come after 'rollouts'")

    def step(self, name: str) -> Step:
        """The folder of step ``name`` as this attempt sees it."""
        if name == BASELINE_STEP:
            return self.layout.step(self.iteration, name)
        own = STEP_ORDER.index(step_kind(name)) >= STEP_ORDER.index(step_kind(self.from_step))
        return self.layout.step(self.iteration, name, attempt=self.attempt if own else None)

    @property
    def label(self) -> str:
        return f"iter-{self.iteration}" + (f"/attempt-{self.attempt}" if self.attempt else "")
