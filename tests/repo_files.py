"""The project's files as git sees them, for the checks that read every source or page (step names, vocabulary).

Why git and not a walk of the folder: the folder also holds what tests and tools put beside the code (the MLflow
test's ``.venv-mlflow/``, whose big5-encoded modules broke a walking check on CI's clean clone, caches, outputs).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def repo_files(*patterns: str) -> list[str]:
    """Paths (relative to the repository, sorted) matching git ``patterns``: tracked files and new ones git does not
    ignore, that exist (a tracked file deleted in the work tree is left out)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z", "--", *patterns],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return sorted({name for name in listed.split("\0") if name and (ROOT / name).exists()})
