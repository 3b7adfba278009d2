"""Fault injection for the crash tests: ``maybe_crash(point)`` SIGKILLs the process tree running a flow, once.

Why: "a crashed run resumes where it stopped" is only worth something if a crash at *every* step was tried. The
step code calls ``maybe_crash("<point>")`` at named places (one line each); it does nothing unless the process
environment asks for that point:

- ``PETTINGFLOW_CRASH_AT``: the point(s) to crash at, comma-separated (e.g. ``filtered:mid``); ``<point>@iter-<k>``
  arms a point in iteration k only (``rollouts:shard@iter-1``: the rollouts of iteration 1, also when iteration 0
  collects them ahead), for a point every iteration reaches: the call site names where it is (its step folder);
- ``PETTINGFLOW_CRASH_DIR``: where a point that fired leaves ``<point>.fired`` (default
  ``$PETTINGFLOW_STATE/faults``), so a resumed attempt that inherits the same environment does not crash again;
- ``PETTINGFLOW_CRASH_SCOPE``: ``worker`` (default): the Prefect worker this process runs under and everything
  below it (the flow run, Ray, learner ranks, sandbox actors), as a machine losing the worker would; without a
  worker above it, this process and its descendants. ``process``: this process alone (what the deathsig
  watchers must then clean up after);
- ``PETTINGFLOW_CRASH_DELAY_S``: for ``crash_soon`` (points inside a long call, ``update:mid``), seconds to wait.
- ``PETTINGFLOW_HOLD_AT``: points where ``hold`` waits (``update:before_commit``: the update trained and wrote its
  files, its marker not yet), until ``<point>.release`` appears in the same folder.

Points (docs/flows.md, "Kill matrix", generated from tests/kill_points.py): ``rollouts:shard`` (a group shard
committed, the step not), ``rollouts:mid`` (every shard committed, the step begun, nothing written),
``filtered:mid``, ``advantages:mid`` (a batch file written, the step not committed), ``update:mid`` (the learner
training), ``snapshot:mid`` (the optimizer snapshot written, not committed), ``sync:mid`` (servers synced, the step
not committed), ``baseline:mid``/``validation:mid`` (episodes run, not committed), ``report:mid``, and
``before_marker:<step>`` for every step: all files written, the marker not.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path

ENV_POINTS = "PETTINGFLOW_CRASH_AT"
ENV_DIR = "PETTINGFLOW_CRASH_DIR"
ENV_SCOPE = "PETTINGFLOW_CRASH_SCOPE"
ENV_DELAY = "PETTINGFLOW_CRASH_DELAY_S"
ENV_HOLD = "PETTINGFLOW_HOLD_AT"
WORKER_MARK = "prefect worker start"  # the command line of a Prefect worker (``prefect worker start --pool ...``)


def armed(point: str, where: str = "") -> bool:
    """Whether the environment asks for a crash at ``point`` (cheap: one environment lookup when unset); ``where``:
    the folder the call site works in, for entries that name an iteration (``point@iter-1``)."""
    return _entry(point, where) is not None


def _entry(point: str, where: str) -> str | None:
    """The entry of ``PETTINGFLOW_CRASH_AT`` that arms ``point`` in ``where``: ``point``, or ``point@iter-<k>`` when
    ``where`` lies in iteration k's folder (``.../iter-<k>/...``); None if none does."""
    wanted = os.environ.get(ENV_POINTS)
    if not wanted:
        return None
    for entry in (p.strip() for p in wanted.split(",")):
        name, _, scope = entry.partition("@")
        if name == point and (not scope or f"/{scope}/" in f"{where}/"):
            return entry
    return None


def _named(variable: str, point: str) -> bool:
    """Whether the comma-separated points in ``$variable`` include ``point``."""
    wanted = os.environ.get(variable)
    return bool(wanted) and point in (p.strip() for p in wanted.split(","))


