"""Exact replays: whether a re-run of an iteration starts its update from exactly the state the original's did, and
the optimizer snapshots that make it possible.

A control re-run (no override) reproduces the original update bitwise only when everything that decides its
floating-point results is the same: the starting weights at the precision the optimizer steps (the fp32 masters
under bf16 mixed precision, which only an optimizer snapshot holds: ``model/`` is bf16), Adam's moments and step
count, torch's thread count (how matmuls split their sums), torch's version and the device (the kernels), the
world size, ZeRO stage and dtype. The worker records these with every update (``UpdateWorker.numerics``); the
original's resident learner held that state in memory, so a re-run needs the snapshot written after the update
before it (``training.replay_snapshots`` keeps those of the last iterations, ``prune_replay_snapshots``).

Two checks, one rule:

- ``plan_replay`` before the re-run starts, from storage alone (commit markers, no download, no torch): the one
  line ``pettingflow rerun`` prints and the ``rerun`` flow logs, ``exact replay: ...`` or ``not an exact replay:
  <reason>``, also stored in the attempt's ``attempt.json``;
- ``verify_replay`` after the re-run's update, from the numbers both updates recorded: ``exact_replay`` and
  ``replay_reason`` in the re-run's update metrics, what ``runs show`` prints.

"Exact" is about the starting state and the machine: a re-run with ``training.lr=1e-6`` starts from the original's
exact state and then differs by its override alone. An override of a setting that changes the numerics themselves
(``NUMERIC_SETTINGS``) makes it not an exact replay.
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import logging
import shutil
from dataclasses import dataclass
from typing import Any

from pettingflow.configs.settings import ExperimentConfig
from pettingflow.storage import RunLayout, Step
from pettingflow.storage.layout import StepName
from pettingflow.training.checkpoint import DEEPSPEED_SUBDIR, replay_snapshot_kept

log = logging.getLogger(__name__)

#: what each update records (``UpdateWorker.numerics`` and its row metrics) that a replay must match
NUMERICS = (
    "dtype",
    "master_weights",
    "num_processes",
    "zero_stage",
    "torch_threads",
    "torch_version",
    "device",
    "global_step_start",
    "adam_step_start",
)
#: overrides that change the numerics themselves: a re-run with one of them is not a replay of the original
NUMERIC_SETTINGS = (
    "training.dtype",
    "training.master_weights",
    "training.num_processes",
    "training.zero_stage",
    "training.num_threads",
)
#: the override behind a recorded number (an overridden one is reported once, as the override)
_SETTING_OF = {
    "dtype": "training.dtype",
    "master_weights": "training.master_weights",
    "num_processes": "training.num_processes",
    "zero_stage": "training.zero_stage",
    "torch_threads": "training.num_threads",
}
#: how a pruned snapshot's commit marker names this retention (``Step.prune``)
PRUNED_BY = "training.replay_snapshots"


@dataclass(frozen=True)
class ReplayPlan:
    """The verdict before a re-run starts: exact or not, why, and the torch thread count each policy's update
    must use to replay its original (``None``: the original recorded none)."""

    exact: bool
    reason: str
    threads: dict[str, int | None]

    @property
    def line(self) -> str:
        """The one line the CLI prints and the flow logs before the re-run starts."""
        return ("exact replay: " if self.exact else "not an exact replay: ") + self.reason

    def record(self) -> dict[str, Any]:
        """What ``attempt.json`` keeps of it."""
        return {"exact": self.exact, "reason": self.reason}


def plan_replay(
    layout: RunLayout, config: ExperimentConfig, iteration: int, changes: list[dict[str, Any]]
) -> ReplayPlan:
    """Whether a re-run of ``iteration`` under ``config`` (``changes``: its overrides, as ``rerun_config`` returns
    them) will start every policy's update from the original's exact state. Reads commit markers only."""
    reasons, details, threads = [], [], {}
    overridden = [c["key"] for c in changes if c["key"] in NUMERIC_SETTINGS]
    if overridden:
        reasons.append(f"{', '.join(overridden)} overridden (the original's numerics are not kept)")
    for policy in dict.fromkeys(agent.policy for agent in config.agents):
        original = original_update(layout, policy, iteration)
        threads[policy] = (original or {}).get("torch_threads")
        why = _plan_policy(layout, config, policy, iteration, original)
        if why is None:
            details.append(_state_phrase(layout, policy, iteration, original or {}))
        else:
            reasons.append(why)
    if reasons:
        return ReplayPlan(False, "; ".join(reasons), threads)
    changed = [c["key"] for c in changes]
    tail = (
        f"; the attempt differs from the original by its overrides alone ({', '.join(changed)})"
        if changed
        else "; expect the original's update bitwise"
    )
    return ReplayPlan(True, "; ".join(details) + tail, threads)


def original_update(layout: RunLayout, policy: str, iteration: int) -> dict[str, Any] | None:
    """The metrics the original attempt's update of ``policy`` committed, or None when it never committed."""
    step = layout.step(iteration, StepName.UPDATE.folder(policy))
    if not step.is_committed():
        return None
    meta = step.manifest().metadata
    return {**meta.get("metrics", {}), "skipped": bool(meta.get("skipped"))}


