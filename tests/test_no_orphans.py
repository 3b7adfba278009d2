"""No process the project starts outlives it: ``pettingflow rollout`` ended by SIGTERM (as ``timeout`` does)
or SIGKILL takes its inference server and the server's children with it.

The server is a fake (``$PETTINGFLOW_VLLM_LAUNCHER``) that, like vLLM, starts an "engine" child in its
process group, and that on SIGTERM exits at once *without* stopping that child: the way the real API server
left its engine core behind. It never becomes healthy, so the command is signalled while it waits for the
server, as in the first minute of a real rollout.

Slow: the ``train`` flow's process SIGKILLed a moment into its update (``pettingflow.faults``, scope ``process``),
and a process driving a resident learner SIGKILLed: the learner ranks, the sandbox actors, raylet and GCS must end
with it, Ray's dashboard and runtime-env agents included (``RAY_AGENTS``: they outlived a SIGKILLed driver by minutes
until ``deathsig.kill_with_this_process`` gave the local Ray's processes a watcher).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from test_flows import scripted  # noqa: F401 (module fixture)

REPO = Path(__file__).resolve().parent.parent
FAKE_SERVER = r"""
import json, os, signal, subprocess, sys, time
record = os.environ["FAKE_RECORD"]
engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "fake-engine", sys.argv[0]])

def note(name):
    with open(os.path.join(record, "signals"), "a") as fh:
        fh.write(name + "\n")

def on_term(signum, frame):
    note("SIGTERM")
    os._exit(0)  # leaves the engine running, as an API server that dies without stopping its engine core

def on_int(signum, frame):
    note("SIGINT")
    engine.terminate()
    engine.wait()
    sys.exit(0)

signal.signal(signal.SIGTERM, on_term)
signal.signal(signal.SIGINT, on_int)
with open(os.path.join(record, "pids.json.tmp"), "w") as fh:
    json.dump({"server": os.getpid(), "engine": engine.pid}, fh)
os.replace(os.path.join(record, "pids.json.tmp"), os.path.join(record, "pids.json"))
while True:  # never healthy: the command waits for its server
    time.sleep(1)
