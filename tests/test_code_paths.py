"""``run.code_paths``: a team of your own, from a package that is not on the import path of any process.

The package is the one docs/guides/custom-env.md builds (rebuilt from the page), installed with pip into a temp
folder. The run names that folder in its config and nothing else: no PYTHONPATH, Ray started before the config
was read (so its actors do not inherit the folder from the driver's environment, as on an attached cluster).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_flows import scripted  # noqa: F401 (module fixtures)
from test_guides import ROOT, write_guide_files

from pettingflow.configs import ConfigError, load_config
from pettingflow.configs.code_paths import absolute_code_paths, activate_code_paths
from pettingflow.envs.registry import RegistryError, resolve_env_class

PYPROJECT = """[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "mygame"
version = "0.1"

[tool.setuptools]
packages = ["mygame"]
"""


@pytest.fixture
def clean_import_path(monkeypatch: pytest.MonkeyPatch):
    """sys.path, PYTHONPATH and the mygame modules as they were, after the test."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    yield
    for name in [m for m in sys.modules if m == "mygame" or m.startswith("mygame.")]:
        del sys.modules[name]


@pytest.fixture
def installed_package(tmp_path: Path) -> tuple[Path, Path]:
    """(the folder pip installed the guide's package into, the folder with the guide's task file and config)."""
    src, work, site = tmp_path / "src", tmp_path / "work", tmp_path / "site"
    write_guide_files(ROOT / "docs" / "guides" / "custom-env.md", src)
    (src / "pyproject.toml").write_text(PYPROJECT)
    work.mkdir()
    for name in ("tasks.jsonl", "mygame.yaml"):
        (src / name).rename(work / name)
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index"]
    done = subprocess.run([*pip, "--target", str(site), str(src)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (site / "mygame" / "env.py").is_file() and not (site / "mygame.yaml").exists()
    return site, work


def test_paths_are_stored_absolute_and_activated_once(tmp_path, monkeypatch, clean_import_path) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pkgs").mkdir()
    assert absolute_code_paths(["pkgs", str(tmp_path / "pkgs")]) == [str(tmp_path / "pkgs")]
    config = load_config("code-env", ["run.code_paths=[pkgs]"])
    assert config.run.code_paths == [str(tmp_path / "pkgs")]
    assert sys.path[0] == str(tmp_path / "pkgs")
    load_config("code-env", ["run.code_paths=[pkgs]"])
    assert sys.path.count(str(tmp_path / "pkgs")) == 1
    assert os.environ["PYTHONPATH"].split(os.pathsep).count(str(tmp_path / "pkgs")) == 1  # child processes too


def test_a_missing_folder_or_package_says_where_to_put_it(tmp_path, monkeypatch, clean_import_path) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"run.code_paths: .*nope is not a folder here"):
        load_config("code-env", ["run.code_paths=[nope]"])
    assert str(tmp_path / "nope") not in sys.path  # a bad config changes nothing
    with pytest.raises(RegistryError, match=r"name the folder that holds it in run\.code_paths"):
        resolve_env_class("mygame_not_here.env:SumEnv")
    assert activate_code_paths([str(tmp_path / "nope")]) == [str(tmp_path / "nope")]


@pytest.mark.slow  # pip builds the package, Ray starts, an iteration trains: about two minutes here
def test_a_package_outside_the_repo_trains_with_ray_rollout_workers(
    installed_package,
    clean_import_path,
    prefect_env,
    scripted,  # noqa: F811
    tiny_model,
) -> None:
    """One iteration of the guide's team with ``rollout.workers: ray``: the rows were made by its classes in
    two Ray actors, the learner trained on them, and a task row naming a class that is not there fails at load
    time with one line naming the row."""
    import ray

    from pettingflow.flows.train import train
    from pettingflow.ray_cluster import init_ray
    from pettingflow.storage import RunLayout, read_step_trajectories

    site, work = installed_package
    with pytest.raises(ModuleNotFoundError):
        __import__("mygame")
    assert not ray.is_initialized()
    init_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)  # before the config: actors get no path
    try:
        overrides = [
            f"run.code_paths=[{site}]",
            f"run.storage_root={work / 'outputs'}",
            "run.iterations=1",
            f"env.dataset.path={work / 'tasks.jsonl'}",
            f"policies.0.model={tiny_model}",
            f"inference.url={scripted.url}",
            "rollout.workers=ray",
            "rollout.num_workers=2",
            "env.group_size=2",
            "algorithm.filter_method=none",
            "validation.frequency=0",
            "training.zero_stage=0",
        ]
        state = train(str(work / "mygame.yaml"), overrides, return_state=True)
        assert state.is_completed(), state
        layout = RunLayout(str(work / "outputs"), state.result()["run_id"])
        rows = read_step_trajectories(layout.step(0, "rollouts")).to_pylist()
        assert {r["agent_name"] for r in rows} == {"proposer", "checker"}
        assert {r["env_name"] for r in rows} == {"mygame.env:SumEnv"}, {r["env_name"] for r in rows}
        workers = layout.step(0, "rollouts").manifest().metadata["workers"]
        assert len(workers) == 2 and all(w["pid"] != os.getpid() for w in workers)  # run in two Ray actors
        assert layout.step(0, "update-shared").is_committed()
        # a row naming a class that is not there: refused when the file loads, the row and the problem in one line
        bad = work / "bad.jsonl"
        bad.write_text('{"env_class_path": "mygame.env:NoSuchEnv", "task_data": {"task_id": "x", "a": 1, "b": 2}}\n')
        with pytest.raises(Exception, match=r"bad.jsonl: line 1: field 'env_class_path': .*NoSuchEnv") as failed:
            train(str(work / "mygame.yaml"), [*overrides, f"env.dataset.path={bad}"])
        assert "\n" not in str(failed.value).strip()
    finally:
        ray.shutdown()


def test_env_serve_imports_the_class_from_its_code_path_before_it_listens(tmp_path, clean_import_path) -> None:
    from typer.testing import CliRunner

    from pettingflow.cli import app

    runner = CliRunner()
    missing = runner.invoke(app, ["env", "serve", "mygame.env:SumEnv", "--code-path", str(tmp_path / "nope")])
    assert missing.exit_code != 0 and "not a folder here" in missing.output, missing.output
    (tmp_path / "empty").mkdir()
    absent = runner.invoke(app, ["env", "serve", "mygame.env:SumEnv", "--code-path", str(tmp_path / "empty")])
    assert absent.exit_code != 0 and "run.code_paths" in absent.output, absent.output
