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
from pettingflow.configs.loader import ConfigError, parse_override, validate_config
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
            return validate_config(info["config"], source=f"{layout.iteration_path(iteration, attempt)}/attempt.json")
    info = layout.read_run_info()
    return validate_config(info["config"], source=f"{layout.run_uri}/run.json")


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
    config = validate_config(stored, source=f"{layout.run_uri}/run.json", overrides=list(overrides))
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
        return validate_config(stored).model_dump(mode="json")
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
