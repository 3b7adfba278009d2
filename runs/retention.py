"""Disk retention for a run's checkpoints (``pettingflow runs prune``).

Every committed update step holds the full weights after its iteration (≈0.27 GB at 135M in bf16, GBs at 7B)
and every ``training.save_optimizer_every``-th one an optimizer snapshot (≈1.8 GB at 135M). Only the snapshots
that ``training.replay_snapshots`` adds for exact re-runs are deleted automatically, as they leave its window
(``runs/replay.prune_replay_snapshots``); no weights are, because the weights before iteration k are exactly what
re-running or resuming k starts from
("re-run any iteration from its stored trajectories"). Pruning is therefore an explicit, per-run decision:
keep the newest updates (what a resumed run and the final evaluation need) and every Nth one (points to
re-run from), drop the rest. Trajectories, advantages and metrics are never touched, and a pruned step says
so in its commit marker, so whatever later needs the removed weights fails with an error naming the prune
(``runs/weights.PrunedWeightsError``) instead of silently starting from the base model.
"""

from __future__ import annotations

import datetime as dt
import shutil
from dataclasses import dataclass

from pettingflow.runs.lineage import cached_copy_dir
from pettingflow.storage import RunLayout, Step
from pettingflow.storage.commits import Manifest
from pettingflow.storage.layout import OPTIMIZER_STEP_PREFIX, UPDATE_STEP_PREFIX
from pettingflow.training.checkpoint import ADAPTERS_SUBDIR, DEEPSPEED_SUBDIR, MODEL_SUBDIR

WEIGHT_PREFIXES = (f"{MODEL_SUBDIR}/", f"{ADAPTERS_SUBDIR}/", f"{DEEPSPEED_SUBDIR}/")
OPTIMIZER_PREFIXES = (f"{DEEPSPEED_SUBDIR}/",)


@dataclass(frozen=True)
class PruneTarget:
    """One update step and what pruning it frees."""

    policy: str
    iteration: int
    step: Step
    files: int
    bytes: int


def kept_iterations(updated: list[int], keep_last: int, keep_every: int) -> set[int]:
    """Which of the iterations whose update committed weights (ascending) keep them: the newest ``keep_last``,
    and every iteration k with (k + 1) % ``keep_every`` == 0 (0: none), so re-runs can start every N iterations.
    Pure, so the rule is tested apart from any storage."""
    if keep_last < 1:
        raise ValueError(
            f"keep_last must be >= 1, got {keep_last}: the newest weights are what a resumed run trains from "
            "and what `evaluate --run-id` scores"
        )
    if keep_every < 0:
        raise ValueError(f"keep_every must be >= 0 (0: no periodic keeps), got {keep_every}")
    kept = set(sorted(updated)[-keep_last:])
    if keep_every:
        kept |= {k for k in updated if (k + 1) % keep_every == 0}
    return kept


def plan_prune(
    layout: RunLayout, keep_last: int = 1, keep_every: int = 0, optimizer_only: bool = False
) -> list[PruneTarget]:
    """The committed update steps (original attempts) whose checkpoint files pruning would remove.

    ``optimizer_only``: drop only optimizer snapshots (the bulk of the bytes); every iteration stays re-runnable,
    with Adam restarting from the newest kept snapshot or from zero.
    """
    prefixes = OPTIMIZER_PREFIXES if optimizer_only else WEIGHT_PREFIXES
    by_policy: dict[str, dict[int, list[tuple[Step, Manifest]]]] = {}
    for k in layout.iterations():
        for name in layout.update_steps(k):
            step = layout.step(k, name)
            if not step.is_committed():
                continue
            manifest = step.manifest()
            if not manifest.metadata.get("skipped"):
                policy = name.removeprefix(UPDATE_STEP_PREFIX)
                by_policy.setdefault(policy, {})[k] = [(step, manifest)]
                snapshot = layout.step(k, f"{OPTIMIZER_STEP_PREFIX}{policy}")  # written after it (background)
                if snapshot.is_committed():
                    by_policy[policy][k].append((snapshot, snapshot.manifest()))
    targets = []
    for policy, steps in sorted(by_policy.items()):
        kept = kept_iterations(sorted(steps), keep_last, keep_every)
        for k, pairs in sorted(steps.items()):
            if k in kept:
                continue
            for step, manifest in pairs:
                files = [e for e in manifest.files if e.name.startswith(prefixes)]
                if files:
                    targets.append(PruneTarget(policy, k, step, len(files), sum(e.bytes for e in files)))
    return targets


def prune(targets: list[PruneTarget], optimizer_only: bool = False) -> int:
    """Remove the planned checkpoint files (marker first, then the files; see ``Step.prune``) and any downloaded
    copy of those steps under ``$PETTINGFLOW_HOME/cache``. Returns the bytes freed in storage."""
    prefixes = OPTIMIZER_PREFIXES if optimizer_only else WEIGHT_PREFIXES
    stamp = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    freed = 0
    for target in targets:
        dropped = target.step.prune(prefixes, {"at": stamp, "by": "pettingflow runs prune"})
        freed += sum(e.bytes for e in dropped)
        shutil.rmtree(cached_copy_dir(target.step), ignore_errors=True)
    return freed
