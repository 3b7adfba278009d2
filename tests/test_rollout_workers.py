"""Rollout workers on Ray (``rollout.workers: ray``): a step's groups run in Ray actors, the flow process only
schedules and commits them. The rows must be exactly local mode's (seeds and UIDs never depend on which actor
ran a group), a crash mid-rollout must keep the finished groups, and a run must work attached to a Ray cluster
started elsewhere (a real ``ray start --head`` on loopback)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from factories import crash_after_first_shard

from bench.scripted_server import ScriptedServer
from pettingflow.configs import load_config
from pettingflow.envs import EnvCache, load_humaneval
from pettingflow.rollout.local import Sampling, run_episodes
from pettingflow.rollout.ray_workers import RolloutWorker
from pettingflow.runs.context import IterationContext
from pettingflow.runs.endpoint import PolicyEndpoint
from pettingflow.steps.rollouts import collect_step
from pettingflow.storage import RunLayout, read_step_trajectories

RUN_SPECIFIC = {"run_id", "uid"}  # namespaced by the run id; every other column must match


@pytest.fixture(scope="module")
def scripted(default_tokenizer):
    solutions = {t["entry_point"]: t["prompt"] + t["canonical_solution"] for t in load_humaneval()}
    with ScriptedServer(default_tokenizer, solutions) as server:
        yield server


def config_for(root: Path, model_dir: Path, *extra: str):
    return load_config(
        "code-env",
        [
            f"run.storage_root={root}",
            f"policies.0.model={model_dir}",
            "rollout.use_ray=false",
            "env.tasks_per_iteration=4",
            "env.group_size=2",
            *extra,
        ],
    )


def endpoints_for(server: ScriptedServer, model_dir: Path) -> dict[str, PolicyEndpoint]:
    return {"shared": PolicyEndpoint(policy="shared", url=server.url, served_model="shared", model_dir=str(model_dir))}


def comparable(layout: RunLayout) -> list[dict]:
    rows = read_step_trajectories(layout.step(0, "rollouts")).to_pylist()
    return [{k: v for k, v in r.items() if k not in RUN_SPECIFIC} for r in rows]


@pytest.mark.sandbox
def test_worker_body_runs_one_group_with_the_steps_seeds(tmp_path, scripted, default_model_dir) -> None:
    """The actor body (called in-process here) runs exactly the asked group, with the seeds and sample indexes
    that group gets when the whole step runs in one loop, and shares its clients across calls."""
    config = config_for(tmp_path, default_model_dir, "rollout.max_concurrent_requests=5")
    endpoints = endpoints_for(scripted, default_model_dir)
    from pettingflow.steps.rollouts import select_train_tasks

    tasks = select_train_tasks(config, 0)
    worker = RolloutWorker(config, endpoints, worker=1, num_workers=2)
    assert worker.config.rollout.max_concurrent_requests == 3  # a server sees the same load from 2 actors

    async def both():
        got = await worker.run_group(tasks, 2, Sampling(group_size=2, seed_namespace="iter-0/"))
        again = await worker.run_group(tasks, 3, Sampling(group_size=2, seed_namespace="iter-0/"))
        clients = dict(worker.clients)
        await worker.close()
        return got, again, clients

    got, again, clients = asyncio.run(both())
    assert len(clients) == 1 and not worker.clients  # one client for both calls, closed by close()
    assert (got.env_idx, got.worker) == (2, 1) and again.env_idx == 3
    assert {r.id.env_idx for r in got.records} == {2} and sorted(r.id.sample_idx for r in got.records) == [0, 1]
    everything, _ = asyncio.run(
        run_episodes(config, endpoints, tasks, group_size=2, seed_namespace="iter-0/", env_cache=EnvCache())
    )
    want = {(r.id.env_idx, r.id.sample_idx): r for r in everything}
    for rec in [*got.records, *again.records]:
        ref = want[(rec.id.env_idx, rec.id.sample_idx)]
        assert (rec.id.seed, rec.id.rollout_idx, rec.final_reward("code_generator")) == (
            ref.id.seed,
            ref.id.rollout_idx,
            ref.final_reward("code_generator"),
        )
        assert [t.response_ids for t in rec.turns] == [t.response_ids for t in ref.turns]


@pytest.mark.sandbox
def test_ray_workers_commit_the_rows_of_local_mode_and_resume_a_crash(
    tmp_path, scripted, default_model_dir, monkeypatch
) -> None:
    """Local Ray, 2 actors: the step's rows equal local mode's; after a crash that kept one group's shard the
    actors run only the other groups, and the committed step is the same again."""
    import ray

    endpoints = endpoints_for(scripted, default_model_dir)

    def collect(run_id: str, *extra: str):
        layout = RunLayout(str(tmp_path), run_id)
        config = config_for(tmp_path, default_model_dir, *extra)
        outcome = collect_step(IterationContext(layout, 0), config, endpoints, show_progress=False)
        return layout, outcome

    local_layout, _ = collect("run-local")
    assert not ray.is_initialized()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        ray_layout, outcome = collect("run-ray", "rollout.workers=ray", "rollout.num_workers=2")
        workers = outcome.metrics["workers"]
        assert [w["worker"] for w in workers] == [0, 1]
        assert sorted(g for w in workers for g in w["groups"]) == [0, 1, 2, 3]  # each group ran once
        assert all(w["groups"] for w in workers)  # both actors worked
        assert all(w["pid"] != os.getpid() and w["node_id"] for w in workers)  # in Ray worker processes
        assert comparable(ray_layout) == comparable(local_layout)

        # a crash after the first group's shard: the resume runs the other three groups in the actors
        with crash_after_first_shard(monkeypatch) as writes:
            collect("run-crash", "rollout.workers=ray", "rollout.num_workers=2")
        crash_layout, resumed = collect("run-crash", "rollout.workers=ray", "rollout.num_workers=2")
    finally:
        ray.shutdown()
    assert resumed.metrics["groups_resumed"] == 1
    assert sorted(g for w in resumed.metrics["workers"] for g in w["groups"]) == sorted({0, 1, 2, 3} - set(writes))
    assert comparable(crash_layout) == comparable(local_layout)


# --- a Ray cluster started elsewhere, on loopback ---------------------------------------------------------------


def test_workers_are_dealt_round_robin_over_the_alive_nodes() -> None:
    """``spread_over_nodes``: worker i is pinned to the (i mod n)-th alive node; a dead node gets none. (Ray's
    SPREAD, and soft node affinity, put both actors of a two-node loopback cluster on one node.) The attached
    two-node run is tests/test_two_nodes.py."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from pettingflow.rollout.ray_workers import spread_over_nodes

    a, b, dead = "aa" * 28, "bb" * 28, "cc" * 28  # node ids are hex
    nodes = [{"NodeID": b, "Alive": True}, {"NodeID": dead, "Alive": False}, {"NodeID": a, "Alive": True}]
    strategies = spread_over_nodes(nodes, 5)
    assert all(isinstance(s, NodeAffinitySchedulingStrategy) and not s.soft for s in strategies)
    assert [s.node_id for s in strategies] == [a, b, a, b, a]
    assert spread_over_nodes([], 2) == ["SPREAD", "SPREAD"]
