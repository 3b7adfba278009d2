"""Flows on S3: a run with ``run.storage_root=s3://...`` against moto's S3 server on loopback.

The same harness as test_flows.py (Prefect's temporary server, the scripted LLM server, the tiny model, the real
DeepSpeed update in the resident learner), with every step, checkpoint and re-run stored in a bucket. The S3
endpoint comes from the config (``run.storage_options.client_kwargs.endpoint_url``), the credentials from the
environment, as in a deployment. The crash is injected, not a kill: iteration 1's checkpoint is uploaded and its
marker is not (``Step.commit`` raises), so the flow fails in the window between a step's data and its marker;
the kill matrix (tests/test_kill_matrix.py) kills real processes on local storage.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from test_flows import STEPS, flow_run_task_states, overrides, scripted  # noqa: F401

from pettingflow.paths import home
from pettingflow.storage import RunLayout, list_runs, read_step_trajectories
from pettingflow.storage.commits import MARKER, Step

pytestmark = pytest.mark.slow

BUCKET = "pf-flows"
PREFIX = "experiments"


@pytest.fixture(scope="module")
def s3_endpoint():
    """moto's S3 server on 127.0.0.1 with one bucket; the credentials are environment variables (as an AWS
    profile or instance role would provide them), never in ``run.storage_options``, which is stored in run.json
    and in the flow run's parameters."""
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's server logs every request otherwise
    mp = pytest.MonkeyPatch()
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        mp.delenv(var, raising=False)
    mp.setenv("AWS_ACCESS_KEY_ID", "testing")
    mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
    yield endpoint
    server.stop()
    mp.undo()


def bucket_keys(endpoint: str, prefix: str) -> list[str]:
    """Object keys under ``prefix``, listed with boto3: what is in the bucket, not what pettingflow reads."""
    import boto3

    pages = (
        boto3.client("s3", endpoint_url=endpoint)
        .get_paginator("list_objects_v2")
        .paginate(Bucket=BUCKET, Prefix=prefix)
    )
    return sorted(obj["Key"] for page in pages for obj in page.get("Contents", []))


def cache_dir(layout: RunLayout, iteration: int, step: str) -> Path:
    """Where ``local_copy`` puts the verified download of a step (``$PETTINGFLOW_HOME/cache``)."""
    return home() / "cache" / layout.step(iteration, step).path.strip("/").replace("/", "__")


