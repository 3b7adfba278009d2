"""No process the project starts outlives it: ``pettingflow rollout`` ended by SIGTERM (as ``timeout`` does)
or SIGKILL takes its inference server and the server's children with it.

The server is a fake (``$PETTINGFLOW_VLLM_LAUNCHER``) that, like vLLM, starts an "engine" child in its
process group, and that on SIGTERM exits at once *without* stopping that child: the way the real API server
left its engine core behind. It never becomes healthy, so the command is signalled while it waits for the
server, as in the first minute of a real rollout.
"""

from __future__ import annotations

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
            "rollout.use_ray=false", "inference.startup_timeout_s=300"]  # fmt: skip
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
