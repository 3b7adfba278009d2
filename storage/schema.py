"""The trajectory record: one Parquet row = one training sample (docs/reference/trajectories.md).

The schema is versioned in the Parquet key-value metadata so that a reader can refuse files it does
not understand instead of mis-reading them. Bump ``SCHEMA_VERSION`` whenever a column is added, and give
the new column a value for older files in ``ADDED_COLUMNS``: ``upgrade_table`` fills it in when an older
file is read, so every stored run stays readable.

Versions: 1 (the first), 2 (``policy_version``: which weights generated the row, for async rollouts), 3
(``branch_idx`` and ``continued``: tree rollouts, ``rollout.mode: tree``), 4 (``inference_server``: which
replica generated the row), 5 (``outcome``: how the episode ended, solved / failed / max_turns / not_finished;
``prefill``: the text the prompt started the reply with).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

SCHEMA_VERSION = "5"
READABLE_VERSIONS = ("1", "2", "3", "4", "5")
META_SCHEMA_VERSION = b"pettingflow.schema_version"
META_KIND = b"pettingflow.kind"

TRAJECTORY_FIELDS: list[pa.Field] = [
    # where it belongs
    pa.field("run_id", pa.string(), nullable=False),
    pa.field("iteration", pa.int32(), nullable=False),
    # the group: same task + same seed (GRPO group, as in verl's multi-turn recipe)
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
    # the reply's first characters, written by the prompt (an agent's answer_prefix), not sampled: the reply as
    # the agent parsed it is prefill + response_text; its tokens are the prompt's last ones (mask 0, never trained)
    pa.field("prefill", pa.string(), nullable=False),
    pa.field("info_json", pa.string(), nullable=False),
    # which weights generated the row: 0 = the base weights, k + 1 = the weights written by the update of
    # iteration k. Async rollouts train on older rows; an update's lag is (version of the weights it starts
    # from) - policy_version: iterations between the two (an update skipped in between still counts).
    pa.field("policy_version", pa.int32(), nullable=False),
    # tree rollouts (rollout.mode: tree): which of the K candidates of its (task, turn, agent) the row is, and
    # whether the episode continued from it. Independent rollouts: 0 and True (every row is on its episode's path).
    pa.field("branch_idx", pa.int32(), nullable=False),
    pa.field("continued", pa.bool_(), nullable=False),
    # which inference server (replica) generated the row; null where unknown (older files, hand-made rows)
    pa.field("inference_server", pa.string(), nullable=True),
    # how the episode ended (envs.base.OUTCOMES): solved, failed, max_turns, not_finished
    pa.field("outcome", pa.string(), nullable=False),
]

# what each column holds, for readers of the files (docs/reference/trajectories.md is generated from this)
COLUMN_DOCS: dict[str, str] = {
    "run_id": "The run that wrote the row.",
    "iteration": "The iteration whose rollouts step collected it.",
    "env_name": "The env's short name (code-env, plan-path, or the class path of your own).",
    "env_idx": "The task's position in the iteration's batch: one GRPO group per task.",
    "group_id": "`g<env_idx>`: the group, unique within an iteration (with run_id and iteration, unique anywhere).",
    "sample_idx": "The episode's index within its group, 0 .. group_size - 1 (same task, same env seed).",
    "rollout_idx": "`env_idx * group_size + sample_idx`: the episode's index in the iteration.",
    "turn_idx": "The agent call's index within the episode, counted over all agents (per_episode layout: 0).",
    "agent_idx": "The agent's position in the turn order (the config's agents list).",
    "agent_name": "The agent that acted.",
    "policy_name": "The policy (weights) that sampled the response and that this row trains.",
    "lora_name": "The agent's LoRA adapter with specialization: lora; null otherwise.",
    "prompt_ids": "The prompt's token ids, exactly as sent to the sampler (chat template applied).",
    "response_ids": "The sampled token ids; in the per_episode layout also the env's tokens between the agent's turns.",
    "response_mask": "Per response token: 1 = sampled by the model (trained), 0 = written by the env (not trained).",
    "sampler_logprobs": "Per response token: its log-prob under the sampler (vLLM, raw distribution); 0 for env "
    "tokens.",
    "reward": "This turn's reward, as the agent's apply_action returned it (per_episode: its last turn's).",
    "final_reward": "The agent's reward at its last turn of the episode: its outcome for the episode.",
    "success": "Whether this turn succeeded (apply_action's second value).",
    "done": "Whether the env ended the episode (solved, failed or at max_turns); false when it stopped on the token "
    "budget or the model context.",
    "truncated": "Whether the episode ended on a limit (max_turns, token budget, context), neither solved nor failed.",
    "uid": "The advantage group: uuid5 of (rollout_idx // group_size, turn_idx, agent_idx); rows with one uid are "
    "compared with each other (docs/rl.md).",
    "prompt_text": "The prompt as text (for people; the ids are what was sampled from).",
    "response_text": "The response as text (per_episode: the agent's turns joined by <<turn>>): the model's tokens "
    "only, decoded.",
    "prefill": "The text the reply started with in the prompt (the agent's `answer_prefix`), empty when none. The "
    "agent's `parse_response` read `prefill + response_text`; the prefill's tokens end `prompt_ids`, so they are "
    "never trained. Files before schema 5: empty (the text is only in `prompt_ids`).",
    "info_json": "JSON: the turn's details (turn_info, e.g. reward parts) and the env's episode_info (e.g. a "
    "team reward).",
    "policy_version": "Which weights sampled the row: 0 = the base weights, k + 1 = those written by the update of "
    "iteration k (async rollouts train on older rows).",
    "branch_idx": "Tree rollouts: which of the K candidates of its (task, turn, agent) the row is; 0 otherwise.",
    "continued": "Tree rollouts: whether the episode went on from this candidate; true otherwise.",
    "inference_server": "The inference server (replica) root URL that generated the row (per_episode: its last "
    "turn's; the others are in info_json when they differ); null where unknown.",
    "outcome": "How the episode ended: `solved` (the env's solved()), `failed` (its failed(): lost before the last "
    "turn), `max_turns` (out of turns) or `not_finished` (stopped on the token budget or the model context). Files "
    "before schema 5 get it derived from done and truncated (solved if done and not truncated, max_turns if both, "
    "not_finished otherwise): they could not say failed, so an env that then reported a lost episode as solved "
    "reads solved.",
}

# column -> (schema version that added it, value in files written before): see upgrade_table
ADDED_COLUMNS: dict[str, tuple[str, Any]] = {
    # rows of version-1 files were always generated by the weights of their own iteration (sync rollouts)
    "policy_version": ("2", None),
    # files before version 3 hold independent rollouts only: one row per call, each on its episode's path
    "branch_idx": ("3", 0),
    "continued": ("3", True),
    # files before version 4 do not say which server generated a row
    "inference_server": ("4", None),
    # files before version 5: derived from done and truncated (``derived_outcomes``)
    "outcome": ("5", None),
    # files before version 5 do not keep the prefill as text (it is the end of prompt_ids)
    "prefill": ("5", ""),
}

TRAJECTORY_SCHEMA = pa.schema(
    TRAJECTORY_FIELDS,
    metadata={META_SCHEMA_VERSION: SCHEMA_VERSION.encode(), META_KIND: b"trajectories"},
)


class SchemaError(ValueError):
    """Rows or files that do not match the trajectory schema."""


def upgrade_table(table: pa.Table, version: str) -> pa.Table:
    """A table read from a file of an older schema ``version`` with the columns added since filled in.

    ``policy_version`` of version-1 rows is their ``iteration`` (sync rollouts: the weights the iteration
    started from, when every earlier iteration updated; the best that can be said of an old file).
    """
    if version not in READABLE_VERSIONS:
        raise SchemaError(
            f"trajectory schema version {version!r}; this pettingflow reads {', '.join(READABLE_VERSIONS)}"
        )
    for name, (added, default) in ADDED_COLUMNS.items():
        if int(version) >= int(added) or name in table.column_names:
            continue
        field = TRAJECTORY_SCHEMA.field(name)
        if name == "policy_version" and "iteration" in table.column_names:
            column = table.column("iteration").cast(field.type)
        elif name == "outcome":
            column = pa.array(
                derived_outcomes(table.column("done").to_pylist(), table.column("truncated").to_pylist()), field.type
            )
        else:
            column = pa.array([default] * table.num_rows, field.type)
        position = min(TRAJECTORY_SCHEMA.get_field_index(name), table.num_columns)
        table = table.add_column(position, field, column)
    return table


def derived_outcomes(done: Iterable[bool], truncated: Iterable[bool]) -> list[str]:
    """The ``outcome`` of rows written before the column existed, as well as ``done`` and ``truncated`` tell it.

    Before schema 5 the env's contract had no failure: ``done`` without ``truncated`` was a solved episode, both
    an episode out of turns, neither an episode stopped on the token budget or context (the engine's own turn
    limit also left ``done`` false: read as not_finished, the one label these files cannot get right).
    """
    return [("solved" if not t else "max_turns") if d else "not_finished" for d, t in zip(done, truncated, strict=True)]


def trajectories_to_table(rows: Iterable[Mapping[str, Any]]) -> pa.Table:
    """Build a validated table from row dicts (missing nullable columns become null; a missing ``outcome`` is
    derived from ``done`` and ``truncated`` as for older files, and a missing ``prefill`` is empty, so rows made by hand
    or by older code still fit)."""
    rows = list(rows)
    columns: dict[str, list[Any]] = {f.name: [] for f in TRAJECTORY_FIELDS}
    for i, row in enumerate(rows):
        unknown = set(row) - set(columns)
        if unknown:
            raise SchemaError(f"row {i} has columns not in the trajectory schema: {sorted(unknown)}")
        if "outcome" not in row and "done" in row and "truncated" in row:
            row = {**row, "outcome": derived_outcomes([row["done"]], [row["truncated"]])[0]}
        if "prefill" not in row:
            row = {**row, "prefill": ""}
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
