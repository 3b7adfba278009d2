"""Run a command that dies with its parent: ``python -m pettingflow.deathsig SIGNAL PARENT_PID -- CMD ...``.

Why: the update worker and the vLLM server run in their own process groups (so they can be stopped
as a whole), which also means they outlive a parent that is SIGKILLed — a crashed Prefect worker
would leave a 7 GB vLLM server or a training job writing into a step folder that the resumed run
is about to clear. Linux's PR_SET_PDEATHSIG delivers SIGNAL to this process when the thread that
started it exits; it is kept across ``exec``, so we set it here and exec the real command.

The parent's pid is passed in rather than read with ``getppid()`` here: if the parent dies while this
interpreter is still starting, ``getppid()`` already names the reaper, the death would go unnoticed and
the command would run on as an orphan (seen in CI when a worker was killed just as an update started).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def wrap(cmd: list[str], sig: signal.Signals = signal.SIGTERM) -> list[str]:
    """``cmd`` prefixed so that it receives ``sig`` when the calling thread's process dies (Linux only)."""
    if not sys.platform.startswith("linux"):
        return list(cmd)
    return [sys.executable, "-m", "pettingflow.deathsig", sig.name, str(os.getpid()), "--", *cmd]


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


def main(argv: list[str]) -> None:
    if len(argv) < 4 or argv[2] != "--" or not argv[1].isdigit():
        raise SystemExit("usage: python -m pettingflow.deathsig SIGNAL PARENT_PID -- CMD [ARGS...]")
    sig = signal.Signals[argv[0]]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != int(argv[1]):  # the parent died before prctl took effect: act as if it just did
        os.kill(os.getpid(), sig)
    os.execvp(argv[3], argv[3:])


if __name__ == "__main__":
    main(sys.argv[1:])
