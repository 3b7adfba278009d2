"""The disk guard: a run stops at a step boundary, with one message saying why and what to do, before a step
would fill the disk (the ``disk.guard`` setting).

Why: a full disk does not fail cleanly. A step that runs out of space half way leaves a folder the commit protocol
hides, but everything around it (the Prefect database, logs, the servers' caches) fails next, each with an error
that does not name the cause. So before a step writes, the free space of the run's folder is compared with what
that step wrote the last time it ran (its commit marker lists its files and their bytes, and a prune records what
it removed), or, before an update ever ran, an estimate from the model's size; below it plus ``disk.margin_mb``
the step raises ``DiskSpaceError`` before it writes anything, the task is not retried, and the run can be resumed
once space is freed. Local storage only: on s3:// and other remote roots the guard is skipped (an object store has
no free space to read).
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

from pettingflow.configs.settings import ExperimentConfig, Specialization
from pettingflow.runs.context import IterationContext
from pettingflow.runs.lineage import optimizer_step_name
from pettingflow.storage import Step
from pettingflow.storage.commits import StepNotCommittedError
from pettingflow.storage.fs import is_local
from pettingflow.storage.layout import StepName, update_policy
from pettingflow.training.checkpoint import optimizer_snapshot_written

log = logging.getLogger(__name__)

#: how many iterations back the guard looks for the last time a step ran (validation runs every N; older is stale)
LOOKBACK = 8
#: an update's files per byte of the base model's weights, before one ran: model/ (the full weights) and an
#: optimizer snapshot (fp32 master weights and two Adam moments: 6.7x a bf16 model at 135M, measured)
FULL_UPDATE_FACTOR, FULL_SNAPSHOT_FACTOR = 1.0, 7.0
#: the same for LoRA adapters: a few percent of the model (rank 16), their snapshot about 3x that
LORA_UPDATE_FACTOR, LORA_SNAPSHOT_FACTOR = 0.05, 0.15
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


class DiskSpaceError(OSError):
    """Not enough free space for the next step: the run stopped before it wrote anything (not retried)."""


@dataclass(frozen=True)
class Need:
    """What a step is expected to write, and where that number comes from (for the message)."""

    bytes: int
    basis: str


def written(step: Step) -> int | None:
    """The bytes a committed step wrote: the files its marker lists plus what prunes removed since; None when it
    is not committed."""
    try:
        manifest = step.manifest()
    except StepNotCommittedError:
        return None
    return sum(e.bytes for e in manifest.files) + sum(
        int(p.get("bytes", 0)) for p in manifest.metadata.get("pruned", [])
    )


def model_bytes(folder: str | Path) -> int:
    """The size of a model folder's weight files (what the estimates scale with)."""
    root = Path(folder)
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))


def estimate_update(config: ExperimentConfig, policy: str, snapshot: bool, base_bytes: int) -> int:
    """What the first update of ``policy`` will write (weights, and its optimizer snapshot when ``snapshot``),
    from the size of the base model's weights. Pure."""
    lora = config.specialization is Specialization.lora
    update, snap = (LORA_UPDATE_FACTOR, LORA_SNAPSHOT_FACTOR) if lora else (FULL_UPDATE_FACTOR, FULL_SNAPSHOT_FACTOR)
    return int(base_bytes * (update + (snap if snapshot else 0.0)))


def step_need(ctx: IterationContext, config: ExperimentConfig, folder: str) -> Need:
    """What the step ``folder`` of this attempt is expected to write: what it wrote the last time it ran (within
    ``LOOKBACK`` iterations; an update with the optimizer snapshot written with or after it); else, for an update,
    the estimate (``estimate_update``); else 0 (trajectories and reports are MBs: the margin covers them)."""
    layout, k = ctx.layout, ctx.iteration
    if (policy := update_policy(folder)) is not None:
        return _update_need(ctx, config, folder, policy)
    names = [folder, StepName.BASELINE.value] if folder == StepName.VALIDATION else [folder]
    for j in range(k, max(-1, k - 1 - LOOKBACK), -1):
        for name in names:
            size = None if (j == k and name == folder) else written(layout.step(j, name))
            if size is not None:
                return Need(size, f"what {name} wrote at iteration {j}")
    return Need(0, "no earlier run of this step")


