"""The ``evaluate`` flow: success rate per agent on the validation split for some weights.

With ``run_id``: the weights after ``iteration`` of that run (default: its last committed update).
Without: the config's base model(s). Results are stored as an evaluation run of their own
(``runs/eval-<name>-.../iter-0/validation``) whose ``run.json`` records what was evaluated. The work is
``runs.evaluation`` (which ``pettingflow eval`` and ``pettingflow play`` use too): this flow only wires it.

``swap_roles``: the positive control of a study. A team of two agents on two policies (``lora`` or ``full``
specialization) is scored with each agent served by the other's weights; trained roles that specialised score
far lower so (PettingLLMs reports 96 -> 6 on plan-path at 1.7B). A design that cannot see that cannot see a
smaller effect either.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger

from pettingflow.configs.loader import load_config
from pettingflow.runs.evaluation import Weights, evaluate_weights, roles_swappable, run_iteration, swap_roles
from pettingflow.storage import RunLayout

__all__ = ["evaluate", "roles_swappable", "swap_roles"]


@flow(name="evaluate", log_prints=True)
def evaluate(
    config: str = "code-env",
    overrides: list[str] | None = None,
    run_id: str | None = None,
    iteration: int | None = None,
    roles_swapped: bool = False,
) -> dict[str, Any]:
    """Score weights on the validation split; returns the per-agent metrics and where they are.

    ``roles_swapped``: each agent played by the other's weights (``swap_roles``; the positive control). The work
    is ``runs.evaluation.evaluate_weights``, which ``pettingflow eval`` runs too."""
    cfg = load_config(config, list(overrides or []))
    weights = Weights("base", "base")
    if run_id:
        root, options = cfg.run.storage_root, cfg.run.storage_options
        after = run_iteration(RunLayout(root, run_id, options), iteration, require_update=False)
        weights = Weights("run", run_id, run_id=run_id, root=root, storage_options=options, iteration=after)
    extra = {"roles_swapped": True} if roles_swapped else {}
    (done,) = evaluate_weights(
        cfg, config, list(overrides or []), [weights], extra=extra, reset_attached=False, roles_swapped=roles_swapped
    )
    source = {**weights.source(), **extra}
    metrics = done.outcome.metrics
    # agents: scores over every episode asked for; outcomes: how those episodes ended (analysis/outcomes.py)
    get_run_logger().info(
        "eval of %s: %s; episodes %s", weights.label(), metrics.get("agents"), metrics.get("outcomes")
    )
    return {
        "run_id": done.ref.run_id,
        "uri": done.outcome.uri,
        "source": source,
        "agents": metrics.get("agents"),
        "outcomes": metrics.get("outcomes"),
    }
