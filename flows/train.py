"""The ``train`` flow: what ``prefect deployment run train/code-env`` starts.

It resolves the config, creates the run (or resumes it when ``run_id`` names an existing one),
starts the inference servers once, and runs ``run.iterations`` iteration subflows against them.
Resuming walks past the finished iterations without entering them (``resume_passes``) and re-enters the last
finished one and the rest, whose committed steps are skipped, so only unfinished work runs and a resume costs
the same after 10 iterations as after 1,000.

Without ``run_id``, the id is derived from the Prefect flow run (its name and scheduled start), so
``prefect flow-run retry <id>`` of a crashed run resumes that same run.
"""

from __future__ import annotations

import sys
from typing import Any

from prefect import flow, get_run_logger

from pettingflow.configs.loader import load_config
from pettingflow.flows.iteration import iteration
from pettingflow.runs.run import start_or_resume
from pettingflow.runs.runtime import Runtime
from pettingflow.steps.report import generated_tokens, read_metrics
from pettingflow.storage import RunLayout, StepName, new_run_id
from pettingflow.tasks.report import summarize_run


def _default_run_id(name: str) -> str | None:
    """A run id tied to the current Prefect flow run (stable across its retries)."""
    try:
        from prefect.runtime import flow_run

        started = flow_run.scheduled_start_time
        run_uuid = str(flow_run.id or "")
    except Exception:  # pragma: no cover - outside a flow run
        return None
    if not run_uuid or started is None:
        return None
    return f"{new_run_id(name, started).rsplit('-', 1)[0]}-{run_uuid[:6]}"


def resume_passes(layout: RunLayout, iteration: int) -> bool:
    """Whether a resume walks past ``iteration`` without entering its subflow: the next iteration's report is
    committed, so this one finished everything it does, its retention included (the next one started after it).

    The last finished iteration is entered again (its retention may have been cut short by the crash), and so
    is every later one. Before this, a resume re-entered every iteration: each finished one cost ~2.5 s and
    ~0.5 MB of Prefect database (a subflow and its task runs saying "already committed") before new work began,
    so resuming after k iterations took O(k), and a long run killed now and then paid it again each time.
    """
    return layout.step(iteration + 1, StepName.REPORT).is_committed()


def passed_result(layout: RunLayout, iteration: int) -> dict[str, Any]:
    """What ``iteration`` returned when it ran, read back from its committed report (the flow's result lists
    every iteration, entered or not)."""
    report = layout.step(iteration, StepName.REPORT)
    return {"iteration": iteration, "attempt": 0, "report": report.uri, "metrics": read_metrics(report), "passed": True}


@flow(name="train", log_prints=True)
def train(config: str = "code-env", overrides: list[str] | None = None, run_id: str | None = None) -> dict[str, Any]:
    """Train the agents of ``config`` for ``run.iterations`` iterations (or resume ``run_id``), or fewer
    when ``run.max_generated_tokens`` is spent first."""
    logger = get_run_logger()
    overrides = list(overrides or [])
    cfg = load_config(config, overrides)
    ref, resumed = start_or_resume(cfg, config, overrides, run_id or _default_run_id(cfg.run.name), {})
    layout = ref.layout()
    logger.info("%s run %s at %s", "resuming" if resumed else "starting", ref.run_id, layout.run_uri)
    results = []
    with Runtime(cfg, ref.run_id, start_learners=True) as runtime:
        chosen, threads = runtime.between_updates, runtime.server_threads
        logger.info("inference servers during updates: %s (%s)", chosen.mode, chosen.reason)
        if any(service.managed for service in runtime.services.values()):
            logger.info("inference server compute threads: %s (%s)", threads.threads or "vLLM's choice", threads.reason)
        for name, service in runtime.services.items():  # once per run: the learners live across iterations
            if (learner := service.learner_handle) is None:
                continue
            logger.info(
                "resident learner of %s: %d rank(s) up (start #%d)", name, learner.num_processes, learner.starts
            )
        budget = cfg.run.max_generated_tokens
        passed = {k for k in range(cfg.run.iterations) if resume_passes(layout, k)} if resumed else set()
        if passed:
            logger.info(
                "resume: %d finished iteration(s) not entered again (up to %d); their steps are committed",
                len(passed),
                max(passed),
            )
        for k in range(cfg.run.iterations):
            if k in passed:
                results.append(passed_result(layout, k))
                continue
            results.append(iteration(ref, k, runtime=runtime))
            if budget is not None and (spent := generated_tokens(layout)) >= budget:
                logger.info("generation budget reached: %d of %d tokens after iteration %d", spent, budget, k)
                break
    # the training is committed by now: a summary that cannot be made is a warning, not a failed run
    summary = summarize_run(ref, return_state=True)
    if not summary.is_completed():
        logger.warning("no run summary (%s): `pettingflow runs summary %s` makes it again", summary.message, ref.run_id)
    logger.info("run %s finished: %s", ref.run_id, layout.run_uri)
    return {"run_id": ref.run_id, "uri": layout.run_uri, "iterations": results}


if __name__ == "__main__":  # python flows/train.py [config] [overrides...]
    train(sys.argv[1] if len(sys.argv) > 1 else "code-env", sys.argv[2:])