def _update_need(ctx: IterationContext, config: ExperimentConfig, folder: str, policy: str) -> Need:
    """An update's need: the last update that did work, with its snapshot; the snapshot part estimated when this
    update writes one (``optimizer_snapshot_written``) and that one did not."""
    layout, k = ctx.layout, ctx.iteration
    t = config.training
    snapshot = not ctx.attempt and optimizer_snapshot_written(
        t.save_optimizer_every, t.replay_snapshots, k, config.run.iterations
    )
    for j in range(k - 1, max(-1, k - 1 - LOOKBACK), -1):
        update = layout.step(j, folder)
        if not update.did_work():
            continue
        size = (written(update) or 0) + (written(layout.step(j, optimizer_step_name(policy))) or 0)
        had_snapshot = _snapshot_bytes(update) or _snapshot_bytes(layout.step(j, optimizer_step_name(policy)))
        if had_snapshot or not snapshot:
            return Need(size, f"what {folder} and its snapshot wrote at iteration {j}")
        return Need(
            size + _estimate(config, policy, snapshot_only=True),
            f"what {folder} wrote at iteration {j} and an estimate of its optimizer snapshot",
        )
    return Need(_estimate(config, policy, snapshot=snapshot), "an estimate for a first update from the model's size")


def _estimate(config: ExperimentConfig, policy: str, snapshot: bool = True, snapshot_only: bool = False) -> int:
    from pettingflow.runs.lineage import base_model_dir  # resolves the model: only when estimating

    base = model_bytes(base_model_dir(config, policy))
    if snapshot_only:
        return estimate_update(config, policy, True, base) - estimate_update(config, policy, False, base)
    return estimate_update(config, policy, snapshot, base)


def _snapshot_bytes(step: Step) -> int:
    """The bytes of the optimizer snapshot a committed step holds or held (its ``deepspeed/`` files, pruned ones
    included); 0 when none or not committed."""
    try:
        manifest = step.manifest()
    except StepNotCommittedError:
        return 0
    listed = sum(e.bytes for e in manifest.files if e.name.startswith("deepspeed/"))
    pruned = sum(
        int(p.get("bytes", 0)) for p in manifest.metadata.get("pruned", []) if "deepspeed/" in p.get("prefixes", [])
    )
    return listed + pruned


def free_bytes(path: str) -> int:
    """Free bytes on the filesystem of ``path`` (its nearest existing ancestor), for an unprivileged writer."""
    here = Path(path)
    while not here.exists() and here != here.parent:
        here = here.parent
    return shutil.disk_usage(here).free


def check_step(ctx: IterationContext, config: ExperimentConfig, folder: str) -> Need | None:
    """Raise ``DiskSpaceError`` when the run's folder has less free space than step ``folder`` of this attempt
    needs plus ``disk.margin_mb``; returns the need checked (None: not checked: guard off, remote storage, or the
    step is committed and will not write)."""
    layout = ctx.layout
    if not config.disk.guard or not is_local(layout.fs) or ctx.step(folder).is_committed():
        return None
    need = step_need(ctx, config, folder)
    margin = config.disk.margin_mb * 2**20
    free = free_bytes(layout.run_path)
    if free < need.bytes + margin:
        raise DiskSpaceError(message(ctx, folder, free, need, margin))
    return need


def message(ctx: IterationContext, folder: str, free: int, need: Need, margin: int) -> str:
    """The one message of a run stopped by the guard: where, how much is free and needed, how to go on."""
    layout = ctx.layout
    run_id, root = layout.run_id, layout.root
    return (
        f"not enough free disk for step {folder} of iteration {ctx.iteration} of run {run_id}: {layout.run_path} has "
        f"{size(free)} free, the step needs about {size(need.bytes + margin)} ({need.basis}: {size(need.bytes)}, "
        f"plus disk.margin_mb {size(margin)}). The run stopped before the step wrote anything. Free space, e.g. old "
        f"checkpoints of this run: `pettingflow runs prune {run_id} --root {root} --keep-last 1 --yes` (without "
        "--yes it lists what would go, and the bytes), then resume the run with the same config and overrides "
        f"(`pettingflow train <config> [overrides] --run-id {run_id}`, or `prefect deployment run train/<config> "
        f"--param run_id={run_id}`)."
    )


def size(n: int) -> str:
    """Bytes as the message shows them: GB from 1 GB up, else MB."""
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def not_disk_full(task: object, task_run: object, state: object) -> bool:
    """A Prefect ``retry_condition_fn``: retry a failed task unless the disk guard stopped it (retrying cannot free
    space; the run stops at the step boundary instead)."""
    return not isinstance(getattr(state, "data", None), DiskSpaceError)
