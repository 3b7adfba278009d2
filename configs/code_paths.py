"""Your own packages on the import path of every process of a run (``run.code_paths``).

Why: a config or a task row may name classes by import path (``mygame.env:GuessEnv``) from a package that is
not installed. Every process of a run imports them: the flow process (whether ``pettingflow train`` started
it or a Prefect process worker did), Ray rollout actors, an env service, and what those start. Exporting
``PYTHONPATH`` by hand for the worker, then for every Ray node, is easy to get half right: the run then fails
mid-rollout in an actor. So the folders are part of the config: every config passes through
``configs.loader.validate_config``, which activates them in the process that reads it; a Ray rollout actor
activates them again from the config it is given (it is not started from the driver's environment on an
attached cluster); and ``PYTHONPATH`` is extended too, so child processes inherit them.

The folders must exist at the same path wherever the run's processes run (as the policies' model folders
must); on a cluster of several machines, put the package on a shared file system or install it on each node.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path


def absolute_code_paths(paths: Sequence[str]) -> list[str]:
    """The folders as absolute paths (relative ones: to the working directory), without duplicates.

    Stored absolute in the run's config, so a resume or a Prefect worker started elsewhere finds the same
    folders."""
    out: list[str] = []
    for raw in paths:
        if not isinstance(raw, str) or not raw.strip():
            raise ValueError(f"a code path must be a non-empty folder path, got {raw!r}")
        path = str(Path(raw).expanduser().absolute())
        if path not in out:
            out.append(path)
    return out


def activate_code_paths(paths: Sequence[str]) -> list[str]:
    """Put the folders first on ``sys.path`` and on ``PYTHONPATH`` (for child processes); idempotent.

    Returns the folders that do not exist here, and then changes nothing: the caller says so (an import of a
    class from them would fail later with a plain ModuleNotFoundError otherwise)."""
    missing = [p for p in paths if not os.path.isdir(p)]
    if missing:
        return missing
    for path in reversed(paths):
        if path not in sys.path:
            sys.path.insert(0, path)
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join([*[p for p in paths if p not in inherited], *inherited])
    if paths:
        importlib.invalidate_caches()  # a folder created after the first import of this process is seen
    return missing
