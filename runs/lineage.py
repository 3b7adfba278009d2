"""Weights lineage: which weights each step of a run started from and produced, and how far behind them the
rows it trains on may be.

The truth is in storage: the weights after iteration k are the checkpoint in the committed
``update-<policy>`` step of iteration k (attempt 0). Iteration k therefore starts from the newest
committed update before k, or from the base model. Because this is derived from committed files,
a resumed run (new process, fresh vLLM server) serves and trains from exactly the right weights.

Policy lag: every row records the version of the weights that generated it (``policy_version``: 0 the base, k + 1
the update of iteration k). An update may train on rows at most ``allowed_policy_lag`` versions older than the
weights it starts from: 0 for synchronous rollouts, ``rollout.max_policy_lag`` with ``async_rollouts``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import numpy as np

from pettingflow.configs.settings import ExperimentConfig
from pettingflow.inference.models import resolve_model
from pettingflow.runs.context import IterationContext
from pettingflow.storage import RunLayout, Step
from pettingflow.storage.commits import Manifest
from pettingflow.storage.layout import StepName, optimizer_step_name
from pettingflow.storage.local_copy import COMPLETE, cached_copy_dir, local_copy
from pettingflow.storage.trajectories import read_step_trajectories
from pettingflow.training.checkpoint import ADAPTERS_SUBDIR, DEEPSPEED_SUBDIR, MODEL_SUBDIR, PolicyWeights
from pettingflow.training.launch import UpdateSpec

__all__ = [
    "COMPLETE",
    "PolicyWeights",
    "PrunedWeightsError",
    "allowed_policy_lag",
    "base_model_dir",
    "cached_copy_dir",
    "lag_metrics",
    "local_copy",
    "localize_start",
    "lost_snapshot",
    "optimizer_step_name",
    "policy_lags",
    "row_lags",
    "stale_rollouts",
    "start_version",
    "update_checkpoints",
    "update_with_snapshot",
    "weights_after",
    "weights_before",
    "weights_in_step",
]


def base_model_dir(config: ExperimentConfig, policy: str) -> str:
    """The local folder of the policy's base model (KL reference, tokenizer, what adapters sit on)."""
    return str(resolve_model(config.policy(policy).model))


def weights_before(layout: RunLayout, config: ExperimentConfig, policy: str, iteration: int) -> PolicyWeights:
    """The weights ``policy`` has when iteration ``iteration`` starts, with the newest optimizer snapshot.

    The weights come from the newest committed, non-skipped update before ``iteration``. The optimizer
    snapshot (``deepspeed_dir``) is the newest one at or before those weights, in the update step itself
    (``training.optimizer_snapshot: inline``) or in the ``optimizer-<policy>`` step committed after it
    (``background``); ``optimizer_age`` counts the updates between the two (0: exact).
    """
    base = base_model_dir(config, policy)
    weights: PolicyWeights | None = None
    age = 0
    for k in range(iteration - 1, -1, -1):
        step = layout.step(k, StepName.UPDATE.folder(policy))
        if not step.did_work():
            continue
        if weights is None:
            weights = weights_in_step(step, policy, base, version=k + 1)
            if weights.deepspeed_dir is not None:
                return weights
            if (snapshot := snapshot_of(layout, k, policy, step)) is not None:
                return with_snapshot(weights, snapshot)
        else:
            age += 1
            if (snapshot := snapshot_of(layout, k, policy, step)) is not None:
                return with_snapshot(weights, snapshot, age)
    return weights or PolicyWeights(policy=policy, base_dir=base, model_dir=base)


def snapshot_of(layout: RunLayout, iteration: int, policy: str, update: Step) -> Step | None:
    """The step holding the optimizer snapshot of ``policy``'s update at ``iteration``, if one was committed: the
    update step itself, or the ``optimizer-<policy>`` step written after it in the background."""
    for step in (update, layout.step(iteration, optimizer_step_name(policy))):
        if step is not update and not step.is_committed():
            continue
        if any(e.name.startswith(DEEPSPEED_SUBDIR + "/") for e in step.manifest().files):
            return step
    return None


def with_snapshot(weights: PolicyWeights, step: Step, age: int = 0) -> PolicyWeights:
    """``weights`` with the optimizer snapshot held by ``step`` (downloaded to this node when remote)."""
    folder = str(local_copy(step) / DEEPSPEED_SUBDIR)
    return replace(weights, deepspeed_dir=folder, snapshot_source=step.uri, optimizer_age=age)


def update_with_snapshot(layout: RunLayout, iteration: int, policy: str) -> tuple[Step, Step]:
    """``policy``'s update step of ``iteration`` (attempt 0) and the ``optimizer-<policy>`` step its background
    snapshot is written to after it."""
    return layout.step(iteration, StepName.UPDATE.folder(policy)), layout.step(iteration, optimizer_step_name(policy))


