"""Steps 4 and 5: one update per policy, then weight sync to the servers.

The update runs in the policy's resident learner (Ray actors that keep the model and optimizer across
iterations, ``training.learner: resident``) or in a learner of its own, started for this update
(``training.run_update``: ``process``, and whenever no runtime is up, e.g. a re-run without servers). This
module decides the update's inputs (batch, starting weights, optimizer snapshot) from committed steps, builds
its spec with the one builder (``training.spec_from_config``) and commits its outputs (checkpoint, metrics) as
the ``update-<policy>`` step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pettingflow.configs.settings import ExperimentConfig
from pettingflow.faults import armed, crash_soon, hold, maybe_crash
from pettingflow.runs.context import IterationContext
from pettingflow.runs.lineage import (
    allowed_policy_lag,
    check_batch_lag,
    lag_metrics,
    lost_snapshot,
    optimizer_step_name,
    policy_lags,
    update_with_snapshot,
    weights_after,
    weights_before,
)
from pettingflow.runs.replay import original_update, prune_replay_snapshots, replay_threads, verify_replay
from pettingflow.steps.batches import batch_file
from pettingflow.steps.outcome import StepOutcome, already_done
from pettingflow.storage.commits import FileEntry, Step
from pettingflow.storage.fs import join, uri_of
from pettingflow.storage.layout import StepName
from pettingflow.training.launch import METRICS_FILE, rebase_outputs, spec_from_config
from pettingflow.training.learner import UPLOADED_KEY, run_update

if TYPE_CHECKING:
    from pettingflow.runs.runtime import RunServices

log = logging.getLogger(__name__)


def update_step(
    ctx: IterationContext, config: ExperimentConfig, policy: str, runtime: RunServices | None = None
) -> StepOutcome:
    """Train ``policy`` on its batch of this iteration; commit checkpoint + metrics."""
    name = StepName.UPDATE.folder(policy)
    step = ctx.step(name)
    if done := already_done(step):
        if runtime is not None:
            runtime.services[policy].wait_snapshot()
        discard_lost_snapshot(ctx.step(optimizer_step_name(policy)), step)
        return done
    if runtime is not None:  # the previous update's snapshot commits first: this one may start from it
        runtime.services[policy].wait_snapshot()
    if ctx.iteration > 0:  # a crash while it was written, found by a resume past that iteration
        k = ctx.iteration - 1
        update, snapshot = update_with_snapshot(ctx.layout, k, policy)
        discard_lost_snapshot(snapshot, update)
    batches = ctx.step(StepName.ADVANTAGES)
    entry = next((f for f in batches.manifest().files if f.name == batch_file(policy)), None)
    if entry is None:
        raise FileNotFoundError(f"{batches.uri} has no {batch_file(policy)}: was {policy!r} in the config?")
    start = weights_before(ctx.layout, config, policy, ctx.iteration)
    step.begin()
    if not entry.rows:
        metrics = {
            "skipped": True,
            "reason": f"no rows for policy {policy!r} after filtering",
            "starts_from": start.source,
        }
        step.write_json("metrics.json", metrics)
        step.commit(metrics)
        return StepOutcome(name, step.uri, 0, False, metrics)
    lags = policy_lags(batches.read_table(entry.name, columns=["policy_version"]), start.version)
    check_batch_lag(policy, ctx.iteration, lags, start, allowed_policy_lag(config))
    local = step.local_path
    out_dir = local if local is not None else Path(tempfile.mkdtemp(prefix="pettingflow-update-"))
    learner = runtime.learner(policy) if runtime is not None and config.training.learner == "resident" else None
    # inference.between_updates: the servers keep running, are paused, sleep or are stopped while this trains
    released = runtime.servers_released() if runtime is not None else contextlib.nullcontext(False)
    # a failure below leaves the step uncommitted; a resident learner then holds weights named after this
    # step (``weights_uri``), never the retry's starting weights, so the retry reloads the committed ones
    try:
        with released as servers_released:
            spec = spec_from_config(
                config,
                policy=policy,
                batch_uri=uri_of(batches.fs, join(batches.path, entry.name)),
                out_dir=str(out_dir),
                start=start,
                iteration=ctx.iteration,
                weights_uri=step.uri,
                num_threads=update_threads(config, servers_released, ctx, policy),
                out_uri=step.uri if local is None else None,  # ranks on other nodes upload there
                save_optimizer=False if ctx.attempt else None,  # a re-run's snapshot: nothing ever starts from it
            )
            background = (
                learner is not None and spec.save_resume_state and (config.training.optimizer_snapshot == "background")
            )
            if background:  # written after the commit, off the critical path (snapshot_in_background)
                spec = spec.model_copy(update={"save_resume_state": False})
            if any(lag > 0 for lag in lags):  # off-policy rows: the sampler's log-probs are the behaviour policy
                spec = spec.model_copy(
                    update={"algorithm": spec.algorithm.model_copy(update={"use_sampler_logprobs": True})}
                )
            crash_soon("update:mid", step.path)  # kill matrix: a few seconds into the training
            if learner is not None:
                metrics = learner.update(spec, timeout_s=config.training.update_timeout_s)
            else:
                metrics = run_update(spec, timeout_s=config.training.update_timeout_s)
        metrics["servers_released"] = servers_released  # paused, asleep or stopped during the update
        metrics["between_updates"] = runtime.between_updates.mode if runtime is not None else "keep"
        metrics["behaviour_logprobs"] = "sampler" if spec.algorithm.use_sampler_logprobs else "recomputed"
        metrics.update(lag_metrics(lags))
        metrics.update(_flat_timings(metrics))
        if ctx.attempt:  # a re-run: did its update start exactly where the original's did?
            metrics.update(replay_metrics(ctx, policy, metrics))
        uploaded = [FileEntry(**e) for e in metrics.pop(UPLOADED_KEY, [])]  # by ranks on other nodes
        if not (Path(out_dir) / METRICS_FILE).is_file() and METRICS_FILE not in {e.name for e in uploaded}:
            raise RuntimeError(  # rank 0 writes it last, beside the checkpoint
                f"the update of {policy!r} wrote no {METRICS_FILE} into {out_dir} nor into {step.uri}: its rank 0 "
                "wrote the checkpoint somewhere else"
            )
        step.add_tree(out_dir)
        step.add_entries(uploaded)
        if local is None:  # name the uploaded files (log, checkpoint), not the temp folder deleted below
            metrics = rebase_outputs(metrics, str(out_dir), step.uri)
        if background and not metrics.get("skipped"):
            metrics["optimizer_snapshot"] = "background"
        meta = {"metrics": _small(metrics), "starts_from": start.source, "skipped": bool(metrics.get("skipped"))}
        hold("update:before_commit")  # crash tests: keep the update in flight while other work goes on
        manifest = step.commit(meta)
    finally:
        if local is None:
            shutil.rmtree(out_dir, ignore_errors=True)
    if background and not metrics.get("skipped"):
        snapshot_in_background(ctx, policy, learner, runtime, step.uri, config.training.update_timeout_s, config)
        snapshot = ctx.step(optimizer_step_name(policy))
        if armed("snapshot:mid", snapshot.path) or armed(f"before_marker:{snapshot.name}", snapshot.path):
            # kill matrix: the crash lands while the snapshot is the only work in flight
            runtime.services[policy].wait_snapshot()
    elif spec.save_resume_state and not metrics.get("skipped") and not ctx.attempt:
        drop_old_replay_snapshots(ctx, config, policy)  # the snapshot came inline, committed with the update
    return StepOutcome(name, step.uri, manifest.rows, False, meta)


def snapshot_in_background(
    ctx: IterationContext,
    policy: str,
    learner: Any,
    runtime: RunServices,
    weights_uri: str,
    timeout_s: float | None,
    config: ExperimentConfig | None = None,
) -> None:
    """Write the optimizer snapshot of the update just committed (``weights_uri``) in the learner, and commit it as
    ``optimizer-<policy>`` once every rank is done, from a thread of the runtime: the flow goes on to sync,
    validate and collect meanwhile. A failure or a crash leaves the step uncommitted, so a resume uses the
    previous snapshot (and says how old it is); nothing half-written is ever read. Once committed, the snapshots
    that only ``training.replay_snapshots`` kept and that are now out of its window are removed (``config``: the
    run's; None: none are)."""
    step = ctx.step(optimizer_step_name(policy))
    if step.is_committed():
        return
    step.begin()
    local = step.local_path
    out_dir = local if local is not None else Path(tempfile.mkdtemp(prefix="pettingflow-optimizer-"))

    def write_and_commit() -> None:
        started = time.perf_counter()
        try:
            result = learner.save_optimizer(
                str(out_dir),
                weights_uri,
                timeout_s=timeout_s,
                out_uri=step.uri if local is None else None,
                storage_options=ctx.layout.storage_options,
            )
            uploaded = [FileEntry(**e) for e in result.pop(UPLOADED_KEY, [])]  # by ranks on other nodes
            maybe_crash("snapshot:mid", step.path)  # kill matrix: every rank wrote its part, nothing committed
            step.add_tree(out_dir)
            step.add_entries(uploaded)
            step.commit(
                {
                    "policy": policy,
                    "for_update": weights_uri,
                    "wall_s": round(time.perf_counter() - started, 3),
                    **result,
                }
            )
            log.info(
                "optimizer snapshot of %s committed at %s (%.1f s, off the critical path)",
                policy,
                step.uri,
                result["save_s"],
            )
            if config is not None and not ctx.attempt:
                drop_old_replay_snapshots(ctx, config, policy)
        except Exception as exc:  # the snapshot is optional: the run goes on with the previous one
            log.warning(
                "optimizer snapshot of %s after %s failed, the previous one stays in force: %s",
                policy,
                weights_uri,
                exc,
            )
        finally:
            if local is None:
                shutil.rmtree(out_dir, ignore_errors=True)

    runtime.services[policy].track_snapshot(write_and_commit)


def drop_old_replay_snapshots(ctx: IterationContext, config: ExperimentConfig, policy: str) -> None:
    """``runs/replay.prune_replay_snapshots`` once this iteration's snapshot is committed. A failure only logs: the
    update and its snapshot are committed, and the next commit prunes what this one left."""
    try:
        prune_replay_snapshots(ctx.layout, config, policy, ctx.iteration)
    except Exception as exc:
        log.warning("removing old optimizer snapshots of %s (training.replay_snapshots) failed: %s", policy, exc)


def discard_lost_snapshot(step: Step, update: Step) -> bool:
    """Remove an uncommitted ``optimizer-<policy>`` step folder once its update is committed and no snapshot is
    being written (the caller waited for them): a crash cut the background snapshot short, and the moments it
    would hold died with the learner, so it can never be completed (the next update says which optimizer state
    it found). Nothing reads an uncommitted step; this gives its bytes (~1.8 GB at 135M) back. True when
    something was removed. ``update``: the update step the snapshot belongs to; nothing is removed before it
    is committed."""
    if not lost_snapshot(step, update):
        return False
    step.fs.rm(step.path, recursive=True)
    log.warning("removed %s: an optimizer snapshot a crash left unfinished (it cannot be completed)", step.uri)
    return True


def update_threads(
    config: ExperimentConfig, servers_released: bool, ctx: IterationContext | None = None, policy: str | None = None
) -> int | None:
    """torch threads per rank: ``training.num_threads``, or every core split over the ranks while the servers
    are paused, asleep or stopped (nothing else runs then), or None (the process default, ``OMP_NUM_THREADS``).
    A re-run (``ctx.attempt`` > 0) uses the original update's recorded count instead: the thread count decides
    how matmuls split their sums, so another one would change the update's numbers (``runs/replay.py``)."""
    if ctx is not None and ctx.attempt and policy is not None:
        threads = replay_threads(ctx.layout, config, policy, ctx.iteration)
        if threads is not None:
            return threads
    if config.training.num_threads is not None:
        return config.training.num_threads
    if servers_released:
        return max(1, (os.cpu_count() or 1) // config.training.num_processes)
    return None


def optimizer_state_line(policy: str, metrics: dict[str, Any]) -> str | None:
    """One readable line on the optimizer state and the learner of an update (None for a skipped update)."""
    state = metrics.get("optimizer_state")
    if state is None:
        return None
    age = metrics.get("optimizer_age")
    detail = {
        "new": "new (starts from the base weights)",
        "resident": "resident (moments carried over in memory)",
        "restored": "restored exactly from the snapshot of the starting weights",
        "stale": f"STALE: restored from a snapshot {age} update(s) older than the starting weights",
        "reset": "RESET: no snapshot of the trained weights exists, Adam restarts",
    }.get(state, state)
    learner = "learner loaded the committed weights" if metrics.get("learner_loaded") else "learner resident"
    starts = metrics.get("learner_starts")
    return f"update {policy}: optimizer state {detail}; {learner}" + (f", start #{starts}" if starts else "")


def replay_metrics(ctx: IterationContext, policy: str, metrics: dict[str, Any]) -> dict[str, Any]:
    """``exact_replay`` (whether this re-run's update started exactly where the original's did, from the numbers
    both recorded: ``runs/replay.verify_replay``) and ``replay_reason`` (why not; "" when it did), logged."""
    info = ctx.layout.read_attempt_info(ctx.iteration, ctx.attempt) or {}
    original = original_update(ctx.layout, policy, ctx.iteration)
    reason = verify_replay(original, metrics, info.get("config_changes") or [])
    if reason is None:
        log.info("update %s of %s: exact replay of the original's update", policy, ctx.label)
    else:
        log.warning("update %s of %s: not an exact replay: %s", policy, ctx.label, reason)
    return {"exact_replay": reason is None, "replay_reason": reason or ""}


def _flat_timings(metrics: dict[str, Any]) -> dict[str, Any]:
    """The update's own breakdown (read, setup, load, log-probs, train, save) and whether its optimizer state is
    exact, as scalars for the manifest and the report (``update/<policy>/time/train_s``, ...)."""
    out: dict[str, Any] = {f"time/{k}": v for k, v in (metrics.get("timings") or {}).items()}
    if "optimizer_state" in metrics:
        out["optimizer_exact"] = int(metrics["optimizer_state"] in ("new", "resident", "restored"))
    if "learner" in metrics:
        out["learner_starts"] = metrics["learner"]["starts"]
    return out


def _small(metrics: dict[str, Any]) -> dict[str, Any]:
    """Scalars only: the manifest and the Prefect result stay small."""
    return {k: v for k, v in metrics.items() if isinstance(v, int | float | str | bool) or v is None}


def sync_step(ctx: IterationContext, config: ExperimentConfig, runtime: RunServices) -> dict[str, Any]:
    """Make every server serve the weights of this iteration; the next rollout uses them.

    Not skipped on re-runs: a restarted server serves the base model again, and syncing is cheap and
    idempotent (the runtime only reloads what differs). With ``inference.between_updates: restart`` the servers
    are down after the update: this starts them from the new weights (no reload on top).
    """
    results = {}
    for policy, service in runtime.services.items():
        results[policy] = service.serve(weights_after(ctx, config, policy))
    step = ctx.step(StepName.SYNC)
    maybe_crash("sync:mid", step.path)  # kill matrix: servers synced, the step not committed
    if not step.is_committed():
        step.begin()
        step.write_json("sync.json", results)
        step.commit({"policies": list(results)})
    return results
