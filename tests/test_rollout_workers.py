"""Rollout workers on Ray (``rollout.workers: ray``): a step's groups run in Ray actors, the flow process only
schedules and commits them. The rows must be exactly local mode's (seeds and UIDs never depend on which actor
ran a group), a crash mid-rollout must keep the finished groups, and a run must work attached to a Ray cluster
started elsewhere (a real ``ray start --head`` on loopback)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path

import psutil
import pytest
from factories import crash_after_first_shard
from scripted_server import ScriptedServer
from test_flows import overrides, prefect_env, tiny_model  # noqa: F401 (module fixtures: Prefect's server, a tiny model)

from pettingflow.configs import load_config
from pettingflow.envs import EnvCache, load_humaneval
from pettingflow.runs.context import IterationContext
from pettingflow.runs.endpoint import PolicyEndpoint
from pettingflow.steps.rollout_workers import RolloutWorker
from pettingflow.steps.rollouts import collect_step, run_episodes
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
        got = await worker.run_group(tasks, 2, group_size=2, seed_namespace="iter-0/")
        again = await worker.run_group(tasks, 3, group_size=2, seed_namespace="iter-0/")
        clients = dict(worker.clients)
        await worker.close()
        return got, again, clients

    got, again, clients = asyncio.run(both())
    assert len(clients) == 1 and not worker.clients  # one client for both calls, closed by close()
    assert (got.env_idx, got.worker) == (2, 1) and again.env_idx == 3
    assert {r.env_idx for r in got.records} == {2} and sorted(r.sample_idx for r in got.records) == [0, 1]
    everything, _ = asyncio.run(
        run_episodes(config, endpoints, tasks, group_size=2, seed_namespace="iter-0/", env_cache=EnvCache())
    )
    want = {(r.env_idx, r.sample_idx): r for r in everything}
    for rec in [*got.records, *again.records]:
        ref = want[(rec.env_idx, rec.sample_idx)]
        assert (rec.seed, rec.rollout_idx, rec.final_reward("code_generator")) == (
            ref.seed,
            ref.rollout_idx,
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


def _cluster_processes(temp_dir: str) -> list[psutil.Process]:
    """The processes of the cluster whose files live in ``temp_dir`` (every Ray process names its session dir)."""
    out = []
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any(temp_dir in arg for arg in proc.info["cmdline"] or []):
                out.append(proc)
    return out


@pytest.fixture
def ray_head(tmp_path):
    """``ray start --head`` on 127.0.0.1 as PettingFlow starts one (``start_head``: token auth with the session's
    token, so the run attaches with it), with its own temp dir (short: Ray's socket paths are length-limited),
    stopped by killing exactly that cluster's processes (``ray stop`` would stop every Ray on the machine)."""
    from e2e_stack import loopback_ray_head

    with loopback_ray_head(4, "pfray-") as head:
        yield head


@pytest.mark.slow
@pytest.mark.sandbox
@pytest.mark.usefixtures("prefect_env")
def test_iteration_attached_to_a_loopback_ray_cluster(tmp_path, ray_head, scripted, request) -> None:
    """A whole iteration (rollouts in rollout actors, the resident learner's rank, the sync) with
    ``rollout.ray_address`` pointing at a cluster this test started with ``ray start --head``: the actors and
    the learner ran in that cluster's processes, not in a Ray the flow started."""
    from pettingflow.flows.train import train

    address, temp_dir = ray_head
    model = request.getfixturevalue("tiny_model")
    extra = [
        f"rollout.ray_address={address}",
        "rollout.workers=ray",
        "rollout.num_workers=2",
        "run.iterations=1",
        "validation.at_start=false",
    ]
    state = train("code-env", overrides(tmp_path, model, scripted.url, *extra), return_state=True)
    assert state.is_completed(), state
    run_id = state.result()["run_id"]
    layout = RunLayout(str(tmp_path), run_id)
    for name in ("rollouts", "filtered", "advantages", "update-shared", "sync", "validation", "report"):
        assert layout.step(0, name).is_committed(), name
    workers = layout.step(0, "rollouts").manifest().metadata["workers"]
    assert sorted(g for w in workers for g in w["groups"]) == [0, 1]
    assert len({w["node_id"] for w in workers}) == 1 and len({w["node_ip"] for w in workers}) == 1
    # the actors were worker processes of that cluster: its raylet wrote their logs (worker-<id>-<job>-<pid>.out)
    logs = {p.name for p in Path(temp_dir, "session_latest", "logs").glob("worker-*")}
    for w in workers:
        assert any(name.endswith(f"-{w['pid']}.out") for name in logs), (w, sorted(logs)[:20])
    cluster_raylets = [p for p in _cluster_processes(temp_dir) if p.name() == "raylet"]
    assert len(cluster_raylets) == 1, "the cluster started by ray start is still up"
    raylet = cluster_raylets[0]
    update = layout.step(0, "update-shared").manifest().metadata["metrics"]
    assert update["optimizer_state"] == "new"
    # no Ray of the flow's own: the only raylet is the cluster's, and this process started none
    assert not [p for p in psutil.Process().children(recursive=True) if p.name() in ("raylet", "gcs_server")]
    assert raylet.is_running()

    def run_actors() -> list[str]:
        names = []
        for proc in raylet.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                title = " ".join(proc.cmdline())
                if "RolloutWorker" in title or "Rank" in title:
                    names.append(title)
        return names

    deadline = time.monotonic() + 60  # the run's actors (rollout workers, learner ranks) end with the run
    while run_actors() and time.monotonic() < deadline:
        time.sleep(1)
    assert not run_actors(), "actors of the finished run still alive in the cluster"
