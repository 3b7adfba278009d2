"""The ``evaluate`` flow: success rate per agent on the validation split for some weights.

With ``run_id``: the weights after ``iteration`` of that run (default: its last committed update).
Without: the config's base model(s). Results are stored as an evaluation run of their own
(``runs/eval-.../iter-0/validation``) whose ``run.json`` records what was evaluated.

``swap_roles``: the positive control of a study. A team of two agents on two policies (``lora`` or ``full``
specialization) is scored with each agent served by the other's weights; trained roles that specialised score
far lower so (PettingLLMs reports 96 -> 6 on plan-path at 1.7B). A design that cannot see that cannot see a
smaller effect either.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from prefect import flow, get_run_logger

from pettingflow.configs.loader import load_config
from pettingflow.configs.settings import ExperimentConfig, Specialization
from pettingflow.runs.context import IterationContext
from pettingflow.runs.endpoint import PolicyEndpoint
from pettingflow.runs.run import RunRef, load_run_config, start_or_resume
from pettingflow.runs.runtime import Runtime
from pettingflow.steps.rollouts import validation_step


def roles_swappable(config: ExperimentConfig) -> bool:
    """Whether ``swap_roles`` applies: two agents with weights of their own (two LoRA adapters, or two policies)."""
    agents = config.agents
    if len(agents) != 2:
        return False
    return config.specialization is Specialization.lora or agents[0].policy != agents[1].policy


def swap_roles(
    config: ExperimentConfig, endpoints: dict[str, PolicyEndpoint]
) -> tuple[ExperimentConfig, dict[str, PolicyEndpoint]]:
    """Each of the two agents served by the other's weights: under ``lora`` the adapters change hands (the
    endpoints'), under ``full`` the policies (the config's agents)."""
    agents = config.agents
    names = [a.name for a in agents]
    if not roles_swappable(config):
        raise ValueError(
            "roles_swapped serves each agent with the other's weights, so it needs two agents with weights of their "
            f"own (specialization lora, or full with two policies); this config has {config.specialization.value} "
            f"and agents {[(a.name, a.policy) for a in agents]}"
        )
    if config.specialization is Specialization.lora:
        swapped_names = dict(zip(names, reversed(names), strict=True))
        return config, {
            policy: replace(ep, adapters={agent: ep.adapters[swapped_names.get(agent, agent)] for agent in ep.adapters})
            for policy, ep in endpoints.items()
        }
    swapped = [a.model_copy(update={"policy": b.policy}) for a, b in zip(agents, reversed(agents), strict=True)]
    return config.model_copy(update={"agents": swapped}), endpoints


@flow(name="evaluate", log_prints=True)
def evaluate(
    config: str = "code-env",
    overrides: list[str] | None = None,
    run_id: str | None = None,
    iteration: int | None = None,
    roles_swapped: bool = False,
) -> dict[str, Any]:
    """Score weights on the validation split; returns the per-agent metrics and where they are.

    ``roles_swapped``: each agent played by the other's weights (``swap_roles``; the positive control)."""
    cfg = load_config(config, list(overrides or []))
    source = {"weights": "base"}
    if run_id:
        trained = RunRef(root=cfg.run.storage_root, run_id=run_id, storage_options=cfg.run.storage_options)
        cfg_run = load_run_config(trained)
        last = iteration if iteration is not None else max(trained.layout().iterations(), default=-1)
        cfg = cfg_run.model_copy(update={"validation": cfg.validation})
        source = {"weights": "run", "run_id": run_id, "after_iteration": last}
    if roles_swapped:
        swap_roles(cfg, {})  # refuse a config without two sets of weights before anything starts
        source["roles_swapped"] = True
    tag = f"eval-{run_id or 'base'}"
    ref, _ = start_or_resume(cfg, config, list(overrides or []), None, {"evaluates": source})
    ref = RunRef(root=ref.root, run_id=ref.run_id, storage_options=ref.storage_options)
    ctx = IterationContext(ref.layout(), 0)
    with Runtime(cfg, ref.run_id) as runtime:
        if run_id:
            runtime.serve_start_of(trained.layout(), source["after_iteration"] + 1)
        endpoints = runtime.endpoints()
        if roles_swapped:
            cfg, endpoints = swap_roles(cfg, endpoints)
        outcome = validation_step(ctx, cfg, endpoints, env_cache=runtime.env_cache)
    # agents: scores over every episode asked for; outcomes: how those episodes ended (analysis/outcomes.py)
    get_run_logger().info("%s: %s; episodes %s", tag, outcome.metrics.get("agents"), outcome.metrics.get("outcomes"))
    return {
        "run_id": ref.run_id,
        "uri": outcome.uri,
        "source": source,
        "agents": outcome.metrics.get("agents"),
        "outcomes": outcome.metrics.get("outcomes"),
    }
