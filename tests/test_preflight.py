"""`pettingflow check`: a config's class paths, tasks and models are checked before anything starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import test_training_worker
from typer.testing import CliRunner

from pettingflow.cli import app
from pettingflow.configs.loader import available_configs, load_config
from pettingflow.runs.preflight import PreflightError, preflight

tiny_model_dir = test_training_worker.tiny_model_dir  # the same session fixture (one tiny model per test run)


@pytest.mark.parametrize("name", available_configs())
def test_every_shipped_config_passes(name: str) -> None:
    report = preflight(load_config(name), check_models=False)
    assert report.train_tasks > 0 and report.validation_tasks > 0
    assert set(report.agents) == {a.name for a in load_config(name).agents}


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["agents.0.class_path=no_such_pkg.mod:Agent"], r"agents\[0\] \('code_generator'\)\.class_path: cannot import"),
        (["env.class_path=no-such-env"], r"env \(env.class_path='no-such-env'\): unknown env 'no-such-env'"),
        (["agents.1.envs=[no-such-env]"], r"agents\[1\] \('test_generator'\)\.envs: unknown env"),
        (["env.class_path=plan-path"], r"task 0 \(train\) cannot run in 'plan-path'"),
        (["agents.0.envs=[plan-path]", "agents.1.envs=[plan-path]"], r"tasks of env 'code-env' have no agent"),
        (["env.dataset.source=file"], r"env.dataset.path is not set"),
        (["policies.0.model=/no/such/folder"], r"policies\[0\] \('shared'\)\.model: model folder /no/such/folder"),
    ],
)
def test_a_broken_config_fails_naming_the_key(overrides: list[str], expected: str) -> None:
    models = any(o.startswith("policies.") for o in overrides)  # the session's model is not prepared here
    with pytest.raises(PreflightError, match=expected):
        preflight(load_config("code-env", overrides), check_models=models)


def test_cli_checks_a_task_file(tmp_path: Path) -> None:
    """`--tasks FILE` checks that file's rows; a bad row fails with exit 2 and its position; a good file passes."""
    good = tmp_path / "tasks.jsonl"
    rows = [{"env_class_path": "plan-path", "task_data": {"task_id": f"grid-{s}", "seed": s}} for s in range(6)]
    good.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    runner = CliRunner()
    ok = runner.invoke(app, ["check", "plan-path", "--tasks", str(good), "--no-models"])
    assert ok.exit_code == 0, ok.output
    assert "plan-path: ok" in ok.output and "plan-path x6" in ok.output
    bad = tmp_path / "bad.jsonl"
    row = {"env_class_path": "plan-path", "task_data": {"task_id": "x", "prompt": "no seed or grid"}}
    bad.write_text(good.read_text() + json.dumps(row) + "\n")
    failed = runner.invoke(app, ["check", "plan-path", "--tasks", str(bad), "--no-models"])
    assert failed.exit_code == 2 and "bad.jsonl: line 7" in failed.output and "seed" in failed.output


def test_cli_train_checks_then_runs_the_train_flow_in_the_foreground(tiny_model_dir, monkeypatch) -> None:
    """`pettingflow train CONFIG overrides` calls the train flow with them (the flow itself runs in the end-to-end
    tests); a config that fails the check never reaches the flow."""
    import pettingflow.flows.train as train_module

    calls = []

    def fake_flow(config: str, overrides: list[str], run_id: str | None) -> dict:
        calls.append((config, overrides, run_id))
        return {"run_id": "code-env-x", "uri": "/tmp/runs/code-env-x", "iterations": [{}]}

    monkeypatch.setattr(train_module, "train", fake_flow)
    runner = CliRunner()
    model = f"policies.0.model={tiny_model_dir}"
    ok = runner.invoke(app, ["train", "code-env", model, "run.iterations=1"])
    assert ok.exit_code == 0, ok.output
    assert calls == [("code-env", [model, "run.iterations=1"], None)]
    assert "run code-env-x: 1 iteration(s)" in ok.output and "pettingflow runs summary code-env-x" in ok.output
    refused = runner.invoke(app, ["train", "code-env", model, "agents.0.class_path=nope:Nope"])
    assert refused.exit_code == 2 and "agents[0]" in refused.output and len(calls) == 1
