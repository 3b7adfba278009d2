"""Bubblewrap backend: unprivileged namespaces plus rlimits, no daemon; a cgroup only where delegated.

Layers, outermost first (docs/sandbox.md has the full threat model):

1. Host: if we are root, ``bwrap`` itself is started as uid/gid 65534 with no supplementary groups
   (``Popen(user=, group=, extra_groups=[])``, done in C after fork, so it is safe with threads).
   Inside the sandbox the program is therefore not root on the host either: it cannot write
   root-owned files even through a kernel bug in the mount code, and RLIMIT_NPROC applies (the kernel
   never enforces it for host uid 0). ``bwrap`` runs in its own session / process group, with a
   minimal environment and cwd ``/``.
2. ``bwrap``: new user, pid, net, ipc, uts and cgroup namespaces; uid/gid 65534 inside; no
   capabilities; no further user namespaces; ``--clearenv``; ``--new-session``; ``--die-with-parent``.
   The mount namespace holds only ``/usr`` (read-only), the /bin /lib... symlinks, a fresh ``/proc``
   and a minimal ``/dev`` (read-only), three size-capped tmpfs (``/workdir`` = cwd and HOME,
   ``/tmp``, ``/dev/shm``; each ``scratch_mb``, default 2 x max_file_mb) and the program at
   ``/program/main.py`` (read-only). Nothing from ``/etc``, HOME, ``/root``, ``/work`` or the project.
3. Launcher: a few lines of Python run first inside the namespaces, set the rlimits (CPU, address
   space, processes, file size, open files, core, memlock) and ``execv`` the program as
   ``python3 -I /program/main.py``. The limits are set there, not in a ``preexec_fn`` on the host,
   because RLIMIT_NPROC counts per (user namespace, uid): set inside the sandbox's own user namespace
   it caps this sandbox alone, so a fork bomb in one run cannot starve a concurrent one.
4. Supervisor (base.supervise): wall-clock deadline, incremental output caps, the whole-run
   watchdog (scratch inodes; tree memory unless a cgroup bounds it, see tree_limits.py), and at a
   kill SIGKILL to the namespace's init (learned from ``--info-fd``), on which the kernel kills every
   process in the pid namespace before the init can be reaped.

Before the first run, a self-check program is run through exactly this path and must prove from the
inside that it is isolated (uid != 0, no capabilities, only a loopback interface, no /etc, bwrap as
pid 1, limits applied); otherwise construction fails with SandboxUnavailableError.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Literal

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
from pettingflow.envs.sandbox.tree_limits import (
    DEFAULT_MAX_INODES,
    RunCgroup,
    TreeWatchdog,
    find_delegated_cgroup,
)

#: uid/gid the program runs as, inside the sandbox and (when we are root) on the host: "nobody".
SANDBOX_UID = 65534
SANDBOX_GID = 65534
#: The interpreter for model-written code. It must live under /usr because only /usr is bound; the
#: project's .venv (torch, transformers, ...) and its pyenv base interpreter under /root are never
#: visible inside, so programs get the plain system Python 3 standard library.
DEFAULT_PYTHON = "/usr/bin/python3"
#: RLIMIT_NOFILE inside the sandbox (SandboxSettings has no field for it).
DEFAULT_MAX_OPEN_FILES = 256
#: Size of each scratch tmpfs (/workdir, /tmp, /dev/shm) as a multiple of max_file_mb, unless
#: ``scratch_mb`` is given: large enough that one file of the maximum size still leaves room, so the
#: per-file limit (RLIMIT_FSIZE) and the total (tmpfs --size) are both meaningful.
SCRATCH_FACTOR = 2
#: --size (tmpfs caps) and --disable-userns first appeared in bubblewrap 0.8.0.
MIN_BWRAP_VERSION = (0, 8, 0)

WORKDIR = "/workdir"
PROGRAM_PATH = "/program/main.py"
#: The size-capped tmpfs mounts the program may write to; their inodes are counted together.
SCRATCH_MOUNTS = (WORKDIR, "/tmp", "/dev/shm")
_ENV = {
    "PATH": "/usr/bin:/bin",
    "LANG": "C.UTF-8",  # built into glibc >= 2.35: UTF-8 stdio without binding /usr/lib/locale or /etc
    "HOME": WORKDIR,
    "TMPDIR": "/tmp",
}
# Host top-level entries that merged-/usr distributions make symlinks into /usr. Mirrored as the same
# symlinks; on a distribution where one is a real directory it is bound read-only instead.
_USR_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")

_INSTALL_HINT = "install it with `apt-get install -y bubblewrap` (Debian/Ubuntu) or `dnf install -y bubblewrap`"
_USERNS_HINT = (
    "bubblewrap could not create namespaces. Unprivileged user namespaces must be allowed: check "
    "`sysctl user.max_user_namespaces` (> 0), `sysctl kernel.unprivileged_userns_clone=1` (older "
    "Debian), `sysctl kernel.apparmor_restrict_unprivileged_userns=0` (Ubuntu >= 23.10), and that a "
    "container runtime's seccomp profile allows unshare/clone with CLONE_NEWUSER"
)

# Runs first inside the sandbox, trusted. argv: RLIMIT_NAME=soft:hard ... then the program path.
# Limits may only go down (min with the current hard limit), so this never fails for lack of privilege.
_LAUNCHER = """\
import os, resource, sys
for spec in sys.argv[1:-1]:
    name, _, value = spec.partition("=")
    soft, hard = (int(v) for v in value.split(":"))
    res = getattr(resource, name)
    cur_hard = resource.getrlimit(res)[1]
    if cur_hard != resource.RLIM_INFINITY:
        soft, hard = min(soft, cur_hard), min(hard, cur_hard)
    resource.setrlimit(res, (soft, hard))
