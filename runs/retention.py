"""Disk retention for a run's checkpoints: while the run goes on (the ``disk`` settings) and by hand
(``pettingflow runs prune``).

Every committed update step holds the full weights after its iteration (≈0.27 GB at 135M in bf16, GBs at 7B)
and an optimizer snapshot (≈1.8 GB at 135M) every ``training.save_optimizer_every``-th update and every update
inside ``training.replay_snapshots``' window. Kept forever, a run's disk grows with its length, so the run itself
deletes what nothing can start from any more (``apply_retention``, at the end of every iteration, once its report
committed): it keeps the newest ``disk.keep_last_updates`` weights per policy (a resume trains from the newest,
``evaluate --run-id`` scores it), the weights the last ``replay_snapshots`` iterations start from (their re-runs),
every ``disk.keep_every``-th, and the newest ``disk.keep_snapshots`` optimizer snapshots beside the replay window's.
``pettingflow runs prune`` applies the same rule by hand, with its own numbers. Trajectories, advantages and
metrics are never touched, and a pruned step says so in its commit marker (who pruned, when, how many bytes), so
whatever later needs the removed weights fails with an error naming the prune (``runs/lineage.PrunedWeightsError``)
instead of silently starting from the base model. Deleting goes through ``Step.prune``: the marker is rewritten
first, then the files go, so a kill in between leaves unlisted files that no reader opens and the next pass deletes.
"""

from __future__ import annotations

import datetime as dt
import shutil
from dataclasses import dataclass

from pettingflow.configs.settings import ExperimentConfig
from pettingflow.runs.lineage import cached_copy_dir, update_checkpoints
from pettingflow.storage import RunLayout, Step
from pettingflow.storage.commits import Manifest
from pettingflow.storage.fs import join
from pettingflow.training.checkpoint import ADAPTERS_SUBDIR, DEEPSPEED_SUBDIR, MODEL_SUBDIR

WEIGHT_PREFIXES = (f"{MODEL_SUBDIR}/", f"{ADAPTERS_SUBDIR}/", f"{DEEPSPEED_SUBDIR}/")
OPTIMIZER_PREFIXES = (f"{DEEPSPEED_SUBDIR}/",)
MODEL_PREFIXES = (f"{MODEL_SUBDIR}/", f"{ADAPTERS_SUBDIR}/")
#: how the run's own retention names itself in a pruned step's marker (``Step.pruned``, ``PrunedWeightsError``)
RETENTION_BY = "disk retention (disk.keep_last_updates, disk.keep_snapshots)"


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
    iterations = layout.iterations()
    policies = sorted({policy for k in iterations for policy in layout.update_policies(k)})
    by_policy = {policy: steps for policy in policies if (steps := update_checkpoints(layout, policy, iterations))}
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


# ------------------------------------------------------------------------------------------------ while the run goes
@dataclass(frozen=True)
class Deletion:
    """Files of one committed step that retention removes: the weights (``model/``, ``adapters/``) and/or the
    optimizer snapshot (``deepspeed/``) of an update of ``policy`` at ``iteration``."""

    policy: str
    iteration: int
    step: Step
    prefixes: tuple[str, ...]
    bytes: int


def kept_weights(updated: list[int], current: int, keep_last: int, keep_every: int, replay: int) -> set[int]:
    """Which iterations whose update committed weights (``updated``) keep them at the end of ``current``: the
    newest ``keep_last`` and every ``keep_every``-th (``kept_iterations``), and the weights each of the last
    ``replay`` iterations (``training.replay_snapshots``) started from, so their re-runs can start. Pure."""
    kept = kept_iterations(updated, keep_last, keep_every)
    ordered = sorted(updated)
    for j in range(max(0, current - replay + 1), current + 1):
        before = [k for k in ordered if k < j]
        if before:
            kept.add(before[-1])
    return kept


