"""Where each run was stored: ``$PETTINGFLOW_HOME/runs.jsonl``, one line per run started on this machine.

Why: a run lives under its config's ``run.storage_root``, which may be relative (``./outputs``, resolved in the
worker's folder), on S3, or anything a user's own YAML names. The CLI (``runs show RUN``, ``trajectories
show``, ``rerun``) is given only the run id; without this index it could look only under the default
config's root. Each started run appends ``{"run_id", "root", "config_name", "created"}`` with ``root``
made absolute (a local path) so the lookup works from any folder. Storage options (credentials, endpoints)
are not written here: a run whose root needs them records ``"storage_options": true`` and the CLI asks for
``--root`` and a config. A missing or unreadable index is an empty one: the index only saves typing.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
from pathlib import Path
from typing import Any

from pettingflow.paths import home

log = logging.getLogger(__name__)

INDEX_NAME = "runs.jsonl"


def index_path() -> Path:
    return home() / INDEX_NAME


def absolute_root(root: str) -> str:
    """``root`` with a local path made absolute (``./outputs`` -> ``/work/outputs``); URIs unchanged."""
    if "://" in root and not root.startswith("file://"):
        return root
    return str(Path(root.removeprefix("file://")).expanduser().resolve())


def record_run(run_id: str, root: str, config_name: str, storage_options: dict[str, Any] | None = None) -> None:
    """Append the run to the index; a failure to write is logged, never raised (the run itself goes on)."""
    entry = {
        "run_id": run_id,
        "root": absolute_root(root),
        "config_name": config_name,
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "storage_options": bool(storage_options),
    }
    path = index_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # one short line in append mode: concurrent runs do not interleave within a line
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")
    except OSError as exc:
        log.warning("could not record run %s in %s: %s", run_id, path, exc)


def recorded_runs() -> list[dict[str, Any]]:
    """Every entry of the index, oldest first (unreadable lines skipped)."""
    path = index_path()
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(entry, dict) and entry.get("run_id") and entry.get("root"):
            out.append(entry)
    return out


def find_run(run_id: str) -> dict[str, Any] | None:
    """The latest index entry of ``run_id``, or None."""
    matches = [e for e in recorded_runs() if e["run_id"] == run_id]
    return matches[-1] if matches else None


def recorded_roots() -> list[str]:
    """Distinct roots of recorded runs, in first-use order (for ``runs list`` without ``--root``)."""
    seen: dict[str, None] = {}
    for entry in recorded_runs():
        if not entry.get("storage_options"):
            seen.setdefault(entry["root"], None)
    return list(seen)


def same_root(a: str, b: str) -> bool:
    return absolute_root(a).rstrip(os.sep) == absolute_root(b).rstrip(os.sep)
