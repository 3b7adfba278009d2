"""The harness the end-to-end tests share: a private Prefect server, its pool and deployments, workers.

test_deployment_e2e.py and test_kill_matrix.py (and the tests that borrow their fixtures) start the same
stack; one copy here keeps their environments and process handling from drifting apart.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil

from pettingflow.processes import free_port

__all__ = [
    "PREFECT",
    "REPO",
    "create_pool_and_deployments",
    "free_port",
    "kill_tree",
    "loopback_ray_head",
    "postgres",
    "stack_env",
    "start_server",
    "start_worker",
    "stop_worker",
    "update_jobs",
    "wait_http",
]

REPO = Path(__file__).resolve().parent.parent
#: The venv's own prefect CLI, so the server and workers run the code under test.
PREFECT = str(Path(sys.executable).parent / "prefect")


def stack_env(state: Path, pettingflow_home: Path, port: int, **extra: str) -> dict[str, str]:
    """Environment of the server, the CLI calls and the workers: everything under ``state``, offline."""
    return {
        **os.environ,
        "PETTINGFLOW_STATE": str(state),
        "PETTINGFLOW_HOME": str(pettingflow_home),
        "PETTINGFLOW_REPO": str(REPO),
        "PREFECT_HOME": str(state / "prefect"),
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
        "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{state}/prefect.db",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_CLI_PROMPT": "false",
        "PREFECT_WORKER_QUERY_SECONDS": "1",
        "PREFECT_LOGGING_EXTRA_LOGGERS": "pettingflow",  # as make run: library lines (learner starts) in the log
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
        "TORCH_EXTENSIONS_DIR": str(pettingflow_home / "torch_extensions"),
        **extra,
    }


def wait_http(url: str, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {timeout_s} s")


@contextlib.contextmanager
def postgres() -> Iterator[tuple[str, Path]]:
    """A private PostgreSQL cluster for a Prefect server (``scripts/prefect_postgres.sh``, as
    ``PF_PREFECT_DB=postgres make run`` starts it): yields (connection URL, data folder). The folder is a temp dir
    directly under /tmp, since the cluster runs as the ``postgres`` user when the tests run as root and pytest's
    own temp folders are private to their owner."""
    import pytest

    if not list(Path("/usr/lib/postgresql").glob("*/bin/initdb")):
        if os.environ.get("CI"):
            pytest.fail("PostgreSQL is not installed: scripts/test_deps.sh installs it, so CI must have it")
        pytest.skip("PostgreSQL is not installed (apt-get install postgresql)")
    data = Path(tempfile.mkdtemp(prefix="pf-e2e-postgres-", dir="/tmp"))
    data.chmod(0o755)
    script = str(REPO / "scripts" / "prefect_postgres.sh")
    try:
        done = subprocess.run([script, "start", str(data), str(free_port())], capture_output=True, text=True)
        assert done.returncode == 0, f"PostgreSQL did not start: {done.stderr[-2000:]}"
        yield done.stdout.strip(), data
    finally:
        subprocess.run([script, "stop", str(data)], capture_output=True, timeout=120)
        shutil.rmtree(data, ignore_errors=True)


def postgres_rows(data: Path, url: str, table: str) -> int:
    """Rows of one table of the Prefect database, read with psql (proof of which database the server used)."""
    port = url.rsplit(":", 1)[1].split("/", 1)[0]
    psql = sorted(Path("/usr/lib/postgresql").glob("*/bin/psql"))[-1]
    runner = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    out = subprocess.run(
        [*runner, str(psql), "-h", str(data / "cluster"), "-p", port, "-U", "postgres", "-d", "prefect", "-qtAc",
         f"SELECT count(*) FROM {table}"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return int(out.stdout.strip())


def start_server(env: dict[str, str], port: int, log: Path) -> subprocess.Popen:
    """Start a Prefect server on ``port`` and wait for its health check; killed again if it never answers."""
    server = subprocess.Popen(
        [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=open(log, "w"),  # noqa: SIM115 - the server writes to it until teardown
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/api/health", 120)
    except BaseException:
        kill_tree(server)
        raise
    return server


def create_pool_and_deployments(env: dict[str, str]) -> None:
    """The process work pool and every deployment of prefect.yaml, as a user sets them up."""
    for args in (("work-pool", "create", "pettingflow", "--type", "process"), ("--no-prompt", "deploy", "--all")):
        subprocess.run([PREFECT, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=300, check=True)


def start_worker(env: dict[str, str], log: Path) -> subprocess.Popen:
    """A process worker on the pool, in its own session so ``kill_tree`` takes it and its flow runs."""
    return subprocess.Popen(
        [PREFECT, "worker", "start", "--pool", "pettingflow"],
        env=env,
        cwd=REPO,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def stop_worker(proc: subprocess.Popen) -> None:
    """SIGINT (Prefect's orderly stop), then SIGKILL whatever is left: a worker that outlives its test would poll
    the pool and take the next test's flow run."""
    kill_tree(proc, signal.SIGINT)
    kill_tree(proc)


def kill_tree(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Kill a process and all its descendants (a crash of the worker and everything it started)."""
    try:
        parent = psutil.Process(proc.pid)
        procs = [*parent.children(recursive=True), parent]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(sig)
    psutil.wait_procs(procs, timeout=30)


def update_jobs(env: dict[str, str] | None = None) -> list[psutil.Process]:
    """One-shot update processes and resident learner ranks on this machine; with ``env``, only those whose
    environment holds those values (inherited from the worker a test started: another test's learner on a shared
    machine is not this test's survivor)."""
    marks = ("pettingflow.training.worker", "ray::LearnerRank")
    found = [
        p
        for p in psutil.process_iter(["cmdline"])
        if p.info["cmdline"] and any(m in " ".join(p.info["cmdline"]) for m in marks)
    ]
    if not env:
        return found
    mine = []
    for p in found:
        try:
            environ = p.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if all(environ.get(k) == v for k, v in env.items()):
            mine.append(p)
    return mine


@contextlib.contextmanager
def loopback_ray_head(num_cpus: int, prefix: str) -> Iterator[tuple[str, str]]:
    """``ray start --head`` on 127.0.0.1 as PettingFlow starts one (``ray_cluster.start_head``: token auth with the
    session's token), with its own port and temp dir (short: Ray's socket paths are length-limited); yields
    (address, temp dir) and stops it by killing exactly that cluster's processes (``ray stop`` would stop every
    Ray on the machine)."""
    from pettingflow.ray_cluster import start_head, stop_node

    temp_dir = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    port = free_port()
    out = start_head(
        port,
        "127.0.0.1",
        f"--num-cpus={num_cpus}",
        "--include-dashboard=false",
        temp_dir=temp_dir,
        env={"RAY_USAGE_STATS_ENABLED": "0"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    try:
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        yield f"127.0.0.1:{port}", temp_dir
    finally:
        stop_node(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
