"""Episodes in this process: the team's inference bindings, the episode specs of a task list, one engine run.

Everything a rollout needs from the outside world arrives as an endpoint per policy (``runs.endpoint.
PolicyEndpoint``: the URLs, the served model name, the adapter names, the model folder for the tokenizer):
plain data, so a Prefect task can take it as a parameter, a Ray actor can receive it, and a re-run can see
exactly what was used. ``run_episodes`` is what the local runner calls once per step and what each Ray rollout
actor calls once per group (``rollout/ray_workers.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from pettingflow.agents import build_agent
from pettingflow.configs.settings import ExperimentConfig, Specialization
from pettingflow.envs import EnvCache, EnvSpec, TaskSpec, env_spec_from_settings, task_specs_from_rows
from pettingflow.envs.registry import ENV_REGISTRY
from pettingflow.envs.service.client import RemoteEnvs
from pettingflow.inference import auth
from pettingflow.inference.client import InferenceClient
from pettingflow.inference.replicas import ReplicaSet
from pettingflow.rollout.engine import AgentBinding, EngineStats, EpisodeSpec, ExecutionEngine, group_specs
from pettingflow.rollout.records import EpisodeRecord


class Endpoint(Protocol):
    """What the rollout reads of a policy's endpoint (``runs.endpoint.PolicyEndpoint``)."""

    served_model: str
    model_dir: str
    adapters: dict[str, str]
    api_key: str | None

    @property
    def urls(self) -> tuple[str, ...]: ...