def start_optimizer(layout: RunLayout, policy: str, iteration: int) -> tuple[str, int | None, str | None]:
    """``(optimizer_state, optimizer_age, snapshot step URI)`` that an update of ``iteration`` rebuilt from storage
    finds, as ``runs.lineage.weights_before`` picks it, from commit markers alone: ``new`` (no trained weights
    before it), ``restored`` (a snapshot of exactly the starting weights), ``stale`` (an older one) or ``reset``."""
    from pettingflow.runs.lineage import snapshot_of  # slow imports: paid by a request that got here

    trained, age = None, 0
    for k in range(iteration - 1, -1, -1):
        step = layout.step(k, StepName.UPDATE.folder(policy))
        if not step.did_work():
            continue
        if trained is None:
            trained = k
        else:
            age += 1
        if (snapshot := snapshot_of(layout, k, policy, step)) is not None:
            return ("restored" if age == 0 else "stale", age, snapshot.uri)
    return ("new", 0, None) if trained is None else ("reset", None, None)


def _needed(original: dict[str, Any]) -> tuple[str, int | None]:
    """The optimizer state a rebuilt update must find to start where the original did: a resident learner's
    in-memory moments are the snapshot of the weights it held (age 0)."""
    state = original.get("optimizer_state")
    if state in ("resident", "restored"):
        return "restored", 0
    if state == "stale":
        return "stale", original.get("optimizer_age")
    return str(state), (0 if state == "new" else None)


def _plan_policy(
    layout: RunLayout, config: ExperimentConfig, policy: str, iteration: int, original: dict[str, Any] | None
) -> str | None:
    """Why ``policy``'s re-run update cannot replay the original's exactly, or None."""
    if original is None:
        return f"the original update of {policy!r} never committed (the run stopped before it): nothing to replay"
    if original["skipped"]:
        return None  # no rows: nothing was trained, and a re-run on the same rows trains nothing either
    missing = [key for key in ("torch_threads", "global_step_start") if key not in original]
    if missing or "optimizer_state" not in original:
        return (
            f"the original update of {policy!r} recorded neither its thread count nor its optimizer step (a run "
            "from before exact replays were recorded)"
        )
    state, age, _ = start_optimizer(layout, policy, iteration)
    need = _needed(original)
    if (state, age) != need:
        return _state_mismatch(config, policy, iteration, need, state, age)
    here = _torch_version()
    if here is not None and original.get("torch_version") not in (None, here):
        return f"torch {here} here, the original update of {policy!r} ran on torch {original['torch_version']}"
    return None


def _state_mismatch(
    config: ExperimentConfig, policy: str, iteration: int, need: tuple[str, int | None], state: str, age: int | None
) -> str:
    """Why the optimizer state a re-run would find is not the one the original started from."""
    t = config.training
    if need == ("restored", 0):
        found = (
            "Adam would restart (no older snapshot either)"
            if state == "reset"
            else f"the newest is {age} update(s) older, so its moments are not the original's"
        )
        return (
            f"no optimizer snapshot of the weights of {policy!r} after iteration {iteration - 1} was kept: {found} "
            f"(training.replay_snapshots={t.replay_snapshots} keeps those of the last iterations, "
            f"save_optimizer_every={t.save_optimizer_every} every Nth; or `runs prune` removed it)"
        )
    return (
        f"the original update of {policy!r} started with optimizer state {need[0]}"
        + (f" (age {need[1]})" if need[1] else "")
        + f", a re-run would find {state}"
        + (f" (age {age})" if age else "")
    )


