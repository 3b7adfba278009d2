"""Prefect tasks: one per iteration step, each a thin wrapper over ``pettingflow.steps``.

Conventions:
- Tasks take small, JSON-able inputs (a ``RunRef``, the iteration, the attempt) and return small
  metadata (URIs, row counts, metrics) — never data. The data is in committed steps.
- A step whose commit marker exists is not redone: the task finishes ``Completed`` with the message
  "already committed ... skipped", which is how the UI shows a resumed iteration.
- Prefect's result cache is off (``NO_CACHE``): the commit markers beside the data are the single
  source of truth for "done", for Prefect runs and CLI runs alike.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed, State

from pettingflow.runs.context import IterationContext
from pettingflow.runs.run import RunRef, load_run_config
from pettingflow.runs.runtime import Runtime
from pettingflow.steps import batches, rollouts, updates
from pettingflow.steps.outcome import StepOutcome


def context(run: RunRef, iteration: int, attempt: int = 0, from_step: str = "rollouts") -> IterationContext:
    return IterationContext(run.layout(), iteration, attempt, from_step if attempt else "rollouts")


def finished(outcome: StepOutcome) -> dict[str, Any] | State:
    """The task's return: plain metadata, or a ``Completed`` state with a message when skipped."""
    data = asdict(outcome)
    if outcome.skipped:
        get_run_logger().info("%s already committed at %s: skipped", outcome.step, outcome.uri)
        return Completed(message=f"{outcome.step} already committed at {outcome.uri}: skipped", data=data)
    return data


def value(result: Any) -> Any:
    """A task's data whether it returned plain data or a ``State`` (skipped steps)."""
    return result.result() if isinstance(result, State) else result


@task(name="collect_rollouts", retries=2, retry_delay_seconds=[10, 30], cache_policy=NO_CACHE)
def collect_rollouts(run: RunRef, iteration: int, runtime: Runtime, ahead: bool = False) -> dict[str, Any] | State:
    """Serve the weights this iteration samples with, then collect G samples per task (``steps.rollouts``).

    ``ahead`` (``rollout.async_rollouts``): collected beside the previous iteration's update."""
    outcome = rollouts.rollouts_step(
        context(run, iteration), load_run_config(run), runtime, ahead=ahead, warn=get_run_logger().warning
    )
    return finished(outcome)


@task(name="filter_and_group", cache_policy=NO_CACHE)
def filter_and_group(run: RunRef, iteration: int, attempt: int, from_step: str, upstream: Any = None):
    """UID groups (PettingLLMs' trainer) and the configured filter (mean/std/dapo/uid)."""
    config = load_run_config(run, iteration, attempt)
    return finished(batches.filter_step(context(run, iteration, attempt, from_step), config))


@task(name="compute_advantages", cache_policy=NO_CACHE)
def compute_advantages(run: RunRef, iteration: int, attempt: int, from_step: str, upstream: Any = None):
    """Group-relative advantages; one batch file per policy."""
    config = load_run_config(run, iteration, attempt)
    outcome = batches.advantage_step(context(run, iteration, attempt, from_step), config)
    for message in batches.zero_signal_policies(outcome.metrics).values():
        get_run_logger().warning("iteration %d: %s", iteration, message)
    return finished(outcome)


@task(
    name="update_policy",
    task_run_name="update_policy[{policy}]",
    retries=1,
    retry_delay_seconds=[5],
    cache_policy=NO_CACHE,
)
def update_policy(
    run: RunRef,
    iteration: int,
    attempt: int,
    from_step: str,
    policy: str,
    runtime: Runtime | None = None,
    upstream: Any = None,
):
    """``policy``'s DeepSpeed update: in its resident learner when the run has a runtime, else in a new process.

    A learner that dies mid-update fails this attempt with its log tail; the retry starts new ranks that
    load the newest committed checkpoint (the metrics say how old the optimizer state then is)."""
    ctx = context(run, iteration, attempt, from_step)
    outcome = updates.update_step(ctx, load_run_config(run, iteration, attempt), policy, runtime)
    if not outcome.skipped and (line := updates.optimizer_state_line(policy, outcome.metrics.get("metrics") or {})):
        get_run_logger().info(line)
    return finished(outcome)


@task(name="sync_weights", retries=2, retry_delay_seconds=[5, 15], cache_policy=NO_CACHE)
def sync_weights(run: RunRef, iteration: int, attempt: int, from_step: str, runtime: Runtime, upstream: Any = None):
    """Full weights: reload in place; LoRA: load adapters by name. Probes confirm the change."""
    config = load_run_config(run, iteration, attempt)
    return updates.sync_step(context(run, iteration, attempt, from_step), config, runtime)


@task(name="validate", retries=1, retry_delay_seconds=[10], cache_policy=NO_CACHE)
def validate(run: RunRef, iteration: int, attempt: int, from_step: str, runtime: Runtime, upstream: Any = None):
    """Greedy episodes on held-out tasks; success rate per agent."""
    ctx = context(run, iteration, attempt, from_step)
    config = load_run_config(run, iteration, attempt)
    outcome = rollouts.validation_step(
        ctx, config, runtime.endpoints(), env_cache=runtime.env_cache, policy_versions=runtime.served_versions()
    )
    return finished(outcome)


@task(name="validate_baseline", retries=1, retry_delay_seconds=[10], cache_policy=NO_CACHE)
def validate_baseline(run: RunRef, iteration: int, runtime: Runtime) -> dict[str, Any] | State:
    """``validate`` on the weights ``iteration`` starts from, before any update (``validation.at_start``)."""
    return finished(rollouts.baseline_step(context(run, iteration), load_run_config(run), runtime))