"""


def _live(procs: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except psutil.NoSuchProcess:
            continue
    return alive


def _with_marker(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(marker in arg for arg in proc.info["cmdline"] or []):
                found.append(proc)
        except psutil.Error:
            continue
    return found


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_rollout_command_leaves_no_process_behind(tmp_path: Path, sig: signal.Signals) -> None:
    script = tmp_path / "fake_vllm_server.py"
    script.write_text(FAKE_SERVER)
    model = tmp_path / "fake-model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    record = tmp_path / "record"
    record.mkdir()
    env = {
        **os.environ,
        "PETTINGFLOW_VLLM_LAUNCHER": shlex.join([sys.executable, str(script)]),
        "FAKE_RECORD": str(record),
        "PETTINGFLOW_STATE": str(tmp_path / "state"),
        "PETTINGFLOW_HOME": str(tmp_path / "home"),
        "OMP_NUM_THREADS": "1",
    }
    cli = Path(sys.executable).with_name("pettingflow")
    argv = [str(cli), "rollout", "code-env", "--out", str(tmp_path / "runs"), f"policies.shared.model={model}",
            "rollout.use_ray=false", "inference.startup_timeout_s=300",
            "env.tasks_per_iteration=2", "env.group_size=2", "env.max_turns=2"]  # fmt: skip
    command = subprocess.Popen(argv, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    snapshot: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 120
        while not (record / "pids.json").exists():
            if command.poll() is not None:
                pytest.fail(f"the command ended before its server started:\n{command.stdout.read().decode()[-3000:]}")
            assert time.monotonic() < deadline, "the fake server never started"
            time.sleep(0.2)
        pids = json.loads((record / "pids.json").read_text())
        snapshot = [*psutil.Process(command.pid).children(recursive=True), *_with_marker(str(script))]
        seen = {p.pid for p in snapshot}
        assert {pids["server"], pids["engine"]} <= seen, (pids, seen)
        # positive control: the server's watcher exists, detached from the command's tree
        watchers = [p for p in _with_marker(str(script)) if "pettingflow.deathsig" in " ".join(p.cmdline())]
        assert watchers and all(w.pid != pids["server"] for w in watchers)

        os.kill(command.pid, sig)
        output = command.communicate(timeout=60)[0].decode()
        if sig == signal.SIGTERM:  # handled: the runtime stopped its server in order, then the command exited
            assert command.returncode == 128 + signal.SIGTERM, output[-3000:]
        else:
            assert command.returncode == -signal.SIGKILL
        _, alive = psutil.wait_procs(_live(snapshot), timeout=30)
        assert _live(alive) == [], f"survived {sig.name} of the command: {[p.cmdline() for p in _live(alive)]}"
        signals = (record / "signals").read_text().split()
        # SIGTERM: the orderly stop (SIGINT first); SIGKILL: the watcher's SIGTERM to the whole group
        assert signals[:1] == (["SIGINT"] if sig == signal.SIGTERM else ["SIGTERM"]), signals
    finally:
        for proc in _live([*snapshot, psutil.Process(command.pid)] if command.poll() is None else snapshot):
            proc.kill()
        command.wait()


# ------------------------------------------------------------------------------------------ flows and learners
# Process kinds the project starts below a flow or learner driver; Prefect's own temporary API server (a child of
# a flow run started without PREFECT_API_URL) is Prefect's, not ours, and is only cleaned up.
# After a SIGKILL of the driver that started a local Ray, Ray's dashboard and runtime-env agents were seen running
# minutes later (ray.init(include_dashboard=False) still starts them); the Runtime and a local Learner now register
# the local Ray's processes with a watcher that kills them when the driver is gone (pettingflow/deathsig.py).
RAY_AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")
OURS = ("ray::", "raylet", "gcs_server", "LearnerRank", "pettingflow.deathsig", "pettingflow.training", "vllm")


def _watch_tree(proc: subprocess.Popen, seen: dict[int, tuple[psutil.Process, str]], until: float) -> None:
    """Record every descendant of ``proc`` with its latest command line until it exits (or ``until``): the tree right
    before it died (its members may be gone a moment later, so their command lines are kept)."""
    root = psutil.Process(proc.pid)
    while proc.poll() is None and time.monotonic() < until:
        try:
            for child in root.children(recursive=True):
                with contextlib.suppress(psutil.Error):  # the latest title: a Ray worker becomes ray::LearnerRank
                    seen[child.pid] = (seen.get(child.pid, (child,))[0], " ".join(child.cmdline()) + " " + child.name())
        except psutil.NoSuchProcess:
            break
        time.sleep(0.2)


def _ours(seen: dict[int, tuple[psutil.Process, str]]) -> list[tuple[psutil.Process, str]]:
    """The recorded processes the project started (``OURS``), alive or not."""
    return [(proc, line) for proc, line in seen.values() if any(m in line for m in OURS)]


@pytest.mark.slow
def test_flow_process_sigkilled_mid_update_leaves_no_process(tmp_path, tiny_model, scripted) -> None:  # noqa: F811
    """The ``train`` flow's process (the Ray driver of the sandbox actors and the resident learner) SIGKILLs itself
    a few seconds into iteration 0's update (``PETTINGFLOW_CRASH_AT=update:mid``, scope ``process``): the learner
    ranks, Ray's processes and the sandbox actors must all end without anybody cleaning up after them."""
    from pettingflow import faults

    env = {
        **os.environ,
        "PETTINGFLOW_STATE": str(tmp_path / "state"),
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "OMP_NUM_THREADS": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
        faults.ENV_POINTS: "update:mid",
        faults.ENV_SCOPE: "process",
        faults.ENV_DELAY: "0.5",  # the tiny model's update is short
        faults.ENV_DIR: str(tmp_path / "faults"),
    }
    env.pop("PREFECT_API_URL", None)  # Prefect's temporary server, started by the flow process
    argv = [sys.executable, str(REPO / "flows" / "train.py"), "code-env", f"run.storage_root={tmp_path / 'runs'}",
            "run.iterations=1", f"policies.0.model={tiny_model}", f"inference.url={scripted.url}",
            "rollout.use_ray=true", "rollout.ray_num_cpus=2", "env.tasks_per_iteration=2", "validation.frequency=0",
            "env.group_size=2", "env.max_turns=2", "algorithm.filter_method=none",
            "training.zero_stage=0", "training.learner=resident"]  # fmt: skip
    log = tmp_path / "flow.log"
    with open(log, "w") as out:
        flow = subprocess.Popen(argv, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    seen: dict[int, tuple[psutil.Process, str]] = {}
    try:
        _watch_tree(flow, seen, time.monotonic() + 600)
        assert flow.wait(timeout=30) == -signal.SIGKILL, log.read_text()[-3000:]
        record = json.loads((tmp_path / "faults" / "update_mid.fired").read_text())
        assert [k["pid"] for k in record["killed"]] == [flow.pid]  # the flow process alone was killed
        ours = _ours(seen)
        kinds = " ".join(line for _, line in ours)
        assert "LearnerRank" in kinds and "raylet" in kinds, kinds  # positive control: they were running
        _, alive = psutil.wait_procs(_live([p for p, _ in ours]), timeout=60)
        left = [line.split()[0] for p, line in ours if p in _live(alive)]
        assert any(agent in kinds for agent in RAY_AGENTS), kinds  # the agents ran too (they used to outlive it)
        assert not left, f"outlived the flow process by more than 60 s: {left}"
    finally:
        procs = [p for p, _ in seen.values()]
        for proc in _live([*procs, psutil.Process(flow.pid)] if flow.poll() is None else procs):
            proc.kill()
        flow.wait()


LEARNER_DRIVER = """
import json, sys, time
import ray
ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
from pettingflow.training.learner import Learner
learner = Learner("shared", 1, sys.argv[1], master_host="127.0.0.1").start()
print(json.dumps(learner.pids), flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_learner_driver_sigkilled_leaves_no_rank(tmp_path) -> None:
    """A process that started a resident learner (Ray and its rank actors) dies by SIGKILL: ranks and Ray end."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    driver = subprocess.Popen(
        [sys.executable, "-c", LEARNER_DRIVER, str(tmp_path / "logs")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    seen: list[psutil.Process] = []
    try:
        output = []
        while not (line := driver.stdout.readline().decode()).startswith("["):  # Ray logs before the pids
            output.append(line)
            if not line:
                pytest.fail(f"the driver ended without starting its learner: {''.join(output)[-3000:]}")
        names: dict[int, str] = {}
        deadline = time.monotonic() + 60
        while not any("LearnerRank" in n for n in names.values()):  # positive control: the rank actor runs
            assert time.monotonic() < deadline, f"no learner rank below the driver: {sorted(names.values())}"
            seen = psutil.Process(driver.pid).children(recursive=True)
            for proc in seen:
                with contextlib.suppress(psutil.Error):
                    names[proc.pid] = " ".join(proc.cmdline()).split(" ")[0]
            time.sleep(0.5)
        ranks = [pid for pid, name in names.items() if "LearnerRank" in name]
        os.kill(driver.pid, signal.SIGKILL)
        assert driver.wait(timeout=30) == -signal.SIGKILL
        _, alive = psutil.wait_procs(_live(seen), timeout=60)
        left = [names.get(p.pid, str(p.pid)) for p in _live(alive)]
        assert not any(p.pid in ranks for p in _live(alive)), f"a learner rank outlived its driver: {left}"
        assert any(name in RAY_AGENTS for name in names.values()), names  # positive control
        assert not left, f"outlived the learner's driver by more than 60 s: {left}"
    finally:
        for proc in _live(seen):
            proc.kill()
        if driver.poll() is None:
            driver.kill()
        driver.wait()