def kept_snapshots(snapshots: list[int], current: int, keep: int, replay: int) -> set[int]:
    """Which iterations whose update has a committed optimizer snapshot (``snapshots``) keep it at the end of
    ``current``: the newest ``keep`` (a resume restores Adam from the newest) and those of
    ``training.replay_snapshots``' window (``k >= current - replay``: the snapshots the last ``replay`` iterations
    start from, as ``training.checkpoint.replay_snapshot_kept``). Pure."""
    if keep < 1:
        raise ValueError(f"disk.keep_snapshots must be >= 1 (a resume restores Adam from the newest), got {keep}")
    kept = set(sorted(snapshots)[-keep:])
    if replay > 0:
        kept |= {k for k in snapshots if k >= current - replay}
    return kept


def plan_retention(layout: RunLayout, config: ExperimentConfig, current: int) -> list[Deletion]:
    """What the run's retention deletes at the end of iteration ``current`` (original attempts only; re-run
    attempts are never touched), oldest first, from commit markers alone: O(iterations) small reads per pass."""
    d, replay = config.disk, config.training.replay_snapshots
    if d.keep_last_updates is None and d.keep_snapshots is None:
        return []
    deletions = []
    for policy in dict.fromkeys(agent.policy for agent in config.agents):
        holders = update_checkpoints(layout, policy, range(current + 1))  # each update and its optimizer step
        did_work = list(holders)
        with_snapshot = [k for k, steps in holders.items() if any(_has(m, OPTIMIZER_PREFIXES) for _, m in steps)]
        kept_w = (
            set(did_work)
            if d.keep_last_updates is None
            else kept_weights(did_work, current, d.keep_last_updates, d.keep_every, replay)
        )
        kept_s = (
            set(with_snapshot)
            if d.keep_snapshots is None
            else kept_snapshots(with_snapshot, current, d.keep_snapshots, replay)
        )
        for k, steps in holders.items():
            for step, manifest in steps:
                prefixes = (MODEL_PREFIXES if k not in kept_w else ()) + (OPTIMIZER_PREFIXES if k not in kept_s else ())
                files = [e for e in manifest.files if e.name.startswith(prefixes)] if prefixes else []
                if files:
                    deletions.append(Deletion(policy, k, step, prefixes, sum(e.bytes for e in files)))
                elif leftovers := _leftovers(step, manifest):  # a pass killed between a marker and its files
                    deletions.append(Deletion(policy, k, step, leftovers, 0))
    return deletions


def apply_retention(layout: RunLayout, config: ExperimentConfig, current: int) -> list[Deletion]:
    """Delete what ``plan_retention`` plans, oldest first, and any downloaded copy of those steps; returns it.

    Called by the run once iteration ``current``'s report committed (``tasks/retention.py``): everything that
    supersedes the deleted files is committed by then. Each step's marker is rewritten first (``Step.prune``:
    a ``pruned`` record saying what went, when and by whom), then the files go; a kill in between leaves files no
    reader opens, and the next pass (the resumed iteration runs this again) deletes them and the rest."""
    deletions = plan_retention(layout, config, current)
    stamp = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    for deletion in deletions:
        deletion.step.prune(deletion.prefixes, {"at": stamp, "by": RETENTION_BY, "after_iteration": current})
        shutil.rmtree(cached_copy_dir(deletion.step), ignore_errors=True)
    return deletions


def _has(manifest: Manifest, prefixes: tuple[str, ...]) -> bool:
    return any(e.name.startswith(prefixes) for e in manifest.files)


def _leftovers(step: Step, manifest: Manifest) -> tuple[str, ...]:
    """The pruned folders (per the marker's ``pruned`` records) still on disk: a prune killed after rewriting the
    marker, before its deletions finished. Unlisted, so no reader opens them; deleting them again is safe."""
    recorded = {p for entry in manifest.metadata.get("pruned", []) for p in entry.get("prefixes", [])}
    return tuple(
        sorted(p for p in recorded if step.fs.exists(join(step.path, p.rstrip("/"))) and not _has(manifest, (p,)))
    )
