"""Docker backend: one throw-away container per program, for machines with a Docker engine.

Differences from bubblewrap (docs/sandbox.md): memory and process limits are cgroup limits on the
whole container (``--memory``, ``--pids-limit``), not per-process rlimits; the inode cap is the tmpfs
``nr_inodes`` option (creating one file too many fails with ENOSPC instead of killing the run); the filesystem is the
image's (read-only), not the host's /usr; the engine daemon runs as root, so a container escape is
worse than a bubblewrap escape, and whoever can talk to the engine is root-equivalent on that host.

The program and its stdin travel together over the container's stdin (a sealed memfd on our side):
``--read-only`` forbids copying a file in before start, and a ``-c`` argument is capped at 128 KiB.
A bootstrap reads exactly the program's length from fd 0, writes it to ``/program/main.py`` on a
tmpfs and ``execv``s ``python3 -I`` on it; the rest of fd 0 is the program's stdin, untouched.

The container is driven with the ``docker`` CLI (so output streams through pipes into the same
incremental, capped supervisor as bubblewrap, and ``--log-driver none`` keeps a flood off the
engine's disk); ``docker.from_env().ping()`` decides availability. Both use DOCKER_HOST; a CLI
``docker context`` pointing elsewhere would make them disagree.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid

from pettingflow.configs.settings import SandboxSettings
from pettingflow.envs.sandbox.base import (
    BoundedSandbox,
    ExecResult,
    SandboxError,
    SandboxUnavailableError,
    sealed_memfd,
    supervise,
    terminate_process_tree,
)
from pettingflow.envs.sandbox.tree_limits import DEFAULT_MAX_INODES

SANDBOX_USER = "65534:65534"
WORKDIR = "/workdir"
_NAME_PREFIX = "pettingflow-sandbox-"
_FIX = (
    "Start a Docker engine (dockerd) and make it reachable (DOCKER_HOST or /var/run/docker.sock), "
    "or set env.sandbox.backend: bubblewrap"
)

# Trusted bootstrap. argv[1] = program length in bytes. Reads exactly that many bytes so the
# program's own stdin stays in fd 0.
_BOOTSTRAP = """\
import os, sys
n = int(sys.argv[1]); buf = bytearray()
while len(buf) < n:
    chunk = os.read(0, n - len(buf))
    if not chunk:
        sys.exit("sandbox bootstrap: program truncated")
    buf += chunk
with open("/program/main.py", "wb") as f:
    f.write(buf)
