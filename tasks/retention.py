"""The ``retention`` task: the run deletes the checkpoints nothing can start from any more, at the end of every
iteration of the original run (``runs/retention.apply_retention``, the ``disk`` settings).

Why a task after the report rather than a step: it commits nothing of its own (the pruned steps' markers say what
went), so it has no folder to skip on resume; a resumed iteration whose steps are all committed runs it again,
which is what finishes a pass that a kill cut short. Why after the report: by then the update that supersedes the
oldest weights, the sync that serves it and the report that reads the iteration are committed.
"""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from pettingflow.runs.retention import apply_retention
from pettingflow.runs.run import RunRef, load_run_config


@task(name="retention", cache_policy=NO_CACHE)
def retention(run: RunRef, iteration: int, runtime: Any = None, upstream: Any = None) -> dict[str, Any]:
    """Delete the weights and optimizer snapshots outside the ``disk`` settings' keep rules (after ``iteration``'s
    report); returns how many steps and bytes. A failure only warns: everything the run needs is committed, and
    the next iteration's pass retries (the disk guard stops the run before the disk fills meanwhile)."""
    logger = get_run_logger()
    layout = run.layout()
    config = load_run_config(run)
    if runtime is not None:  # a snapshot committing now may prune snapshots too (training.replay_snapshots)
        for service in runtime.services.values():
            service.wait_snapshot()
    try:
        done = apply_retention(layout, config, iteration)
    except Exception as exc:
        logger.warning("retention after iteration %d failed, the next iteration tries again: %s", iteration, exc)
        return {"steps": 0, "bytes": 0, "failed": str(exc)}
    freed = sum(d.bytes for d in done)
    if done:
        what = ", ".join(f"{d.policy} iter-{d.iteration} {d.step.name} ({'+'.join(d.prefixes)})" for d in done)
        logger.info("retention after iteration %d: freed %.2f GB: %s", iteration, freed / 1e9, what)
    return {"steps": len(done), "bytes": freed}
