"""The ``rerun`` flow: redo the later steps of one iteration from its stored trajectories.

No new rollouts: filter, advantages and the update run again on the committed ``rollouts`` of
``iteration`` into a new ``iter-<k>/attempt-<a>/`` folder, optionally with ``overrides`` of the
sections that do not describe how the trajectories were made (algorithm, training, validation; see
``runs/run.rerun_config``): another filter, estimator, clip or learning rate on the same rollouts.
The attempt's resolved config and what it changed versus ``run.json`` are stored in its
``attempt.json`` and shown as an artifact. The original attempt is never overwritten, and later
iterations are not affected. Validation (which needs an inference server) runs only when
``with_validation`` is true. A request that cannot run is refused by ``runs/run.check_rerun`` before anything
starts (``pettingflow rerun`` calls it too, so from the CLI no flow run is even created); the flow run, once
its attempt is reserved, is named after it (``rerun <run> iter-<k>/attempt-<a> from <step>``), like its
``iteration`` subflow (``<run> iter-<k>/attempt-<a>``). Before the attempt starts, one log line says whether it
replays the original exactly (``exact replay: ...`` or ``not an exact replay: <reason>``, ``runs/replay.py``);
``attempt.json`` keeps it under ``replay``, and the update's metrics say whether it did (``exact_replay``).
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

from prefect import flow, get_client, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.context import FlowRunContext
from prefect.states import Failed, State

from pettingflow import __version__
from pettingflow.configs.loader import ConfigError
from pettingflow.flows.iteration import iteration as iteration_flow
from pettingflow.runs.replay import plan_replay
from pettingflow.runs.run import RerunOverrideError, RerunRequestError, RunRef, check_rerun, format_change
from pettingflow.storage.layout import StepName
from pettingflow.tasks.report import artifact_key

#: what ``check_rerun`` raises for a request that cannot run: the flow fails with its message, before any task
REFUSED = (RerunRequestError, RerunOverrideError, ConfigError)


@flow(name="rerun", flow_run_name="rerun {run_id} iter-{iteration} from {from_step}", log_prints=True)
def rerun(
    run_id: str,
    iteration: int,
    from_step: str = StepName.FILTERED,
    root: str = "./outputs",
    storage_options: dict[str, Any] | None = None,
    with_validation: bool = False,
    overrides: list[str] | None = None,
) -> dict[str, Any] | State:
    """Re-run ``iteration`` of ``run_id`` from ``from_step`` into a new attempt folder, with ``overrides``
    (``training.lr=1e-6``, ...) of the algorithm, training and validation sections.

    A request that cannot run (no such iteration, a reused step never committed, pruned weights, a refused
    override) ends the flow run Failed with one line before any task starts or anything is written; called
    in-process, the call raises that error (``RerunRequestError``, ``RerunOverrideError`` or ``ConfigError``).
    """
    logger = get_run_logger()
    overrides = list(overrides or [])
    ref = RunRef(root=root, run_id=run_id, storage_options=storage_options or {})
    try:
        config, changes = check_rerun(ref, iteration, from_step, overrides)
    except REFUSED as exc:  # a Failed state, not a raise: the UI shows one line instead of a traceback
        line = one_line(exc)
        logger.error("re-run refused before it started: %s", line)
        return Failed(message=f"re-run refused: {line}", data=exc)
    layout = ref.layout()
    replay = plan_replay(layout, config, iteration, changes)
    # one line, before anything starts: whether this attempt replays the original (a warning when it cannot)
    (logger.info if replay.exact else logger.warning)("%s", replay.line)
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
            "replay": replay.record(),
            "config": config.model_dump(mode="json"),
            "created": dt.datetime.now(dt.UTC).isoformat(),
            "pettingflow_version": __version__,
        },
    )
    name_flow_run(rerun_run_name(run_id, iteration, attempt, from_step))
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


def rerun_run_name(run_id: str, iteration: int, attempt: int, from_step: str) -> str:
    """The re-run's flow run name once its attempt is reserved: ``rerun <run> iter-<k>/attempt-<a> from <step>``,
    so the UI tells two re-runs of one iteration apart without opening their parameters."""
    return f"rerun {run_id} iter-{iteration}/attempt-{attempt} from {from_step}"


def name_flow_run(name: str) -> None:
    """Rename the current flow run. Why after the start: the attempt number is only known once ``attempt.json``
    reserves it, inside the flow, and the name template is resolved before."""
    context = FlowRunContext.get()
    if context is None or context.flow_run is None or context.flow_run.name == name:
        return
    with get_client(sync_client=True) as client:
        client.set_flow_run_name(flow_run_id=context.flow_run.id, name=name)
    context.flow_run.name = name


def one_line(exc: BaseException) -> str:
    """An error's message on one line: a refused-overrides message lists one problem per line, here joined by "; "."""
    first, *rest = [part.strip() for part in str(exc).splitlines() if part.strip()] or [type(exc).__name__]
    return first + (" " + "; ".join(rest) if rest else "")


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
