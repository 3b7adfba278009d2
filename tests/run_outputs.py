"""What a run produced, as a comparable record: rows, UIDs and metrics of every step, without what varies from
one run of the same config to the next (timings, ports, memory use).

Why: a refactor of how an iteration is put together must not change what it computes. ``run_outputs`` of a
scripted 2-iteration run is checked against ``tests/data/two_iterations_outputs.json``, written from the code
before the change; ``PETTINGFLOW_WRITE_OUTPUTS=1`` rewrites it when a change of results is intended, and then
fails the test, so that a rewrite never passes for a check: run it again without the flag (and say why in the
commit).

Every metric is compared except the ``VOLATILE_METRICS`` named below (times, rates, memory: what the machine's
load decides). Floats are compared as tightly as the kernels that computed them allow (``float_tolerance``):

- on the kernels the record was written with (torch's CPU capability, stored in the record): within 1e-9
  relative. Two runs of the scripted 2-iteration flow in one session on this 2-core machine (Nov 28 2026, AVX-512)
  gave every non-volatile metric bit for bit the same, the update's too (loss, grad norm, KL, entropy); 1e-9 only
  allows the sums of concurrent episodes' rewards to be added in another order.
- on other kernels (this VM's CPU changes from day to day): within 1e-4 relative, 1e-6 absolute. Measured the
  same day with ``ATEN_CPU_CAPABILITY=avx2`` against the AVX-512 record: the largest gap 1.6e-5 relative
  (``update/shared/grad_norm``, iteration 1), every other metric within 6.3e-6; the rows were identical. The
  absolute part is for metrics that are rounding noise themselves (``approx_kl`` is about 1e-8 here).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest

from pettingflow.storage import RunLayout
from pettingflow.storage.trajectories import read_step_trajectories

GOLDEN = Path(__file__).parent / "data" / "two_iterations_outputs.json"

# columns that differ between two runs of one config on one machine: the server's URL (a free port) and text
# that holds timings
VOLATILE_COLUMNS = {"inference_server", "info_json", "run_id"}

# report metrics that are times, rates or memory use: the machine's load decides them. Exact names; a metric that
# is not named here is compared, and a new one fails the check until it is in the record (or named here).
VOLATILE_METRICS = {
    *(f"duration/{step}_s" for step in ("baseline", "rollouts", "filtered", "advantages", "sync", "validation")),
    "duration/iteration_before_report_s",
    "orchestration/outside_step_tasks_s",
    "orchestration/outside_step_tasks_share",
    "rollouts/env_s",
    "rollouts/llm_s",
    "rollouts/tokens_per_s",
    "rollouts/wall_s",
}
# the same for each policy's update: ``update/<policy>/<name>``, plus ``duration/update-<policy>_s``
VOLATILE_UPDATE_METRICS = {
    "computed_tokens_per_s",
    "duration_s",
    "max_rss_mb_per_rank",
    "model_tokens_per_s",
    "release_memory_s",
    "rss_mb_after_release",
    "rss_mb_released",
    "step_s",
    "time/logprob_s",
    "time/read_s",
    "time/save_s",
    "time/setup_s",
    "time/train_s",
    "tokens_per_s",
    "torch_threads",  # the machine's cores over the ranks: a property of the machine, not of the run
    "wall_s",
}
SAME_KERNELS_TOL = (1e-9, 0.0)  # (relative, absolute)
OTHER_KERNELS_TOL = (1e-4, 1e-6)
META = "_written_with"  # the record's own key: what computed it, not an iteration


def cpu_capability() -> str:
    """The SIMD kernels torch's CPU ops use here (``AVX512``, ``AVX2``, ``DEFAULT``; ``ATEN_CPU_CAPABILITY`` picks)."""
    import torch

    return str(torch.backends.cpu.get_cpu_capability())


def float_tolerance(golden: dict[str, Any]) -> tuple[float, float]:
    """(relative, absolute) tolerance for the record's floats on this machine's kernels."""
    written = (golden.get(META) or {}).get("cpu_capability")
    return SAME_KERNELS_TOL if written == cpu_capability() else OTHER_KERNELS_TOL


def volatile_metrics(policies: list[str]) -> set[str]:
    """Every volatile metric name of a run whose policies are ``policies``."""
    per_policy = {f"update/{p}/{name}" for p in policies for name in VOLATILE_UPDATE_METRICS}
    return VOLATILE_METRICS | per_policy | {f"duration/update-{p}_s" for p in policies}


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


def _same_metric(expected: Any, got: Any, tol: tuple[float, float]) -> bool:
    if isinstance(expected, float) and isinstance(got, float):
        if math.isnan(expected) or math.isnan(got):
            return math.isnan(expected) and math.isnan(got)
        return math.isclose(expected, got, rel_tol=tol[0], abs_tol=tol[1])
    return expected == got


def run_outputs(layout: RunLayout, iterations: int, policies: list[str]) -> dict[str, Any]:
    """Per iteration: the rows of the baseline, rollouts, filtered and validation steps and each policy's advantage
    batch (count and digest), and the report's metrics but the volatile ones (``volatile_metrics``)."""
    out: dict[str, Any] = {}
    volatile = volatile_metrics(policies)
    for k in range(iterations):
        record: dict[str, Any] = {}
        for name in ("baseline", "rollouts", "filtered", "validation"):
            step = layout.step(k, name)
            if step.is_committed():
                record[name] = _rows_digest(read_step_trajectories(step))
        advantages = layout.step(k, "advantages")
        for policy in policies:
            record[f"advantages/{policy}"] = _rows_digest(advantages.read_table(f"batch-{policy}.parquet"))
        metrics = layout.step(k, "report").read_json("metrics.json")
        record["metrics"] = {key: metrics[key] for key in sorted(metrics) if key not in volatile}
        out[f"iter-{k}"] = record
    return out


def check_against_golden(outputs: dict[str, Any]) -> None:
    """Assert ``outputs`` equal the stored record, naming the first step that differs."""
    if os.environ.get("PETTINGFLOW_WRITE_OUTPUTS") == "1":
        record = {**outputs, META: {"cpu_capability": cpu_capability()}}
        GOLDEN.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        pytest.fail(f"rewrote {GOLDEN} (PETTINGFLOW_WRITE_OUTPUTS=1): run the test again without the flag to check it")
    golden = json.loads(GOLDEN.read_text())
    tol = float_tolerance(golden)
    golden.pop(META, None)
    for it, record in golden.items():
        for step, expected in record.items():
            got = outputs.get(it, {}).get(step)
            if step == "metrics":
                diff = {
                    k: (v, (got or {}).get(k))
                    for k, v in expected.items()
                    if not _same_metric(v, (got or {}).get(k), tol)
                }
                extra = sorted(set(got or {}) - set(expected))
                assert not diff and not extra, (
                    f"{it} metrics differ (expected, got) at tolerance {tol} (record written with "
                    f"{cpu_capability() if tol == SAME_KERNELS_TOL else 'other'} kernels): {diff}; new keys: {extra}"
                )
            else:
                assert got == expected, f"{it}/{step}: expected {expected}, got {got}"
    assert set(outputs) == set(golden), f"iterations {sorted(outputs)} vs golden {sorted(golden)}"
