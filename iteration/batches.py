"""Steps 2 and 3 of an iteration: filter UID groups, then compute advantages per policy.

Both read committed Parquet and write committed Parquet; neither does RL math itself (that is
``pettingflow.rl``). The advantage step writes one ``batch-<policy>.parquet`` per policy: the
trajectory columns of that policy's kept rows plus an ``advantage`` column, which is exactly what
the update job of that policy reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pettingflow.configs.settings import ExperimentConfig
from pettingflow.iteration.context import IterationContext
from pettingflow.rl.advantages import compute_advantages
from pettingflow.rl.filters import filter_samples
from pettingflow.storage import Manifest, Step, read_step_trajectories, write_trajectories

BATCH_KIND = b"batch"


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


def filter_table(table: pa.Table, config: ExperimentConfig) -> tuple[pa.Table, dict[str, Any]]:
    """The rows the configured filter keeps (none/mean/std/dapo/uid, seed 000), and what it removed."""
    algo = config.algorithm
    result = filter_samples(
        table.column("uid").to_pylist(),
        np.asarray(table.column("reward").to_numpy(zero_copy_only=False), dtype=np.float64),
        algo.filter_method,
        algo.filter_ratio,
    )
    kept = table.filter(pa.array(result.keep, pa.bool_()))
    metrics = {
        "method": algo.filter_method,
        "ratio": algo.filter_ratio,
        "rows_in": table.num_rows,
        "rows_kept": kept.num_rows,
        "removed_samples": result.removed_samples,
        "removed_groups": len(result.removed_uids),
        "reason": result.reason,
    }
    return kept, metrics


def with_advantages(table: pa.Table, config: ExperimentConfig) -> pa.Table:
    """``table`` plus a float32 ``advantage`` column (group-relative within UIDs)."""
    rewards = np.asarray(table.column("reward").to_numpy(zero_copy_only=False), dtype=np.float64)
    advantages = compute_advantages(rewards, table.column("uid").to_pylist(), config.algorithm.advantage_estimator)
    return table.append_column("advantage", pa.array(advantages.astype(np.float32), pa.float32()))


def policy_batch(table: pa.Table, policy: str) -> pa.Table:
    """The rows of one policy, marked as a batch in the Parquet metadata."""
    part = table.filter(pc.equal(table.column("policy_name"), policy))
    return part.replace_schema_metadata({**(part.schema.metadata or {}), b"pettingflow.kind": BATCH_KIND})


def filter_step(ctx: IterationContext, config: ExperimentConfig) -> StepOutcome:
    """Apply the configured filter to the iteration's rollouts; commit the kept rows."""
    out = ctx.step("filtered")
    if done := already_done(out):
        return done
    kept, metrics = filter_table(read_step_trajectories(ctx.step("rollouts")), config)
    manifest = write_trajectories(out, kept, metadata=metrics)
    return StepOutcome("filtered", out.uri, manifest.rows, False, metrics)


def advantage_step(ctx: IterationContext, config: ExperimentConfig) -> StepOutcome:
    """GRPO-style advantages within UID groups, written as one batch file per policy."""
    out = ctx.step("advantages")
    if done := already_done(out):
        return done
    table = with_advantages(read_step_trajectories(ctx.step("filtered")), config)
    policies = [p.name for p in config.policies]
    metrics: dict[str, Any] = {"estimator": config.algorithm.advantage_estimator, "policies": {}}
    out.begin()
    for policy in policies:
        part = policy_batch(table, policy)
        out.write_table(batch_file(policy), part)
        adv = part.column("advantage").to_numpy() if part.num_rows else np.zeros(0)
        metrics["policies"][policy] = {
            "rows": part.num_rows,
            "advantage_mean": float(adv.mean()) if len(adv) else 0.0,
            "advantage_abs_mean": float(np.abs(adv).mean()) if len(adv) else 0.0,
            "nonzero_advantage_rows": int((adv != 0).sum()),
        }
    manifest: Manifest = out.commit(metrics)
    return StepOutcome("advantages", out.uri, manifest.rows, False, metrics)


def batch_file(policy: str) -> str:
    """File name of a policy's batch inside the ``advantages`` step."""
    return f"batch-{policy}.parquet"
