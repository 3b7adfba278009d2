"""pettingflow.processes: a free port, and stopping a process group by escalation."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from pettingflow.processes import free_port, stop_process_group


@pytest.fixture
def start():
    """``start(code)`` runs ``code`` in its own session; the code prints the pids to check on one line once it is
    set up. Whatever a failed test leaves of those groups is SIGKILLed at teardown."""
    groups: list[int] = []

    def run(code: str) -> tuple[subprocess.Popen[str], list[int]]:
        proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True, start_new_session=True
        )
        groups.append(proc.pid)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, "the child exited before it was set up"
        return proc, [int(p) for p in line.split()]

    yield run
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


def gone(pids: list[int]) -> bool:
    """Every pid has exited (a zombie still waiting for its reaper counts as gone)."""
    _, alive = psutil.wait_procs([p for p in map(_process, pids) if p is not None], timeout=10)
    return all(_status(p) == psutil.STATUS_ZOMBIE for p in alive)


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def _status(proc: psutil.Process) -> str:
    try:
        return proc.status()
    except psutil.NoSuchProcess:
        return psutil.STATUS_ZOMBIE


# A leader and a child of it that both ignore SIGINT and SIGTERM: only SIGKILL ends them.
STUBBORN = """
    import os, signal, subprocess, sys, time
    IGNORE = "import signal\\nfor s in (signal.SIGINT, signal.SIGTERM): signal.signal(s, signal.SIG_IGN)\\n"
    exec(IGNORE)
    code = IGNORE + "import time\\nprint('ok', flush=True)\\ntime.sleep(600)"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child.stdout.readline()
    print(os.getpid(), child.pid, flush=True)
    time.sleep(600)
"""


def test_free_port_can_be_bound() -> None:
    port = free_port()
    assert 0 < port < 65536
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))


def test_a_group_ignoring_sigterm_is_killed(start) -> None:
    proc, pids = start(STUBBORN)
    report = stop_process_group(proc, ((signal.SIGINT, 0.2), (signal.SIGTERM, 0.2)), reap_timeout_s=30)
    assert report.sent == ("SIGINT", "SIGTERM", "SIGKILL") and not report.survivors
    assert proc.returncode == -signal.SIGKILL
    assert gone(pids)


def test_leader_scope_kills_the_group_when_the_leader_ignores_sigterm(start) -> None:
    proc, pids = start(STUBBORN)
    report = stop_process_group(proc, ((signal.SIGTERM, 0.2),), scope="leader", reap_timeout_s=30)
    assert report.sent == ("SIGTERM", "SIGKILL")
    assert proc.returncode == -signal.SIGKILL
    assert gone(pids)


def test_a_stopped_group_is_continued_so_it_acts_on_the_signal(start) -> None:
    """A handled SIGTERM stays pending in a SIGSTOPped process: without the SIGCONT that follows it, only
    the SIGKILL after the (long) grace would end it, and the exit code would be -9 instead of the handler's."""
    proc, pids = start(
        """
        import os, signal, sys, time
        signal.signal(signal.SIGTERM, lambda *_: os._exit(7))
        print(os.getpid(), flush=True)
        time.sleep(600)
        """
    )
    psutil.Process(proc.pid).send_signal(signal.SIGSTOP)
    while psutil.Process(proc.pid).status() != psutil.STATUS_STOPPED:  # signals are delivered asynchronously
        time.sleep(0.01)
    report = stop_process_group(proc, ((signal.SIGTERM, 60.0),), reap_timeout_s=30)
    assert report.sent == ("SIGTERM",)
    assert proc.returncode == 7
    assert gone(pids)


def test_a_stopped_group_ignoring_sigterm_still_ends(start) -> None:
    proc, pids = start(STUBBORN)
    for pid in pids:
        psutil.Process(pid).send_signal(signal.SIGSTOP)
    report = stop_process_group(proc, ((signal.SIGTERM, 0.2),), reap_timeout_s=30)
    assert report.sent == ("SIGTERM", "SIGKILL") and proc.returncode == -signal.SIGKILL
    assert gone(pids)


@pytest.mark.parametrize("reaped", [True, False])
def test_a_process_that_is_gone_is_left_alone(reaped: bool) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    if reaped:
        proc.wait()
    else:  # exited, not yet reaped: a zombie leader is not alive
        while psutil.Process(proc.pid).status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.01)
    for scope in ("group", "leader"):
        report = stop_process_group(proc, ((signal.SIGTERM, 5.0),), scope=scope)
        assert report.sent == () and not report.survivors
    assert proc.returncode == 0


def test_the_callers_own_kill_runs_first_and_even_for_an_exited_process(start) -> None:
    """The precise kill (a container, a pid namespace) targets what may outlive the process we started."""
    calls = []

    def kill_container() -> bool:
        calls.append(proc.poll())
        return True

    proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    proc.wait()
    report = stop_process_group(proc, ((kill_container, 5.0),), scope="leader")
    assert calls == [0] and report.sent == ("kill_container",)

    proc, pids = start(STUBBORN)
    # a kill that did not deliver is not recorded, and the group still gets SIGKILL
    report = stop_process_group(proc, ((lambda: False, 0.2),), scope="leader", reap_timeout_s=30)
    assert report.sent == ("SIGKILL",) and proc.returncode == -signal.SIGKILL
    assert gone(pids)
