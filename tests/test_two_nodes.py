"""A second Ray node: the learner's rank runs there, with no disk it may share with the flow, and is lost mid-update.

One loopback cluster for the module: a head on 127.0.0.1 (``ray start --head``, token auth) and a second node on
127.0.0.2 that joins it (``ray_cluster.join_cluster``), each with its own Ray temp dir; the second node has its own
``PETTINGFLOW_HOME`` and the only ``learner`` resource, so ``training.rank_resources={learner: 1}`` places the rank
there. Storage is S3 (moto on loopback): the rank downloads its start weights into its own node's cache and uploads
the checkpoint it writes, the flow commits it, and the server on the first node (the scripted double, which
records every reload) reloads it from the flow node's cache. The same run then loses the second node (kill -9 of
every process of that node, raylet and rank) during iteration 1's update: the update fails naming the lost node,
the node rejoins, Prefect's retry places the learner again, and the run completes with every row once and the
optimizer state's status in the metrics.

The flow runs in this process (Prefect's temporary server, as test_flows.py) and attaches to the cluster with
``rollout.ray_address``; the rollout workers spread over both nodes.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest
from test_flows import overrides, scripted  # noqa: F401
from test_flows_s3 import BUCKET, bucket_keys, s3_endpoint  # noqa: F401

from pettingflow.storage import RunLayout, list_runs, read_step_trajectories

pytestmark = [pytest.mark.slow, pytest.mark.sandbox]

SECOND_IP = "127.0.0.2"
STEPS = ("rollouts", "filtered", "advantages", "update-shared", "sync")


class SecondNode:
    """A Ray node on 127.0.0.2 joined to the head at ``address``, with its own temp dir and ``PETTINGFLOW_HOME``;
    ``kill`` SIGKILLs every process of it (what a machine failure does), ``start`` joins a fresh one."""

    def __init__(self, address: str, home: Path) -> None:
        self.address = address
        self.home = home
        self.temp_dir: str | None = None
        self.head_dir = ""
        self.starts = 0

    def start(self) -> None:
        from pettingflow.ray_cluster import join_cluster

        self.temp_dir = tempfile.mkdtemp(prefix="pfnode2-", dir="/tmp")  # short: Ray's socket paths are limited
        out = join_cluster(
            self.address,
            SECOND_IP,
            "--num-cpus=2",
            '--resources={"learner": 1}',
            temp_dir=self.temp_dir,
            env={"PETTINGFLOW_HOME": str(self.home), "RAY_USAGE_STATS_ENABLED": "0"},
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        self.starts += 1

    def processes(self) -> list[psutil.Process]:
        from pettingflow.ray_cluster import node_processes

        return node_processes(self.temp_dir) if self.temp_dir else []

    def kill(self) -> None:
        from pettingflow.ray_cluster import stop_node

        if self.temp_dir:
            stop_node(self.temp_dir)
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = None


@pytest.fixture(scope="module")
def two_nodes(s3_endpoint, tmp_path_factory):  # noqa: F811 (s3 first: both nodes' workers get its credentials)
    from e2e_stack import loopback_ray_head

    with loopback_ray_head(2, "pfhead-") as (address, head_dir):
        node = SecondNode(address, tmp_path_factory.mktemp("node2-home"))
        node.head_dir = head_dir
        node.start()
        try:
            yield node
        finally:
            node.kill()


def run_actors(node: SecondNode) -> list[str]:
    """Titles of rollout-worker and learner-rank processes under either node's raylet."""
    from pettingflow.ray_cluster import node_processes

    titles = []
    for temp_dir in (node.head_dir, node.temp_dir):
        for raylet in [p for p in node_processes(temp_dir or "") if p.name() == "raylet"]:
            for proc in raylet.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    title = " ".join(proc.cmdline())
                    if "RolloutWorker" in title or "LearnerRank" in title:
                        titles.append(title)
    return titles


def kill_second_node_mid_update(node: SecondNode, log_path: Path, done: threading.Event, found: dict) -> None:
    """Wait until the rank's log shows this update planned its optimizer steps (the training follows), then kill
    the second node, and let it join again a few seconds later (a machine coming back)."""
    offset = log_path.stat().st_size if log_path.is_file() else 0
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not done.is_set():
        text = log_path.read_text(errors="replace")[offset:] if log_path.is_file() else ""
        if "optimizer steps of" in text:
            found["rank_pids"] = [
                p.pid
                for raylet in node.processes()
                if raylet.name() == "raylet"
                for p in raylet.children(recursive=True)
                if "LearnerRank" in " ".join(p.cmdline())
            ]
            node.kill()
            found["killed_at"] = time.monotonic()
            time.sleep(5)
            node.start()
            return
        time.sleep(0.05)


