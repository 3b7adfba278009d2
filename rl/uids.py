"""Group UIDs: which samples share a baseline when advantages are computed.

Source: PettingLLMs' trainer (``_assign_consistent_uids``). A UID names one
``(rollout_idx // sample_num, turn_idx, agent_idx)`` triple: the same task/seed (environment group),
the same turn and the same agent. GRPO-style estimators compare samples only within one UID.

Deviation from PettingLLMs: its trainer draws ``uuid.uuid4()`` per key, so re-running an iteration from
stored Parquet gives different UIDs. Here the UID is ``uuid5(PETTINGFLOW_UID_NAMESPACE, name)`` over
``namespace`` and the key, so the same stored rows always get the same UIDs. Pass a namespace that is
unique per run and iteration (e.g. ``"<run_id>/iter-<k>"``) so that UIDs never collide across them.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from numbers import Integral

import numpy as np

# Fixed forever: changing it changes every UID ever written.
PETTINGFLOW_UID_NAMESPACE = uuid.UUID("6f1c9a52-3b7e-5d0a-9e24-70b1c5d8a3f1")


def _as_ints(values: Sequence[int], name: str) -> list[int]:
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, Integral):
            raise TypeError(f"{name}[{i}] must be an integer, got {type(v).__name__} {v!r}")
        if v < 0:
            raise ValueError(f"{name}[{i}] must be >= 0, got {v}")
        out.append(int(v))
    return out


def assign_uids(
    rollout_idx: Sequence[int],
    turn_idx: Sequence[int],
    agent_idx: Sequence[int],
    sample_num: int,
    namespace: str = "",
) -> list[str]:
    """One UID per sample: ``uuid5(NS, json([namespace, rollout_idx // sample_num, turn_idx, agent_idx]))``.

    ``sample_num`` is the number of rollouts per environment group (GRPO group size), so rollouts
    ``0..sample_num-1`` form group 0, the next ``sample_num`` group 1, and so on (PettingLLMs' trainer). The name
    is JSON so that no two (namespace, key) pairs can produce the same string.
    """
    if isinstance(sample_num, bool) or not isinstance(sample_num, Integral):
        raise TypeError(f"sample_num must be an integer, got {type(sample_num).__name__} {sample_num!r}")
    if sample_num < 1:
        raise ValueError(f"sample_num must be >= 1, got {sample_num}")
    if not isinstance(namespace, str):
        raise TypeError(f"namespace must be a str, got {type(namespace).__name__}")
    rollouts = _as_ints(rollout_idx, "rollout_idx")
    turns = _as_ints(turn_idx, "turn_idx")
    agents = _as_ints(agent_idx, "agent_idx")
    if not len(rollouts) == len(turns) == len(agents):
        raise ValueError(
            f"rollout_idx, turn_idx and agent_idx must have the same length, "
            f"got {len(rollouts)}, {len(turns)}, {len(agents)}"
        )
    cache: dict[tuple[int, int, int], str] = {}
    uids = []
    for r, t, a in zip(rollouts, turns, agents, strict=True):
        key = (r // int(sample_num), t, a)
        if key not in cache:
            name = json.dumps([namespace, *key])
            cache[key] = str(uuid.uuid5(PETTINGFLOW_UID_NAMESPACE, name))
        uids.append(cache[key])
    return uids


def group_indices(uids: Sequence[str]) -> dict[str, list[int]]:
    """Sample positions per UID; groups and positions are in first-seen order (dicts keep insertion order)."""
    groups: dict[str, list[int]] = {}
    for i, uid in enumerate(uids):
        if not isinstance(uid, str):
            raise TypeError(f"uids[{i}] must be a str, got {type(uid).__name__} {uid!r}")
        groups.setdefault(uid, []).append(i)
    return groups


def check_rewards(rewards: Sequence[float] | np.ndarray, uids: Sequence[str]) -> np.ndarray:
    """``rewards`` as a finite 1-D float64 array aligned with ``uids`` (else a ValueError saying why)."""
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1:
        raise ValueError(f"rewards must be 1-D, got shape {r.shape}")
    if len(r) != len(uids):
        raise ValueError(f"rewards has {len(r)} entries but uids has {len(uids)}")
    if not np.isfinite(r).all():
        bad = int(np.flatnonzero(~np.isfinite(r))[0])
        raise ValueError(f"rewards must be finite; rewards[{bad}] = {r[bad]}")
    return r
