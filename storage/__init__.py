"""Trajectory storage: the Parquet schema, the run layout and committed steps over fsspec."""

from pettingflow.storage.commits import (
    CorruptFileError,
    Manifest,
    Step,
    StepAlreadyCommittedError,
    StepNotCommittedError,
)
from pettingflow.storage.layout import RunLayout, StepName, list_runs, new_run_id
from pettingflow.storage.schema import SCHEMA_VERSION, TRAJECTORY_SCHEMA, SchemaError, trajectories_to_table
from pettingflow.storage.trajectories import (
    TrajectoryShards,
    read_step_trajectories,
    read_trajectories,
    write_trajectories,
)

__all__ = [
    "SCHEMA_VERSION",
    "TRAJECTORY_SCHEMA",
    "CorruptFileError",
    "Manifest",
    "RunLayout",
    "SchemaError",
    "Step",
    "StepAlreadyCommittedError",
    "StepName",
    "StepNotCommittedError",
    "TrajectoryShards",
    "list_runs",
    "new_run_id",
    "read_step_trajectories",
    "read_trajectories",
    "trajectories_to_table",
    "write_trajectories",
]
