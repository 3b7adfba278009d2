"""The device plan (``runs/device_plan.py``): which GPUs (or cores) each replica and rank gets, for 1, 2 and 8
fake GPUs, shared and split, and the combinations it refuses."""

from __future__ import annotations

import pytest

from pettingflow.runs.device_plan import DevicePlanError, plan_devices


def test_one_gpu_is_shared_and_must_be_freed_during_updates() -> None:
    plan = plan_devices("cuda", [0], replicas=1, ranks=1, between_updates="sleep")
    assert plan.replicas == ((0,),) and plan.ranks == (0,) and plan.tensor_parallel == 1 and plan.shared
    assert plan_devices("cuda", [0], replicas=1, ranks=1, between_updates="keep", both_fit=True).shared
    with pytest.raises(DevicePlanError, match="keeps the servers' memory during updates: use sleep or restart"):
        plan_devices("cuda", [0], replicas=1, ranks=1, between_updates="pause")
    with pytest.raises(DevicePlanError, match="async_rollouts generates during each update"):
        plan_devices("cuda", [0], replicas=1, ranks=1, between_updates="sleep", async_rollouts=True)


def test_two_gpus_split_one_each_and_async_rollouts_may_run() -> None:
    plan = plan_devices("cuda", [0, 1], replicas=1, ranks=1, learning=[0], inference=[1], async_rollouts=True)
    assert plan.replicas == ((1,),) and plan.ranks == (0,) and not plan.shared
    shared = plan_devices("cuda", [0, 1], replicas=2, ranks=2, between_updates="restart")
    assert shared.replicas == ((0,), (1,)) and shared.ranks == (0, 1) and shared.shared


def test_eight_gpus_four_for_two_tensor_parallel_replicas_four_for_the_ranks() -> None:
    plan = plan_devices(
        "cuda", range(8), replicas=2, ranks=4, learning=[0, 1, 2, 3], inference=[4, 5, 6, 7], async_rollouts=True
    )
    assert plan.replicas == ((4, 5), (6, 7)) and plan.tensor_parallel == 2
    assert plan.ranks == (0, 1, 2, 3) and not plan.shared
    one_each = plan_devices("cuda", range(8), replicas=4, ranks=4, learning=range(4), inference=range(4, 8))
    assert one_each.replicas == ((4,), (5,), (6,), (7,)) and one_each.tensor_parallel == 1
    with pytest.raises(DevicePlanError, match="cannot be split evenly over 3 replica"):
        plan_devices("cuda", range(8), replicas=3, ranks=4, learning=range(4), inference=range(4, 8))
    with pytest.raises(DevicePlanError, match=r"ranks need one GPU each, resources\.learning_devices has 4"):
        plan_devices("cuda", range(8), replicas=2, ranks=5, learning=range(4), inference=range(4, 8))
    with pytest.raises(DevicePlanError, match=r"devices \[8\] are not among the available"):
        plan_devices("cuda", range(8), replicas=1, ranks=1, learning=[8], inference=[7])


def test_on_a_cpu_the_plan_maps_cores_and_overlap_is_fine() -> None:
    plan = plan_devices("cpu", [0, 1], replicas=2, ranks=1, between_updates="pause")
    assert plan.replicas == ((0,), (1,)) and plan.ranks == (0,) and plan.shared and plan.tensor_parallel == 1
    assert plan_devices("cpu", range(16), replicas=2, ranks=2, inference=range(8)).replicas == (
        (0, 1, 2, 3),
        (4, 5, 6, 7),
    )
    with pytest.raises(DevicePlanError, match="device must be cuda or cpu"):
        plan_devices("tpu", [0], replicas=1, ranks=1)


def test_the_runtime_gives_each_replica_its_gpus_and_refuses_what_does_not_fit(monkeypatch, tmp_path) -> None:
    """On a (faked) 8-GPU machine: the plan of ``resources`` and ``inference.replicas``, each replica's server
    pinned to its block (``CUDA_VISIBLE_DEVICES``, tensor-parallel over several); a plan that cannot hold is
    refused before any server starts. Not run on a real GPU here."""
    from pettingflow.configs import load_config
    from pettingflow.inference import server as server_module
    from pettingflow.runs.runtime import Runtime

    monkeypatch.setattr(server_module, "detect_device", lambda: "cuda")
    monkeypatch.setattr(server_module, "gpu_ids", lambda: list(range(8)))
    split = [
        "inference.replicas=2",
        "training.num_processes=4",
        "resources.learning_devices=[0,1,2,3]",
        "resources.inference_devices=[4,5,6,7]",
    ]
    runtime = Runtime(load_config("code-env", split), "plan-test")
    runtime.between_updates = runtime._choose_between_updates()
    plan = runtime._plan_devices()
    assert plan.replicas == ((4, 5), (6, 7)) and plan.ranks == (0, 1, 2, 3) and not plan.shared
    (tmp_path / "config.json").write_text("{}")
    settings = runtime.config.inference
    replica = server_module.server_from_settings(settings, tmp_path, replica=1, gpus=plan.replicas[1], device="cuda")
    assert replica.extra_env["CUDA_VISIBLE_DEVICES"] == "6,7"
    assert replica.command()[-2:] == ["--tensor-parallel-size", "2"]

    shared = Runtime(load_config("code-env", ["inference.between_updates=keep"]), "plan-shared")
    shared.between_updates = shared._choose_between_updates()
    with pytest.raises(DevicePlanError, match="use sleep or restart"):
        shared._plan_devices()


def test_auto_puts_the_servers_to_sleep_where_the_learner_shares_their_gpu(monkeypatch) -> None:
    """The default config on a (faked) one-GPU machine: ``between_updates: auto`` must free the GPU during updates
    (``sleep``), or the plan refuses the run. A lent H100 found this: ``auto`` said ``keep`` on any GPU, so the
    default run stopped with the plan's overlap error (bench/gpu_check.py, stage device_plan)."""
    from pettingflow.configs import load_config
    from pettingflow.inference import server as server_module
    from pettingflow.runs.device_plan import devices_overlap
    from pettingflow.runs.runtime import Runtime

    monkeypatch.setattr(server_module, "detect_device", lambda: "cuda")
    monkeypatch.setattr(server_module, "gpu_ids", lambda: [0])
    runtime = Runtime(load_config("code-env"), "one-gpu")
    runtime.between_updates = runtime._choose_between_updates()
    assert runtime.between_updates.mode == "sleep" and "share cuda devices" in runtime.between_updates.reason
    plan = runtime._plan_devices()
    assert plan.replicas == ((0,),) and plan.ranks == (0,) and plan.shared
    fit = Runtime(load_config("code-env", ["resources.both_fit=true"]), "one-gpu-fits")
    assert fit._choose_between_updates().mode == "keep"  # the config says both fit: nothing to free
    monkeypatch.setattr(server_module, "gpu_ids", lambda: [0, 1])
    split = ["resources.learning_devices=[0]", "resources.inference_devices=[1]"]
    assert Runtime(load_config("code-env", split), "two-gpus")._choose_between_updates().mode == "keep"
    assert devices_overlap([0, 1]) and devices_overlap([0, 1], [1]) and not devices_overlap([0, 1], [0], [1])
