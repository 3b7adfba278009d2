"""Starting and resuming a run: its id, its stored config, and the reference tasks pass around.

``run.json`` (written once, at the first start) holds the resolved config. Every later step of the
run — a resumed ``train``, a ``rerun`` of one iteration — reads the config from there, so a run is
always continued with the settings it was started with. A re-run may override the sections that do
not describe how its stored trajectories were made (``RERUN_SECTIONS``); it stores the config it ran
under in its own ``iter-<k>/attempt-<a>/attempt.json``, which its steps read instead.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from pydantic import BaseModel, Field

from pettingflow import __version__
from pettingflow.configs.loader import ConfigError, parse_override, validate_stored_config
from pettingflow.configs.settings import ExperimentConfig
from pettingflow.runs.context import STEP_ORDER, step_kind
from pettingflow.storage import RunLayout, new_run_id
from pettingflow.storage.layout import StepName
from pettingflow.storage.run_index import record_run


class RunRef(BaseModel):
    """Where a run lives; the small, JSON-able handle tasks and flows take as a parameter."""

    root: str
    run_id: str
    storage_options: dict[str, Any] = Field(default_factory=dict)

    def layout(self) -> RunLayout:
        return RunLayout(self.root, self.run_id, self.storage_options)


class RunConfigMismatchError(ValueError):
    """A run id was given whose stored config differs from the requested one."""


def start_or_resume(
    config: ExperimentConfig, config_name: str, overrides: list[str], run_id: str | None, extra: dict[str, Any]
) -> tuple[RunRef, bool]:
    """Create the run (``run.json``) or resume it; returns (ref, resumed)."""
    run_id = run_id or new_run_id(config.run.name)
    ref = RunRef(root=config.run.storage_root, run_id=run_id, storage_options=config.run.storage_options)
    layout = ref.layout()
    wanted = config.model_dump(mode="json")
    try:
        info = layout.read_run_info()
    except FileNotFoundError:
        layout.write_run_info(
            {
                "run_id": run_id,
                "config_name": config_name,
                "overrides": list(overrides),
                "config": wanted,
                "created": dt.datetime.now(dt.UTC).isoformat(),
                "pettingflow_version": __version__,
                **extra,
            }
        )
        record_run(run_id, config.run.storage_root, config_name, config.run.storage_options)
        return ref, False
    stored = _normalized(info["config"])
    if stored != wanted:
        changed = sorted(_diff(stored, wanted))
        raise RunConfigMismatchError(
            f"run {run_id!r} was started with a different config (differs at {changed[:8]}); resume it with the "
            f"same config and overrides {info.get('overrides')}, or start a new run without run_id"
        )
    return ref, True


def load_run_config(ref: RunRef, iteration: int | None = None, attempt: int = 0) -> ExperimentConfig:
    """The config the run was started with; for a re-run (``attempt >= 1`` of ``iteration``) the config that
    attempt runs under (its ``attempt.json``, which holds the run's config plus the re-run's overrides)."""
    layout = ref.layout()
    if iteration is not None and attempt:
        info = layout.read_attempt_info(iteration, attempt)
        if info is not None:
            return validate_stored_config(
                info["config"], source=f"{layout.iteration_path(iteration, attempt)}/attempt.json"
            )
    info = layout.read_run_info()
    return validate_stored_config(info["config"], source=f"{layout.run_uri}/run.json")


# ------------------------------------------------------------------------------------------ re-runs
RERUN_SECTIONS = ("algorithm", "training", "validation")
# overrides read by one step only: a re-run that starts after that step reuses the original's output, so the
# override would silently change nothing
_READ_BY_STEP = {
    "algorithm.filter_method": StepName.FILTERED,
    "algorithm.filter_ratio": StepName.FILTERED,
    "algorithm.advantage_estimator": StepName.ADVANTAGES,
}


class RerunOverrideError(ValueError):
    """A re-run override that cannot apply to stored trajectories (or would have no effect)."""


class RerunRequestError(ValueError):
    """A re-run that cannot start: no such run or iteration, a step it reuses was never committed, or the weights it
    starts from were pruned. The message is one line, saying what was wrong and what to ask for instead."""


#: the steps a re-run may start from (the rollouts are always reused)
RERUN_FROM_STEPS = (StepName.FILTERED, StepName.ADVANTAGES, StepName.UPDATE)


def check_rerun(
    ref: RunRef, iteration: int, from_step: str = StepName.FILTERED, overrides: list[str] | tuple[str, ...] = ()
) -> tuple[ExperimentConfig, list[dict[str, Any]]]:
    """Refuse a re-run request that cannot succeed, from storage alone, before any flow run starts; else return
    ``rerun_config``'s (config, changes).

    Why here and not in the flow: a request refused inside a flow run leaves a Failed run in the UI and a
    traceback; ``pettingflow rerun`` calls this first and exits 2 with the one-line message, and the ``rerun``
    flow (the deployment path) calls it before anything else and fails with that line. Raises
    ``RerunRequestError`` (no such run, iteration or step; an unknown ``from_step``; pruned starting weights),
    ``RerunOverrideError`` or ``ConfigError`` (the overrides).
    """
    kind = _rerun_start(from_step)
    try:
        layout = ref.layout()
        layout.read_run_info()
    except FileNotFoundError:
        raise RerunRequestError(
            f"no run {ref.run_id!r} under {ref.root} (`pettingflow runs list` shows the runs; --root or `root` "
            "points at another storage root)"
        ) from None
    except ValueError as exc:  # a run id that cannot name a folder
        raise RerunRequestError(str(exc)) from None
    config, changes = rerun_config(ref, overrides, from_step)
    ran = layout.iterations()
    span = (f"iterations 0-{ran[-1]}" if ran[-1] else "iteration 0") if ran else "no iteration yet"
    if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
        raise RerunRequestError(
            f"iteration {iteration!r} of run {ref.run_id!r}: iterations are numbered from 0 (this run has {span})"
        )
    if iteration not in ran:
        raise RerunRequestError(f"run {ref.run_id!r} has no iteration {iteration}: it has {span}")
    for step in STEP_ORDER[: STEP_ORDER.index(kind)]:  # what the re-run reads from the original attempt
        if not layout.step(iteration, step).is_committed():
            instead = (
                f"re-run with --from-step {step}"
                if step is not StepName.ROLLOUTS
                else "nothing to re-run from; resume the run to collect them"
            )
            raise RerunRequestError(
                f"iteration {iteration} of run {ref.run_id!r} has no committed {step!r} step (the run stopped "
                f"before it), which a re-run from {from_step!r} reuses: {instead}"
            )
    for policy in dict.fromkeys(agent.policy for agent in config.agents):
        if pruned := _pruned_start(layout, policy, iteration):
            raise RerunRequestError(
                f"iteration {iteration} of run {ref.run_id!r} starts from the weights of policy {policy!r} after "
                f"iteration {pruned[0]}, which `pettingflow runs prune` removed ({pruned[1]}): re-run an iteration "
                "whose starting weights were kept (`pettingflow runs show` lists them)"
            )
    return config, changes


def _rerun_start(from_step: str) -> StepName:
    """The step a re-run starts at, or ``RerunRequestError`` naming the ones it may start at."""
    try:
        kind = step_kind(from_step)
    except ValueError:
        kind = None
    if kind not in RERUN_FROM_STEPS:
        reason = (
            "a re-run reuses the stored rollouts (to collect new ones, start a new run)" if kind else "no such step"
        )
        raise RerunRequestError(
            f"--from-step {from_step!r}: {reason}; a re-run starts from filtered, advantages or update"
        )
    return kind


def _pruned_start(layout: RunLayout, policy: str, iteration: int) -> tuple[int, str] | None:
    """(k, how) when the weights ``policy`` starts ``iteration`` from — those after iteration k, the newest update
    before it that did its work, as ``runs.lineage.weights_before`` picks it — were pruned; else None. Reads the
    commit markers alone (``weights_before`` would download the weights)."""
    from pettingflow.runs.lineage import pruned_weights  # slow imports (~0.5 s): paid by a request that got here

    for k in range(iteration - 1, -1, -1):
        step = layout.step(k, StepName.UPDATE.folder(policy))
        if step.did_work():
            gone = pruned_weights(step.manifest().metadata)
            return (k, gone) if gone else None
    return None


def rerun_config(
    ref: RunRef, overrides: list[str] | tuple[str, ...] = (), from_step: str = StepName.FILTERED
) -> tuple[ExperimentConfig, list[dict[str, Any]]]:
    """The config a re-run from ``from_step`` runs under, and what it changes versus ``run.json``.

    Only ``RERUN_SECTIONS`` may be overridden: every other section (env, agents, policies, rollout,
    inference, run, specialization) describes how the stored trajectories were produced, and a re-run
    reuses them. Raises ``RerunOverrideError`` (what was refused and why) or ``ConfigError``.
    """
    if STEP_ORDER.index(step_kind(from_step)) == 0:
        raise RerunOverrideError(
            "a re-run reuses the stored rollouts: --from-step must be filtered, advantages or update "
            "(to collect new rollouts, start a new run)"
        )
    problems = []
    for text in overrides:
        parts, _ = parse_override(text)
        key = ".".join(parts)
        if parts[0] not in RERUN_SECTIONS:
            problems.append(
                f"{key}: the stored trajectories were produced under the run's {parts[0]!r} settings and a "
                "re-run reuses them; start a new run to change them"
            )
        elif (step := _READ_BY_STEP.get(key)) and STEP_ORDER.index(step) < STEP_ORDER.index(step_kind(from_step)):
            problems.append(
                f"{key}: read by the {step!r} step, which a re-run from {from_step!r} reuses from the original; "
                f"re-run with --from-step {step}"
            )
    if problems:
        allowed = ", ".join(f"{s}.*" for s in RERUN_SECTIONS)
        raise RerunOverrideError(
            f"refused re-run overrides of run {ref.run_id!r} (a re-run may change {allowed}):\n  "
            + "\n  ".join(problems)
        )
    layout = ref.layout()
    stored = layout.read_run_info()["config"]
    config = validate_stored_config(stored, source=f"{layout.run_uri}/run.json", overrides=list(overrides))
    return config, config_changes(_normalized(stored), config.model_dump(mode="json"))


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> list[dict[str, Any]]:
    """``[{key, old, new}]`` for every dotted key whose value differs, sorted by key."""
    return [{"key": k, "old": a, "new": b} for k, a, b in sorted(_changes(old, new), key=lambda c: c[0])]


def format_change(change: dict[str, Any]) -> str:
    """``training.lr: 1e-05 -> 1e-06``"""
    return f"{change['key']}: {change['old']!r} -> {change['new']!r}"


def _normalized(stored: dict[str, Any]) -> dict[str, Any]:
    """A stored config with today's defaults filled in (a run stored before a setting existed compares equal to
    one resolved now); as stored when it no longer validates."""
    try:
        return validate_stored_config(stored).model_dump(mode="json")
    except ConfigError:
        return stored


def _changes(a: Any, b: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[tuple[str, Any, Any]] = []
        for key in set(a) | set(b):
            out += _changes(a.get(key), b.get(key), f"{prefix}.{key}" if prefix else str(key))
        return out
    return [] if a == b else [(prefix or "<root>", a, b)]


def _diff(a: Any, b: Any) -> set[str]:
    return {key for key, _, _ in _changes(a, b)}
