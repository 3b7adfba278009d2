"""The ``rerun`` flow: redo the later steps of one iteration from its stored trajectories.

No new rollouts: filter, advantages and the update run again on the committed ``rollouts`` of
``iteration`` (e.g. with a changed filter implementation), into a new ``iter-<k>/attempt-<a>/``
folder. The original attempt is never overwritten, and later iterations are not affected.
Validation (which needs an inference server) runs only when ``with_validation`` is true.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prefect import flow

from pettingflow.flows.iteration import iteration as iteration_flow
from pettingflow.iteration.run import RunRef


@flow(name="rerun", flow_run_name="rerun {run_id} iter-{iteration} from {from_step}", log_prints=True)
def rerun(
    run_id: str,
    iteration: int,
    from_step: str = "filtered",
    root: str = "./outputs",
    storage_options: dict[str, Any] | None = None,
    with_validation: bool = False,
) -> dict[str, Any]:
    """Re-run ``iteration`` of ``run_id`` from ``from_step`` into a new attempt folder."""
    ref = RunRef(root=root, run_id=run_id, storage_options=storage_options or {})
    layout = ref.layout()
    layout.read_run_info()  # a clear error when the run does not exist
    if not layout.step(iteration, "rollouts").is_committed():
        raise FileNotFoundError(
            f"iteration {iteration} of run {run_id} has no committed rollouts under {layout.run_uri}; "
            "nothing to re-run from"
        )
    attempt = layout.next_attempt(iteration)
    return iteration_flow(ref, iteration, attempt=attempt, from_step=from_step, validate_now=with_validation)