def test_learner_on_a_second_node_then_that_node_lost_mid_update(
    tmp_path,
    prefect_env,
    tiny_model,
    scripted,  # noqa: F811
    s3_endpoint,  # noqa: F811
    two_nodes,
    monkeypatch,
) -> None:
    from pettingflow.flows.train import train
    from pettingflow.paths import home
    from pettingflow.storage.local_copy import COMPLETE, cached_copy_dir
    from pettingflow.training.learner import Learner

    root = f"s3://{BUCKET}/two-nodes"
    options = {"client_kwargs": {"endpoint_url": s3_endpoint}}
    args = overrides(
        root,
        tiny_model,
        scripted.url,
        f"run.storage_options.client_kwargs.endpoint_url={s3_endpoint}",
        f"rollout.ray_address={two_nodes.address}",
        "rollout.workers=ray",
        "rollout.num_workers=2",
        "training.rank_resources.learner=1",
        "validation.at_start=false",
        "training.replay_snapshots=0",  # no snapshot of iteration 0: the retry after the node loss restarts Adam
    )
    # iteration 1's update (the learner's second) loses the second node while it trains
    real_update, calls, found, done = Learner.update, [], {}, threading.Event()

    def update(self: Learner, spec, timeout_s=None):
        calls.append(spec.weights_uri)
        if len(calls) == 2:
            threading.Thread(
                target=kill_second_node_mid_update,
                args=(two_nodes, self.log_paths()[0], done, found),
                daemon=True,
            ).start()
        try:
            return real_update(self, spec, timeout_s)
        except Exception as exc:
            found.setdefault("errors", []).append(str(exc))
            raise

    monkeypatch.setattr(Learner, "update", update)
    try:
        state = train("code-env", args, return_state=True)
    finally:
        done.set()
    assert state.is_completed(), (state, found.get("errors"))
    [run_id] = list_runs(root, options)
    layout = RunLayout(root, run_id, options)
    for k in (0, 1):
        for name in STEPS:
            assert layout.step(k, name).is_committed(), (k, name)

    # the rollout workers ran on both nodes (a worker's node_ip is the machine's address Ray picks, not the node's)
    workers = layout.step(0, "rollouts").manifest().metadata["workers"]
    assert len({w["node_id"] for w in workers}) == 2, workers  # spread_over_nodes: one per node
    assert {w["node_ip"] for w in workers} >= {SECOND_IP}

    # iteration 0: the rank ran on the second node and uploaded the checkpoint itself; the flow committed it
    update0 = layout.step(0, "update-shared")
    names = {f.name for f in update0.manifest().files}
    assert "metrics.json" in names and any(n.startswith("model/") for n in names), names
    log0 = update0.read_bytes("worker.log").decode()
    assert f"rank 0 (node {SECOND_IP}): uploaded" in log0, log0[-3000:]
    assert update0.read_json("metrics.json")["optimizer_state"] == "new"
    # iteration 1 started from iteration 0's weights, downloaded into the second node's own cache
    node_cache = two_nodes.home / cached_copy_dir(update0).relative_to(home())  # the same layout, its own home
    assert (node_cache / COMPLETE).read_text() == update0.manifest().to_json()
    # the server on the first node reloaded each checkpoint from the flow node's copy
    flow_cache = home() / "cache"
    served = [Path(r["kwargs"]["weights_path"]) for r in scripted.reloads if r.get("method") == "reload_weights"]
    for k in (0, 1):
        copy = cached_copy_dir(layout.step(k, "update-shared")) / "model"
        assert copy.resolve() in [p.resolve() for p in served], (k, served)
    assert not str(flow_cache).startswith(str(two_nodes.home))

    # the node loss: the first attempt of iteration 1's update failed naming the lost node, the retry re-placed it
    assert found.get("rank_pids"), "the second node was never killed mid-update"
    assert two_nodes.starts == 2
    assert calls[1] == calls[2] == layout.step(1, "update-shared").uri, calls
    [error] = found["errors"]
    assert f"lost node: rank 0 on node {SECOND_IP}" in error and "left the Ray cluster" in error, error
    for pid in found["rank_pids"]:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    meta = layout.step(1, "update-shared").manifest().metadata
    assert meta["metrics"]["optimizer_state"] == "reset" and meta["metrics"]["learner_starts"] == 2, meta
    assert f"rank 0 (node {SECOND_IP}): uploaded" in layout.step(1, "update-shared").read_bytes("worker.log").decode()
    # every row once: the rollouts of iteration 1 were committed before the loss and read back whole
    for k in (0, 1):
        rollouts = layout.step(k, "rollouts")
        table = read_step_trajectories(rollouts)
        assert table.num_rows == rollouts.manifest().rows > 0
        keys = zip(
            *(table.column(c).to_pylist() for c in ("group_id", "sample_idx", "turn_idx", "agent_idx")), strict=True
        )
        assert len(set(keys)) == table.num_rows
    batch_rows = sum(f.rows or 0 for f in layout.step(1, "advantages").manifest().files)
    assert meta["metrics"]["rows_used"] + meta["metrics"]["rows_dropped"] == batch_rows > 0
    # the bucket holds no half-written upload of the lost attempt: only the files the marker lists
    prefix = f"two-nodes/runs/{run_id}/iter-1/update-shared/"
    # no Ray of the flow's own, and the run's actors (rollout workers, learner ranks) ended with the run
    assert not [p for p in psutil.Process().children(recursive=True) if p.name() in ("raylet", "gcs_server")]
    deadline = time.monotonic() + 60
    while (left := run_actors(two_nodes)) and time.monotonic() < deadline:
        time.sleep(1)
    assert not left, f"actors of the finished run still alive in the cluster: {left}"
    files = layout.step(1, "update-shared").manifest().files
    assert bucket_keys(s3_endpoint, prefix) == sorted([prefix + "_COMMITTED.json", *(prefix + f.name for f in files)])