def lost_snapshot(snapshot: Step, update: Step) -> bool:
    """Whether ``snapshot`` (an ``optimizer-<policy>`` step) is a background snapshot a crash cut short: its folder
    exists uncommitted while the update it belongs to (``update``) is committed. Nothing can complete it (the moments
    it would hold died with the learner) and nothing reads it; before its update commits it may still be written."""
    return not snapshot.is_committed() and update.is_committed() and snapshot.fs.exists(snapshot.path)


def update_checkpoints(
    layout: RunLayout, policy: str, iterations: Iterable[int]
) -> dict[int, list[tuple[Step, Manifest]]]:
    """The steps holding what ``policy``'s updates produced, by iteration (attempt 0), with their commit markers:
    for each of ``iterations`` whose update did work (committed, not skipped), the update step (its weights, an
    inline optimizer snapshot) and, when committed, the ``optimizer-<policy>`` step written after it. What retention
    and ``runs prune`` choose from; read from the markers alone."""
    found: dict[int, list[tuple[Step, Manifest]]] = {}
    for k in iterations:
        update, snapshot = update_with_snapshot(layout, k, policy)
        if not update.is_committed() or (manifest := update.manifest()).metadata.get("skipped"):
            continue
        found[k] = [(update, manifest)]
        if snapshot.is_committed():
            found[k].append((snapshot, snapshot.manifest()))
    return found


def start_version(layout: RunLayout, policy: str, iteration: int) -> int:
    """The version of the weights ``policy`` starts ``iteration`` from (``weights_before(...).version``), read from
    the commit markers alone: no model folder is resolved or downloaded."""
    for k in range(iteration - 1, -1, -1):
        if layout.step(k, StepName.UPDATE.folder(policy)).did_work():
            return k + 1
    return 0


def weights_in_step(step: Step, policy: str, base_dir: str, version: int) -> PolicyWeights:
    """The checkpoint stored in a committed update step, as local folders; ``version``: its iteration + 1.

    Only folders the commit marker lists count (a folder an interrupted prune left behind is not a checkpoint),
    and weights removed by ``pettingflow runs prune`` raise ``PrunedWeightsError``: falling back to the base
    model would silently restart training.
    """
    manifest = step.manifest()
    gone = pruned_weights(manifest.metadata)
    if gone:
        raise PrunedWeightsError(
            f"the weights of {policy} after iteration {version - 1} ({step.uri}) were removed by "
            f"{pruned_by(manifest.metadata)} ({gone}); what starts from them (resuming or re-running iteration "
            f"{version}, evaluating this run at that point) needs them. Re-run a later iteration whose starting "
            "weights were kept (`pettingflow runs show <run_id>` lists them), or train again."
        )
    root = local_copy(step)
    listed = {e.name.split("/", 1)[0] for e in manifest.files}
    adapters_root = root / ADAPTERS_SUBDIR
    adapters = (
        {p.name: str(p) for p in sorted(adapters_root.iterdir()) if p.is_dir()}
        if ADAPTERS_SUBDIR in listed and adapters_root.is_dir()
        else {}
    )
    return PolicyWeights(
        policy=policy,
        base_dir=base_dir,
        model_dir=str(root / MODEL_SUBDIR) if MODEL_SUBDIR in listed else base_dir,
        adapters=adapters,
        deepspeed_dir=str(root / DEEPSPEED_SUBDIR) if DEEPSPEED_SUBDIR in listed else None,
        snapshot_source=step.uri if DEEPSPEED_SUBDIR in listed else None,
        source=step.uri,
        version=version,
    )


class PrunedWeightsError(FileNotFoundError):
    """The weights an operation starts from were deleted by ``pettingflow runs prune`` or the run's retention."""


def pruned_weights(metadata: dict) -> str:
    """A description of the weight folders (model, adapters) a prune removed from an update step; "" if none.
    An optimizer-only prune (``deepspeed/``) leaves the weights usable and returns ""."""
    for entry in metadata.get("pruned", []):
        hit = [p for p in entry.get("prefixes", []) if p.rstrip("/") in (MODEL_SUBDIR, ADAPTERS_SUBDIR)]
        if hit:
            return f"{', '.join(hit)} pruned {entry.get('at', '?')}"
    return ""


def pruned_by(metadata: dict) -> str:
    """Who removed an update step's weights: `pettingflow runs prune` (by hand) or the run's own retention (the
    ``disk`` settings, ``runs/retention.py``), as its marker's ``pruned`` record says."""
    for entry in metadata.get("pruned", []):
        if any(p.rstrip("/") in (MODEL_SUBDIR, ADAPTERS_SUBDIR) for p in entry.get("prefixes", [])):
            by = entry.get("by") or "pettingflow runs prune"
            return f"`{by}`" if by == "pettingflow runs prune" else by
    return "a prune"


