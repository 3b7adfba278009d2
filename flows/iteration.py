"""The ``iteration`` flow: one training iteration as a Prefect flow run, the steps of ``tasks/pipeline.py`` in order.

    baseline (iteration 0, validation.at_start) -> rollouts -> filtered -> advantages -> update[policy] ...
        -> sync -> validation (every validation.frequency) -> report -> retention (the disk settings)

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
from prefect.runtime import flow_run

from pettingflow.configs.settings import ExperimentConfig
from pettingflow.runs.context import IterationContext
from pettingflow.runs.run import RunRef, load_run_config
from pettingflow.runs.runtime import Runtime
from pettingflow.storage import StepName
from pettingflow.tasks.pipeline import PIPELINE, TASKS, StepDef, context, task_run_name, value
from pettingflow.tasks.retention import retention


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
    if all(layout.step(iteration, StepName.UPDATE.folder(p)).is_committed() for p in policies):
        return None
    if layout.step(iteration + 1, StepName.ROLLOUTS).is_committed():
        return None
    name = task_run_name(StepName.ROLLOUTS, iteration + 1, ahead=True)
    return (
        TASKS[StepName.ROLLOUTS]
        .with_options(task_run_name=name)
        .submit(run, iteration + 1, runtime=runtime, ahead=True)
    )


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


def step_runs(
    step: StepDef, ctx: IterationContext, config: ExperimentConfig, validate_now: bool, servers: bool
) -> bool:
    """Whether this attempt runs ``step``: it comes at or after ``from_step``, what it needs is there, and it is due.

    The baseline only before a run's first iteration; sync whenever servers run (rollouts or validation
    follow on them) and the iteration is not finished; validation when due."""
    if not ctx.runs(step.name) or (step.needs_servers and not servers):
        return False
    if step.name is StepName.BASELINE:
        return baseline_due(config, ctx.iteration, ctx.attempt)
    if step.name is StepName.SYNC:  # not for a finished iteration: retention may have deleted the weights it served
        return (ctx.first is StepName.ROLLOUTS or validate_now) and not ctx.step(StepName.REPORT).is_committed()
    if step.name is StepName.VALIDATION:
        return validate_now
    return True


def iteration_run_name(run_id: str, iteration: int, attempt: int = 0) -> str:
    """``<run> iter-<k>`` for the original, ``<run> iter-<k>/attempt-<a>`` for a re-run: the UI lists both under
    the same flow, and only the name tells a re-run's subflow from the original's."""
    return f"{run_id} iter-{iteration}" + (f"/attempt-{attempt}" if attempt else "")


def _flow_run_name() -> str:
    """The ``iteration`` flow's run name, from its parameters (a format string cannot leave out attempt 0)."""
    params = flow_run.parameters
    run = params.get("run")
    run_id = run.get("run_id") if isinstance(run, dict) else getattr(run, "run_id", "?")
    return iteration_run_name(str(run_id), params.get("iteration", "?"), params.get("attempt") or 0)


@flow(name="iteration", flow_run_name=_flow_run_name, log_prints=True)
def iteration(
    run: RunRef,
    iteration: int,
    attempt: int = 0,
    from_step: str = StepName.ROLLOUTS,
    validate_now: bool | None = None,
    runtime: Runtime | None = None,
) -> dict[str, Any]:
    """Run (or resume, or re-run from ``from_step``) one iteration of ``run``: the pipeline's steps in order.

    ``runtime``: the run's servers and learners, opened by the caller (the ``train`` flow keeps one up across its
    iterations) and handed to every task; None (a re-run, a deployment run of one iteration): the iteration opens
    one itself when a step needs servers, and closes it at its end. A runtime never leaves this process: Prefect
    records the parameter as a placeholder (``<Runtime>``), not its contents."""
    flow_started = time.perf_counter()
    logger = get_run_logger()
    config = load_run_config(run, iteration, attempt)
    ctx = context(run, iteration, attempt, from_step)
    due = validation_due(config.validation.frequency, iteration, config.run.iterations, config.validation.schedule)
    validate_now = due if validate_now is None else validate_now
    policies = list(dict.fromkeys(a.policy for a in config.agents))
    outcomes: dict[str, Any] = {}
    durations: dict[str, float] = {}
    args = {"run": run, "iteration": iteration, "attempt": attempt, "from_step": ctx.from_step}

    with ExitStack() as stack:
        if runtime is None and (ctx.first is StepName.ROLLOUTS or validate_now):
            logger.info("no runtime given for %s: starting the servers for this iteration", run.run_id)
            runtime = stack.enter_context(Runtime(config, run.run_id))
        upstream: Any = None
        for step in PIPELINE:
            if step.name is StepName.REPORT:
                break
            if not step_runs(step, ctx, config, validate_now, servers=runtime is not None):
                continue
            ahead = (
                submit_next_rollouts(config, run, iteration, attempt, runtime, policies) if step.per_policy else None
            )
            step_started, results = time.time(), []
            for policy in policies if step.per_policy else [None]:
                label = step.name.folder(policy)
                started = time.perf_counter()
                task = TASKS[step.name]
                if policy:  # update[shared]: one task run per policy
                    task = task.with_options(task_run_name=task_run_name(step.name, iteration, policy))
                result = value(task(**args, runtime=runtime, policy=policy, upstream=upstream))
                durations[label], outcomes[label] = time.perf_counter() - started, result
                results.append(result)
            upstream = results if step.per_policy else results[0]
            if ahead is not None:  # the weights may change only once the next rollouts are complete
                started = time.perf_counter()
                outcomes["async"] = wait_next_rollouts(ahead, iteration, step_started, time.time())
                durations["wait_next_rollouts"] = time.perf_counter() - started
        inputs = {"outcomes": outcomes, "durations": durations, "iteration_s": time.perf_counter() - flow_started}
        summary = value(TASKS[StepName.REPORT](**args, report_inputs=inputs, upstream=upstream))
        if attempt == 0:  # the run's own disk retention (the disk settings); re-runs delete nothing
            retention(run, iteration, runtime=runtime, upstream=summary)
    return {"iteration": iteration, "attempt": attempt, "report": summary["uri"], "metrics": summary["metrics"]}
