"""The ``evaluate`` flow: success rate per agent on the validation split for some weights.

With ``run_id``: the weights after ``iteration`` of that run (default: its last committed update).
Without: the config's base model(s). Results are stored as an evaluation run of their own
(``runs/eval-.../iter-0/validation``) whose ``run.json`` records what was evaluated.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger

from pettingflow.configs.loader import load_config
from pettingflow.runs.context import IterationContext
from pettingflow.runs.run import RunRef, load_run_config, start_or_resume
from pettingflow.runs.runtime import Runtime
from pettingflow.steps.rollouts import validation_step


@flow(name="evaluate", log_prints=True)
def evaluate(
    config: str = "code-env",
    overrides: list[str] | None = None,
    run_id: str | None = None,
    iteration: int | None = None,
) -> dict[str, Any]:
    """Score weights on the validation split; returns the per-agent metrics and where they are."""
    cfg = load_config(config, list(overrides or []))
    source = {"weights": "base"}
    if run_id:
        trained = RunRef(root=cfg.run.storage_root, run_id=run_id, storage_options=cfg.run.storage_options)
        cfg_run = load_run_config(trained)
        last = iteration if iteration is not None else max(trained.layout().iterations(), default=-1)
        cfg = cfg_run.model_copy(update={"validation": cfg.validation})
        source = {"weights": "run", "run_id": run_id, "after_iteration": last}
    tag = f"eval-{run_id or 'base'}"
    ref, _ = start_or_resume(cfg, config, list(overrides or []), None, {"evaluates": source})
    ref = RunRef(root=ref.root, run_id=ref.run_id, storage_options=ref.storage_options)
    ctx = IterationContext(ref.layout(), 0)
    with Runtime(cfg, ref.run_id) as runtime:
        if run_id:
            runtime.serve_start_of(trained.layout(), source["after_iteration"] + 1)
        outcome = validation_step(ctx, cfg, runtime.endpoints(), env_cache=runtime.env_cache)
    get_run_logger().info("%s: %s", tag, outcome.metrics.get("agents"))
    return {"run_id": ref.run_id, "uri": outcome.uri, "source": source, "agents": outcome.metrics.get("agents")}
