"""Rollout workers on Ray (``rollout.workers: ray``): a rollout step's groups run in Ray actors.

Why: with local workers every episode of a step runs in one asyncio loop in the flow process, so env work
(agents, env steps, sandboxed programs) is bounded by one machine. Here the step's groups (the G episodes
of one task) are dealt round-robin to ``rollout.num_workers`` actors, spread over the cluster's nodes; each
actor holds its own env cache (and so its own sandbox) and its own inference clients, and runs the same
``run_episodes`` as local mode (``rollout/local.py``) on one group per call. The flow process only schedules the
calls, takes each finished group as it arrives and hands it on (the rollouts step commits a shard per group), so
a crash keeps finished groups exactly as in local mode. ``rollout/runner.py`` picks local or Ray from the config.

Rows are the same as local mode's: seeds, UIDs and sampling seeds depend on the task's index in the step,
the run seed and the iteration only, never on which actor ran a group or when. ``max_concurrent_requests``
(per inference server) is split between the actors, so a server sees the same load.

Actors live for one step (created, used, killed). They reserve no Ray CPU (like the sandbox pool: the
work is waiting on the server and the sandbox's own child processes) and are dealt round-robin over the alive
nodes (``spread_over_nodes``: Ray's own ``SPREAD`` is best effort and, for actors that reserve nothing, put
them all on one node in one of two loopback runs). What an actor needs on its node: the policies' tokenizer
folders (``PolicyEndpoint.model_dir``) at the same path, the inference URLs reachable, and the sandbox
(bubblewrap) installed.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pettingflow.configs.code_paths import activate_code_paths
from pettingflow.configs.settings import ExperimentConfig
from pettingflow.envs import EnvCache
from pettingflow.ray_cluster import init_ray
from pettingflow.rollout.engine import EngineStats, summarize
from pettingflow.rollout.local import Sampling, run_episodes
from pettingflow.rollout.records import EpisodeRecord

log = logging.getLogger(__name__)


@dataclass
class GroupResult:
    """One group's episodes as an actor returns them."""

    env_idx: int
    worker: int
    records: list[EpisodeRecord]
    stats: EngineStats
    started_at: float  # epoch seconds when the actor's engine started (places its spans on the step's clock)


@dataclass
class GroupRun:
    """What ``RayRolloutWorkers.run`` saw: the records of every group it ran and the merged statistics."""

    records: list[EpisodeRecord]
    stats: EngineStats
    workers: list[dict[str, Any]] = field(default_factory=list)  # per actor: worker, pid, node_id, node_ip, groups


class RolloutWorker:
    """Ray actor body (an async actor: its concurrent calls share one event loop, env cache and clients).

    Usable without Ray too (tests call it in-process)."""

    def __init__(self, config: ExperimentConfig, endpoints: dict[str, Any], worker: int, num_workers: int):
        missing = activate_code_paths(config.run.code_paths)  # the env and agent classes of the run's own packages
        if missing:
            raise FileNotFoundError(
                f"rollout worker {worker}: run.code_paths {missing} are not folders on this node; put the package "
                "at the same path on every node (or on a shared file system)"
            )
        share = max(1, math.ceil(config.rollout.max_concurrent_requests / num_workers))
        rollout = config.rollout.model_copy(update={"max_concurrent_requests": share})
        self.config = config.model_copy(update={"rollout": rollout})
        self.endpoints = endpoints
        self.worker = worker
        self.env_cache = EnvCache()  # its own factories, so its own sandbox (built on first use)
        self.clients: dict[str, Any] = {}  # url -> InferenceClient, shared by every call of this actor

    def info(self) -> dict[str, Any]:
        """Where this actor runs: its pid and, under Ray, its node's id and address."""
        out: dict[str, Any] = {"worker": self.worker, "pid": os.getpid(), "node_id": None, "node_ip": None}
        try:
            import ray

            if ray.is_initialized():
                out["node_id"] = ray.get_runtime_context().get_node_id()
                out["node_ip"] = ray.util.get_node_ip_address()
        except ImportError:
            pass
        return out

    async def run_group(
        self,
        tasks: list[dict[str, Any]],
        env_idx: int,
        sampling: Sampling,
    ) -> GroupResult:
        """The episodes of task ``env_idx`` of ``tasks`` (the whole step's list: indexes fix seeds and UIDs)."""
        started_at = time.time()
        records, stats = await run_episodes(
            self.config,
            self.endpoints,
            tasks,
            group_size=sampling.group_size,
            seed_namespace=sampling.seed_namespace,
            env_cache=self.env_cache,
            temperature=sampling.temperature,
            show_progress=False,
            skip_groups=set(range(len(tasks))) - {env_idx},
            tree_branches=sampling.tree_branches,
            clients=self.clients,
        )
        return GroupResult(env_idx, self.worker, records, stats, started_at)

    async def close(self) -> None:
        for client in self.clients.values():
            await client.aclose()
        self.clients.clear()


