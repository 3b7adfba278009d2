"""What a parent does with the programs it starts while it is alive: pick a free port, stop a process group.

Which module for what:

- ``pettingflow.processes`` (this one): the parent is running and in charge. ``free_port`` finds a port for a
  child to listen on; ``stop_process_group`` ends a child and everything it started, in order (a signal, a
  grace period, the next signal, SIGKILL at the end) and reaps it. Used by the vLLM server's ``stop()``, the
  one-shot update worker and the sandbox backends.
- ``pettingflow.deathsig``: the parent is *gone* (SIGKILLed, crashed). A command that dies with its parent
  (PR_SET_PDEATHSIG, or group mode's detached watcher) and Ray processes swept after this process ends.

Both expect the child to run in its own session (``subprocess.Popen(..., start_new_session=True)``), so its
pid is its process group id and a signal to the group never reaches the parent.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

log = logging.getLogger(__name__)

#: One step of an escalation: a signal for the whole group, or a caller's own kill (``docker kill``, SIGKILL
#: to a pid namespace's init) that returns whether it delivered.
Step = signal.Signals | Callable[[], bool]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (the OS picks it; another process could still take it
    before the child binds it, so a caller that can should retry on "address already in use")."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class StopReport:
    """What ``stop_process_group`` had to do."""

    #: The steps taken, in order: signal names (``"SIGTERM"``, ``"SIGKILL"``), a caller's kill by its
    #: function name when it delivered. Empty when the process was gone already.
    sent: tuple[str, ...]
    #: Something was still alive after SIGKILL and the waits (a process in uninterruptible sleep, or zombies
    #: of the group that their new parent has not reaped yet).
    survivors: bool
    seconds: float


def stop_process_group(
    proc: subprocess.Popen,
    steps: Sequence[tuple[Step, float]] = ((signal.SIGTERM, 5.0),),
    *,
    scope: Literal["group", "leader"] = "group",
    kill_grace_s: float = 5.0,
    reap_timeout_s: float | None = None,
    logger: logging.Logger | None = None,
    name: str = "process group",
) -> StopReport:
    """End ``proc`` (started with ``start_new_session=True``) and its process group, escalating to SIGKILL.

    Each step of ``steps`` is done in turn, then up to its grace seconds are given for the process to end:

    - a signal goes to the whole group, followed by SIGCONT: a stopped process (``inference.between_updates:
      pause`` SIGSTOPs the servers) would otherwise keep a handled SIGINT/SIGTERM pending until SIGKILL. A
      signal step is skipped once the process is gone.
    - a callable (the backend's precise kill) is always called, even when ``proc`` has exited: what it kills
      (a container, a pid namespace) can outlive the process we started. Its grace is skipped when it returns
      False or raises.

    If the process is still alive after the steps, the group gets SIGKILL and ``kill_grace_s`` to go away;
    then ``proc`` is reaped (``reap_timeout_s``; None: wait until it is).

    ``scope`` says what "alive" means. ``"group"``: any member of the group, the leader included until it is
    reaped (the vLLM server's engine core and workers must go too). ``"leader"``: ``proc`` itself, so the
    group is only signalled while ``proc`` is not reaped and its pgid cannot belong to anybody else yet.

    With a ``logger``, the escalations are warnings and the outcome is logged under ``name``; otherwise only
    debug lines (sandboxes stop their programs all the time).
    """
    out = logger or log
    say = out.warning if logger is not None else out.debug
    pgid = proc.pid  # start_new_session=True: the leader's pid is the group id
    started = time.monotonic()
    sent: list[str] = []
    for action, grace in steps:
        if isinstance(action, signal.Signals):
            if not _alive(proc, pgid, scope):
                break
            _signal_group(pgid, action)
            if action != signal.SIGKILL:
                _signal_group(pgid, signal.SIGCONT)
            sent.append(action.name)
        else:
            try:
                delivered = bool(action())
            except Exception:
                delivered = False
            if not delivered:
                continue
            sent.append(getattr(action, "__name__", "kill"))
        _wait_gone(proc, pgid, scope, grace)
        if _alive(proc, pgid, scope):
            say("%s (pid %d) still running %.0f s after %s; escalating", name, pgid, grace, sent[-1])
    if _alive(proc, pgid, scope):
        _signal_group(pgid, signal.SIGKILL)
        sent.append("SIGKILL")
        _wait_gone(proc, pgid, scope, kill_grace_s)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=reap_timeout_s)
    report = StopReport(tuple(sent), _alive(proc, pgid, scope), time.monotonic() - started)
    if report.survivors:
        out.error("processes of %s %d survived SIGKILL (zombies not reaped by init?)", name, pgid)
    else:
        (out.info if logger is not None else out.debug)("%s (pid %d) stopped in %.1f s", name, pgid, report.seconds)
    return report


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _alive(proc: subprocess.Popen, pgid: int, scope: str) -> bool:
    running = proc.poll() is None  # reaps the leader, so that a zombie leader does not count
    if scope == "leader" or running:
        return running
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member we may not signal is still a member
        return True
    return True


def _wait_gone(proc: subprocess.Popen, pgid: int, scope: str, grace_s: float) -> None:
    if scope == "leader":
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and _alive(proc, pgid, scope):
        time.sleep(0.1)