os.execv(sys.executable, [sys.executable, "-I", sys.argv[-1]])
"""

# Used only when a delegated cgroup bounds the run: the first process (started as our uid) enters the
# run's cgroup itself, so bwrap and everything it starts are inside from their first instruction, then
# drops to the sandbox uid (when we are root) and execs bwrap. argv: cgroup.procs uid gid bwrap-argv...
_CGROUP_ENTER = """\
import os, sys
with open(sys.argv[1], "w") as f:
    f.write("0")
uid, gid = int(sys.argv[2]), int(sys.argv[3])
if uid >= 0:
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
os.execv(sys.argv[4], sys.argv[4:])
"""

_SELF_CHECK_OK = "PETTINGFLOW-SANDBOX-SELF-CHECK-OK"
# Must pass from inside before any real program runs. Each line is a property the threat model relies on.
_SELF_CHECK = f"""\
import os, resource, socket
problems = []
if 0 in (os.getuid(), os.geteuid(), os.getgid(), os.getegid()):
    problems.append("running as uid/gid 0")
status = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines() if ":" in l)
for cap in ("CapEff", "CapPrm", "CapAmb", "CapBnd"):
    if int(status[cap].strip(), 16) != 0:
        problems.append(cap + " is not 0")
names = [n for _, n in socket.if_nameindex()]
if names != ["lo"]:
    problems.append("network interfaces visible: %r" % names)
for path in ("/etc", "/root", "/home", "/work", "/run", "/var"):
    if os.path.exists(path):
        problems.append(path + " is visible")
if b"bwrap" not in open("/proc/1/cmdline", "rb").read():
    problems.append("pid 1 is not bwrap: no private pid namespace")
if resource.getrlimit(resource.RLIMIT_NPROC)[0] == resource.RLIM_INFINITY:
    problems.append("RLIMIT_NPROC not applied")
