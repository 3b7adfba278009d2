"""The trajectory record: one Parquet row = one training sample (ARCHITECTURE §3).

The schema is versioned in the Parquet key-value metadata so that a reader can refuse files it does
not understand instead of mis-reading them. Bump ``SCHEMA_VERSION`` on any incompatible change.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

SCHEMA_VERSION = "1"
META_SCHEMA_VERSION = b"pettingflow.schema_version"
META_KIND = b"pettingflow.kind"

TRAJECTORY_FIELDS: list[pa.Field] = [
    # where it belongs
    pa.field("run_id", pa.string(), nullable=False),
    pa.field("iteration", pa.int32(), nullable=False),
    # the group: same task + same seed (GRPO group, seed 003)
    pa.field("env_name", pa.string(), nullable=False),
    pa.field("env_idx", pa.int32(), nullable=False),
    pa.field("group_id", pa.string(), nullable=False),
    pa.field("sample_idx", pa.int32(), nullable=False),
    pa.field("rollout_idx", pa.int32(), nullable=False),
    # who acted
    pa.field("turn_idx", pa.int32(), nullable=False),
    pa.field("agent_idx", pa.int32(), nullable=False),
    pa.field("agent_name", pa.string(), nullable=False),
    pa.field("policy_name", pa.string(), nullable=False),
    pa.field("lora_name", pa.string(), nullable=True),
    # tokens exactly as the sampler saw them
    pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("response_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("response_mask", pa.list_(pa.int8()), nullable=False),
    pa.field("sampler_logprobs", pa.list_(pa.float32()), nullable=False),
    # outcome
    pa.field("reward", pa.float32(), nullable=False),
    pa.field("final_reward", pa.float32(), nullable=False),
    pa.field("success", pa.bool_(), nullable=False),
    pa.field("done", pa.bool_(), nullable=False),
    pa.field("truncated", pa.bool_(), nullable=False),
    pa.field("uid", pa.string(), nullable=False),
    # for humans and debugging
    pa.field("prompt_text", pa.string(), nullable=False),
    pa.field("response_text", pa.string(), nullable=False),
    pa.field("info_json", pa.string(), nullable=False),
]

TRAJECTORY_SCHEMA = pa.schema(
    TRAJECTORY_FIELDS,
    metadata={META_SCHEMA_VERSION: SCHEMA_VERSION.encode(), META_KIND: b"trajectories"},
)


class SchemaError(ValueError):
    """Rows or files that do not match the trajectory schema."""


def trajectories_to_table(rows: Iterable[Mapping[str, Any]]) -> pa.Table:
    """Build a validated table from row dicts (missing nullable columns become null)."""
    rows = list(rows)
    columns: dict[str, list[Any]] = {f.name: [] for f in TRAJECTORY_FIELDS}
    for i, row in enumerate(rows):
        unknown = set(row) - set(columns)
        if unknown:
            raise SchemaError(f"row {i} has columns not in the trajectory schema: {sorted(unknown)}")
        for field in TRAJECTORY_FIELDS:
            if field.name not in row and not field.nullable:
                raise SchemaError(f"row {i} is missing required column {field.name!r}")
            columns[field.name].append(row.get(field.name))
    try:
        table = pa.Table.from_pydict(columns, schema=TRAJECTORY_SCHEMA)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise SchemaError(f"rows do not fit the trajectory schema: {exc}") from exc
    validate_trajectories(table)
    return table


def validate_trajectories(table: pa.Table) -> None:
    """Check the invariants training relies on; raise ``SchemaError`` naming the first bad row.

    - columns and types equal the schema's;
    - ``response_mask`` and ``sampler_logprobs`` have the length of ``response_ids``;
    - mask values are 0 or 1.
    """
    if not table.schema.remove_metadata().equals(TRAJECTORY_SCHEMA.remove_metadata()):
        expected = {f.name: str(f.type) for f in TRAJECTORY_SCHEMA}
        got = {f.name: str(f.type) for f in table.schema}
        diff = {k: (expected.get(k), got.get(k)) for k in set(expected) | set(got) if expected.get(k) != got.get(k)}
        raise SchemaError(f"table schema differs from the trajectory schema (column: expected, got): {diff}")
    n_resp = table.column("response_ids").combine_chunks().value_lengths()
    for name in ("response_mask", "sampler_logprobs"):
        lengths = table.column(name).combine_chunks().value_lengths()
        bad = pc.not_equal(lengths, n_resp)
        if pc.any(bad).as_py():
            row = pc.index(bad, True).as_py()
            raise SchemaError(
                f"row {row}: {name} has {lengths[row].as_py()} entries but response_ids has {n_resp[row].as_py()}"
            )
    mask_values = table.column("response_mask").combine_chunks().flatten()
    if len(mask_values) and not pc.all(pc.is_in(mask_values, pa.array([0, 1], pa.int8()))).as_py():
        raise SchemaError("response_mask holds values other than 0 and 1")


def schema_version_of(schema: pa.Schema) -> str | None:
    """The pettingflow schema version stored in a file's metadata, or None for foreign files."""
    meta = schema.metadata or {}
    value = meta.get(META_SCHEMA_VERSION)
    return value.decode() if value is not None else None
