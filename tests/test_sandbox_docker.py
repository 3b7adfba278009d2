"""The Docker sandbox against a real engine: a private `dockerd` (Debian's docker.io, no bridge, no iptables,
its own socket and data folder in a temp dir) and an image built here by `scripts/docker_sandbox_image.sh`
(nothing pulled from a registry). The limits of docs/sandbox.md hold, and the code env scores the same code
the same way as under bubblewrap.

Needs root (dockerd) and the docker.io package (`scripts/test_deps.sh` installs it); skipped without them,
except under CI, where they are required.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from pettingflow.configs.settings import SandboxSettings
from pettingflow.envs.sandbox import make_sandbox

ROOT = Path(__file__).resolve().parents[1]
IMAGE = "pettingflow-sandbox:test"
pytestmark = pytest.mark.slow


def _unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{reason}: CI runs the Docker sandbox tests (scripts/test_deps.sh installs docker.io)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def docker_host(tmp_path_factory: pytest.TempPathFactory):
    """DOCKER_HOST of a private engine with the sandbox image built; stopped at the end of the module."""
    if shutil.which("dockerd") is None or shutil.which("docker") is None:
        _unavailable("no dockerd (apt-get install docker.io)")
    if os.geteuid() != 0:
        _unavailable("dockerd needs root")
    base = tmp_path_factory.mktemp("docker")
    sock = base / "docker.sock"
    log = open(base / "dockerd.log", "w")  # noqa: SIM115 (closed below)
    daemon = subprocess.Popen(
        [
            "dockerd",
            "--iptables=false",
            "--ip-forward=false",
            "--bridge=none",
            f"--data-root={base / 'data'}",
            f"--exec-root={base / 'exec'}",
            f"--pidfile={base / 'docker.pid'}",
            f"--host=unix://{sock}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    host = f"unix://{sock}"
    env = {**os.environ, "DOCKER_HOST": host}
    deadline = time.monotonic() + 60
    while subprocess.run(["docker", "version"], env=env, capture_output=True).returncode != 0:
        if daemon.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"dockerd did not start: {(base / 'dockerd.log').read_text()[-3000:]}")
        time.sleep(0.5)
    mp = pytest.MonkeyPatch()
    mp.setenv("DOCKER_HOST", host)
    try:
        built = subprocess.run(
            [str(ROOT / "scripts" / "docker_sandbox_image.sh"), IMAGE], env=env, capture_output=True, text=True
        )
        assert built.returncode == 0, built.stderr
        yield host
    finally:
        mp.undo()
        subprocess.run(["docker", "rm", "-f", *_containers(env)], env=env, capture_output=True)
        daemon.terminate()
        try:
            daemon.wait(timeout=30)
        except subprocess.TimeoutExpired:
            daemon.kill()
        log.close()


def _containers(env: dict) -> list[str]:
    out = subprocess.run(["docker", "ps", "-aq"], env=env, capture_output=True, text=True).stdout
    return out.split() or ["none"]


def settings(**kw) -> SandboxSettings:
    return SandboxSettings(backend="docker", docker_image=IMAGE, **kw)


def test_programs_run_isolated_within_their_limits(docker_host) -> None:
    sb = make_sandbox(settings(timeout_s=5, memory_mb=256, max_processes=32, max_file_mb=2))
    ok = sb.run("import sys\nprint(sys.stdin.read().upper())\nsys.stderr.write('e')\nsys.exit(3)", stdin="abc")
    assert (ok.exit_code, ok.stdout, ok.stderr, ok.memory_bound) == (3, "ABC\n", "e", "cgroup")
    net = sb.run("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)")
    assert net.status == "failed" and "unreachable" in net.stderr
    fs = sb.run(
        "import os\nopen('/workdir/a', 'w').write('x'); open('/tmp/b', 'w').write('y')\n"
        "try:\n    open('/usr/evil', 'w')\nexcept OSError as e:\n    print('ro', e.errno)\n"
        "print(os.getuid(), sorted(os.listdir('/workdir')))"
    )
    assert fs.stdout.splitlines() == ["ro 30", "65534 ['a']"], fs  # EROFS, uid nobody
    timeout = sb.run("while True:\n    pass")
    assert timeout.status == "timeout" and timeout.exit_code is None and timeout.duration_s < 15
    bomb = sb.run("import os\nn = 0\nwhile True:\n    os.fork(); n += 1")
    assert bomb.status == "failed" and "Resource temporarily unavailable" in bomb.stderr
    memory = sb.run("x = bytearray(2 * 1024**3)\nprint('allocated')")
    assert memory.exit_code != 0 and "allocated" not in memory.stdout  # the cgroup's bound: MemoryError or OOM kill
    big = sb.run("open('/workdir/f', 'wb').write(b'x' * 3 * 1024 * 1024)")
    assert big.exit_code != 0  # 2 MB tmpfs and RLIMIT_FSIZE


def test_long_output_keeps_head_and_tail(docker_host) -> None:
    sb = make_sandbox(settings(timeout_s=10, max_output_bytes=4096))
    result = sb.run("print('head')\nprint('x' * 50000)\nprint('verdict')")
    assert result.passed and result.stdout_truncated and len(result.stdout.encode()) <= 4096
    assert result.stdout.startswith("head\n") and result.stdout.endswith("verdict\n") and "bytes cut" in result.stdout


def test_code_env_scores_the_same_under_docker_and_bubblewrap(docker_host) -> None:
    """Same code, same task: identical per-case verdicts from both backends (the sandbox changes isolation,
    never rewards)."""
    from pettingflow.envs import load_humaneval
    from pettingflow.envs.code_env.env import CodeEnv

    task = next(t for t in load_humaneval() if t["task_id"] == "HumanEval/0")
    wrong = "def has_close_elements(numbers, threshold):\n    return True\n"
    verdicts = {}
    for backend in ("docker", "bubblewrap"):
        s = SandboxSettings(backend=backend, docker_image=IMAGE, timeout_s=20)
        env = CodeEnv(task, {"sandbox": s.model_dump()}, sandbox=make_sandbox(s))
        good = asyncio.run(env.submit_code(task["prompt"] + task["canonical_solution"])).ground_truth
        bad = asyncio.run(env.submit_code(wrong)).ground_truth
        verdicts[backend] = (good.flags(), bad.flags())
    assert verdicts["docker"] == verdicts["bubblewrap"]
    assert all(verdicts["docker"][0]) and 0 < sum(verdicts["docker"][1]) < len(verdicts["docker"][1])