print("{_SELF_CHECK_OK}" if not problems else "; ".join(problems))
"""


class BubblewrapSandbox(BoundedSandbox):
    """Runs programs under bubblewrap. Construction checks everything and fails with the fix."""

    def __init__(
        self,
        settings: SandboxSettings,
        *,
        bwrap: str | None = None,
        python: str = DEFAULT_PYTHON,
        max_open_files: int = DEFAULT_MAX_OPEN_FILES,
        scratch_mb: int | None = None,
        max_inodes: int = DEFAULT_MAX_INODES,
        memory_bound: Literal["auto", "cgroup", "watchdog"] = "auto",
        self_check: bool = True,
    ):
        """``max_inodes``: files, directories and links the program may have at once on its scratch
        mounts together. ``memory_bound``: how ``settings.memory_mb`` bounds the whole run (all its
        processes together): "cgroup" needs a delegated cgroup v2 subtree (raises otherwise),
        "watchdog" polls the tree's memory, "auto" takes a cgroup when one is available."""
        super().__init__(default_timeout_s=settings.timeout_s, max_concurrency=settings.max_concurrency)
        self.settings = settings
        self.bwrap = _find_bwrap(bwrap)
        self.python = _check_python(python)
        self.max_open_files = max_open_files
        # tmpfs pages are host RAM outside RLIMIT_AS: worst case per run is 3 x scratch_mb.
        self.scratch_mb = scratch_mb if scratch_mb is not None else SCRATCH_FACTOR * settings.max_file_mb
        if self.scratch_mb < 1:
            raise ValueError(f"scratch_mb must be >= 1, got {scratch_mb}")
        if max_inodes < 1:
            raise ValueError(f"max_inodes must be >= 1, got {max_inodes}")
        self.max_inodes = max_inodes
        if memory_bound not in ("auto", "cgroup", "watchdog"):
            raise ValueError(f"memory_bound must be 'auto', 'cgroup' or 'watchdog', got {memory_bound!r}")
        self.cgroup_parent = None if memory_bound == "watchdog" else find_delegated_cgroup()
        if memory_bound == "cgroup" and self.cgroup_parent is None:
            raise SandboxUnavailableError(
                "memory_bound='cgroup' needs a cgroup v2 subtree delegated to this process (memory in the "
                "cgroup.subtree_control of our cgroup or its parent, writable); none was found. Run under "
                "`systemd-run --user -p Delegate=yes` (moving this process into a leaf cgroup) or use "
                "memory_bound='watchdog'"
            )
        #: What bounds the memory of a whole run: "cgroup" or "watchdog" (also in every ExecResult).
        self.memory_bound = "cgroup" if self.cgroup_parent is not None else "watchdog"
        # Drop to "nobody" before bwrap starts only when we can; a non-root caller is already unprivileged.
        self._host_ids = (SANDBOX_UID, SANDBOX_GID) if os.geteuid() == 0 else None
        if self_check:
            self._self_check()

    # ------------------------------------------------------------------------------------------
    # command line
    # ------------------------------------------------------------------------------------------
    def rlimits(self) -> dict[str, tuple[int, int]]:
        """The limits the launcher sets inside the sandbox, as RLIMIT name -> (soft, hard)."""
        s = self.settings
        mib = 1024 * 1024
        return {
            # SIGXCPU at the soft limit, SIGKILL one second later if the program ignores it.
            "RLIMIT_CPU": (s.cpu_time_s, s.cpu_time_s + 1),
            "RLIMIT_AS": (s.memory_mb * mib, s.memory_mb * mib),
            # Counts tasks (processes and threads) of the sandbox uid in this sandbox's user namespace,
            # including bwrap's init and the program itself.
            "RLIMIT_NPROC": (s.max_processes, s.max_processes),
            "RLIMIT_FSIZE": (s.max_file_mb * mib, s.max_file_mb * mib),
            "RLIMIT_NOFILE": (self.max_open_files, self.max_open_files),
            "RLIMIT_CORE": (0, 0),
            "RLIMIT_MEMLOCK": (0, 0),
        }

    def command(self, program_fd: int, info_fd: int) -> list[str]:
        """The full bwrap argv for one run; ``program_fd`` holds the program, ``info_fd`` gets bwrap's info."""
        tmpfs_bytes = str(self.scratch_mb * 1024 * 1024)
        argv = [
            self.bwrap,
            # namespaces: --unshare-all = user(try), ipc, pid, net, uts, cgroup(try); user made mandatory
            "--unshare-all",
            "--unshare-user",
            "--disable-userns",
            "--uid",
            str(SANDBOX_UID),
            "--gid",
            str(SANDBOX_GID),
            "--cap-drop",
            "ALL",
            "--hostname",
            "sandbox",
            "--die-with-parent",
            "--new-session",  # setsid: no TIOCSTI injection into a terminal we might have
            "--clearenv",
        ]
        for key, value in _ENV.items():
            argv += ["--setenv", key, value]
        argv += ["--ro-bind", "/usr", "/usr"]
        for name in _USR_LINKS:
            host = Path("/", name)
            if host.is_symlink():
                argv += ["--symlink", os.readlink(host), str(host)]
            elif host.is_dir():
                argv += ["--ro-bind", str(host), str(host)]
        argv += [
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--perms",
            "0700",
            "--size",
            tmpfs_bytes,
            "--tmpfs",
            "/dev/shm",
            # bwrap's /dev is itself an uncapped tmpfs writable by the sandbox uid: make it read-only
            # (not recursive, so /dev/shm above stays writable and capped).
            "--remount-ro",
            "/dev",
            "--perms",
            "0700",
            "--size",
            tmpfs_bytes,
            "--tmpfs",
            WORKDIR,
            "--perms",
            "0700",
            "--size",
            tmpfs_bytes,
            "--tmpfs",
            "/tmp",
            "--ro-bind-data",
            str(program_fd),
            PROGRAM_PATH,
            "--remount-ro",
            "/",
            "--chdir",
            WORKDIR,
            "--info-fd",
            str(info_fd),
            "--",
            self.python,
            "-I",
            "-S",
            "-c",
            _LAUNCHER,
            *(f"{name}={soft}:{hard}" for name, (soft, hard) in self.rlimits().items()),
            PROGRAM_PATH,
        ]
        return argv

    # ------------------------------------------------------------------------------------------
    # running
    # ------------------------------------------------------------------------------------------
    def _run_one(self, code: str, stdin: str, timeout_s: float) -> ExecResult:
        program_fd = stdin_fd = info_r = info_w = -1
        cgroup: RunCgroup | None = None
        feeder: _StdinFeeder | None = None
        try:
            program_fd = sealed_memfd("program", code.encode("utf-8"))
            # stdin is a pipe, not a file: a program that reads it to the end (the code env's judge) leaves
            # nothing behind for a process that reopens it later through /proc/1/fd/0 (bwrap's init holds it)
            stdin_fd, stdin_w = os.pipe()
            feeder = _StdinFeeder(stdin_w, stdin.encode("utf-8"))
            info_r, info_w = os.pipe()
            memory_bytes = self.settings.memory_mb * 1024 * 1024
            argv, ids = self.command(program_fd, info_w), self._popen_ids()
            if self.cgroup_parent is not None:
                try:
                    cgroup = RunCgroup(self.cgroup_parent, memory_bytes)
                except OSError as exc:
                    raise SandboxError(f"could not create a cgroup under {self.cgroup_parent}: {exc}") from exc
                uid, gid = self._host_ids or (-1, -1)
                argv = [self.python, "-I", "-S", "-c", _CGROUP_ENTER, str(cgroup.procs), str(uid), str(gid), *argv]
                ids = {}
            started = time.monotonic()
            try:
                proc = subprocess.Popen(
                    argv,
                    stdin=stdin_fd,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    pass_fds=(program_fd, info_w),
                    cwd="/",
                    env={"PATH": "/usr/bin:/bin"},  # bwrap never sees our secrets either
                    start_new_session=True,
                    **ids,
                )
            except OSError as exc:
                raise SandboxError(f"could not start {self.bwrap}: {exc}") from exc
            for fd in (program_fd, stdin_fd, info_w):  # the child holds its copies
                os.close(fd)
            program_fd = stdin_fd = info_w = -1
            feeder.start()
            init = _NamespaceInit(proc)
            watchdog = TreeWatchdog(
                proc.pid,
                init_pid=init.pid,
                mounts=SCRATCH_MOUNTS,
                max_inodes=self.max_inodes,
                memory_bytes=None if cgroup is not None else memory_bytes,
            )
            try:
                result = supervise(
                    proc,
                    started=started,
                    timeout_s=timeout_s,
                    max_output_bytes=self.settings.max_output_bytes,
                    kill_tree=lambda: terminate_process_tree(proc, init.kill),
                    side_channels={info_r: init.feed},
                    watchdog=watchdog,
                    memory_bound=self.memory_bound,
                )
            except BaseException:  # a bug or KeyboardInterrupt here must not leave the program running
                if proc.returncode is None:
                    terminate_process_tree(proc, init.kill)
                raise
            finally:
                init.close()
            if cgroup is not None and not result.timed_out and cgroup.oom_killed():
                result = replace(result, exit_code=None, killed_reason="memory")
            return result
        finally:
            if feeder is not None:
                feeder.close()
            if cgroup is not None:
                cgroup.close()
            for fd in (program_fd, stdin_fd, info_r, info_w):
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(fd)

    def _popen_ids(self) -> dict:
        if self._host_ids is None:
            return {}
        uid, gid = self._host_ids
        return {"user": uid, "group": gid, "extra_groups": []}

    def _self_check(self) -> None:
        try:
            result = self._run_one(_SELF_CHECK, "", max(self.settings.timeout_s, 10.0))
        except SandboxError as exc:
            raise SandboxUnavailableError(f"bubblewrap self-check could not start: {exc}") from exc
        if result.exit_code == 0 and result.stdout.strip() == _SELF_CHECK_OK:
            return
        detail = (result.stdout.strip() + "\n" + result.stderr.strip()).strip()
        bwrap_errors = [line for line in result.stderr.splitlines() if line.startswith("bwrap:")]
        if bwrap_errors and any(k in e for e in bwrap_errors for k in ("namespace", "uid map", "not permitted")):
            hint = _USERNS_HINT
        elif bwrap_errors:
            hint = "bubblewrap could not set up the sandbox (see its error above)"
        else:
            hint = "the sandbox did not isolate the program as required; refusing to run model-written code"
        raise SandboxUnavailableError(
            f"bubblewrap self-check failed ({self.bwrap}, exit {result.exit_code}, "
            f"killed_reason={result.killed_reason}): {detail or '(no output)'}. {hint}"
        )


