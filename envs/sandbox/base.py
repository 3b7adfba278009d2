"""What every sandbox backend shares: the result type, the errors, the protocol and the supervisor.

The supervisor (:func:`supervise`) is the one place where the host talks to a sandboxed process tree:
it reads stdout/stderr incrementally (keeping at most ``max_output_bytes`` of each: its head and its tail
with a marked gap between, draining and discarding the middle, so a flood never reaches host memory),
enforces the wall-clock deadline, runs the backend's watchdog (whole-run memory, scratch inodes), and calls
the backend's ``kill_tree`` when a limit is exceeded. It never interprets what the program printed as an
instruction: a sandboxed program can at worst make its own result fail,
never make the host raise, hang or skip a limit.
"""

from __future__ import annotations

import asyncio
import fcntl
import functools
import math
import os
import selectors
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from pettingflow.processes import stop_process_group

#: Seconds the supervisor waits for a killed tree to be reaped before escalating to SIGKILL of the group.
KILL_GRACE_S = 5.0
#: Seconds spent reading what is left in the pipes after a kill (the writers are dead by then).
DRAIN_GRACE_S = 1.0
#: Output past ``max_output_bytes`` is read and its middle thrown away (the result is marked truncated); only a
#: stream that exceeds this many times the cap gets the tree killed (``killed_reason="output"``). 16 x
#: the default 64 KiB is 1 MiB: a program printing a long line or a big table keeps running and is
#: judged on its exit status, while an endless flood still stops long before its deadline.
HARD_OUTPUT_FACTOR = 16
#: Seconds between two watchdog checks (memory of the tree, scratch inodes) while a program runs.
WATCH_INTERVAL_S = 0.05
_READ_CHUNK = 65536