@functools.lru_cache(maxsize=8)
def load_tokenizer(model_dir: str) -> Any:
    """The policy's tokenizer (with its chat template), loaded once per process."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


class ClientPool:
    """One ``InferenceClient`` per server URL (it bounds that server's concurrency), and a ``ReplicaSet`` over
    them for a policy served by replicas. ``clients``: URL (or replica-set key) -> client, owned by the caller
    when given, so a rollout worker's clients and their concurrency bound hold over all its calls."""

    def __init__(self, config: ExperimentConfig, clients: dict[str, Any] | None = None):
        self.config = config
        self.owned = clients is None
        self.clients: dict[str, Any] = {} if clients is None else clients

    def client_for(self, urls: tuple[str, ...]) -> InferenceClient | ReplicaSet:
        clients = self.clients
        for url in urls:
            if url not in clients:
                clients[url] = InferenceClient(
                    url,
                    max_concurrency=self.config.rollout.max_concurrent_requests,
                    timeout_s=self.config.inference.request_timeout_s,
                    max_retries=self.config.inference.max_retries,
                )
        if len(urls) == 1:
            return clients[urls[0]]
        key = "replicas:" + ",".join(urls)
        if key not in clients:
            clients[key] = ReplicaSet([clients[u] for u in urls], names=list(urls))
        else:  # a set kept from an earlier call: the replicas it saw die were restarted since (heal)
            clients[key].revive()
        return clients[key]

    async def close_owned(self) -> None:
        """Close the clients this pool made itself; a caller's stay open."""
        if self.owned:
            for client in self.clients.values():
                await client.aclose()


def bindings(
    config: ExperimentConfig,
    endpoints: Mapping[str, Endpoint],
    client_for: Callable[[tuple[str, ...]], Any],
) -> dict[str, AgentBinding]:
    """Agent -> how it is served: its policy's client, the model or its LoRA adapter (``specialization: lora``),
    the policy's tokenizer."""
    out = {}
    for agent in config.agents:
        ep = endpoints[agent.policy]
        lora = ep.adapters.get(agent.name) if config.specialization is Specialization.lora else None
        out[agent.name] = AgentBinding(
            client=client_for(ep.urls),
            served_model=lora or ep.served_model,
            tokenizer=load_tokenizer(ep.model_dir),
            policy_name=agent.policy,
            lora_name=lora,
        )
    return out


def evaluation_temperatures(config: ExperimentConfig) -> dict[str, float]:
    """Agent -> its own evaluation temperature (``sampling.eval_temperature``), for the agents that set one."""
    return {a.name: a.sampling.eval_temperature for a in config.agents if a.sampling.eval_temperature is not None}


def episode_specs(
    config: ExperimentConfig, tasks: list[dict[str, Any]], group_size: int, seed_namespace: str, env_cache: EnvCache
) -> list[EpisodeSpec]:
    """G episodes per task. A task row may name its own env class and config
    (``{"env_class_path", "env_config", "task_data"}``), so one batch can mix envs; each distinct
    (class, config) gets one cached factory. ``env.server`` set: the episodes live on env services instead
    (``RemoteEnvs``, docs/env-service.md) and ``env_cache`` is not used."""
    default_env: EnvSpec = env_spec_from_settings(config.env)
    task_specs = task_specs_from_rows(tasks, default_env)
    remote = RemoteEnvs(config.env.server) if config.env.server else None

    def make_env(spec: EpisodeSpec) -> Any:
        ts: TaskSpec = spec.task
        if remote is not None:
            return remote.create(
                ts.env, ts.task, env_idx=spec.id.env_idx, rollout_idx=spec.id.rollout_idx, seed=spec.id.seed
            )
        factory = env_cache.get(ts.env)
        return factory.create(ts.task, env_idx=spec.id.env_idx, rollout_idx=spec.id.rollout_idx, seed=spec.id.seed)

    def env_name(ts: TaskSpec) -> str:
        return config.env.class_path if ts.env == default_env else ENV_REGISTRY.short_name(ts.env.class_path)

    return group_specs(task_specs, group_size, config.run.seed, env_name, make_env, namespace=seed_namespace)


@dataclass(frozen=True)
class Sampling:
    """How a step samples its episodes, passed as one value through ``rollout.runner.EpisodeRunner.run``, the Ray
    pool and its actors down to ``run_episodes``: a new option is a field here, not a parameter in every signature
    on the way.

    ``group_size``: episodes per task (``env.group_size``; 1 in tree mode); ``tree_branches``: K candidates per
    turn of tree episodes (``rollout.tree.branches``), None for independent ones; ``seed_namespace`` prefixes the
    episodes' seeds; ``temperature`` overrides the agents' own."""

    group_size: int
    seed_namespace: str
    tree_branches: int | None = None
    temperature: float | None = None


async def run_episodes(
    config: ExperimentConfig,
    endpoints: Mapping[str, Endpoint],
    tasks: list[dict[str, Any]],
    *,
    group_size: int,
    seed_namespace: str,
    env_cache: EnvCache,
    temperature: float | None = None,
    show_progress: bool = True,
    skip_groups: Collection[int] = (),
    on_episode: Callable[[EpisodeRecord], None] | None = None,
    tree_branches: int | None = None,
    clients: dict[str, Any] | None = None,
) -> tuple[list[EpisodeRecord], EngineStats]:
    """Run ``group_size`` episodes per task with the configured team; return records and stats.

    ``tree_branches``: K for tree episodes (K candidates per turn, ``rollout.tree.branches``; the continued one
    by ``rollout.tree_select``), None for independent ones.

    ``skip_groups``: task indexes (``env_idx``) not to run (already stored); the others keep their indexes,
    seeds and UIDs. ``on_episode``: called with each finished episode (see ``ExecutionEngine.run``).
    ``clients``: URL -> client, owned by the caller and kept open (a rollout worker reuses its clients across
    calls, so its concurrency bound holds over all of them); None: clients of this call, closed at its end.
    """
    pool = ClientPool(config, clients)
    for ep in endpoints.values():  # the servers' keys, also in a rollout worker's process (inference/auth.py)
        if ep.api_key:
            for url in ep.urls:
                auth.register(url, ep.api_key)
    team = bindings(config, endpoints, pool.client_for)

    def make_agents() -> list[Any]:
        return [
            build_agent(a, agent_idx=i, tokenizer=team[a.name].tokenizer, layout=config.env.sample_layout)
            for i, a in enumerate(config.agents)
        ]

    engine = ExecutionEngine(
        make_agents,
        team,
        max_turns=config.env.max_turns,
        token_budget=config.env.token_budget,
        layout=config.env.sample_layout,
        max_model_len=config.inference.max_model_len,
        sampling_overrides={"temperature": temperature} if temperature is not None else None,
        agent_temperatures=evaluation_temperatures(config) if temperature is not None else None,
        show_progress=show_progress,
        tree_branches=tree_branches,
        tree_select=config.rollout.tree_select,
        team_credit=config.rollout.tree.team_credit if tree_branches is not None else "shared",
        lookahead_temperature=config.rollout.tree.lookahead_temperature,
    )
    specs = [
        s
        for s in episode_specs(config, tasks, group_size, seed_namespace, env_cache)
        if s.id.env_idx not in skip_groups
    ]
    try:
        return await engine.run(specs, on_episode=on_episode)
    finally:
        await pool.close_owned()