def maybe_crash(point: str, where: str = "") -> None:
    """SIGKILL the configured scope at ``point`` (in ``where``, the call site's folder) if ``PETTINGFLOW_CRASH_AT``
    arms it there and that entry has not fired yet (its ``<entry>.fired`` file records it)."""
    entry = _entry(point, where)
    if entry is None or not _claim(entry):
        return
    _kill(entry, os.environ.get(ENV_SCOPE, "worker"))


def crash_soon(point: str, where: str = "") -> None:
    """``maybe_crash(point, where)`` after ``PETTINGFLOW_CRASH_DELAY_S`` (default 3 s), from a daemon thread: for a
    point inside a call that blocks this thread (an update running in learner ranks)."""
    if not armed(point, where):
        return
    delay = float(os.environ.get(ENV_DELAY, "3"))
    threading.Thread(
        target=lambda: (time.sleep(delay), maybe_crash(point, where)), daemon=True, name=f"crash-{point}"
    ).start()


def hold(point: str, timeout_s: float = 900.0) -> None:
    """Wait at ``point`` while ``PETTINGFLOW_HOLD_AT`` names it, until ``<point>.release`` appears in ``fired_dir()``
    or ``timeout_s`` passes.

    Why: a crash test that needs two things in flight at once (an update not yet committed while the rollouts
    of the next iteration are collected ahead) must not depend on which of them the machine's load makes
    finish first; holding one of them open makes the window certain. A no-op unless the variable is set.
    """
    if not _named(ENV_HOLD, point):
        return
    release = fired_dir() / f"{_file_name(point)}.release"
    # who holds, for the test to wait on (a folder left by an earlier crash is no sign that the hold was reached)
    held = fired_dir() / f"{_file_name(point)}.held"
    held.parent.mkdir(parents=True, exist_ok=True)
    held.write_text(json.dumps({"point": point, "pid": os.getpid(), "time": time.time()}))
    deadline = time.monotonic() + timeout_s
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.2)


def fired_dir() -> Path:
    state = Path(os.environ.get("PETTINGFLOW_STATE", Path.cwd() / ".pettingflow"))
    return Path(os.environ.get(ENV_DIR) or state / "faults")


def fired(point: str) -> dict | None:
    """What an entry of ``PETTINGFLOW_CRASH_AT`` that fired recorded (pid, time, the processes killed), or None."""
    path = fired_dir() / f"{_file_name(point)}.fired"
    with contextlib.suppress(FileNotFoundError, ValueError):
        return json.loads(path.read_text())
    return None


def _file_name(point: str) -> str:
    return point.replace("/", "_").replace(":", "_").replace("@", "_at_")


def _claim(point: str) -> bool:
    """Create ``<point>.fired`` exclusively: only the first caller (of any process) crashes at a point."""
    folder = fired_dir()
    folder.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(folder / f"{_file_name(point)}.fired", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as fh:
        json.dump({"point": point, "pid": os.getpid(), "at": time.time()}, fh)
        fh.flush()
        os.fsync(fh.fileno())
    return True


def _kill(point: str, scope: str) -> None:
    """SIGKILL the scope; this process last (it never returns)."""
    import psutil

    me = psutil.Process()
    victims: list[psutil.Process] = []
    if scope != "process":
        root = next((p for p in me.parents() if WORKER_MARK in _cmdline(p)), me)
        victims = [p for p in [root, *root.children(recursive=True)] if p.pid != me.pid]
    record = fired_dir() / f"{_file_name(point)}.fired"
    with contextlib.suppress(OSError, ValueError):  # what was killed, for the test that checks nothing survived
        info = json.loads(record.read_text())
        info["killed"] = [{"pid": p.pid, "cmdline": _cmdline(p)[:200]} for p in [*victims, me]]
        record.write_text(json.dumps(info))
    for proc in victims:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signal.SIGKILL)
    os.kill(me.pid, signal.SIGKILL)


def _cmdline(proc) -> str:
    try:
        return " ".join(proc.cmdline())
    except Exception:  # a process that ended, or that we may not read, is no worker
        return ""
