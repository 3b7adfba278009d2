"""What a run produced, as a comparable record: rows, UIDs and metrics of every step, without what varies from
one run of the same config to the next (timings, ports, float noise of training).

Why: a refactor of how an iteration is put together must not change what it computes. ``run_outputs`` of a
scripted 2-iteration run is checked against ``tests/data/two_iterations_outputs.json``, written from the code
before the change; ``PETTINGFLOW_WRITE_OUTPUTS=1`` rewrites it when a change of results is intended (say why in
the commit).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

from pettingflow.storage import RunLayout
from pettingflow.storage.trajectories import read_step_trajectories

GOLDEN = Path(__file__).parent / "data" / "two_iterations_outputs.json"

# columns that differ between two runs of one config on one machine: the server's URL (a free port) and text
# that holds timings
VOLATILE_COLUMNS = {"inference_server", "info_json", "run_id"}
# metrics that are timings, machine load, or the training's float results (compared to 3 significant digits)
VOLATILE_METRIC_PARTS = (
    "duration",
    "_s",
    "orchestration/",
    "time",
    "seconds",
    "throughput",
    "per_s",
    "memory",
    "rss",
    "startup",
    "wall",
    "_at",
    "tokens_per",
    "learner_",
    "pid",
    "threads",  # torch threads per rank: the machine's cores over the ranks
    "host",
)


def _rounded(value: Any, digits: int = 6) -> Any:
    if isinstance(value, float):
        return None if math.isnan(value) else float(f"{value:.{digits}g}")
    if isinstance(value, list):
        return [_rounded(v, digits) for v in value]
    if isinstance(value, dict):
        return {k: _rounded(v, digits) for k, v in value.items()}
    return value


def _rows_digest(table: Any) -> dict[str, Any]:
    """Row count and a digest of the rows in a canonical order (rows of concurrent episodes land in any order)."""
    columns = [c for c in table.column_names if c not in VOLATILE_COLUMNS]
    rows = [json.dumps(_rounded([r[c] for c in columns]), sort_keys=True) for r in table.select(columns).to_pylist()]
    digest = hashlib.sha256("\n".join(sorted(rows)).encode()).hexdigest()[:16]
    return {"rows": table.num_rows, "columns": columns, "digest": digest}


# metrics of the training itself: float results of a real (tiny) model's update, which differ in late digits from
# one CPU to another; compared within TRAINING_TOLERANCE. ``servers_paused`` was renamed ``servers_released``
# by the redesign (the record holds neither).
TRAINING_TOLERANCE = (1e-2, 1e-6)  # relative, absolute
LEFT_OUT_METRICS = {"update/shared/servers_paused", "update/shared/servers_released"}


def _metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in sorted(metrics.items()):
        if key in LEFT_OUT_METRICS or any(part in key for part in VOLATILE_METRIC_PARTS):
            continue
        out[key] = value if key.startswith("update/") else _rounded(value)
    return out


def _same_metric(key: str, expected: Any, got: Any) -> bool:
    if key.startswith("update/") and isinstance(expected, float) and isinstance(got, float):
        return math.isclose(expected, got, rel_tol=TRAINING_TOLERANCE[0], abs_tol=TRAINING_TOLERANCE[1])
    return expected == got


def run_outputs(layout: RunLayout, iterations: int, policies: list[str]) -> dict[str, Any]:
    """Per iteration: the rows of the baseline, rollouts, filtered and validation steps and each policy's advantage
    batch (count and digest), and the report's metrics without the volatile ones."""
    out: dict[str, Any] = {}
    for k in range(iterations):
        record: dict[str, Any] = {}
        for name in ("baseline", "rollouts", "filtered", "validation"):
            step = layout.step(k, name)
            if step.is_committed():
                record[name] = _rows_digest(read_step_trajectories(step))
        advantages = layout.step(k, "advantages")
        for policy in policies:
            record[f"advantages/{policy}"] = _rows_digest(advantages.read_table(f"batch-{policy}.parquet"))
        record["metrics"] = _metrics(layout.step(k, "report").read_json("metrics.json"))
        out[f"iter-{k}"] = record
    return out


def check_against_golden(outputs: dict[str, Any]) -> None:
    """Assert ``outputs`` equal the stored record, naming the first step that differs."""
    if os.environ.get("PETTINGFLOW_WRITE_OUTPUTS") == "1":
        GOLDEN.write_text(json.dumps(outputs, indent=1, sort_keys=True) + "\n")
        return
    golden = json.loads(GOLDEN.read_text())
    for it, record in golden.items():
        for step, expected in record.items():
            got = outputs.get(it, {}).get(step)
            if step == "metrics":
                diff = {
                    k: (v, (got or {}).get(k))
                    for k, v in expected.items()
                    if not _same_metric(k, v, (got or {}).get(k))
                }
                extra = sorted(set(got or {}) - set(expected))
                assert not diff and not extra, f"{it} metrics differ (expected, got): {diff}; new keys: {extra}"
            else:
                assert got == expected, f"{it}/{step}: expected {expected}, got {got}"
    assert set(outputs) == set(golden), f"iterations {sorted(outputs)} vs golden {sorted(golden)}"
