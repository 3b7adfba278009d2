"""A Ray cluster PettingFlow starts accepts only drivers that have its token (``pettingflow.ray_cluster``).

One ``ray start --head`` on 127.0.0.1 for the module, started as PettingFlow starts one (``start_head``: token
auth, the session's token from ``$PETTINGFLOW_HOME/ray/auth_token``). A driver with the token runs a task; a
stranger's driver (a subprocess with a clean environment and an empty home, so no token anywhere, or a token of
its own) is refused by the cluster; the token file is private and the token appears in no process's command
line or environment and in none of the cluster's logs."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import process_list
import psutil
import pytest
from e2e_stack import loopback_ray_head

from pettingflow.ray_cluster import (
    AUTH_MODE_VAR,
    TOKEN_PATH_VAR,
    RayAuthError,
    ensure_token,
    init_ray,
    node_processes,
    token_path,
)

REFUSED = "Authentication token is missing or incorrect"  # what the GCS answers a driver without the token


@pytest.fixture(scope="module")
def auth_head(ray_token_auth: Path):
    """``ray start --head`` with token auth on 127.0.0.1 (own temp dir and port), stopped by killing exactly
    its processes."""
    with loopback_ray_head(1, "pfauth-") as head:
        yield head


def test_the_token_file_is_private(ray_token_auth: Path, tmp_path, monkeypatch) -> None:
    """The session's token (made by ``use_token_auth``) and a fresh one: mode 0600 in a 0700 folder, 256 bits,
    generated once (a second call keeps it)."""
    assert stat.S_IMODE(ray_token_auth.stat().st_mode) == 0o600
    assert os.environ[TOKEN_PATH_VAR] == str(ray_token_auth) and os.environ[AUTH_MODE_VAR] == "token"

    monkeypatch.delenv(TOKEN_PATH_VAR)
    monkeypatch.setenv("PETTINGFLOW_HOME", str(tmp_path / "home"))
    old_umask = os.umask(0o022)  # a usual umask: files 0644 unless made private
    try:
        path = ensure_token()
    finally:
        os.umask(old_umask)
    assert path == tmp_path / "home" / "ray" / "auth_token" == token_path()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    token = path.read_text()
    assert len(token) == 64 and int(token, 16) >= 0
    assert ensure_token() == path and path.read_text() == token
    assert [p.name for p in path.parent.iterdir()] == ["auth_token"]  # no temp file left behind


def test_attaching_without_the_token_says_where_it_goes(tmp_path, monkeypatch) -> None:
    """Attaching never makes a token up (a new one would not open the cluster): it names the missing file."""
    missing = tmp_path / "nowhere" / "auth_token"
    monkeypatch.setenv(TOKEN_PATH_VAR, str(missing))
    with pytest.raises(RayAuthError, match=r"no Ray auth token at .*nowhere/auth_token") as err:
        init_ray("127.0.0.1:1")
    assert "PETTINGFLOW_HOME/ray/auth_token" in str(err.value)
    assert not missing.parent.exists()


def test_a_driver_with_the_token_runs_a_task(auth_head, ray_token_auth: Path) -> None:
    """``init_ray(address)`` (what a run does with ``rollout.ray_address``) connects and runs a task; the worker
    got the token's path from its node, never the token; the token is in no process's arguments or environment
    and in none of the cluster's files (logs, session data)."""
    import ray

    address, temp_dir = auth_head
    token = ray_token_auth.read_text().strip()
    assert not ray.is_initialized()
    init_ray(address, log_to_driver=False)
    try:

        @ray.remote(num_cpus=0)
        def where() -> dict:
            return {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN")} | {
                "pid": os.getpid()
            }

        seen = ray.get(where.remote(), timeout=120)
        assert seen["RAY_AUTH_MODE"] == "token" and seen["RAY_AUTH_TOKEN_PATH"] == str(ray_token_auth)
        assert seen["RAY_AUTH_TOKEN"] is None
        procs = [*node_processes(temp_dir), psutil.Process(seen["pid"]), psutil.Process()]
        assert len(procs) >= 4  # gcs, raylet, agents, the worker, this driver
        for proc in procs:
            assert not any(token in arg for arg in proc.cmdline()), proc
            assert token not in "\n".join(f"{k}={v}" for k, v in proc.environ().items()), proc
        assert process_list.showing([token]) == []  # nor any other process's command line (ps shows them to all)
    finally:
        ray.shutdown()
    leaked = []
    for folder, _, files in os.walk(temp_dir):
        for name in files:
            path = Path(folder, name)
            if not path.is_socket() and path.is_file() and token.encode() in path.read_bytes():
                leaked.append(str(path))
    assert not leaked