def _state_phrase(layout: RunLayout, policy: str, iteration: int, original: dict[str, Any]) -> str:
    """How ``policy``'s re-run update will start, for the exact-replay line."""
    if original.get("skipped"):
        return f"{policy}: the original skipped its update (no rows)"
    state, _, snapshot = start_optimizer(layout, policy, iteration)
    where = {
        "new": "the base weights and a new optimizer",
        "restored": f"the snapshot {snapshot} (fp32 weights, Adam moments)",
        "stale": f"the same {original.get('optimizer_age')}-update-old snapshot {snapshot}",
        "reset": "the committed weights with Adam restarting, as the original did",
    }.get(state, state)
    return (
        f"{policy} starts from {where} at optimizer step {original.get('global_step_start')} with "
        f"{original.get('torch_threads')} torch thread(s), as the original"
    )


def _torch_version() -> str | None:
    """torch's installed version, read without importing torch (None when it is not installed here)."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def verify_replay(original: dict[str, Any] | None, rerun: dict[str, Any], changes: list[dict[str, Any]]) -> str | None:
    """None when the re-run's update started exactly where the original's did (``rerun``, ``original``: the two
    updates' metrics), else the reason: an override of ``NUMERIC_SETTINGS``, another optimizer state, or a
    recorded number (``NUMERICS``) that differs."""
    if original is None:
        return "the original update never committed: nothing to compare"
    if original.get("skipped") or rerun.get("skipped"):
        if original.get("skipped") and rerun.get("skipped"):
            return None
        return "the original skipped its update (no rows)" if original.get("skipped") else "the re-run had no rows"
    reasons = []
    overridden = [c["key"] for c in changes if c["key"] in NUMERIC_SETTINGS]
    if overridden:
        reasons.append(f"{', '.join(overridden)} overridden")
    if "torch_threads" not in original:
        reasons.append("the original recorded no numerics (a run from before exact replays were recorded)")
    else:
        need = _needed(original)
        have = (rerun.get("optimizer_state"), rerun.get("optimizer_age"))
        if have != need:
            reasons.append(f"optimizer state {have[0]} (age {have[1]}), the original's start needs {need[0]}")
        reasons += [
            f"{key} {rerun.get(key)!r}, the original's {original.get(key)!r}"
            for key in NUMERICS
            if _SETTING_OF.get(key) not in overridden and rerun.get(key) != original.get(key)
        ]
    return "; ".join(reasons) or None


def replay_threads(layout: RunLayout, config: ExperimentConfig, policy: str, iteration: int) -> int | None:
    """The torch thread count a re-run's update of ``policy`` uses: ``training.num_threads`` when set (the run's
    own, or an override), else the original update's recorded count; None when neither is known."""
    if config.training.num_threads is not None:
        return config.training.num_threads
    return (original_update(layout, policy, iteration) or {}).get("torch_threads")


def prune_replay_snapshots(layout: RunLayout, config: ExperimentConfig, policy: str, newest: int) -> list[int]:
    """Remove the optimizer snapshots of ``policy`` that only ``training.replay_snapshots`` kept and that fell out
    of its window once the snapshot of ``newest`` committed (``replay_snapshot_kept``); returns their iterations.

    Why here and not in ``runs prune``: the snapshots are written for replays alone, so their disk cost is bounded
    by the setting, without anyone pruning. Scans back from the newest candidate and stops at one this retention
    already pruned (everything older was handled then). Uses ``Step.prune``: the marker says what went and when.
    """
    from pettingflow.runs.lineage import cached_copy_dir, optimizer_step_name

    t = config.training
    if t.replay_snapshots <= 0 or t.save_optimizer_every <= 0:  # no snapshot was written for replays
        return []
    stamp = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    dropped = []
    for k in range(newest - t.replay_snapshots - 1, -1, -1):
        if replay_snapshot_kept(k, newest, t.save_optimizer_every, t.replay_snapshots, config.run.iterations):
            continue
        steps = [layout.step(k, StepName.UPDATE.folder(policy)), layout.step(k, optimizer_step_name(policy))]
        steps = [s for s in steps if s.is_committed()]
        if any(entry.get("by") == PRUNED_BY for s in steps for entry in s.pruned()):
            break
        if _prune_snapshot(steps, stamp, cached_copy_dir):
            dropped.append(k)
    if dropped:
        log.info("optimizer snapshots of %s after iteration(s) %s removed (%s)", policy, sorted(dropped), PRUNED_BY)
    return dropped


def _prune_snapshot(steps: list[Step], stamp: str, cached_copy_dir: Any) -> bool:
    """Drop ``deepspeed/`` from whichever of ``steps`` holds it (and any downloaded copy); True if one did."""
    done = False
    for step in steps:
        if step.prune((f"{DEEPSPEED_SUBDIR}/",), {"at": stamp, "by": PRUNED_BY}):
            shutil.rmtree(cached_copy_dir(step), ignore_errors=True)
            done = True
    return done
