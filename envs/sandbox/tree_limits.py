"""Limits on a whole sandboxed run rather than on each of its processes: memory and scratch inodes.

rlimits are per process: ten processes under a 450 MiB RLIMIT_AS held 4.5 GiB at once, and no rlimit
counts files, so 200,000 empty files in a tmpfs cost the host ~290 MB. Two ways to bound the tree:

* **cgroup v2** (:class:`RunCgroup`): where this process may create child cgroups with the memory
  controller (a delegated subtree, see :func:`find_delegated_cgroup`), each run gets its own cgroup
  with ``memory.max`` (and ``memory.swap.max = 0``, ``memory.oom.group = 1``): the kernel enforces it,
  between two polls included, and charges tmpfs pages too.
* **watchdog** (:class:`TreeWatchdog`): otherwise the supervisor polls the tree every
  ``WATCH_INTERVAL_S`` and kills it when the anonymous resident memory of all its processes together
  exceeds the bound. Best effort: a tree can overshoot for one interval (each process is still capped
  by RLIMIT_AS).

Inodes are always watched (bubblewrap cannot set tmpfs ``nr_inodes``, and mounting inside the sandbox
would need capabilities the program must not have): ``statvfs`` of each scratch mount, seen through
``/proc/<namespace init>/root``, gives the inodes in use; over the cap the tree is killed with
``killed_reason="files"``.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

#: Default cap on inodes (files, directories, links) on a run's scratch mounts together. An empty
#: file costs the host ~1.5 KB of kernel memory outside every other limit: 10,000 is ~15 MB.
DEFAULT_MAX_INODES = 10_000

_PAGE = os.sysconf("SC_PAGE_SIZE")
_CGROUP_PREFIX = "pettingflow-sandbox-"


# --------------------------------------------------------------------------------------------------
# the process tree
# --------------------------------------------------------------------------------------------------
def tree_pids(root: int) -> list[int]:
    """``root`` and all its descendants (a process that double-forks inside a pid namespace is
    reparented to the namespace's init, so it stays in the tree). Uses /proc/PID/task/TID/children
    (no scan of every host process); falls back to psutil where the kernel lacks it."""
    if not Path(f"/proc/{root}/task/{root}/children").exists():
        import psutil

        try:
            parent = psutil.Process(root)
            return [root, *(p.pid for p in parent.children(recursive=True))]
        except psutil.Error:
            return []
    seen: list[int] = []
    todo = [root]
    while todo:
        pid = todo.pop()
        seen.append(pid)
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            with contextlib.suppress(OSError, ValueError):
                todo.extend(int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split())
    return seen


def anon_rss_bytes(pid: int) -> int:
    """Anonymous resident memory of ``pid`` (statm resident - shared): what a memory hog grows, without
    the shared pages of /usr's libraries that every interpreter maps. 0 when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/statm").read_text().split()
        return max(int(fields[1]) - int(fields[2]), 0) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def tree_memory_bytes(root: int) -> int:
    return sum(anon_rss_bytes(pid) for pid in tree_pids(root))


class TreeWatchdog:
    """The supervisor's watchdog for one run: scratch inodes always, tree memory when no cgroup does it.

    ``root`` is the supervised process (bwrap); ``init_pid`` returns the sandbox's pid-namespace init
    once known (its ``/proc/PID/root`` is the sandbox's filesystem). ``memory_bytes`` ``None`` skips
    the memory check.
    """

    def __init__(
        self,
        root: int,
        *,
        init_pid: Callable[[], int | None],
        mounts: Sequence[str],
        max_inodes: int,
        memory_bytes: int | None,
    ):
        self.root = root
        self.init_pid = init_pid
        self.mounts = tuple(mounts)
        self.max_inodes = max_inodes
        self.memory_bytes = memory_bytes

    def inodes_used(self) -> int | None:
        """Inodes in use on the scratch mounts, not counting their root directories; ``None`` before
        the namespace is known or after it is gone."""
        pid = self.init_pid()
        if pid is None:
            return None
        used = 0
        for mount in self.mounts:
            try:
                st = os.statvfs(f"/proc/{pid}/root{mount}")
            except OSError:
                return None
            used += max(st.f_files - st.f_ffree - 1, 0)
        return used

    def __call__(self) -> str | None:
        used = self.inodes_used()
        if used is not None and used > self.max_inodes:
            return "files"
        if self.memory_bytes is not None and tree_memory_bytes(self.root) > self.memory_bytes:
            return "memory"
        return None


# --------------------------------------------------------------------------------------------------
# cgroup v2
# --------------------------------------------------------------------------------------------------
def _cgroup2_mount(mountinfo: str) -> Path | None:
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        if sep and right.split()[:1] == ["cgroup2"]:
            return Path(left.split()[4])
    return None


def _own_cgroup(proc_cgroup: str) -> str | None:
    for line in proc_cgroup.splitlines():
        if line.startswith("0::"):
            return line[3:].strip()
    return None


def find_delegated_cgroup(
    mountinfo: str | None = None, proc_cgroup: str | None = None, *, probe: bool = True
) -> Path | None:
    """A cgroup v2 directory in which this process may create child cgroups with the memory controller
    (``memory`` in its ``cgroup.subtree_control``, writable), or ``None``.

    Candidates are our own cgroup (only usable when it is a root: a non-root cgroup with processes
    cannot enable controllers for children) and its parent (the usual delegation: we run in a leaf,
    e.g. ``.../service/main``, of a subtree delegated to us). ``probe`` creates and removes a child to
    be sure. The arguments are the contents of /proc/self/mountinfo and /proc/self/cgroup (for tests).
    """
    try:
        mountinfo = Path("/proc/self/mountinfo").read_text() if mountinfo is None else mountinfo
        proc_cgroup = Path("/proc/self/cgroup").read_text() if proc_cgroup is None else proc_cgroup
    except OSError:
        return None
    mount, own = _cgroup2_mount(mountinfo), _own_cgroup(proc_cgroup)
    if mount is None or own is None:
        return None
    here = mount / own.lstrip("/")
    for candidate in (here, here.parent):
        if not candidate.is_relative_to(mount):
            continue
        try:
            controls = (candidate / "cgroup.subtree_control").read_text().split()
        except OSError:
            continue
        if "memory" not in controls or not os.access(candidate, os.W_OK):
            continue
        if not probe or _probe(candidate):
            return candidate
    return None


def _probe(parent: Path) -> bool:
    child = parent / f"{_CGROUP_PREFIX}probe-{uuid.uuid4().hex[:12]}"
    try:
        child.mkdir()
    except OSError:
        return False
    try:
        (child / "memory.max").write_text("max\n")
        return True
    except OSError:
        return False
    finally:
        with contextlib.suppress(OSError):
            child.rmdir()


class RunCgroup:
    """One run's cgroup under a delegated ``parent``: memory.max, no swap, the whole group OOM-killed
    together. The sandbox's first process enters it itself (``procs`` path) before exec'ing bwrap, so
    nothing it starts is ever outside; :meth:`close` kills what is left and removes the cgroup."""

    def __init__(self, parent: Path, memory_bytes: int):
        self.path = parent / f"{_CGROUP_PREFIX}{uuid.uuid4().hex[:16]}"
        self.path.mkdir()
        try:
            (self.path / "memory.max").write_text(f"{memory_bytes}\n")
            for name, value in (("memory.swap.max", "0"), ("memory.oom.group", "1")):
                if (self.path / name).exists():
                    (self.path / name).write_text(value + "\n")
        except OSError:
            self.close()
            raise

    @property
    def procs(self) -> Path:
        return self.path / "cgroup.procs"

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of this run for exceeding ``memory.max``."""
        try:
            events = dict(line.split() for line in (self.path / "memory.events").read_text().splitlines())
        except (OSError, ValueError):
            return False
        return int(events.get("oom_kill", 0)) > 0 or int(events.get("oom_group_kill", 0)) > 0

    def close(self) -> None:
        kill = self.path / "cgroup.kill"  # Linux >= 5.14
        if kill.exists():
            with contextlib.suppress(OSError):
                kill.write_text("1\n")
        for _ in range(50):  # the last processes may take a moment to be reaped
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.02)
