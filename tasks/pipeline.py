"""The steps of an iteration, declared once: what each reads, what runs it, how often it is retried.

``PIPELINE`` is the iteration. Each entry names its step (``StepName``, whose order is the order the steps
run in), the steps whose committed output it reads, the library function that does the work
(``pettingflow.steps``: plain code over an ``IterationContext``, no Prefect), its retries, and whether it needs the
run's inference servers. Everything else is derived from it: the Prefect task of each step (``TASKS``, named by the
step), the flow's order and its resume point (``IterationContext.runs``), the "already committed: skipped" state
a resumed iteration shows, and the docs' table (tests/test_pipeline.py checks the order and the names).

Why the Prefect tasks live here and not beside each step: the step functions stay testable without Prefect,
and a task is nothing but a step function plus retries and a name, which is exactly what a row here says.
Conventions of every task: small, JSON-able inputs (a ``RunRef``, the iteration, the attempt) and small metadata
out (URIs, row counts, metrics), never data; a step whose commit marker exists is not redone; Prefect's result
cache is off (``NO_CACHE``): the commit markers beside the data are the one source of truth for "done".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed, State

from pettingflow.configs.settings import ExperimentConfig
from pettingflow.runs.context import IterationContext
from pettingflow.runs.disk_guard import check_step, not_disk_full
from pettingflow.runs.run import RunRef, load_run_config
from pettingflow.steps import batches, rollouts, updates
from pettingflow.steps.outcome import StepOutcome
from pettingflow.storage import StepName
from pettingflow.tasks.report import publish_report


@dataclass(frozen=True)
class StepCall:
    """What a step's function is given: the attempt, its config, the run's servers (None when the flow runs
    without them, e.g. a re-run's update), the policy of a per-policy step, and for the report the outcomes and
    durations of the steps before it."""

    ctx: IterationContext
    config: ExperimentConfig
    runtime: Any = None
    policy: str | None = None
    ahead: bool = False  # rollouts collected beside the previous iteration's update (rollout.async_rollouts)
    outcomes: Mapping[str, Any] = field(default_factory=dict)
    durations: Mapping[str, float] = field(default_factory=dict)
    iteration_s: float | None = None


@dataclass(frozen=True)
class StepDef:
    """One step of the iteration."""

    name: StepName
    reads: tuple[StepName, ...]  # the committed steps whose output it reads
    run: Callable[[StepCall], Any]  # returns a StepOutcome (or, for sync and report, plain metadata)
    what: str  # one line for the task's description and the docs
    retry_delays_s: tuple[int, ...] = ()  # one entry per retry
    per_policy: bool = False  # one task per policy (update-<policy>)
    needs_servers: bool = False


# ------------------------------------------------------------------------------------------------ the step calls
def _baseline(call: StepCall) -> StepOutcome:
    return rollouts.baseline_step(call.ctx, call.config, call.runtime)


def _rollouts(call: StepCall) -> StepOutcome:
    return rollouts.rollouts_step(call.ctx, call.config, call.runtime, ahead=call.ahead, warn=get_run_logger().warning)


def _filtered(call: StepCall) -> StepOutcome:
    return batches.filter_step(call.ctx, call.config)


def _advantages(call: StepCall) -> StepOutcome:
    outcome = batches.advantage_step(call.ctx, call.config)
    for message in batches.zero_signal_policies(outcome.metrics).values():
        get_run_logger().warning("iteration %d: %s", call.ctx.iteration, message)
    return outcome


def _update(call: StepCall) -> StepOutcome:
    assert call.policy is not None, "the update step is per policy"
    outcome = updates.update_step(call.ctx, call.config, call.policy, call.runtime)
    if not outcome.skipped and (
        line := updates.optimizer_state_line(call.policy, outcome.metrics.get("metrics") or {})
    ):
        get_run_logger().info(line)
    return outcome


def _sync(call: StepCall) -> dict[str, Any]:
    return updates.sync_step(call.ctx, call.config, call.runtime)


def _validation(call: StepCall) -> StepOutcome:
    runtime = call.runtime
    return rollouts.validation_step(
        call.ctx,
        call.config,
        runtime.endpoints(),
        env_cache=runtime.env_cache,
        policy_versions=runtime.served_versions(),
    )


def _report(call: StepCall) -> dict[str, Any]:
    return publish_report(call)


_ROLLOUT_OUTPUTS = (StepName.ROLLOUTS, StepName.FILTERED, StepName.ADVANTAGES)

PIPELINE: tuple[StepDef, ...] = (
    StepDef(
        StepName.BASELINE,
        reads=(),
        run=_baseline,
        what="held-out episodes on the base weights, once per run before iteration 0 (validation.at_start)",
        retry_delays_s=(10,),
        needs_servers=True,
    ),
    StepDef(
        StepName.ROLLOUTS,
        reads=(),
        run=_rollouts,
        what="serve the weights this iteration samples with, then G samples per task: rows with token masks",
        retry_delays_s=(10, 30),
        needs_servers=True,
    ),
    StepDef(
        StepName.FILTERED,
        reads=(StepName.ROLLOUTS,),
        run=_filtered,
        what="UID groups and the configured filter (none/mean/std/dapo/uid)",
    ),
    StepDef(
        StepName.ADVANTAGES,
        reads=(StepName.FILTERED, StepName.ROLLOUTS),
        run=_advantages,
        what="group-relative advantages; one batch file per policy",
    ),
    StepDef(
        StepName.UPDATE,
        reads=(StepName.ADVANTAGES,),
        run=_update,
        what="one DeepSpeed update per policy, in its resident learner (or a new process without servers)",
        retry_delays_s=(5,),
        per_policy=True,
    ),
    StepDef(
        StepName.SYNC,
        reads=(StepName.UPDATE,),
        run=_sync,
        what="every server serves the new weights (reload, broadcast, adapters or restart), probes confirm it",
        retry_delays_s=(5, 15),
        needs_servers=True,
    ),
    StepDef(
        StepName.VALIDATION,
        reads=(StepName.SYNC,),
        run=_validation,
        what="held-out episodes on the new weights; success rate per agent",
        retry_delays_s=(10,),
        needs_servers=True,
    ),
    StepDef(
        StepName.REPORT,
        reads=(*_ROLLOUT_OUTPUTS, StepName.UPDATE, StepName.SYNC, StepName.VALIDATION),
        run=_report,
        what="metrics, sample episodes and the curve as Prefect artifacts, TensorBoard and MLflow",
    ),
)
STEPS: dict[StepName, StepDef] = {step.name: step for step in PIPELINE}


# ------------------------------------------------------------------------------------------------ the tasks
def context(run: RunRef, iteration: int, attempt: int = 0, from_step: str = StepName.ROLLOUTS) -> IterationContext:
    return IterationContext(run.layout(), iteration, attempt, from_step if attempt else StepName.ROLLOUTS)


def finished(outcome: Any) -> Any:
    """A task's return: plain metadata, or a ``Completed`` state with a message when the step was committed
    before (a resumed iteration shows it so in the UI)."""
    if not isinstance(outcome, StepOutcome):
        return outcome
    data = asdict(outcome)
    if outcome.skipped:
        get_run_logger().info("%s already committed at %s: skipped", outcome.step, outcome.uri)
        return Completed(message=f"{outcome.step} already committed at {outcome.uri}: skipped", data=data)
    return data


def value(result: Any) -> Any:
    """A task's data whether it returned plain data or a ``State`` (skipped steps)."""
    return result.result() if isinstance(result, State) else result


def _make_task(step: StepDef) -> Any:
    def run_step(
        run: RunRef,
        iteration: int,
        attempt: int = 0,
        from_step: str = StepName.ROLLOUTS,
        runtime: Any = None,
        policy: str | None = None,
        ahead: bool = False,
        report_inputs: dict[str, Any] | None = None,
        upstream: Any = None,  # the step before, so the Prefect UI draws the iteration's order
    ) -> Any:
        ctx = context(run, iteration, attempt, from_step)
        config = load_run_config(run, iteration, attempt)
        if step.per_policy and runtime is not None:  # the previous snapshot's bytes count as used (the guard below)
            runtime.services[policy].wait_snapshot()
        check_step(ctx, config, step.name.folder(policy))  # the disk guard: stop here rather than fill the disk
        call = StepCall(ctx, config, runtime, policy, ahead, **(report_inputs or {}))
        return finished(step.run(call))

    run_step.__doc__ = step.what
    run_step.__name__ = run_step.__qualname__ = f"{step.name}_step"
    return task(
        name=str(step.name),
        description=step.what,
        retries=len(step.retry_delays_s),
        retry_delay_seconds=list(step.retry_delays_s) or None,
        retry_condition_fn=not_disk_full,  # retrying cannot free space: the run stops at this step boundary
        cache_policy=NO_CACHE,
    )(run_step)


TASKS: dict[StepName, Any] = {step.name: _make_task(step) for step in PIPELINE}


def task_run_name(step: StepName, iteration: int, policy: str | None = None, ahead: bool = False) -> str:
    """What the UI shows for one run of a step's task: ``update[shared]``, ``rollouts[iter-3, ahead]``."""
    tags = [policy] if policy else []
    if ahead:
        tags += [f"iter-{iteration}", "ahead"]
    return f"{step}[{', '.join(tags)}]" if tags else str(step)
