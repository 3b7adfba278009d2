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


# ------------------------------------------------------------------------------------------------ the folder map
_ROW = re.compile(r"^\| `([a-z_]+)/` \| (.*) \| ([^|]*) \|$")
_NAMED = re.compile(r"`([A-Za-z0-9_./-]+)`")


def map_rows(doc: str) -> dict[str, str]:
    """``{folder: its "holds" cell}`` of docs/architecture.md's folder map."""
    return {m.group(1): m.group(2) for line in doc.splitlines() if (m := _ROW.match(line))}


def package_folders(root: Path) -> list[str]:
    """The top-level folders that ship as packages (pyproject.toml's package-dir), read at test time."""
    import tomllib

    mapped = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return sorted({path for path in mapped.values() if "/" not in path})


def map_problems(doc: str, root: Path) -> list[str]:
    """What the folder map gets wrong about the tree under ``root``, one line each:

    - a package folder without a row;
    - a module of a package folder the row does not name: each ``<folder>/<name>.py`` (``__init__.py`` aside) is
      named in its folder's row as `name.py`; a subpackage (``envs/sandbox/``) is named as a whole (`sandbox/`
      or `envs/sandbox`), its modules then belong to it;
    - a named module that does not exist (`x.py` in a row: ``<folder>/x.py``; `other/x.py`: from the root).
    """
    rows = map_rows(doc)
    problems = [f"{folder}/ has no row in the folder map" for folder in package_folders(root) if folder not in rows]
    for folder, cell in sorted(rows.items()):
        named = {token.rstrip("/") for token in _NAMED.findall(cell)}
        for token in sorted(t for t in named if t.endswith(".py")):
            top = token.split("/")[0]
            path = root / token if "/" in token and (root / top).is_dir() and top != token else root / folder / token
            if not path.is_file():
                problems.append(f"{folder}/ names `{token}`, which does not exist ({path.relative_to(root)})")
        if folder not in package_folders(root):
            continue  # bench/, tests/: listed as folders, their files are not a package's modules
        base = root / folder
        for module in sorted(base.glob("*.py")):
            if module.name != "__init__.py" and module.name not in named:
                problems.append(f"{folder}/{module.name} is not in the folder map's {folder}/ row")
        for sub in sorted(p for p in base.iterdir() if (p / "__init__.py").is_file()):
            if not {sub.name, f"{folder}/{sub.name}"} & named:
                problems.append(f"{folder}/{sub.name}/ (a subpackage) is not in the folder map's {folder}/ row")
    return problems


def test_the_folder_map_names_every_module_and_only_modules_that_exist() -> None:
    """docs/architecture.md's folder map against the tree as it is now (folders and modules come and go)."""
    problems = map_problems((ROOT / "docs" / "architecture.md").read_text(), ROOT)
    assert not problems, "docs/architecture.md's folder map differs from the tree:\n" + "\n".join(problems)


def test_the_folder_map_check_finds_a_missing_and_an_invented_module(tmp_path: Path) -> None:
    """The check above can fail: on a small tree, a module without a mention, a mention without a module, an
    unnamed subpackage and a package folder without a row are each reported."""
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools.package-dir]\n"p" = "p"\n"p.steps" = "steps"\n"p.steps.sub" = "steps/sub"\n"p.rl" = "rl"\n'
    )
    for path in ("steps/__init__.py", "steps/a.py", "steps/b.py", "steps/sub/__init__.py", "p/__init__.py"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("")
    doc = "\n".join(
        [
            "| folder | holds | imports from |",
            "|---|---|---|",
            "| `steps/` | what runs (`a.py`, `gone.py`; the pipeline in `p/pipeline.py`) | — |",
            "| `p/` | the CLI | — |",
            "| `tests/` | suites (`conftest.py`) | anything |",
        ]
    )
    assert map_problems(doc, tmp_path) == [
        "rl/ has no row in the folder map",
        "steps/ names `gone.py`, which does not exist (steps/gone.py)",
        "steps/ names `p/pipeline.py`, which does not exist (p/pipeline.py)",
        "steps/b.py is not in the folder map's steps/ row",
        "steps/sub/ (a subpackage) is not in the folder map's steps/ row",
        "tests/ names `conftest.py`, which does not exist (tests/conftest.py)",
    ]
