"""The ``iteration`` flow: one training iteration as a Prefect flow run.

    [validate_baseline (iteration 0, validation.at_start)] -> collect_rollouts -> filter_and_group
        -> compute_advantages -> update_policy[per policy] -> sync_weights
        -> validate (every validation.frequency) -> report

Every step writes a committed folder under ``runs/<run_id>/iter-<k>/``; a step that is already
committed is skipped (and says so in the UI), so re-running an iteration after a crash redoes only
the step that was in flight. A re-run from stored trajectories (``attempt >= 1``) starts at
``from_step``, reads the earlier steps from the original, and writes into ``iter-<k>/attempt-<a>/``.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from typing import Any

from prefect import flow, get_run_logger

from pettingflow.configs.settings import ExperimentConfig
from pettingflow.iteration.context import STEP_ORDER, step_kind
from pettingflow.iteration.run import RunRef, load_run_config
from pettingflow.iteration.runtime import Runtime, active_runtime
from pettingflow.tasks.report import report_iteration
from pettingflow.tasks.steps import (
    collect_rollouts,
    compute_advantages,
    filter_and_group,
    sync_weights,
    update_policy,
    validate,
    validate_baseline,
    value,
)


def validation_due(frequency: int, iteration: int, iterations: int) -> bool:
    """At iteration 0, every ``frequency`` iterations, and at the last one; never when 0."""
    return frequency > 0 and (iteration % frequency == 0 or iteration == iterations - 1)


def baseline_due(config: ExperimentConfig, iteration: int, attempt: int) -> bool:
    """The base weights are scored once per run, at the start of iteration 0 (not in re-runs), unless validation
    is off (``frequency: 0``) or ``validation.at_start`` is false."""
    return iteration == 0 and attempt == 0 and config.validation.at_start and config.validation.frequency > 0


@flow(name="iteration", flow_run_name="{run.run_id} iter-{iteration}", log_prints=True)
def iteration(
    run: RunRef, iteration: int, attempt: int = 0, from_step: str = "rollouts", validate_now: bool | None = None
) -> dict[str, Any]:
    """Run (or resume, or re-run from ``from_step``) one iteration of ``run``."""
    flow_started = time.perf_counter()
    logger = get_run_logger()
    config = load_run_config(run, iteration, attempt)
    first = STEP_ORDER.index(step_kind(from_step))
    due = validation_due(config.validation.frequency, iteration, config.run.iterations)
    validate_now = due if validate_now is None else validate_now
    needs_servers = first == 0 or validate_now
    policies = list(dict.fromkeys(a.policy for a in config.agents))
    outcomes: dict[str, Any] = {}
    durations: dict[str, float] = {}

    def timed(name: str, fn, *args, **kwargs) -> Any:
        started = time.perf_counter()
        result = value(fn(*args, **kwargs))
        durations[name] = time.perf_counter() - started
        outcomes[name] = result
        return result

    with ExitStack() as stack:
        runtime = active_runtime(run.run_id)
        if runtime is None and needs_servers:
            logger.info("no running servers for %s in this process: starting them for this iteration", run.run_id)
            runtime = stack.enter_context(Runtime(config, run.run_id))
        upstream: Any = None
        if first == 0 and baseline_due(config, iteration, attempt):
            timed("baseline", validate_baseline, run, iteration, runtime)
        if first == 0:
            upstream = timed("rollouts", collect_rollouts, run, iteration, runtime)
        if first <= STEP_ORDER.index("filtered"):
            upstream = timed("filtered", filter_and_group, run, iteration, attempt, from_step, upstream)
        if first <= STEP_ORDER.index("advantages"):
            upstream = timed("advantages", compute_advantages, run, iteration, attempt, from_step, upstream)
        if first <= STEP_ORDER.index("update"):
            updated = [
                timed(f"update-{p}", update_policy, run, iteration, attempt, from_step, p, runtime, upstream)
                for p in policies
            ]
            upstream = updated
        if runtime is not None and (first == 0 or validate_now):
            upstream = timed("sync", sync_weights, run, iteration, attempt, from_step, runtime, upstream)
        if validate_now and runtime is not None:
            timed("validation", validate, run, iteration, attempt, from_step, runtime, upstream)
        iteration_s = time.perf_counter() - flow_started
        summary = report_iteration(run, iteration, attempt, from_step, outcomes, durations, iteration_s)
    return {"iteration": iteration, "attempt": attempt, "report": summary["uri"], "metrics": summary["metrics"]}
