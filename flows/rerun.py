"""The ``rerun`` flow: redo the later steps of one iteration from its stored trajectories.

No new rollouts: filter, advantages and the update run again on the committed ``rollouts`` of
``iteration`` into a new ``iter-<k>/attempt-<a>/`` folder, optionally with ``overrides`` of the
sections that do not describe how the trajectories were made (algorithm, training, validation; see
``runs/run.rerun_config``): another filter, estimator, clip or learning rate on the same rollouts.
The attempt's resolved config and what it changed versus ``run.json`` are stored in its
``attempt.json`` and shown as an artifact. The original attempt is never overwritten, and later
iterations are not affected. Validation (which needs an inference server) runs only when
``with_validation`` is true.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from pettingflow import __version__
from pettingflow.flows.iteration import iteration as iteration_flow
from pettingflow.runs.run import RunRef, format_change, rerun_config
from pettingflow.storage.layout import StepName
from pettingflow.tasks.report import artifact_key


@flow(name="rerun", flow_run_name="rerun {run_id} iter-{iteration} from {from_step}", log_prints=True)
def rerun(
    run_id: str,
    iteration: int,
    from_step: str = StepName.FILTERED,
    root: str = "./outputs",
    storage_options: dict[str, Any] | None = None,
    with_validation: bool = False,
    overrides: list[str] | None = None,
) -> dict[str, Any]:
    """Re-run ``iteration`` of ``run_id`` from ``from_step`` into a new attempt folder, with ``overrides``
    (``training.lr=1e-6``, ...) of the algorithm, training and validation sections."""
    logger = get_run_logger()
    overrides = list(overrides or [])
    ref = RunRef(root=root, run_id=run_id, storage_options=storage_options or {})
    layout = ref.layout()
    layout.read_run_info()  # a clear error when the run does not exist
    if not layout.step(iteration, StepName.ROLLOUTS).is_committed():
        raise FileNotFoundError(
            f"iteration {iteration} of run {run_id} has no committed rollouts under {layout.run_uri}; "
            "nothing to re-run from"
        )
    config, changes = rerun_config(ref, overrides, from_step)  # refused overrides stop here, before any write
    attempt = layout.next_attempt(iteration)
    layout.write_attempt_info(
        iteration,
        attempt,
        {
            "run_id": run_id,
            "iteration": iteration,
            "attempt": attempt,
            "from_step": from_step,
            "overrides": overrides,
            "config_changes": changes,
            "config": config.model_dump(mode="json"),
            "created": dt.datetime.now(dt.UTC).isoformat(),
            "pettingflow_version": __version__,
        },
    )
    lines = [format_change(c) for c in changes] or ["no changes: the run's own config"]
    logger.info(
        "re-run %s iter-%s/attempt-%s from %s; config vs run.json: %s",
        run_id,
        iteration,
        attempt,
        from_step,
        "; ".join(lines),
    )
    create_markdown_artifact(
        key=artifact_key(run_id, f"iter-{iteration}", f"attempt-{attempt}", "config"),
        markdown=changes_markdown(run_id, iteration, attempt, from_step, overrides, changes),
        description=f"what re-run attempt {attempt} changed versus the run's config",
    )
    result = iteration_flow(ref, iteration, attempt=attempt, from_step=from_step, validate_now=with_validation)
    return {**result, "config_changes": changes}


def changes_markdown(
    run_id: str, iteration: int, attempt: int, from_step: str, overrides: list[str], changes: list[dict[str, Any]]
) -> str:
    """The config diff of a re-run as a markdown table (key, run.json, this attempt)."""
    head = f"# Config of {run_id} iter-{iteration}/attempt-{attempt} (re-run from {from_step})\n\n"
    if overrides:
        head += "overrides: " + " ".join(f"`{o}`" for o in overrides) + "\n\n"
    if not changes:
        return head + "No changes: this attempt ran under the run's own config (`run.json`).\n"
    rows = "\n".join(f"| `{c['key']}` | `{json.dumps(c['old'])}` | `{json.dumps(c['new'])}` |" for c in changes)
    return head + "| key | run.json | this attempt |\n|---|---|---|\n" + rows + "\n"