os.chdir("/workdir")
os.execv(sys.executable, [sys.executable, "-I", "/program/main.py"])
"""


class DockerSandbox(BoundedSandbox):
    """Runs each program in ``docker run --rm`` with no network, no capabilities and cgroup limits."""

    #: The container's cgroup bounds the memory of the whole run.
    memory_bound = "cgroup"

    def __init__(
        self,
        settings: SandboxSettings,
        *,
        docker_cli: str | None = None,
        max_open_files: int = 256,
        max_inodes: int = DEFAULT_MAX_INODES,
    ):
        super().__init__(default_timeout_s=settings.timeout_s, max_concurrency=settings.max_concurrency)
        self.settings = settings
        self.max_open_files = max_open_files
        self.max_inodes = max_inodes
        _ping_engine(settings.docker_image)
        cli = docker_cli or shutil.which("docker")
        if not cli:
            raise SandboxUnavailableError(
                "Docker engine answers but the `docker` CLI is not on PATH; install the docker CLI "
                "(apt-get install -y docker-ce-cli or docker.io)"
            )
        self.docker_cli = cli

    def command(self, name: str, program_len: int) -> list[str]:
        """The ``docker run`` argv for one program of ``program_len`` bytes in container ``name``."""
        return docker_run_argv(
            self.settings,
            docker_cli=self.docker_cli,
            name=name,
            program_len=program_len,
            max_open_files=self.max_open_files,
            max_inodes=self.max_inodes,
        )

    def _run_one(self, code: str, stdin: str, timeout_s: float) -> ExecResult:
        program = code.encode("utf-8")
        payload_fd = sealed_memfd("payload", program + stdin.encode("utf-8"))
        name = _NAME_PREFIX + uuid.uuid4().hex[:16]
        try:
            started = time.monotonic()
            try:
                proc = subprocess.Popen(
                    self.command(name, len(program)),
                    stdin=payload_fd,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                )
            except OSError as exc:
                raise SandboxError(f"could not start {self.docker_cli}: {exc}") from exc
        finally:
            os.close(payload_fd)  # the CLI holds its own copy

        def kill_container() -> bool:
            # Killing the CLI would leave the container running: the engine must kill it.
            done = subprocess.run(
                [self.docker_cli, "kill", name], capture_output=True, timeout=30, check=False
            ).returncode
            return done == 0

        try:
            return supervise(
                proc,
                started=started,
                timeout_s=timeout_s,
                max_output_bytes=self.settings.max_output_bytes,
                kill_tree=lambda: terminate_process_tree(proc, kill_container),
                memory_bound=self.memory_bound,
            )
        except BaseException:  # never leave a container running behind an exception
            if proc.returncode is None:
                terminate_process_tree(proc, kill_container)
            raise


def docker_run_argv(
    settings: SandboxSettings,
    *,
    docker_cli: str,
    name: str,
    program_len: int,
    max_open_files: int = 256,
    max_inodes: int = DEFAULT_MAX_INODES,
) -> list[str]:
    """``docker run`` argv: no network, read-only rootfs, no capabilities, uid 65534, cgroup limits,
    size- and inode-capped tmpfs work dir, no log driver, never pulls. Pure function, so it is unit-tested."""
    s = settings
    tmpfs = f"rw,nosuid,nodev,size={s.max_file_mb}m,nr_inodes={max_inodes},mode=1777"
    return [
        docker_cli,
        "run",
        "--rm",
        "-i",
        "--name",
        name,
        "--pull",
        "never",
        "--network",
        "none",
        "--read-only",
        "--cap-drop",
        "ALL",
        "--security-opt",
        "no-new-privileges",
        "--user",
        SANDBOX_USER,
        "--memory",
        f"{s.memory_mb}m",
        "--memory-swap",
        f"{s.memory_mb}m",
        "--pids-limit",
        str(s.max_processes),
        "--ulimit",
        f"cpu={s.cpu_time_s}:{s.cpu_time_s + 1}",
        "--ulimit",
        f"fsize={s.max_file_mb * 1024 * 1024}",
        "--ulimit",
        f"nofile={max_open_files}",
        "--ulimit",
        "core=0",
        "--tmpfs",
        f"{WORKDIR}:{tmpfs}",
        "--tmpfs",
        f"/tmp:{tmpfs}",
        "--tmpfs",
        f"/program:rw,nosuid,nodev,size={max(1, program_len // (1024 * 1024) + 1)}m,mode=1777",
        # no --workdir: on a real engine (docker.io 20.10) it leaves the tmpfs at WORKDIR owned by root, mode 755,
        # so uid 65534 cannot write there; the bootstrap changes into it instead
        "--log-driver",
        "none",
        "--env",
        f"HOME={WORKDIR}",
        "--env",
        "LANG=C.UTF-8",
        s.docker_image,
        "python3",
        "-I",
        "-S",
        "-c",
        _BOOTSTRAP,
        str(program_len),
    ]


def _ping_engine(image: str) -> None:
    """Raise SandboxUnavailableError unless an engine answers and ``image`` is present locally."""
    try:
        import docker
    except ImportError as exc:
        raise SandboxUnavailableError(
            f"Docker backend needs the `docker` Python package (pip install docker); {_FIX}"
        ) from exc
    try:
        client = docker.from_env(timeout=5)
        client.ping()
    except Exception as exc:
        raise SandboxUnavailableError(f"Docker backend selected but no Docker engine answered ({exc}). {_FIX}") from exc
    try:
        client.images.get(image)
    except docker.errors.ImageNotFound as exc:
        raise SandboxUnavailableError(
            f"Docker image {image} is not present on the engine and sandboxes never pull; run `docker pull {image}`"
        ) from exc
    except Exception as exc:
        raise SandboxUnavailableError(f"Docker engine answered but could not inspect image {image}: {exc}") from exc
    finally:
        client.close()
