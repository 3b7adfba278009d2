"""bench/soak_stack.py: the soak finds its own run's processes (by their mark, and everything below them) with their
roles, and its kill mode signals nothing else."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from bench.soak_stack import MARK, RunProcess, kill_pid, role_of, run_processes

PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env={"PATH": "/usr/bin"})
print(child.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize(
    ("cmdline", "name", "role"),
    [
        ("/venv/bin/python /venv/bin/prefect server start --host 127.0.0.1 --port 4444", "python", "prefect_server"),
        ("/venv/bin/python /venv/bin/prefect worker start --pool pettingflow", "python", "worker"),
        ("/venv/bin/python -m prefect.engine", "python", "flow"),
        ("/venv/bin/python -m vllm.entrypoints.openai.api_server --model m", "python", "vllm"),
        ("VLLM::EngineCore", "VLLM::EngineCore", "vllm"),
        ("ray::LearnerRank.update", "ray::LearnerRank", "learner"),
        ("ray::_SandboxWorker", "ray::_SandboxWorker", "ray_workers"),
        ("ray::DashboardAgent", "ray::DashboardAgent", "ray_system"),
        ("/venv/lib/ray/core/src/ray/raylet/raylet --raylet_socket_name=x", "raylet", "ray_system"),
        (
            "/venv/bin/python -m pettingflow.deathsig --group 5.0 SIGTERM 9 -- python -m vllm.entrypoints",
            "python",
            "other",
        ),
    ],
)
def test_roles_from_command_lines(cmdline: str, name: str, role: str) -> None:
    assert role_of(cmdline, name) == role


def test_the_marked_tree_is_found_and_only_it_is_killed(tmp_path: Path) -> None:
    soak = tmp_path / "soak"
    # a marked parent whose child has an environment without the mark (as a renamed process's reads), and a stranger
    marked = subprocess.Popen(
        [sys.executable, "-c", PARENT], env={**os.environ, MARK: str(soak)}, stdout=subprocess.PIPE, text=True
    )
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env={**os.environ, MARK: "x"})
    try:
        child = int(marked.stdout.readline())
        found = {p.pid: p for p in run_processes(soak)}
        assert set(found) == {marked.pid, child}
        assert stranger.pid not in found
        # a pid of this run that was reused by another process (another start time) is not signalled
        reused = RunProcess(child, marked.pid, "other", "", found[child].create_time + 1)
        assert not kill_pid(reused, soak) and psutil.pid_exists(child)
        assert not kill_pid(RunProcess(stranger.pid, 1, "other", "", psutil.Process(stranger.pid).create_time()), soak)
        assert stranger.poll() is None
        assert kill_pid(found[child], soak)
        for _ in range(300):  # killed: a zombie until its parent reaps it
            try:
                if psutil.Process(child).status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"{child} still runs after its kill")
    finally:
        for proc in (marked, stranger):
            proc.kill()
            proc.wait(timeout=30)


def test_a_capped_role_keeps_its_own_pid_and_logs_through_logcap(tmp_path: Path) -> None:
    """The soak starts the Prefect server as `make run` does (its output through pettingflow.logcap), and its
    role's pid stays the server's own: the pid the soak measures and the kill run kills."""
    from bench.soak_stack import SoakStack, log_errors

    stack = SoakStack(tmp_path / "soak", port=0)
    script = "import time; print('up'); print('database is ' + 'locked', flush=True); time.sleep(60)"
    stack._spawn("prefect_server", [sys.executable, "-c", script], capped_log=True)
    pid = stack.pids["prefect_server"]
    try:
        assert "time.sleep(60)" in " ".join(psutil.Process(pid).cmdline())
        log = stack.logs / "prefect_server.log"
        deadline = time.monotonic() + 30
        while log_errors(log) < 1:
            assert time.monotonic() < deadline, f"nothing logged in 30 s: {log}"
            time.sleep(0.1)
        text = log.read_text()  # the start line, then logcap's header, then the output
        assert text.index(" start: ") < text.index("===== logcap ") < text.index("up\n")
        logcaps = [p for p in psutil.process_iter(["cmdline"]) if str(log) in (p.info["cmdline"] or [])]
        assert len(logcaps) == 1 and "pettingflow.logcap" in logcaps[0].info["cmdline"]
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    for p in logcaps:  # the server gone, its log ends after the last line
        assert p.wait(timeout=30) == 0


def test_stop_ends_the_bench_of_that_soak_first_and_nothing_else(tmp_path) -> None:
    """``--stop`` with the bench still running: left alive, the bench would take the stopped processes for kills and
    start them again. The bench recorded in ``bench.json`` (pid and start time) gets SIGTERM; the bench of another
    soak, or a recycled pid (another start time), does not."""
    import json

    from bench.soak import stop_bench

    sleeper = "import time; time.sleep(60)"
    ours = subprocess.Popen([sys.executable, "-c", sleeper])
    other = subprocess.Popen([sys.executable, "-c", sleeper])

    def record(soak: str, proc: subprocess.Popen, shift: float = 0.0) -> Path:
        (tmp_path / soak).mkdir(exist_ok=True)
        created = psutil.Process(proc.pid).create_time() + shift
        (tmp_path / soak / "bench.json").write_text(json.dumps({"pid": proc.pid, "create_time": created}))
        return tmp_path / soak

    try:
        stop_bench(record("b", ours, shift=1.0), wait_s=1)  # the pid, reused by another program
        assert ours.poll() is None
        stop_bench(record("a", ours), wait_s=10)
        assert ours.wait(5) == -15 and other.poll() is None
        stop_bench(record("b", other), wait_s=10)
        assert other.wait(5) == -15
        stop_bench(tmp_path / "nowhere")  # no bench recorded: nothing to do
    finally:
        for p in (ours, other):
            p.kill()
            p.wait()


def test_run_disk_counts_every_file_once_into_checkpoints_or_the_rest(tmp_path: Path) -> None:
    from bench.soak import run_disk

    sizes = {"iter-0/update-shared/model.bin": 600_000, "iter-0/optimizer-shared/state.pt": 400_000,
             "iter-0/rollouts/part-0.parquet": 30_000, "iter-0/_COMMITTED.json": 1_000, "run.json": 2_000,
             "tensorboard/events": 5_000}  # fmt: skip
    for rel, size in sizes.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"x" * size)
    disk = run_disk(tmp_path)
    assert disk["disk_mb/checkpoints"] * 2**20 == 1_000_000
    assert disk["disk_mb/other"] * 2**20 == 38_000
    assert disk["disk_mb/run"] * 2**20 == sum(sizes.values())
