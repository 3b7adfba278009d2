"""MLflow as a second metrics sink: one MLflow run per training run, found again by its tag.

Why one run, not one per iteration: an MLflow run is what its UI compares and charts, and a training run's
iterations are steps of one curve. Each report (``steps/report.py``) finds the MLflow run tagged with the
PettingFlow run id, creates it with the run's resolved config as params the first time, and logs the
iteration's metrics at step k. A resumed run therefore continues the same MLflow run; a re-run attempt ``a``
of iteration k logs into it too, under ``attempt-<a>/<metric>`` at step k, beside the original's point.

Uses the client API only (``mlflow-skinny``); the tracking server is whatever ``run.mlflow_tracking_uri`` names
(``scripts/mlflow_server.sh`` starts a local one with a SQLite store).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

EXPERIMENT = "pettingflow"
RUN_TAG = "pettingflow.run_id"
# MLflow's limits: params per call, length of a param value
_BATCH = 100
_MAX_PARAM = 6000


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as ``section.key`` -> text, lists by index (``policies.0.model``), as MLflow params."""
    out: dict[str, str] = {}
    items = config.items() if isinstance(config, Mapping) else enumerate(config)
    for key, value in items:
        name = f"{prefix}{key}"
        if isinstance(value, Mapping | list) and value:
            out |= flatten(value, f"{name}.")
        else:
            out[name] = str(value)[:_MAX_PARAM]
    return out


def metric_keys(metrics: Mapping[str, float], attempt: int) -> dict[str, float]:
    """The names a report's metrics get in MLflow: as in TensorBoard; a re-run's under ``attempt-<a>/``."""
    prefix = f"attempt-{attempt}/" if attempt else ""
    return {f"{prefix}{k}": float(v) for k, v in metrics.items()}


def _client(uri: str) -> Any:
    try:
        from mlflow.tracking import MlflowClient
    except ImportError as exc:
        raise RuntimeError(
            "run.mlflow_tracking_uri is set but the MLflow client is not installed: pip install -e '.[mlflow]'"
        ) from exc
    return MlflowClient(tracking_uri=uri)


def training_run(client: Any, run_id: str, run_uri: str, config: Mapping[str, Any]) -> str:
    """The MLflow run id of PettingFlow run ``run_id``: the one tagged with it, or a new one with the config."""
    from mlflow.entities import Param

    experiment = client.get_experiment_by_name(EXPERIMENT)
    experiment_id = experiment.experiment_id if experiment else client.create_experiment(EXPERIMENT)
    found = client.search_runs([experiment_id], filter_string=f"tags.`{RUN_TAG}` = '{run_id}'", max_results=1)
    if found:
        return found[0].info.run_id
    note = f"PettingFlow run `{run_id}`. Run folder: `{run_uri}`. Episodes: `pettingflow trajectories view {run_id}`."
    tags = {RUN_TAG: run_id, "pettingflow.run_uri": run_uri, "mlflow.note.content": note}
    created = client.create_run(experiment_id, run_name=run_id, tags=tags)
    mlflow_run = created.info.run_id
    params = [Param(k, v) for k, v in sorted(flatten(config).items())]
    for i in range(0, len(params), _BATCH):
        client.log_batch(mlflow_run, params=params[i : i + _BATCH])
    return mlflow_run


def log_report(
    uri: str,
    run_id: str,
    run_uri: str,
    config: Mapping[str, Any],
    iteration: int,
    metrics: Mapping[str, float],
    attempt: int = 0,
) -> str:
    """Log one report's metrics at step ``iteration`` into the training run's MLflow run; returns its id."""
    import time

    from mlflow.entities import Metric

    client = _client(uri)
    mlflow_run = training_run(client, run_id, run_uri, config)
    now = int(time.time() * 1000)
    batch = [Metric(k, v, now, iteration) for k, v in sorted(metric_keys(metrics, attempt).items())]
    for i in range(0, len(batch), _BATCH * 10):  # MLflow takes up to 1000 metrics per call
        client.log_batch(mlflow_run, metrics=batch[i : i + _BATCH * 10])
    return mlflow_run
