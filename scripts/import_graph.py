"""The project's folder-level import graph, read from the code (``ast``, lazy imports included).

    .venv/bin/python scripts/import_graph.py          # prints "folder: imports" for docs/architecture.md

Each top-level folder installs as ``pettingflow.<folder>`` (pyproject.toml); the modules directly in
``pettingflow/`` (paths, hardware, allocator, deathsig, faults, cli) count as the folder ``pettingflow``.
``tests/test_architecture.py`` checks that the "imports from" column of docs/architecture.md's folder
map equals this graph, so the page cannot drift from the code.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = (
    "pettingflow",
    "flows",
    "tasks",
    "steps",
    "runs",
    "analysis",
    "rollout",
    "training",
    "inference",
    "agents",
    "envs",
    "rl",
    "storage",
    "configs",
)


def _target(module: str) -> str | None:
    """The folder a ``pettingflow.*`` module name lives in, or None for a third-party module."""
    parts = module.split(".")
    if parts[0] != "pettingflow":
        return None
    if len(parts) > 1 and parts[1] in FOLDERS[1:]:
        return parts[1]
    return "pettingflow"


def imported_folders(path: Path) -> set[str]:
    """Project folders one file imports (``import pettingflow.x``, ``from pettingflow.x import y``, and
    ``from pettingflow import x`` where x is a folder)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(t for a in node.names if (t := _target(a.name)))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "pettingflow":
                out.update(a.name if a.name in FOLDERS[1:] else "pettingflow" for a in node.names)
            elif t := _target(node.module):
                out.add(t)
    return out


def folder_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """``{folder: folders it imports}`` (itself excluded) for every project folder."""
    graph: dict[str, set[str]] = {}
    for folder in FOLDERS:
        deps: set[str] = set()
        for path in sorted((root / folder).rglob("*.py")):
            deps |= imported_folders(path)
        deps.discard(folder)
        if folder == "pettingflow":  # the CLI imports everything; list what the helper modules need
            deps = set()
            for path in sorted((root / folder).glob("*.py")):
                if path.name != "cli.py":
                    deps |= imported_folders(path) - {"pettingflow"}
        graph[folder] = deps
    return graph


def main() -> int:
    for folder, deps in folder_graph().items():
        print(f"{folder}: {', '.join(sorted(deps)) or '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