def localize_start(spec: UpdateSpec) -> UpdateSpec:
    """``spec`` with its start weights and optimizer snapshot as folders on *this* node, made from
    ``spec.start_sources``: what a learner rank on another node than the flow's runs before training (the spec's
    folders are the flow node's). The base model resolves here (a prepared name is converted on this node if
    needed); trained weights and snapshots are verified downloads into this node's ``$PETTINGFLOW_HOME/cache``
    (``local_copy``), or the step folders themselves on local storage."""
    sources = spec.start_sources
    if sources is None:
        raise ValueError(
            f"the update of {spec.policy!r} starts from folders only ({spec.init_model_dir}), with no committed step "
            "behind them: a learner rank on another node cannot find them. Run it with every rank on this node."
        )
    base = str(resolve_model(sources.base_model))
    if sources.weights:
        start = weights_in_step(Step.from_uri(sources.weights, spec.storage_options), spec.policy, base, version=1)
    else:
        start = PolicyWeights(policy=spec.policy, base_dir=base, model_dir=base)
    resume = None
    if spec.resume_dir is not None:
        if not sources.snapshot:
            raise ValueError(f"the update of {spec.policy!r} resumes from {spec.resume_dir}, a folder with no step")
        resume = str(local_copy(Step.from_uri(sources.snapshot, spec.storage_options)) / DEEPSPEED_SUBDIR)
    return spec.model_copy(
        update={
            "init_model_dir": start.model_dir,
            "base_model_dir": start.base_dir,
            "adapters_in": (dict(start.adapters) or None) if spec.uses_lora else None,
            "resume_dir": resume,
        }
    )


def weights_after(ctx: IterationContext, config: ExperimentConfig, policy: str) -> PolicyWeights:
    """The weights a policy has after this attempt's update (or before it, when the update was skipped)."""
    step = ctx.step(StepName.UPDATE.folder(policy))
    if step.did_work():
        return weights_in_step(step, policy, base_model_dir(config, policy), version=ctx.iteration + 1)
    return weights_before(ctx.layout, config, policy, ctx.iteration)


# ------------------------------------------------------------------------------------------------ policy lag
def allowed_policy_lag(config: ExperimentConfig) -> int:
    """The most versions a row may lag behind the weights its update starts from."""
    return config.rollout.max_policy_lag if config.rollout.async_rollouts else 0


def row_lags(policy_versions: Any, start_version: int) -> np.ndarray:
    """Each row's lag: ``start_version - policy_version``, the versions between the weights that generated it and
    the weights its update starts from (0: on-policy). Rows of files older than ``policy_version`` carry their
    iteration, which can exceed an older start (updates skipped in between): lag 0. Pure (an array or a list in)."""
    versions = np.asarray(policy_versions, dtype=np.int64)
    return np.maximum(0, start_version - versions)


def policy_lags(table: Any, start_version: int) -> Counter[int]:
    """Rows per lag (``row_lags``) of a table with a ``policy_version`` column."""
    versions = table.column("policy_version").to_numpy(zero_copy_only=False)
    return Counter(int(lag) for lag in row_lags(versions, start_version))


def lag_metrics(lags: Counter[int]) -> dict[str, int]:
    """What an update reports of its rows' lags: the largest (``policy_lag_max``), and rows per lag
    (``policy_lag/<lag>``)."""
    return {"policy_lag_max": max(lags, default=0), **{f"policy_lag/{lag}": n for lag, n in sorted(lags.items())}}


def check_batch_lag(policy: str, iteration: int, lags: Counter[int], start: PolicyWeights, allowed: int) -> None:
    """Refuse an update whose batch holds rows older than ``allowed`` (``ValueError`` saying how to recover)."""
    if lags and max(lags) > allowed:
        raise ValueError(
            f"{policy}'s batch of iteration {iteration} holds rows {max(lags)} version(s) older than the weights "
            f"the update starts from ({start.source}); at most {allowed} allowed (rollout.max_policy_lag, "
            "rollout.async_rollouts). Collect the iteration's rollouts again (the rollouts task does so on resume)."
        )


def stale_rollouts(ctx: IterationContext, config: ExperimentConfig, start_versions: dict[str, int]) -> str | None:
    """Why the committed rollouts of this iteration may not be trained, or None when they may.

    Rows may be at most ``allowed_policy_lag`` versions older than the weights their update starts from
    (``start_versions``: policy -> version). Rows collected ahead before a crash can fall outside that bound
    only if the run's history changed under them; they are then collected again rather than trained on.
    """
    step = ctx.step(StepName.ROLLOUTS)
    if not step.is_committed():
        return None
    allowed = allowed_policy_lag(config)
    table = read_step_trajectories(step, columns=["policy_name", "policy_version"])
    oldest: dict[str, int] = {}
    policies, versions = table.column("policy_name").to_pylist(), table.column("policy_version").to_pylist()
    for policy, version in zip(policies, versions, strict=True):
        oldest[policy] = min(version, oldest.get(policy, version))
    for policy, version in sorted(oldest.items()):
        start = start_versions.get(policy)
        if start is not None and start - version > allowed:
            return (
                f"rollouts of iteration {ctx.iteration} hold {policy} rows of weights version {version}, but its "
                f"update starts from version {start}: lag {start - version} > {allowed} allowed"
            )
    return None
