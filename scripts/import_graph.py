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


def module_name(path: Path, root: Path = ROOT) -> str:
    """``pettingflow.<folder>.<module>`` of a project file (``pettingflow.<folder>`` for a package's __init__)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    if parts and parts[0] == "pettingflow":
        parts = parts[1:]
    return ".".join(["pettingflow", *parts])


def _runtime_imports(path: Path) -> set[str]:
    """Every ``pettingflow.*`` module name a file imports, at its top or inside functions (run time), but not in
    ``if TYPE_CHECKING:`` blocks; ``from a import b`` counts as ``a`` and ``a.b`` (b may be a module)."""
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return {n for n in names if n.startswith("pettingflow")}


def import_cycles(root: Path = ROOT) -> list[list[str]]:
    """Groups of project modules that import each other, directly or around a loop, counting imports made inside
    functions: each is a loop at run time (a lazy import that only hides it). Empty when the imports point one way."""
    files = {module_name(p, root): p for folder in FOLDERS for p in sorted((root / folder).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        targets = set()
        for imported in _runtime_imports(path):
            while imported and imported not in files:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def strong(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for v in graph:
        if v not in index:
            strong(v)
    return cycles


def main() -> int:
    for folder, deps in folder_graph().items():
        print(f"{folder}: {', '.join(sorted(deps)) or '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