@dataclass(frozen=True)
class ExecResult:
    """Outcome of one sandboxed program.

    ``exit_code`` is ``None`` whenever the program did not exit on its own: killed by the sandbox
    (``killed_reason`` "timeout", "output" (far past the cap), "memory" (the whole-run bound), "files"
    (the scratch inode cap)) or terminated by a signal ("cpu" for RLIMIT_CPU's SIGXCPU,
    "signal:SIGKILL", "signal:SIGSEGV", ...). ``killed_reason`` is also "memory" (with the real exit
    code, usually 1) when the interpreter died of ``MemoryError`` under the per-process limit.
    ``signal`` names the signal that ended the program ("SIGSEGV"), ``None`` after a normal exit.
    ``memory_bound`` says what bounds the memory of the whole run: "cgroup" (kernel-enforced
    ``memory.max``), "watchdog" (the supervisor sums the tree's resident memory and kills it over the
    limit) or ``None`` (per-process limit only).
    """

    exit_code: int | None
    timed_out: bool
    stdout: str
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool
    duration_s: float
    killed_reason: str | None = None
    signal: str | None = None
    memory_bound: str | None = None

    @property
    def passed(self) -> bool:
        """True only for a clean, timely exit: the one outcome a reward may treat as success."""
        return self.exit_code == 0 and not self.timed_out

    @property
    def truncated(self) -> bool:
        """Some output was dropped (more than ``max_output_bytes`` on stdout or stderr)."""
        return self.stdout_truncated or self.stderr_truncated

    @property
    def status(self) -> str:
        """One word for logs and reports: "ok", "failed" (non-zero exit), "timeout", "output",
        "memory", "files", "cpu", "file_size" or "signal" (any other signal; see ``signal``)."""
        if self.timed_out:
            return "timeout"
        if self.killed_reason:
            return "signal" if self.killed_reason.startswith("signal:") else self.killed_reason
        if self.exit_code == 0:
            return "ok"
        return "failed" if self.exit_code is not None else "signal"


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the program inside it)."""


class SandboxUnavailableError(SandboxError):
    """No safe sandbox can be built here. The message says how to fix it; nothing runs unsandboxed."""


@runtime_checkable
class Sandbox(Protocol):
    """Runs a complete Python program (``python3 -I``, cwd = a fresh work dir) under isolation and limits.

    ``run`` is thread-safe and blocks while ``max_concurrency`` programs already run; ``run_async``
    does the same without blocking the event loop.
    """

    def run(self, code: str, *, stdin: str = "", timeout_s: float | None = None) -> ExecResult: ...

    async def run_async(self, code: str, *, stdin: str = "", timeout_s: float | None = None) -> ExecResult: ...


class BoundedSandbox:
    """Concurrency bound and async bridge shared by the process-based backends.

    Why a private executor instead of ``asyncio.to_thread``: the loop's default executor also serves
    ``getaddrinfo`` for the inference client. Parking sandbox runs there would stall HTTP requests
    while programs run; a pool sized ``max_concurrency`` keeps the queue of waiting runs here.
    """

    def __init__(self, *, default_timeout_s: float, max_concurrency: int):
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self._default_timeout_s = default_timeout_s
        self._max_concurrency = max_concurrency
        self._slots = threading.BoundedSemaphore(max_concurrency)
        self._executor: ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()

    def run(self, code: str, *, stdin: str = "", timeout_s: float | None = None) -> ExecResult:
        """Run ``code`` with ``stdin``; waits for a free slot first. The deadline starts at spawn."""
        if not isinstance(code, str) or not isinstance(stdin, str):
            raise TypeError("code and stdin must be str")
        timeout = self._default_timeout_s if timeout_s is None else float(timeout_s)
        if not (timeout > 0 and math.isfinite(timeout)):
            raise ValueError(f"timeout_s must be a positive finite number, got {timeout_s!r}")
        with self._slots:
            return self._run_one(code, stdin, timeout)

    async def run_async(self, code: str, *, stdin: str = "", timeout_s: float | None = None) -> ExecResult:
        """``run`` in this sandbox's own thread pool. Cancelling the await does not stop the program
        early: it still ends at its deadline (bounded), and its result is dropped."""
        loop = asyncio.get_running_loop()
        call = functools.partial(self.run, code, stdin=stdin, timeout_s=timeout_s)
        return await loop.run_in_executor(self._get_executor(), call)

    def close(self) -> None:
        """Release the async worker threads (sync ``run`` keeps working)."""
        with self._executor_lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)

    def _get_executor(self) -> ThreadPoolExecutor:
        with self._executor_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    max_workers=self._max_concurrency, thread_name_prefix=type(self).__name__
                )
            return self._executor

    def _run_one(self, code: str, stdin: str, timeout_s: float) -> ExecResult:
        raise NotImplementedError


def sealed_memfd(name: str, data: bytes) -> int:
    """An anonymous in-memory file holding ``data``, sealed against any change, positioned at 0.

    Used to hand the program and its stdin to the sandbox: nothing touches the host filesystem, a
    file cannot deadlock like a pipe the program never reads, and the seals stop the program from
    growing it (which would use host memory outside every limit). Close-on-exec; pass it explicitly.
    """
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        seals = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


class _Capture:
    """Bytes of one stream, at most ``limit`` of them: all of it when it fits; otherwise its head, a marked
    gap and its tail, so a verdict printed last (a test harness's summary, a traceback) survives a long line of
    junk before it. ``overflow`` once more arrived than fits, ``flood`` once more than ``hard_limit`` arrived
    in all (the rest is counted, never kept)."""

    #: bytes kept for the gap's marker line; the head and the tail share the rest of the cap equally
    MARK_RESERVE = 96

    def __init__(self, limit: int, hard_limit: int):
        self.limit = limit
        self.hard_limit = hard_limit
        room = max(limit - self.MARK_RESERVE, 0)
        self.head_limit = room // 2 if room >= 2 else limit
        self.head = bytearray()
        # everything after the head, trimmed to what could still be shown: the whole rest while the stream
        # fits in ``limit``, its last ``room - head_limit`` bytes once it does not
        self.rest = bytearray()
        self.rest_limit = limit - self.head_limit
        self.tail_limit = room - self.head_limit if room >= 2 else 0
        self.seen = 0

    @property
    def overflow(self) -> bool:
        return self.seen > self.limit

    @property
    def flood(self) -> bool:
        return self.seen > self.hard_limit

    def add(self, data: bytes) -> None:
        self.seen += len(data)
        room = self.head_limit - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.rest += data[-self.rest_limit :] if self.rest_limit else b""
            if len(self.rest) > self.rest_limit:
                del self.rest[: len(self.rest) - self.rest_limit]

    def kept(self) -> bytes:
        """What the result holds: never more than ``limit`` bytes."""
        if not self.overflow:
            return bytes(self.head + self.rest)
        tail = self.rest[len(self.rest) - self.tail_limit :] if self.tail_limit else b""
        cut = self.seen - len(self.head) - len(tail)
        mark = f"\n[... {cut} bytes cut: the sandbox keeps the first and last bytes of each stream ...]\n".encode()
        return bytes(self.head) + mark[: self.limit - len(self.head) - len(tail)] + bytes(tail)

    def text(self) -> str:
        # errors="replace": a cut may split a UTF-8 sequence, and programs may print raw bytes.
        return self.kept().decode("utf-8", errors="replace")


def terminate_process_tree(proc: subprocess.Popen, kill_first: Callable[[], bool] | None = None) -> None:
    """Kill everything the sandbox started and reap ``proc``.

    ``kill_first`` is the backend's precise kill (bubblewrap: SIGKILL to the pid namespace's init,
    which makes the kernel kill every process in the namespace; docker: ``docker kill``) and returns
    whether it delivered; it is called even when ``proc`` has exited. Then ``proc`` is waited for; if it
    does not end (or there was no precise kill), ``proc``'s whole process group gets SIGKILL. ``killpg`` is
    only sent while ``proc`` is not reaped (scope "leader"), so its pgid cannot have been reused by an
    unrelated process.
    """
    steps = ((kill_first, KILL_GRACE_S),) if kill_first is not None else ()
    stop_process_group(proc, steps, scope="leader")


def supervise(
    proc: subprocess.Popen,
    *,
    started: float,
    timeout_s: float,
    max_output_bytes: int,
    kill_tree: Callable[[], None],
    side_channels: Mapping[int, Callable[[bytes], None]] | None = None,
    watchdog: Callable[[], str | None] | None = None,
    memory_bound: str | None = None,
) -> ExecResult:
    """Watch ``proc`` (stdout/stderr are pipes) until it exits, its deadline passes, it floods output
    (``HARD_OUTPUT_FACTOR`` x the cap) or the watchdog names a reason to kill it.

    ``started`` is the ``time.monotonic()`` taken just before spawning. ``kill_tree`` must kill the
    whole tree and reap ``proc``. ``side_channels`` maps extra readable fds (owned by the caller) to
    callbacks that get each chunk and ``b""`` at EOF (bubblewrap's --info-fd). ``watchdog`` is called
    every ``WATCH_INTERVAL_S`` while the program runs and returns a ``killed_reason`` ("memory",
    "files") or ``None``. ``memory_bound`` is copied into the result.
    """
    deadline = started + timeout_s
    hard = max_output_bytes * HARD_OUTPUT_FACTOR
    captures = {
        proc.stdout.fileno(): _Capture(max_output_bytes, hard),
        proc.stderr.fileno(): _Capture(max_output_bytes, hard),
    }
    out, err = captures[proc.stdout.fileno()], captures[proc.stderr.fileno()]
    callbacks = dict(side_channels or {})
    killed_reason: str | None = None

    with selectors.DefaultSelector() as sel:
        for fd in (*captures, *callbacks):
            sel.register(fd, selectors.EVENT_READ)

        def pump(timeout: float) -> None:
            for key, _ in sel.select(timeout):
                fd = key.fd
                try:
                    data = os.read(fd, _READ_CHUNK)
                except OSError:
                    data = b""
                if not data:
                    sel.unregister(fd)
                if fd in captures:
                    captures[fd].add(data)
                elif fd in callbacks:
                    callbacks[fd](data)

        tick = WATCH_INTERVAL_S if watchdog is not None else math.inf
        next_watch = time.monotonic() + tick

        def watch() -> str | None:
            nonlocal next_watch
            if watchdog is None or time.monotonic() < next_watch:
                return None
            next_watch = time.monotonic() + tick
            return watchdog()

        # Phase 1: until both output pipes close (every process holding them is gone), the deadline
        # passes, one stream floods far past its cap, or the watchdog objects.
        while any(fd in sel.get_map() for fd in captures):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                killed_reason = "timeout"
                break
            pump(min(remaining, max(next_watch - time.monotonic(), 0.0)))
            if out.flood or err.flood:
                killed_reason = "output"
                break
            if (killed_reason := watch()) is not None:
                break

        # Phase 2: output closed (the program may have closed its fds and kept running).
        while killed_reason is None:
            remaining = deadline - time.monotonic()
            try:
                proc.wait(timeout=max(min(remaining, next_watch - time.monotonic()), 0))
                break
            except subprocess.TimeoutExpired:
                killed_reason = "timeout" if remaining <= 0 else watch()

        if killed_reason is not None:
            kill_tree()
            # Keep what the dead program had already written (useful to debug a timeout).
            drain_until = time.monotonic() + DRAIN_GRACE_S
            while sel.get_map() and (left := drain_until - time.monotonic()) > 0:
                pump(left)

    duration = time.monotonic() - started
    for stream in (proc.stdout, proc.stderr):
        stream.close()
    stderr_text = err.text()
    exit_code, reason = classify_exit(proc.returncode, killed_reason, stderr_text)
    return ExecResult(
        exit_code=exit_code,
        timed_out=killed_reason == "timeout",
        stdout=out.text(),
        stderr=stderr_text,
        stdout_truncated=out.overflow,
        stderr_truncated=err.overflow,
        duration_s=duration,
        killed_reason=reason,
        signal=exit_signal(proc.returncode),
        memory_bound=memory_bound,
    )


_SIGNAL_REASONS = {signal.SIGXCPU: "cpu", signal.SIGXFSZ: "file_size"}


def classify_exit(returncode: int | None, killed_reason: str | None, stderr: str) -> tuple[int | None, str | None]:
    """Map the supervised process's status to (exit_code, killed_reason).

    Both bubblewrap and ``docker run`` report a program killed by signal N as exit status 128+N, so a
    status in 129..192 is read as a signal. A program that calls ``sys.exit(137)`` itself is therefore
    reported as killed by SIGKILL: the status alone cannot tell them apart.
    """
    if killed_reason is not None:
        return None, killed_reason
    if returncode is None:
        return None, "unknown"
    if returncode < 0:  # the supervised process itself (bwrap / docker CLI) died of a signal
        return None, f"signal:{_signal_name(-returncode)}"
    if 128 < returncode <= 128 + 64:
        signum = returncode - 128
        return None, _SIGNAL_REASONS.get(signum, f"signal:{_signal_name(signum)}")
    if returncode != 0 and _last_line(stderr).startswith("MemoryError"):
        return returncode, "memory"
    return returncode, None


def exit_signal(returncode: int | None) -> str | None:
    """The name of the signal that ended the program ("SIGSEGV"), read from the supervised process's
    status as in :func:`classify_exit` (-N, or 128+N as bwrap and ``docker run`` report it)."""
    if returncode is None or returncode == 0:
        return None
    if returncode < 0:
        return _signal_name(-returncode)
    if 128 < returncode <= 128 + 64:
        return _signal_name(returncode - 128)
    return None


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


def _last_line(text: str) -> str:
    lines = text.rstrip().splitlines()
    return lines[-1] if lines else ""