def test_run_on_s3_completes_resumes_after_a_crash_and_reruns(
    prefect_env,
    tiny_model,
    scripted,  # noqa: F811
    s3_endpoint,
    monkeypatch,
) -> None:
    from pettingflow.flows.rerun import rerun
    from pettingflow.flows.train import train

    root = f"s3://{BUCKET}/{PREFIX}"
    options = {"client_kwargs": {"endpoint_url": s3_endpoint}}
    args = overrides(root, tiny_model, scripted.url, f"run.storage_options.client_kwargs.endpoint_url={s3_endpoint}")

    # 1. iteration 1's update uploads its checkpoint, then "crashes" before the marker: the run fails there
    real_commit = Step.commit

    def crash_before_marker(self: Step, metadata=None):
        if self.path.endswith("iter-1/update-shared"):
            raise RuntimeError("injected crash: iteration 1's checkpoint is uploaded, its marker is not")
        return real_commit(self, metadata)

    with monkeypatch.context() as mp:
        mp.setattr(Step, "commit", crash_before_marker)
        failed = train("code-env", args, return_state=True)
    assert failed.is_failed(), failed
    [run_id] = list_runs(root, options)
    layout = RunLayout(root, run_id, options)
    run_prefix = f"{PREFIX}/runs/{run_id}/"
    assert all(layout.step(0, name).is_committed() for name in STEPS)
    assert [layout.step(1, n).is_committed() for n in STEPS[:4]] == [True, True, True, False]
    update1 = f"{run_prefix}iter-1/update-shared/"
    left = bucket_keys(s3_endpoint, update1)
    assert any(k.startswith(update1 + "model/") for k in left) and update1 + MARKER not in left  # data, no marker
    # iteration 1 was sampled with iteration 0's weights, downloaded from the bucket for the server
    served = [Path(r["kwargs"]["weights_path"]) for r in scripted.reloads if r.get("method") == "reload_weights"]
    assert (cache_dir(layout, 0, "update-shared") / "model").resolve() in served
    committed = {(k, n): layout.step(k, n).manifest().files for k in (0, 1) for n in ("rollouts", "advantages")}

    # 2. resume the same run in a fresh "process": no local copy of any checkpoint, everything comes from S3
    for k in (0, 1):
        shutil.rmtree(cache_dir(layout, k, "update-shared"), ignore_errors=True)
    reloads_before = len(scripted.reloads)
    again = train("code-env", args, run_id=run_id, return_state=True)
    assert again.is_completed(), again
    for k in (0, 1):
        for name in STEPS:
            assert layout.step(k, name).is_committed(), (k, name)
    # nothing committed was written again, no row twice; only the step in flight was redone
    for key, files in committed.items():
        assert layout.step(*key).manifest().files == files, key
    rows = read_step_trajectories(layout.step(1, "rollouts"))
    assert rows.num_rows == sum(f.rows for f in committed[(1, "rollouts")])
    messages = flow_run_task_states(again.state_details.flow_run_id)
    assert all("already committed" in m for m in messages["rollouts"])
    assert sum("already committed" in m for m in messages["update[shared]"]) == 1  # iteration 0's
    # the bucket holds exactly the files the marker lists (the crashed attempt's upload was cleared first)
    manifest = layout.step(1, "update-shared").manifest()
    assert bucket_keys(s3_endpoint, update1) == sorted([update1 + MARKER, *(update1 + f.name for f in manifest.files)])
    assert any(f.name.startswith("model/") for f in manifest.files)
    assert not [k for k in bucket_keys(s3_endpoint, run_prefix) if "/.tmp" in k]
    # iteration 1 trained from iteration 0's checkpoint, downloaded from S3 and verified into the cache
    downloaded = cache_dir(layout, 0, "update-shared")
    assert (downloaded / ".complete").read_text() == layout.step(0, "update-shared").manifest().to_json()
    assert manifest.metadata["starts_from"] == layout.step(0, "update-shared").uri
    spec = layout.step(1, "update-shared").read_json("spec.json")
    assert spec["init_model_dir"] == str(downloaded / "model")
    assert spec["storage_options"] == options and spec["batch_uri"].startswith(f"{root}/runs/{run_id}/iter-1/")
    assert manifest.metadata["metrics"]["learner_loaded"] is True  # a new learner, so it read those files
    # the metadata names the uploaded log and checkpoint, not the temp folder the learner wrote them to
    assert manifest.metadata["metrics"]["out_dir"] == layout.step(1, "update-shared").uri
    assert manifest.metadata["metrics"]["log_path"] == layout.step(1, "update-shared").uri + "/worker.log"
    assert "worker.log" in {f.name for f in manifest.files}
    # the server was synced to the trained weights from their downloads
    new = scripted.reloads[reloads_before:]
    served = [Path(r["kwargs"]["weights_path"]) for r in new if r.get("method") == "reload_weights"]
    assert served[-1] == (cache_dir(layout, 1, "update-shared") / "model").resolve()
    assert (home() / "tensorboard" / run_id / "tensorboard").is_dir()  # events stay local for a remote root
    stored = json.loads(layout.fs.cat_file(f"{layout.run_path}/run.json"))
    assert stored["config"]["run"]["storage_options"] == options

    # 3. re-run iteration 1 from its stored trajectories with another learning rate, into attempt-1 in the bucket
    out = rerun(run_id=run_id, iteration=1, root=root, storage_options=options, overrides=["training.lr=1e-6"])
    assert out["attempt"] == 1 and [(c["key"], c["new"]) for c in out["config_changes"]] == [("training.lr", 1e-6)]
    assert layout.attempts(1) == [0, 1]
    attempt = f"{run_prefix}iter-1/attempt-1/"
    keys = bucket_keys(s3_endpoint, attempt)
    assert attempt + "attempt.json" in keys
    for name in ("filtered", "advantages", "update-shared", "report"):
        assert f"{attempt}{name}/{MARKER}" in keys, name
    assert not any(k.startswith(attempt + "rollouts/") for k in keys)  # the stored rollouts were reused
    rerun_spec = layout.step(1, "update-shared", attempt=1).read_json("spec.json")
    assert rerun_spec["training"]["lr"] == 1e-6 and rerun_spec["init_model_dir"] == str(downloaded / "model")
    assert layout.step(1, "advantages", attempt=1).manifest().rows == layout.step(1, "advantages").manifest().rows
    assert layout.read_run_info()["config"]["training"]["lr"] == 1e-5
    assert layout.step(1, "update-shared").manifest().files == manifest.files  # the original is untouched