class _StdinFeeder:
    """Writes a run's stdin into a pipe from a thread, so a program that never reads it cannot block us: the
    write ends with EPIPE when the program exits, and ``close`` waits for the thread and closes the pipe."""

    def __init__(self, fd: int, data: bytes):
        self._fd = fd
        self._data = data
        self._thread = threading.Thread(target=self._feed, name="sandbox-stdin", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _feed(self) -> None:
        try:
            view = memoryview(self._data)
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError:
            pass  # the program exited (or was killed) without reading everything
        finally:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1

    def close(self) -> None:
        if self._thread.ident is not None:  # started: it closes the pipe itself
            self._thread.join()
        elif self._fd >= 0:  # never started: an error before the program ran
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1


class _NamespaceInit:
    """Tracks the sandbox's pid-namespace init from bwrap's ``--info-fd`` JSON and kills it precisely.

    SIGKILL to a pid namespace's init makes the kernel SIGKILL every process in that namespace (and
    its descendants' namespaces) before the init can be reaped; bwrap then exits, so when
    ``terminate_process_tree`` has reaped bwrap the whole tree is gone. A pidfd pins the process, and
    its parent is checked to be our bwrap, so a recycled pid is never signalled.
    """

    def __init__(self, proc: subprocess.Popen):
        self._proc = proc
        self._buf = b""
        self._pidfd: int | None = None
        self._pid: int | None = None
        self._done = False

    def pid(self) -> int | None:
        """The init's host pid while it is pinned (known and not yet killed by us), else ``None``."""
        return self._pid if self._pidfd is not None else None

    def feed(self, data: bytes) -> None:
        if self._done:
            return
        if not data:
            self._done = True
            return
        self._buf += data
        try:
            info = json.loads(self._buf)
        except ValueError:
            return  # partial JSON, wait for more
        self._done = True
        pid = info.get("child-pid") if isinstance(info, dict) else None
        if not isinstance(pid, int) or pid <= 0:
            return
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            return
        if _parent_pid(pid) == self._proc.pid:
            self._pidfd, self._pid = pidfd, pid
        else:
            os.close(pidfd)

    def kill(self) -> bool:
        """SIGKILL the namespace init; False when it is unknown (the caller then kills bwrap's group)."""
        if self._pidfd is None:
            return False
        try:
            signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            return True
        except ProcessLookupError:
            return False
        finally:
            os.close(self._pidfd)
            self._pidfd = None

    def close(self) -> None:
        if self._pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(self._pidfd)
            self._pidfd = None


def _parent_pid(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("PPid:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def _find_bwrap(explicit: str | None) -> str:
    path = explicit or shutil.which("bwrap")
    if not path or not os.access(path, os.X_OK):
        where = f"{explicit} is not an executable" if explicit else "`bwrap` was not found on PATH"
        raise SandboxUnavailableError(
            f"bubblewrap sandbox unavailable: {where}; {_INSTALL_HINT}. "
            "Model-written code is never run without a sandbox."
        )
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SandboxUnavailableError(f"`{path} --version` failed: {exc}; {_INSTALL_HINT}") from exc
    match = re.search(r"(\d+)\.(\d+)\.(\d+)", out)
    version = tuple(int(x) for x in match.groups()) if match else None
    if version is None or version < MIN_BWRAP_VERSION:
        need = ".".join(map(str, MIN_BWRAP_VERSION))
        raise SandboxUnavailableError(
            f"bubblewrap >= {need} is required (for tmpfs --size and --disable-userns), "
            f"`{path} --version` said {out.strip()!r}; upgrade the bubblewrap package"
        )
    return path


def _check_python(python: str) -> str:
    real = os.path.realpath(python)
    if not os.access(real, os.X_OK):
        raise SandboxUnavailableError(
            f"sandbox interpreter {python} not found; install the system Python with `apt-get install -y python3`"
        )
    if not real.startswith("/usr/"):
        raise SandboxUnavailableError(
            f"sandbox interpreter {python} resolves to {real}, outside /usr: only /usr is visible in the "
            "sandbox. Use the system interpreter (/usr/bin/python3), not a virtualenv or pyenv one"
        )
    return python