STRANGER = textwrap.dedent(
    """
    import sys, ray
    ray.init(address=sys.argv[1], log_to_driver=False)
    print("CONNECTED", ray.get(ray.remote(lambda: 42).options(num_cpus=0).remote()))
    """
)


@pytest.mark.parametrize("token", ["none", "its own"])
def test_a_driver_without_the_token_is_refused(auth_head, tmp_path, token: str) -> None:
    """A plain ``ray.init(address=...)`` from a process that has no token (a clean environment, an empty home:
    no ``~/.ray/auth_token``, no ``$PETTINGFLOW_HOME/ray/auth_token``) or a token of its own is refused by the
    cluster's GCS. Ray retries for about 20 s before giving up; ``RAY_gcs_server_port_wait_time_s`` cuts that to 2
    tries here (the refusal is the same on each)."""
    address, _ = auth_head
    (tmp_path / "home").mkdir()
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(tmp_path / "home"),
        "PETTINGFLOW_HOME": str(tmp_path / "pfhome"),
        "RAY_TMPDIR": str(tmp_path),
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_gcs_server_port_wait_time_s": "2",
    }
    if token == "its own":
        own = tmp_path / "own_token"
        own.write_text("0" * 64)
        env |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(own)}
    out = subprocess.run(
        [sys.executable, "-c", STRANGER, address], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode != 0 and "CONNECTED" not in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
    assert f"Unauthenticated: RPC error: InvalidAuthToken: {REFUSED}" in out.stderr, out.stderr[-3000:]
    assert "ConnectionError: Failed to connect to Ray cluster at" in out.stderr, out.stderr[-3000:]
    assert not (tmp_path / "home" / ".ray").exists() and not (tmp_path / "pfhome").exists()  # nothing made up


def test_the_cli_prints_the_tokens_path_never_the_token(tmp_path) -> None:
    env = {**os.environ, "PETTINGFLOW_HOME": str(tmp_path)}
    env.pop(TOKEN_PATH_VAR, None)
    out = subprocess.run(
        [sys.executable, "-m", "pettingflow.ray_cluster", "token"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    path = tmp_path / "ray" / "auth_token"
    assert out.stdout.strip() == str(path)
    assert path.read_text() not in out.stdout + out.stderr


def test_stop_node_kills_that_nodes_processes_only(tmp_path) -> None:
    """``stop_node(TEMP_DIR)`` ends the processes that name ``TEMP_DIR/session_...``, not a node whose folder merely
    starts with the same name, nor the command that called it (its own arguments name the folder)."""
    folder = tmp_path / "node"
    nap = [sys.executable, "-c", "import time; time.sleep(600)"]
    victim = subprocess.Popen([*nap, f"--session-dir={folder}/session_1"])
    neighbour = subprocess.Popen([*nap, f"--session-dir={folder}2/session_1"])
    try:
        stopper = "import sys; from pettingflow.ray_cluster import stop_node; stop_node(sys.argv[1])"
        out = subprocess.run([sys.executable, "-c", stopper, str(folder)], timeout=60, check=False)
        assert out.returncode == 0
        assert victim.wait(timeout=30) == -9
        assert neighbour.poll() is None
    finally:
        for proc in (victim, neighbour):
            proc.kill()
            proc.wait()
