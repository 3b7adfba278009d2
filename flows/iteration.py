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
from pettingflow.runs.context import STEP_ORDER, step_kind
from pettingflow.runs.run import RunRef, load_run_config
from pettingflow.runs.runtime import Runtime, active_runtime
from pettingflow.runs.weights import update_step_name
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


def validation_due(frequency: int, iteration: int, iterations: int, schedule: str = "periodic") -> bool:
    """At iteration 0, every ``frequency`` iterations, and at the last one; only at the last one with
    ``schedule: end``; never when ``frequency`` is 0."""
    if frequency <= 0:
        return False
    last = iteration == iterations - 1
    return last if schedule == "end" else (iteration % frequency == 0 or last)


def baseline_due(config: ExperimentConfig, iteration: int, attempt: int) -> bool:
    """The base weights are scored once per run, at the start of iteration 0 (not in re-runs), unless validation
    is off (``frequency: 0``) or ``validation.at_start`` is false."""
    return iteration == 0 and attempt == 0 and config.validation.at_start and config.validation.frequency > 0


def submit_next_rollouts(
    config: ExperimentConfig, run: RunRef, iteration: int, attempt: int, runtime: Runtime | None, policies: list[str]
) -> Any:
    """With ``rollout.async_rollouts``: start collecting iteration k+1's rollouts now, in a task that runs beside
    k's update, with the weights k started from (what the servers serve until ``sync_weights``). Only when there
    is an update to overlap (not yet committed), a next iteration, servers, and this is no re-run."""
    if not config.rollout.async_rollouts or runtime is None or attempt or iteration + 1 >= config.run.iterations:
        return None
    layout = run.layout()
    if all(layout.step(iteration, update_step_name(p)).is_committed() for p in policies):
        return None
    if layout.step(iteration + 1, "rollouts").is_committed():
        return None
    name = f"collect_rollouts[iter-{iteration + 1}, ahead]"
    return collect_rollouts.with_options(task_run_name=name).submit(run, iteration + 1, runtime, ahead=True)


def wait_next_rollouts(future: Any, iteration: int, update_started: float, update_ended: float) -> dict[str, float]:
    """Wait for the rollouts collected ahead; how long they took and how much of it overlapped the update.

    A failed collection does not fail this iteration: the next one collects its rollouts itself."""
    logger = get_run_logger()
    future.wait()
    state = future.state
    if not state.is_completed():
        logger.warning(
            "rollouts of iteration %d collected ahead failed (%s): it collects them itself",
            iteration + 1,
            state.message,
        )
        return {"next_rollouts_failed": 1.0}
    metrics = (value(future.result()) or {}).get("metrics") or {}
    begin, end = metrics.get("started_at"), metrics.get("finished_at")
    if begin is None or end is None:  # skipped: committed before (a resumed run)
        return {"next_rollouts_s": 0.0, "overlap_s": 0.0}
    overlap = max(0.0, min(end, update_ended) - max(begin, update_started))
    logger.info(
        "rollouts of iteration %d collected ahead in %.1f s, %.1f s of it beside this iteration's update (%.1f s)",
        iteration + 1,
        end - begin,
        overlap,
        update_ended - update_started,
    )
    return {"next_rollouts_s": end - begin, "overlap_s": overlap, "update_s": update_ended - update_started}


@flow(name="iteration", flow_run_name="{run.run_id} iter-{iteration}", log_prints=True)
def iteration(
    run: RunRef, iteration: int, attempt: int = 0, from_step: str = "rollouts", validate_now: bool | None = None
) -> dict[str, Any]:
    """Run (or resume, or re-run from ``from_step``) one iteration of ``run``."""
    flow_started = time.perf_counter()
    logger = get_run_logger()
    config = load_run_config(run, iteration, attempt)
    first = STEP_ORDER.index(step_kind(from_step))
    due = validation_due(config.validation.frequency, iteration, config.run.iterations, config.validation.schedule)
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
            ahead = submit_next_rollouts(config, run, iteration, attempt, runtime, policies)
            update_started = time.time()
            updated = [
                timed(f"update-{p}", update_policy, run, iteration, attempt, from_step, p, runtime, upstream)
                for p in policies
            ]
            upstream = updated
            if ahead is not None:  # the weights may change only once the next rollouts are complete
                started = time.perf_counter()
                outcomes["async"] = wait_next_rollouts(ahead, iteration, update_started, time.time())
                durations["wait_next_rollouts"] = time.perf_counter() - started
        if runtime is not None and (first == 0 or validate_now):
            upstream = timed("sync", sync_weights, run, iteration, attempt, from_step, runtime, upstream)
        if validate_now and runtime is not None:
            timed("validation", validate, run, iteration, attempt, from_step, runtime, upstream)
        iteration_s = time.perf_counter() - flow_started
        summary = report_iteration(run, iteration, attempt, from_step, outcomes, durations, iteration_s)
    return {"iteration": iteration, "attempt": attempt, "report": summary["uri"], "metrics": summary["metrics"]}
