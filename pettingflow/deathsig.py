"""Run a command that dies with its parent: ``python -m pettingflow.deathsig SIGNAL PARENT_PID -- CMD ...``.

Why: the update worker and the vLLM server run in their own process groups (so they can be stopped
as a whole), which also means they outlive a parent that is SIGKILLed — a crashed Prefect worker
would leave a 7 GB vLLM server or a training job writing into a step folder that the resumed run
is about to clear. Linux's PR_SET_PDEATHSIG delivers SIGNAL to this process when the thread that
started it exits; it is kept across ``exec``, so we set it here and exec the real command.

The parent's pid is passed in rather than read with ``getppid()`` here: if the parent dies while this
interpreter is still starting, ``getppid()`` already names the reaper, the death would go unnoticed and
the command would run on as an orphan (seen in CI when a worker was killed just as an update started).

Group mode (``--group GRACE_S``, ``wrap(..., group_grace_s=...)``), used for the vLLM server. PR_SET_PDEATHSIG
has two gaps there: it reaches only the command's own process, not the children it starts (vLLM's engine
core and workers, which then live on as orphans if the API server dies without stopping them: seen after
SIGTERM to ``pettingflow rollout``), and it fires when the *thread* that started the command exits, not
the process. In group mode the wrapper forks a small watcher first (detached: its own session, a
grandchild of nobody we stop or signal), then execs the command as before, so the command keeps the
wrapper's pid and process group (``start_new_session=True`` in the caller). The watcher waits on pidfds
of the parent process and the command; when the parent process is gone it sends SIGNAL and SIGCONT (a
paused server must act on it) to the command's whole process group, and SIGKILL to whatever is left of it
after GRACE_S. It exits when the group is empty. Without pidfds (Linux < 5.3) it falls back to
PR_SET_PDEATHSIG.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import sys
import time

PR_SET_PDEATHSIG = 1


def wrap(cmd: list[str], sig: signal.Signals = signal.SIGTERM, *, group_grace_s: float | None = None) -> list[str]:
    """``cmd`` prefixed so that it receives ``sig`` when the calling thread's process dies (Linux only).

    ``group_grace_s``: group mode (module docstring): when the calling *process* dies, the command's whole
    process group gets ``sig``, then SIGKILL after that many seconds. The caller must start the command
    in a new session or process group (``start_new_session=True``), or the group would be the caller's.
    """
    if not sys.platform.startswith("linux"):
        return list(cmd)
    mode = ["--group", str(group_grace_s)] if group_grace_s is not None else []
    return [sys.executable, "-m", "pettingflow.deathsig", *mode, sig.name, str(os.getpid()), "--", *cmd]


def die_with_parent(sig: signal.Signals = signal.SIGKILL) -> None:
    """Make *this* process receive ``sig`` when its parent dies (Linux; a no-op elsewhere).

    For processes we do not start ourselves, e.g. Ray actor workers (children of the raylet): a learner rank
    in the middle of a long torch computation does not notice its raylet's death for a long time.
    """
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the parent died before prctl took effect
        os.kill(os.getpid(), sig)


@contextlib.contextmanager
def terminate_gracefully(signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGHUP)):
    """While active, ``signals`` raise ``SystemExit(128 + N)`` in the main thread instead of ending the
    process on the spot, so ``with``/``finally`` blocks stop the servers and learners this process
    started (``timeout`` and process managers send SIGTERM; a closed terminal sends SIGHUP).

    Only the main thread can install handlers, and only default (SIG_DFL) handlers are replaced: a
    framework that installed its own (Prefect's engine does for SIGTERM) keeps it. The previous
    handlers are restored on exit.
    """
    import threading

    previous: dict[signal.Signals, object] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in signals:
            if signal.getsignal(sig) == signal.SIG_DFL:
                previous[sig] = signal.signal(sig, _raise_exit)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _raise_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _live_members(field: int, value: int) -> list[int]:
    """Live (not zombie) processes whose ``/proc/<pid>/stat`` field ``field`` (counted after the name: 0 state,
    2 pgrp, 3 session) is ``value``; a dead leader that nobody reaped yet (a slow init) does not count."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > field and fields[0] != b"Z" and int(fields[field]) == value:
            members.append(int(entry))
    return members


def _group_members(pgid: int) -> list[int]:
    """Live processes of process group ``pgid``, the ones killpg reaches (unlike ``killpg(pgid, 0)``, not a dead
    leader nobody reaped yet): a member that moved to a group of its own would otherwise stall the kill's wait."""
    return _live_members(2, pgid)


def session_members(sid: int) -> list[int]:
    """Live processes of session ``sid``, those that left the leader's group included (what a test of a stop
    counts: nothing the session started may outlive it)."""
    return _live_members(3, sid)


def _kill_group(pgid: int, sig: signal.Signals, grace_s: float) -> None:
    for s in (sig, signal.SIGCONT):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, s)
    deadline = time.monotonic() + grace_s
    while _group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _group_members(pgid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


def _watch(parent_fd: int, leader_fd: int, pgid: int, sig: signal.Signals, grace_s: float) -> None:
    """The watcher's loop: kill group ``pgid`` once the parent process is gone; return once it is empty."""
    poller = select.poll()
    poller.register(parent_fd, select.POLLIN)
    poller.register(leader_fd, select.POLLIN)
    leader_gone = False
    while True:
        # Once the command itself has exited, poll: what is left of its group has no pidfd to wait on.
        for fd, _ in poller.poll(500 if leader_gone else None):
            poller.unregister(fd)
            if fd == parent_fd:
                _kill_group(pgid, sig, grace_s)
                return
            leader_gone = True
        if leader_gone and not _group_members(pgid):
            return


def _fork_watcher(parent: int, sig: signal.Signals, grace_s: float) -> bool:
    """Start the detached watcher for this process's group (see the module docstring); False when pidfds
    are unavailable. Called before exec, while this interpreter has a single thread."""
    try:
        parent_fd = os.pidfd_open(parent)
        leader_fd = os.pidfd_open(os.getpid())
    except (AttributeError, OSError):
        return False
    if os.getppid() != parent:  # the pidfd may name whoever reused the pid: the parent is gone
        os.kill(os.getpid(), sig)
    pgid = os.getpgrp()
    child = os.fork()
    if child == 0:  # intermediate: detach, fork the watcher, exit (the watcher is reparented to a reaper)
        code = 0
        try:
            os.setsid()  # out of the group: neither our own kill nor the caller's stop() reaches it
            if os.fork() == 0:
                null = os.open(os.devnull, os.O_RDWR)
                for fd in (0, 1, 2):  # hold no pipe or log file open for the caller
                    os.dup2(null, fd)
                for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                    signal.signal(s, signal.SIG_IGN)
                try:
                    _watch(parent_fd, leader_fd, pgid, sig, grace_s)
                finally:
                    os._exit(0)
        except BaseException:
            code = 1
        os._exit(code)
    os.waitpid(child, 0)
    os.close(parent_fd)
    os.close(leader_fd)
    return True


def _start_time(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (``/proc/<pid>/stat`` field 22): with the pid, a process's identity."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


def local_ray_processes() -> list[int]:
    """Pids of the Ray processes this process started (a local Ray: raylet, GCS, their agents, workers).
    Empty when attached to a cluster started elsewhere."""
    import psutil

    out = []
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            text = " ".join([child.name(), *child.cmdline()])
            if child.name() in ("raylet", "gcs_server") or "ray::" in text or "/site-packages/ray/" in text:
                out.append(child.pid)
    return out


_SWEPT: set[int] = set()


def kill_with_this_process(pids: list[int]) -> None:
    """SIGKILL ``pids`` once this process is gone, whatever ends it (a detached watcher, started once per pid).

    For processes that do not die with us by themselves: Ray's dashboard and runtime-env agents outlived a
    SIGKILLed driver (and its raylet) by minutes. Each pid is checked against its start time before the kill,
    so a reused pid is never hit. After a normal exit the watcher finds them gone already (``ray.shutdown``).
    """
    if not sys.platform.startswith("linux"):
        return
    todo = [(p, t) for p in pids if p not in _SWEPT and (t := _start_time(p)) is not None]
    if not todo:
        return
    import subprocess

    subprocess.Popen(
        [sys.executable, "-m", "pettingflow.deathsig", "--sweep", str(os.getpid()), *[f"{p}:{t}" for p, t in todo]],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # not in our group: our own stop() of the group must not end the watcher
    )
    _SWEPT.update(p for p, _ in todo)


def _sweep(parent: int, targets: list[str]) -> None:
    """The sweeper's body: wait until ``parent`` is gone, then SIGKILL each ``pid:starttime`` still alive."""
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)
    try:
        fd = os.pidfd_open(parent)
        select.select([fd], [], [])
    except (AttributeError, OSError):  # no pidfds (Linux < 5.3), or the parent is gone already
        while os.path.exists(f"/proc/{parent}") and _start_time(parent) is not None:
            time.sleep(1.0)
    for target in targets:
        pid, _, started = target.partition(":")
        if _start_time(int(pid)) == started:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(pid), signal.SIGKILL)


def main(argv: list[str]) -> None:
    if argv[:1] == ["--sweep"] and len(argv) > 2:
        _sweep(int(argv[1]), argv[2:])
        return
    group_grace_s: float | None = None
    if argv[:1] == ["--group"] and len(argv) > 1:
        group_grace_s = float(argv[1])
        argv = argv[2:]
    if len(argv) < 4 or argv[2] != "--" or not argv[1].isdigit():
        raise SystemExit("usage: python -m pettingflow.deathsig [--group GRACE_S] SIGNAL PARENT_PID -- CMD [ARGS...]")
    sig = signal.Signals[argv[0]]
    if group_grace_s is not None:
        if os.getppid() != int(argv[1]):  # the parent died while this interpreter started
            os.kill(os.getpid(), sig)
        if _fork_watcher(int(argv[1]), sig, group_grace_s):
            os.execvp(argv[3], argv[3:])
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != int(argv[1]):  # the parent died before prctl took effect: act as if it just did
        os.kill(os.getpid(), sig)
    os.execvp(argv[3], argv[3:])


if __name__ == "__main__":
    main(sys.argv[1:])
