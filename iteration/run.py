"""Starting and resuming a run: its id, its stored config, and the reference tasks pass around.

``run.json`` (written once, at the first start) holds the resolved config. Every later step of the
run — a resumed ``train``, a ``rerun`` of one iteration — reads the config from there, so a run is
always continued with the settings it was started with.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from pydantic import BaseModel, Field

from pettingflow import __version__
from pettingflow.configs.loader import validate_config
from pettingflow.configs.settings import ExperimentConfig
from pettingflow.storage import RunLayout, new_run_id


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
        return ref, False
    if info["config"] != wanted:
        changed = sorted(_diff(info["config"], wanted))
        raise RunConfigMismatchError(
            f"run {run_id!r} was started with a different config (differs at {changed[:8]}); resume it with the "
            f"same config and overrides {info.get('overrides')}, or start a new run without run_id"
        )
    return ref, True


def load_run_config(ref: RunRef) -> ExperimentConfig:
    """The config the run was started with."""
    info = ref.layout().read_run_info()
    return validate_config(info["config"], source=f"{ref.layout().run_uri}/run.json")


def _diff(a: Any, b: Any, prefix: str = "") -> set[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out: set[str] = set()
        for key in set(a) | set(b):
            out |= _diff(a.get(key), b.get(key), f"{prefix}.{key}" if prefix else str(key))
        return out
    return set() if a == b else {prefix or "<root>"}
