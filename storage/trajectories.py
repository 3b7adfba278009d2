"""Write and read trajectory Parquet through committed steps.

Readers filter by iteration, policy and agent; only committed steps are ever read.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pyarrow as pa

from pettingflow.faults import maybe_crash
from pettingflow.storage.commits import DEFAULT_ROW_GROUP_SIZE, Manifest, Step
from pettingflow.storage.fs import join
from pettingflow.storage.layout import RunLayout, StepName
from pettingflow.storage.schema import TRAJECTORY_SCHEMA, trajectories_to_table, validate_trajectories

ROLLOUT_STEP = StepName.ROLLOUTS


def write_trajectories(
    step: Step,
    rows: pa.Table | Iterable[Mapping[str, Any]],
    rows_per_file: int = 4096,
    row_group_size: int = DEFAULT_ROW_GROUP_SIZE,
    metadata: dict[str, Any] | None = None,
    keep: tuple[str, ...] = (),
) -> Manifest:
    """Validate ``rows`` and write them as ``part-NNNNN.parquet`` files, then commit the step.

    Returns the existing manifest, writing nothing, when the step is already committed, so a
    retried task never duplicates rows. ``keep``: entries of the step folder that ``Step.begin`` leaves.
    """
    if step.is_committed():
        return step.manifest()
    table = rows if isinstance(rows, pa.Table) else trajectories_to_table(rows)
    validate_trajectories(table)
    table = table.replace_schema_metadata(TRAJECTORY_SCHEMA.metadata)
    step.begin(keep)
    maybe_crash(f"{step.name}:mid", step.path)  # kill matrix: filtered/validation/baseline computed, nothing written
    n_files = max(1, -(-table.num_rows // rows_per_file))
    for i in range(n_files):
        chunk = table.slice(i * rows_per_file, rows_per_file)
        step.write_table(f"part-{i:05d}.parquet", chunk, row_group_size=row_group_size)
    return step.commit(metadata)


def read_step_trajectories(
    step: Step,
    policy: str | Sequence[str] | None = None,
    agent: str | Sequence[str] | None = None,
    columns: list[str] | None = None,
    verify: bool = True,
) -> pa.Table:
    """All Parquet files of a committed step, optionally filtered by policy and agent."""
    filters = _filters(policy=policy, agent=agent)
    tables = [
        step.read_table(name, columns=columns, filters=filters, verify=verify)
        for name in step.files()
        if name.endswith(".parquet")
    ]
    if not tables:
        schema = TRAJECTORY_SCHEMA if columns is None else pa.schema([TRAJECTORY_SCHEMA.field(c) for c in columns])
        return schema.empty_table()
    return pa.concat_tables(tables)


def read_trajectories(
    layout: RunLayout,
    iterations: int | Sequence[int] | None = None,
    policy: str | Sequence[str] | None = None,
    agent: str | Sequence[str] | None = None,
    step_name: str = ROLLOUT_STEP,
    columns: list[str] | None = None,
) -> pa.Table:
    """Trajectories of a run's committed ``step_name`` steps; uncommitted iterations are skipped."""
    if iterations is None:
        wanted = layout.iterations()
    elif isinstance(iterations, int):
        wanted = [iterations]
    else:
        wanted = list(iterations)
    tables = []
    for k in wanted:
        step = layout.step(k, step_name)
        if step.is_committed():
            tables.append(read_step_trajectories(step, policy=policy, agent=agent, columns=columns))
    if not tables:
        schema = TRAJECTORY_SCHEMA if columns is None else pa.schema([TRAJECTORY_SCHEMA.field(c) for c in columns])
        return schema.empty_table()
    return pa.concat_tables(tables)


def _filters(**by_column: str | Sequence[str] | None) -> list[tuple[str, str, Any]] | None:
    names = {"policy": "policy_name", "agent": "agent_name"}
    filters: list[tuple[str, str, Any]] = []
    for key, value in by_column.items():
        if value is None:
            continue
        column = names[key]
        if isinstance(value, str):
            filters.append((column, "=", value))
        else:
            filters.append((column, "in", list(value)))
    return filters or None


class TrajectoryShards:
    """Rows of one step committed shard by shard while the step runs, so a crash keeps the finished shards.

    Each shard (``<step>/shards/<key>/``) is a step of its own with its own commit marker; it is written
    only whole (a group of G episodes for the rollouts step). A retried attempt reads the committed shards,
    redoes only the missing keys, and ``commit`` writes the step once from all shards (in key order), then
    removes them. Readers never see shards: only the step's marker makes rows visible, so the rows of a key
    are in the step exactly once whether it was collected before or after a crash.
    """

    FOLDER = "shards"

    def __init__(self, step: Step):
        self.step = step
        self.root = join(step.path, self.FOLDER)

    def _shard(self, key: int) -> Step:
        return Step(self.step.fs, join(self.root, f"{key:06d}"))

    def committed(self) -> dict[int, pa.Table]:
        """Rows of every committed shard by key; uncommitted leftovers are ignored (and rewritten if redone)."""
        if self.step.is_committed() or not self.step.fs.exists(self.root):
            return {}
        shards = {}
        for path in self.step.fs.ls(self.root, detail=False):
            name = posixpath.basename(path.rstrip("/"))
            if name.isdigit() and (shard := self._shard(int(name))).is_committed():
                shards[int(name)] = read_step_trajectories(shard)
        return shards

    def write(self, key: int, rows: Iterable[Mapping[str, Any]]) -> pa.Table:
        """Commit one whole shard and return its rows as a table."""
        table = trajectories_to_table(rows)
        write_trajectories(self._shard(key), table)
        maybe_crash(f"{self.step.name}:shard", self.step.path)  # kill matrix: rollouts mid-flight, a group committed
        return table

    def commit(self, shards: Mapping[int, pa.Table], metadata: dict[str, Any] | None = None) -> Manifest:
        """Write the step from ``shards`` (key order), commit it, then drop the shard folders."""
        tables = [shards[k] for k in sorted(shards)]
        table = pa.concat_tables(tables) if tables else trajectories_to_table([])
        manifest = write_trajectories(self.step, table, metadata=metadata, keep=(self.FOLDER,))
        if self.step.fs.exists(self.root):
            self.step.fs.rm(self.root, recursive=True)
        return manifest
