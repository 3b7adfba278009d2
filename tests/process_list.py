"""Whether a secret shows in the process list, for the tests of a running stack.

A process's command line (``/proc/<pid>/cmdline``, what ``ps`` prints) is readable by every local user; its
environment (``/proc/<pid>/environ``) only by its owner and root. So PettingFlow hands its secrets (the vLLM servers'
key, Ray's token, the env service's token, the Prefect database's password) to child processes in their environment
or in a 0600 file, never as arguments; these helpers check that on the processes of a stack while it runs.

Findings name the process and the secret's index in the list given, never the secret, so a failing assertion does
not print it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

import psutil

__all__ = ["ProcessListWatch", "showing"]


def showing(secrets: Iterable[str]) -> list[str]:
    """``"<pid> <name>: secret #i"`` for every process (of any user) whose command line holds ``secrets[i]``."""
    wanted = [s for s in secrets if s]
    if not wanted:
        raise ValueError("no secret to look for")
    found = []
    for proc in psutil.process_iter(["pid", "name", "cmdline"], ad_value=None):
        argv = "\0".join(proc.info["cmdline"] or ())
        found += [f"{proc.info['pid']} {proc.info['name']}: secret #{i}" for i, s in enumerate(wanted) if s in argv]
    return found


class ProcessListWatch:
    """Scans the process list every ``interval_s`` in a thread while the ``with`` block runs (processes that live
    for a moment, like a ``psql -c`` of a start script, are seen by a sample that falls in their lifetime);
    ``found`` collects what ``showing`` reported, ``samples`` counts the scans. ``secrets``: the secrets, or a
    function returning those known so far (a run makes its key after the watch began)."""

    def __init__(self, secrets: Iterable[str] | Callable[[], Iterable[str]], interval_s: float = 0.25) -> None:
        self._secrets = secrets if callable(secrets) else (lambda s=list(secrets): s)
        self.interval_s = interval_s
        self.found: set[str] = set()
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="process-list-watch", daemon=True)

    def scan(self) -> None:
        current = [s for s in self._secrets() if s]
        if current:
            self.found.update(showing(current))
            self.samples += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            self.scan()
            self._stop.wait(self.interval_s)

    def __enter__(self) -> ProcessListWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self.scan()  # once more with every secret known by now
