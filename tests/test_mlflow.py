"""MLflow as a metrics sink, against a real tracking server (SQLite store, loopback) started by
``scripts/mlflow_server.sh``: one MLflow run per training run with its config as params and a link to the run
folder; later iterations, a resumed process and a re-run attempt all continue that run."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pettingflow.configs.loader import load_config
from pettingflow.processes import free_port
from pettingflow.runs.run import start_or_resume
from pettingflow.steps.mlflow_sink import RUN_TAG, flatten, metric_keys

ROOT = Path(__file__).resolve().parents[1]


def test_config_becomes_params_and_reruns_get_their_own_metric_names() -> None:
    params = flatten({"run": {"seed": 1}, "policies": [{"name": "shared", "lora": None}], "agents": []})
    assert params == {"run.seed": "1", "policies.0.name": "shared", "policies.0.lora": "None", "agents": "[]"}
    assert metric_keys({"update/shared/loss": 1}, 0) == {"update/shared/loss": 1.0}
    assert metric_keys({"update/shared/loss": 1}, 2) == {"attempt-2/update/shared/loss": 1.0}


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory):
    """A tracking server from the project's own script (its environment, .venv-mlflow, is built once)."""
    port = free_port()
    data = tmp_path_factory.mktemp("mlflow")
    log = open(data / "server.log", "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        [str(ROOT / "scripts" / "mlflow_server.sh"), str(port), str(data)],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600  # the first call builds .venv-mlflow
    try:
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the MLflow server did not start: {(data / 'server.log').read_text()[-3000:]}")
            time.sleep(1)
        yield url
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=30)
        log.close()


@pytest.mark.slow
def test_one_mlflow_run_per_training_run_across_iterations_resume_and_reruns(mlflow_server, tmp_path) -> None:
    from mlflow.tracking import MlflowClient

    from pettingflow.steps.report import log_metrics

    overrides = [f"run.storage_root={tmp_path}", f"run.mlflow_tracking_uri={mlflow_server}", "training.lr=2e-6"]
    ref, _ = start_or_resume(load_config("code-env", overrides), "code-env", overrides, "run-ml", {})
    layout = ref.layout()
    log_metrics(layout, 0, {"update/shared/loss": 0.5, "rollouts/code_generator/reward_mean": 0.1}, mlflow_server)
    log_metrics(layout, 1, {"update/shared/loss": 0.25, "rollouts/code_generator/reward_mean": 0.3}, mlflow_server)
    # a resumed run is another process: it finds the same MLflow run by its tag
    code = (
        "from pettingflow.storage import RunLayout\nfrom pettingflow.steps.report import log_metrics\n"
        f"log_metrics(RunLayout({str(tmp_path)!r}, 'run-ml'), 2, {{'update/shared/loss': 0.125}}, {mlflow_server!r})\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    log_metrics(layout, 0, {"update/shared/loss": 0.75}, mlflow_server, attempt=1)  # a re-run of iteration 0

    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("pettingflow")
    runs = client.search_runs([experiment.experiment_id], filter_string=f"tags.`{RUN_TAG}` = 'run-ml'")
    assert len(runs) == 1, [r.info.run_name for r in runs]
    run = runs[0]
    assert run.info.run_name == "run-ml" and run.data.params["training.lr"] == "2e-06"
    assert run.data.params["env.class_path"] == "code-env" and len(run.data.params) > 50
    assert run.data.tags["pettingflow.run_uri"] == layout.run_uri
    assert "pettingflow trajectories view run-ml" in run.data.tags["mlflow.note.content"]
    history = client.get_metric_history(run.info.run_id, "update/shared/loss")
    assert sorted((m.step, m.value) for m in history) == [(0, 0.5), (1, 0.25), (2, 0.125)]
    rerun = client.get_metric_history(run.info.run_id, "attempt-1/update/shared/loss")
    assert [(m.step, m.value) for m in rerun] == [(0, 0.75)]
