"""docs/architecture.md's folder map says which folders import which: check it against the code."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _graph_module():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def documented_imports() -> dict[str, set[str]]:
    """``{folder: folders}`` from the "imports from" column of the folder map ("—" = none; bench/ and tests/
    say "anything" and are not checked)."""
    out: dict[str, set[str]] = {}
    for line in (ROOT / "docs" / "architecture.md").read_text().splitlines():
        m = re.match(r"^\| `([a-z_]+)/` \| .* \| ([^|]*) \|$", line)
        if m:
            cell = re.sub(r"\(.*\)", "", m.group(2)).strip()  # "— (a remark)": the remark is not a folder
            out[m.group(1)] = set() if cell in ("—", "-") else {w.strip() for w in cell.split(",")}
    return out


def test_the_folder_map_lists_every_import_between_folders():
    graph = _graph_module().folder_graph()
    documented = documented_imports()
    assert set(graph) <= set(documented), f"folders missing from the map: {set(graph) - set(documented)}"
    wrong = {
        folder: {"code": sorted(deps), "docs": sorted(documented[folder])}
        for folder, deps in graph.items()
        if deps != documented[folder]
    }
    assert not wrong, f"docs/architecture.md's 'imports from' column differs from the code: {wrong}"


def test_the_pure_layers_import_nothing_from_the_project_and_only_the_prefect_layer_knows_prefect():
    graph = _graph_module().folder_graph()
    assert graph["rl"] == set() and graph["configs"] == {"rl"}  # configs: the registries' names only
    knows_prefect = {
        path.relative_to(ROOT).parts[0]
        for folder in _graph_module().FOLDERS
        for path in (ROOT / folder).rglob("*.py")
        if re.search(r"^\s*(import prefect|from prefect)", path.read_text(), flags=re.MULTILINE)
    }
    assert knows_prefect <= {"flows", "tasks", "pettingflow"}, knows_prefect


def test_the_graph_reader_sees_lazy_and_aliased_imports(tmp_path):
    mod = _graph_module()
    f = tmp_path / "m.py"
    f.write_text(
        "import os\nfrom pettingflow import deathsig, storage\n"
        "def g():\n    from pettingflow.rl.losses import x\n    import pettingflow.envs.base as b\n"
    )
    assert mod.imported_folders(f) == {"pettingflow", "storage", "rl", "envs"}


def test_no_two_modules_import_each_other_even_inside_functions() -> None:
    """A lazy import inside a function only hides a loop: every import, at run time too, points one way."""
    assert _graph_module().import_cycles() == []


def test_loading_a_config_imports_no_torch() -> None:
    """configs read the advantage estimators' and filters' names from rl's registries; those modules must stay
    numpy-only, so the CLI and the flows' config checks do not pay for importing torch."""
    import subprocess
    import sys

    code = "\n".join(
        [
            "import sys",
            "from pettingflow.configs import load_config",
            "load_config('code-env')",
            "print('torch' in sys.modules)",
        ]
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "False", done.stdout + done.stderr[-2000:]


def test_every_package_folder_ships_in_the_wheel() -> None:
    """A folder with an __init__.py that pyproject.toml does not list works in the editable install and is missing
    from a built wheel; the list and the mapping must name every such folder."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    setuptools_cfg = project["tool"]["setuptools"]
    listed, mapped = set(setuptools_cfg["packages"]), setuptools_cfg["package-dir"]
    assert listed == set(mapped), f"packages and package-dir differ: {sorted(listed ^ set(mapped))}"
    folders = {mapped[name]: name for name in mapped}
    for init in ROOT.glob("*/**/__init__.py"):
        folder = init.parent.relative_to(ROOT).as_posix()
        if folder.split("/")[0] in {"tests", "bench", "scripts", ".venv", "docs"} or folder.startswith("."):
            continue
        assert folder in folders, f"{folder}/ is a package but pyproject.toml does not ship it (packages, package-dir)"