def spread_over_nodes(nodes: list[dict[str, Any]], num_workers: int) -> list[Any]:
    """One scheduling strategy per worker: worker i is pinned to the (i mod n)-th alive node (by node id).
    ``nodes``: ``ray.nodes()``. Pinned, not soft: with ``soft=True`` Ray 2.60 put both workers of a two-node
    loopback cluster on one node. A node lost mid-step takes its workers with it: the step fails and its retry
    deals the groups still missing over the nodes then alive."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    alive = sorted(n["NodeID"] for n in nodes if n.get("Alive"))
    if not alive:
        return ["SPREAD"] * num_workers
    return [NodeAffinitySchedulingStrategy(alive[i % len(alive)], soft=False) for i in range(num_workers)]


class RayRolloutWorkers:
    """``num_workers`` rollout actors for one step; a context manager that kills them on exit.

    Ray must be reachable: an initialised Ray (the run's runtime connects one) is used as it is; otherwise
    this attaches to ``rollout.ray_address``, or starts a local runtime, with token authentication
    (``pettingflow.ray_cluster.init_ray``), and shuts it down on exit.
    """

    def __init__(self, config: ExperimentConfig, endpoints: dict[str, Any], num_workers: int | None = None):
        import ray

        self._ray = ray
        self.num_workers = num_workers or config.rollout.num_workers
        self._owns_ray = False
        if not ray.is_initialized():
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            if config.rollout.ray_address:
                init_ray(config.rollout.ray_address, log_to_driver=False)
            else:
                init_ray(num_cpus=config.rollout.ray_num_cpus, include_dashboard=False, log_to_driver=False)
            self._owns_ray = True
        actor_cls = ray.remote(RolloutWorker)
        self.actors = [
            actor_cls.options(num_cpus=0, scheduling_strategy=strategy, max_restarts=0).remote(
                config, endpoints, i, self.num_workers
            )
            for i, strategy in enumerate(spread_over_nodes(ray.nodes(), self.num_workers))
        ]
        try:
            self.workers = ray.get([a.info.remote() for a in self.actors], timeout=300)
        except BaseException:
            self.close()
            raise

    def run(
        self,
        tasks: Sequence[dict[str, Any]],
        groups: Sequence[int],
        sampling: Sampling,
        *,
        on_group: Callable[[list[EpisodeRecord]], None] | None = None,
    ) -> GroupRun:
        """Run groups ``groups`` (indexes into ``tasks``); ``on_group`` gets each group's records (sorted by
        ``sample_idx``) in the flow process as soon as an actor returns it. Raises the first failure, after
        cancelling the calls still running."""
        ray = self._ray
        started_at, started = time.time(), time.perf_counter()
        tasks_ref = ray.put(list(tasks))  # stored once, not once per call
        pending = {}
        for i, env_idx in enumerate(groups):
            actor = self.actors[i % self.num_workers]
            ref = actor.run_group.remote(tasks_ref, env_idx, sampling)
            pending[ref] = env_idx
        results: list[GroupResult] = []
        try:
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1)
                result: GroupResult = ray.get(ready[0])
                del pending[ready[0]]
                result.records.sort(key=lambda r: r.id.sample_idx)
                results.append(result)
                if on_group is not None:
                    on_group(result.records)
                log.info(
                    "rollouts: group %d done by worker %d (%d/%d)",
                    result.env_idx,
                    result.worker,
                    len(results),
                    len(groups),
                )
        except BaseException:
            for ref in pending:
                ray.cancel(ref)
            raise
        return self._merge(results, started_at, time.perf_counter() - started)

    def _merge(self, results: list[GroupResult], started_at: float, wall_s: float) -> GroupRun:
        """One ``EngineStats`` for the step, as local mode reports it (spans on the step's clock)."""
        results = sorted(results, key=lambda r: r.env_idx)
        records = [rec for r in results for rec in r.records]
        stats = summarize(records)
        stats.wall_s = wall_s
        for r in results:
            shift = r.started_at - started_at
            stats.llm_s += r.stats.llm_s
            stats.env_s += r.stats.env_s
            stats.llm_spans += [(s + shift, e + shift) for s, e in r.stats.llm_spans]
            stats.env_spans += [(s + shift, e + shift) for s, e in r.stats.env_spans]
        workers = [dict(w, groups=sorted(r.env_idx for r in results if r.worker == w["worker"])) for w in self.workers]
        return GroupRun(records, stats, workers)

    def close(self) -> None:
        """Kill the actors (their clients go with them); shut Ray down only if this started it."""
        for actor in self.actors:
            self._ray.kill(actor)
        self.actors = []
        if self._owns_ray:
            self._ray.shutdown()
            self._owns_ray = False

    def __enter__(self) -> RayRolloutWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
