"""Where a run's files live: ``<root>/runs/<run_id>/iter-<k>/<step>/...``.

Re-runs of an iteration (``pettingflow rerun``) write into ``iter-<k>/attempt-<a>/<step>/`` so that
the original attempt is never overwritten.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import secrets
from enum import StrEnum
from typing import Any

import fsspec

from pettingflow.storage.commits import Step
from pettingflow.storage.fs import filesystem, join, uri_of, write_bytes_atomic


class StepName(StrEnum):
    """The steps of an iteration, in the order they run, each named once: the folder it commits
    (``iter-<k>/<name>/``), its Prefect task, its metrics prefix and its name in docs and on the command line.

    ``baseline`` scores the base weights before iteration 0 (a step of the run, never of a re-run's attempt);
    ``update`` is one step per policy (``update-<policy>``), and ``optimizer`` the optimizer snapshot written after
    a policy's update, off the critical path (``optimizer-<policy>``), which takes the update's place in the order.
    The pipeline (``tasks/pipeline.py``) says what each step reads, runs and retries.
    """

    BASELINE = "baseline"
    ROLLOUTS = "rollouts"
    FILTERED = "filtered"
    ADVANTAGES = "advantages"
    UPDATE = "update"
    SYNC = "sync"
    VALIDATION = "validation"
    REPORT = "report"

    def __repr__(self) -> str:  # messages quote a step as the user types it: 'filtered', not <StepName...>
        return repr(self.value)

    def folder(self, policy: str | None = None) -> str:
        """The step's folder name: ``update-<policy>`` for the per-policy update, else the name itself."""
        if self is StepName.UPDATE:
            if not policy:
                raise ValueError("the update step is per policy: say which (update-<policy>)")
            return f"{UPDATE_STEP_PREFIX}{policy}"
        return self.value


UPDATE_STEP_PREFIX = f"{StepName.UPDATE}-"  # + policy name: the step holding that policy's checkpoint
# + policy name: an optimizer snapshot written after that policy's update, off the critical path
OPTIMIZER_STEP_PREFIX = "optimizer-"


def optimizer_step_name(policy: str) -> str:
    """The step holding the optimizer snapshot written after ``policy``'s update, off the critical path."""
    if not policy:
        raise ValueError("the optimizer snapshot is per policy: say which (optimizer-<policy>)")
    return f"{OPTIMIZER_STEP_PREFIX}{policy}"


def update_policy(folder: str) -> str | None:
    """The policy whose update a folder holds (``update-<policy>`` -> ``<policy>``); None for any other step.

    Also what a report's ``update-<policy>`` outcome or duration key is about: the reverse of
    ``StepName.UPDATE.folder``, so no caller strips the prefix by hand."""
    policy = folder.removeprefix(UPDATE_STEP_PREFIX)
    return policy if policy != folder and policy else None


def step_kind(folder: str) -> StepName:
    """The step a folder name belongs to: ``update-<policy>`` and ``optimizer-<policy>`` are the update's."""
    if folder.startswith((UPDATE_STEP_PREFIX, OPTIMIZER_STEP_PREFIX)):
        return StepName.UPDATE
    try:
        return StepName(folder)
    except ValueError:
        names = ", ".join(StepName)
        raise ValueError(f"unknown step {folder!r}; steps are {names} (update as update-<policy>)") from None


_ITER = re.compile(r"^iter-(\d+)$")
_ATTEMPT = re.compile(r"^attempt-(\d+)$")
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def new_run_id(name: str, now: dt.datetime | None = None) -> str:
    """``<name>-<UTC timestamp>-<4 hex>``: sortable by time, unique across machines."""
    now = now or dt.datetime.now(dt.UTC)
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "run"
    return f"{slug}-{now:%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"


class RunLayout:
    """Paths of one run under a storage root (any fsspec URI)."""

    def __init__(self, root: str, run_id: str, storage_options: dict[str, Any] | None = None):
        if not _RUN_ID.match(run_id):
            raise ValueError(f"run id {run_id!r} must be letters, digits, '.', '_' or '-'")
        self.root = root
        self.run_id = run_id
        self.storage_options = storage_options or {}
        self.fs: fsspec.AbstractFileSystem
        self.fs, root_path = filesystem(root, self.storage_options)
        self.run_path = join(root_path, "runs", run_id)

    @property
    def run_uri(self) -> str:
        return uri_of(self.fs, self.run_path)

    def iteration_path(self, iteration: int, attempt: int | None = None) -> str:
        if iteration < 0:
            raise ValueError(f"iteration must be >= 0, got {iteration}")
        path = join(self.run_path, f"iter-{iteration}")
        return join(path, f"attempt-{attempt}") if attempt else path

    def step(self, iteration: int, name: str, attempt: int | None = None) -> Step:
        """The step folder ``name`` of ``iteration`` (attempt 0/None is the original)."""
        return Step(self.fs, join(self.iteration_path(iteration, attempt), name), name=name)

    def iterations(self) -> list[int]:
        """Iterations that have a folder, in numeric order."""
        if not self.fs.exists(self.run_path):
            return []
        found = []
        for entry in self.fs.ls(self.run_path, detail=False):
            m = _ITER.match(entry.rstrip("/").rsplit("/", 1)[-1])
            if m:
                found.append(int(m.group(1)))
        return sorted(found)

    def attempts(self, iteration: int) -> list[int]:
        """Re-run attempts of ``iteration`` (the original, 0, is always listed)."""
        path = self.iteration_path(iteration)
        found = [0]
        if self.fs.exists(path):
            for entry in self.fs.ls(path, detail=False):
                m = _ATTEMPT.match(entry.rstrip("/").rsplit("/", 1)[-1])
                if m:
                    found.append(int(m.group(1)))
        return sorted(found)

    def update_steps(self, iteration: int) -> list[str]:
        """Names of the ``update-<policy>`` step folders of ``iteration`` (attempt 0), committed or not, sorted."""
        return self._steps_named(iteration, UPDATE_STEP_PREFIX)

    def update_policies(self, iteration: int) -> list[str]:
        """The policies with an ``update-<policy>`` folder in ``iteration`` (attempt 0), committed or not, sorted."""
        return [policy for name in self.update_steps(iteration) if (policy := update_policy(name))]

    def optimizer_steps(self, iteration: int) -> list[str]:
        """Names of the ``optimizer-<policy>`` snapshot folders of ``iteration`` (attempt 0), sorted."""
        return self._steps_named(iteration, OPTIMIZER_STEP_PREFIX)

    def _steps_named(self, iteration: int, prefix: str) -> list[str]:
        path = self.iteration_path(iteration)
        if not self.fs.exists(path):
            return []
        names = (entry.rstrip("/").rsplit("/", 1)[-1] for entry in self.fs.ls(path, detail=False))
        return sorted(n for n in names if n.startswith(prefix))

    def next_attempt(self, iteration: int) -> int:
        return max(self.attempts(iteration)) + 1

    # ------------------------------------------------------------ run-level metadata
    def write_run_info(self, info: dict[str, Any]) -> None:
        """``run.json``: the resolved config and how the run was started (written at run start)."""
        write_bytes_atomic(self.fs, join(self.run_path, "run.json"), json.dumps(info, indent=2, default=str).encode())

    def read_run_info(self) -> dict[str, Any]:
        path = join(self.run_path, "run.json")
        if not self.fs.exists(path):
            raise FileNotFoundError(f"no run {self.run_id!r} under {self.root} (missing {uri_of(self.fs, path)})")
        with self.fs.open(path, "rb") as f:
            return json.loads(f.read())

    def write_run_file(self, name: str, data: bytes) -> str:
        """A derived file beside ``run.json`` (``summary.md``): rewritten atomically whenever it is remade, never
        a step's data (those are in committed step folders). Returns its URI."""
        path = join(self.run_path, name)
        write_bytes_atomic(self.fs, path, data)
        return uri_of(self.fs, path)

    def write_attempt_info(self, iteration: int, attempt: int, info: dict[str, Any]) -> None:
        """``iter-<k>/attempt-<a>/attempt.json``: the resolved config a re-run ran under and what it changed.

        Written before the attempt's first step, so it also reserves the attempt number."""
        if attempt < 1:
            raise ValueError(f"attempt 0 is the original iteration (its config is run.json); got attempt {attempt}")
        path = join(self.iteration_path(iteration, attempt), "attempt.json")
        write_bytes_atomic(self.fs, path, json.dumps(info, indent=2, default=str).encode())

    def read_attempt_info(self, iteration: int, attempt: int) -> dict[str, Any] | None:
        """The re-run's ``attempt.json``, or None (attempt 0, or an attempt stored before re-runs had one)."""
        if attempt < 1:
            return None
        path = join(self.iteration_path(iteration, attempt), "attempt.json")
        if not self.fs.exists(path):
            return None
        with self.fs.open(path, "rb") as f:
            return json.loads(f.read())


def list_runs(root: str, storage_options: dict[str, Any] | None = None) -> list[str]:
    """Run ids under ``root``, oldest first (ids start with a sortable timestamp after the name)."""
    fs, root_path = filesystem(root, storage_options)
    runs_path = join(root_path, "runs")
    if not fs.exists(runs_path):
        return []
    return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(runs_path, detail=False) if fs.isdir(p))
