"""Steps 4 and 5: one update job per policy, then weight sync to the servers.

The update job runs in its own process (``pettingflow.training``); this module decides its inputs
(batch, starting weights, optimizer state) from committed steps and commits its outputs
(checkpoint, metrics) as the ``update-<policy>`` step.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from pettingflow.configs.settings import ExperimentConfig, Specialization
from pettingflow.iteration.batches import StepOutcome, already_done, batch_file
from pettingflow.iteration.context import IterationContext
from pettingflow.iteration.weights import (
    PolicyWeights,
    base_model_dir,
    update_step_name,
    weights_before,
    weights_in_step,
)
from pettingflow.storage.fs import join, uri_of
from pettingflow.training.launch import UpdateSpec, run_update


def update_step(ctx: IterationContext, config: ExperimentConfig, policy: str) -> StepOutcome:
    """Train ``policy`` on its batch of this iteration; commit checkpoint + metrics."""
    name = update_step_name(policy)
    step = ctx.step(name)
    if done := already_done(step):
        return done
    batches = ctx.step("advantages")
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
    local = step.local_path
    out_dir = local if local is not None else Path(tempfile.mkdtemp(prefix="pettingflow-update-"))
    agents = [a.name for a in config.agents_of(policy)]
    spec = UpdateSpec(
        batch_uri=uri_of(batches.fs, join(batches.path, entry.name)),
        policy=policy,
        out_dir=str(out_dir),
        init_model_dir=start.model_dir,
        base_model_dir=start.base_dir,
        adapters_in=dict(start.adapters) if config.specialization is Specialization.lora else None,
        resume_dir=start.deepspeed_dir,
        specialization=config.specialization,
        agents=agents,
        training=config.training,
        algorithm=config.algorithm,
        lora=config.policy(policy).lora,
        storage_options=ctx.layout.storage_options,
        seed=config.run.seed + ctx.iteration,
        save_resume_state=config.training.save_optimizer_state,
    )
    try:
        metrics = run_update(spec)
        step.add_tree(out_dir)
        meta = {"metrics": _small(metrics), "starts_from": start.source, "skipped": bool(metrics.get("skipped"))}
        manifest = step.commit(meta)
    finally:
        if local is None:
            shutil.rmtree(out_dir, ignore_errors=True)
    return StepOutcome(name, step.uri, manifest.rows, False, meta)


def _small(metrics: dict[str, Any]) -> dict[str, Any]:
    """Scalars only: the manifest and the Prefect result stay small."""
    return {k: v for k, v in metrics.items() if isinstance(v, int | float | str | bool) or v is None}


def weights_after(ctx: IterationContext, config: ExperimentConfig, policy: str) -> PolicyWeights:
    """The weights a policy has after this attempt's update (or before it, when the update was skipped)."""
    step = ctx.step(update_step_name(policy))
    if step.is_committed() and not step.manifest().metadata.get("skipped"):
        return weights_in_step(step, policy, base_model_dir(config, policy))
    return weights_before(ctx.layout, config, policy, ctx.iteration)


def sync_step(ctx: IterationContext, config: ExperimentConfig, runtime: Any) -> dict[str, Any]:
    """Make every server serve the weights of this iteration; the next rollout uses them.

    Not skipped on re-runs: a restarted server serves the base model again, and syncing is cheap and
    idempotent (the runtime only reloads what differs).
    """
    results = {}
    for policy in runtime.servers:
        results[policy] = runtime.ensure_serving(weights_after(ctx, config, policy))
    step = ctx.step("sync")
    if not step.is_committed():
        step.begin()
        step.write_json("sync.json", results)
        step.commit({"policies": list(results)})
    return results
